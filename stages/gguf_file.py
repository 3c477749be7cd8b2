"""A model given as one GGUF file (llama.cpp's format, what most people serving on CPUs hold):
its config from the file's metadata, its tensors by Hugging Face name, read through the `gguf`
package (which memory-maps the file: a stage touches only its own tensors).

The metadata becomes a config.json-shaped dict for `ModelConfig.from_dict`, so a GGUF model
goes through the same family checks as a folder. Tensor names map to Hugging Face's Llama
names; llama.cpp's converter reorders the rows of each q and k head of a `llama` model for its
rotary (pairs adjacent) and this puts them back (transformers' GGUF loader does the same).

Served: the architectures in ARCHITECTURES (their tensor names and metadata as llama.cpp's
converter writes them: Gemma's norms as 1 + w, Phi-3's fused q/k/v and gate/up, its LongRoPE
factors as tensors, Granite's scalars), tensors in SERVED_FORMATS. A quantized matrix is
read as its rows of blocks (stages/gguf_matrix.py GgufMatrix), and the backend decides what it
holds: the CPU kernels hold a Q4_0, Q4_1, Q5_0 or Q8_0 matrix as its codes, read straight from
the blocks (the default model served from its GGUF holds all 61 matrices so); the k-quants and
every GPU stage take the dequantized values.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from stages.errors import ConfigError

# A GGUF file's rope_freqs (llama.cpp's Llama 3 scaling, a divisor per frequency) as a rope type:
# read from the file, never from a config.json (stages/config.py turns it into a RopeScaling)
FREQ_FACTORS = "freq_factors"

# general.architecture -> Hugging Face architecture
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
}
# general.architecture -> config.json's model_type, where they differ
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# llama.cpp's converter reorders each q and k head's rows for these (its "normal" rotary)
_PERMUTED_QK = ("llama", "granite")
# llama.cpp's converter stores these families' RMSNorm weights as 1 + w (Gemma's form)
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
SERVED_FORMATS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# `blk.N.<name>` -> `model.layers.N.<name>`; the rest by their whole name
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# where a family's names differ from Llama's (llama.cpp's tensor names per architecture)
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_FAMILY_TENSORS = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    # Phi-3's q, k, v in one matrix, and gate, up in `ffn_up` ([2 I, d], as its checkpoint)
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # OLMo 2's norms after attention and the MLP (none before)
    "olmo2": {
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Granite's four scalars: config.json's name -> its metadata key's tail
_GRANITE_SCALARS = {
    "attention_multiplier": "attention.scale",
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "logits_scaling": "logit_scale",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def open_gguf(path: str | Path) -> Any:
    """The file's header (stages/gguf_header.py: its metadata, its tensors as views of the
    memory-mapped file), or one ConfigError. A process reads a file's header once (its config,
    its summary line and its stage's tensors all ask): it is kept while the file is the same
    (path, size and modification time)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} is not a file; pass --model a .gguf file or a model folder")
    stat = path.stat()
    return _reader(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _reader(path: Path, size: int, mtime_ns: int) -> Any:
    """(size and mtime_ns: the cache's key, so a rewritten file is read again)"""
    from stages.gguf_header import read_header

    try:
        return read_header(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{path} is not a readable GGUF file ({exc})") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    """One GGUF metadata value: a str, int or float, a list of them, or `default` if absent."""
    if key not in reader.fields:
        return default
    value = reader.fields[key]
    # GGUF stores floats as float32 (1e-5 reads back as 9.999999747378752e-06): the float32's
    # shortest repr is the value the model was made with
    if isinstance(value, float):
        import numpy as np

        return float(str(np.float32(value)))
    return value


def config_dicts(path: str | Path, reader: Any | None = None) -> tuple[dict, dict]:
    """(config.json, generation_config.json) as dicts, from the file's metadata; one
    ConfigError for an architecture or a tensor format ppring does not serve."""

    reader = reader if reader is not None else open_gguf(path)
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{path} is a GGUF file of a {arch!r} model; ppring serves GGUF files of "
            f"{', '.join(ARCHITECTURES)} (and every family as a Hugging Face folder)"
        )
    check_formats(path, reader)
    names = {tensor.name for tensor in reader.tensors}

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"{path} lacks the metadata {arch}.{key}; re-convert the file")
        return value

    heads = need("attention.head_count")
    hidden = need("embedding_length")
    tokens = field(reader, "tokenizer.ggml.tokens")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = field(reader, f"{arch}.vocab_size") or (
        len(tokens) if tokens is not None else int(embedding.shape[-1])
    )
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "num_hidden_layers": need("block_count"),
        "intermediate_size": need("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": field(reader, f"{arch}.attention.key_length", hidden // heads),
        "max_position_embeddings": need("context_length"),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": field(reader, f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": vocab,
        # llama.cpp leaves output.weight out where the lm_head is the embedding
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": {"F32": "float32", "BF16": "bfloat16"}.get(
            embedding.tensor_type.name, "float16"
        ),
    }
    scaling = field(reader, f"{arch}.rope.scaling.type")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        # Llama 3.x: llama.cpp's converter writes the Llama 3 scaling as one divisor per
        # rotary frequency (the same factors transformers derives from rope_scaling)
        raw["rope_parameters"] = {
            "rope_type": FREQ_FACTORS,
            "rope_theta": raw["rope_theta"],
            "factors": [float(f) for f in _values(freqs).reshape(-1)],
        }
    elif scaling not in (None, "none") and "rope_factors_long.weight" not in names:
        if scaling != "linear":
            raise ConfigError(
                f"{path} scales its rotary by {scaling!r}, which ppring reads from a GGUF file "
                "only as 'linear'; serve the model's Hugging Face folder"
            )
        raw["rope_scaling"] = {
            "rope_type": "linear",
            "factor": field(reader, f"{arch}.rope.scaling.factor", 1.0),
        }
    if arch == "qwen2":  # (Qwen2's biases are its layer's; its config says nothing of them)
        raw["use_sliding_window"] = False
    raw.update(_family_fields(path, reader, arch, raw))
    generation = {"eos_token_id": raw["eos_token_id"], "bos_token_id": raw["bos_token_id"]}
    return raw, generation


def _family_fields(path: str | Path, reader: Any, arch: str, raw: dict[str, Any]) -> dict:
    """What a family's config.json says beyond Llama's, from the metadata llama.cpp's converter
    writes (and, where it writes none, what llama.cpp itself assumes)."""
    out: dict[str, Any] = {}
    window = field(reader, f"{arch}.attention.sliding_window")
    layers, heads, hidden = raw["num_hidden_layers"], raw["num_attention_heads"], raw["hidden_size"]
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales attention by head_dim^-0.5, but by (hidden / heads)^-0.5 in the 27B
        # models (46 layers for Gemma 2, 62 for Gemma 3), as their query_pre_attn_scalar says
        big = layers == (46 if arch == "gemma2" else 62)
        out["query_pre_attn_scalar"] = hidden // heads if big else raw["head_dim"]
        out["sliding_window"] = window
        # the windowed layers: every other from the first (Gemma 2), five of each six (Gemma 3)
        pattern = field(reader, f"{arch}.attention.sliding_window_pattern") or (
            2 if arch == "gemma2" else 6
        )
        out["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    if arch == "gemma2":
        out["attn_logit_softcapping"] = field(reader, "gemma2.attn_logit_softcapping")
        out["final_logit_softcapping"] = field(reader, "gemma2.final_logit_softcapping")
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0  # llama.cpp's, for the windowed layers
    if arch == "granite":
        for name, key in _GRANITE_SCALARS.items():
            value = field(reader, f"granite.{key}")
            if value is not None:
                out[name] = value
    if arch == "phi3":
        out["sliding_window"] = window
        rotary = field(reader, "phi3.rope.dimension_count")
        out["partial_rotary_factor"] = rotary / raw["head_dim"] if rotary else 1.0
        tensors = {t.name: t for t in reader.tensors}
        if "rope_factors_long.weight" in tensors:  # LongRoPE: its factors as two tensors
            original = field(reader, "phi3.rope.scaling.original_context_length")
            if not original:
                raise ConfigError(
                    f"{path} holds LongRoPE factors but no "
                    "phi3.rope.scaling.original_context_length; re-convert the file"
                )
            out["original_max_position_embeddings"] = original
            out["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": _values(tensors["rope_factors_long.weight"]).reshape(-1).tolist(),
                "short_factor": _values(tensors["rope_factors_short.weight"]).reshape(-1).tolist(),
            }
    return out


def _values(tensor: Any) -> Any:
    """An F32, F16 or BF16 tensor's values as fp32 (a numpy array in the file's row order)."""
    import gguf
    import numpy as np

    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def check_formats(path: str | Path, reader: Any) -> None:
    """One ConfigError naming the formats served where a tensor is in another."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SERVED_FORMATS:
            raise ConfigError(
                f"{path} holds {tensor.name} as {tensor.tensor_type.name}, a format ppring does "
                f"not serve; it serves {', '.join(SERVED_FORMATS)} (llama.cpp's quantize makes "
                "those, e.g. Q4_K_M)"
            )


def layer_tensors(arch: str) -> dict[str, str]:
    """An architecture's layer tensor names, GGUF's -> Hugging Face's."""
    return {**_LAYER_TENSORS, **_FAMILY_TENSORS.get(arch, {})}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (in `arch`'s names);
    None for a tensor no stage reads."""
    parts = gguf_name.split(".")
    names = layer_tensors(arch)
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    return None


def unpermute_rope(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's q/k row order: it puts each head's rotary pairs side by side, (x0, x1),
    (x2, x3), ..., where Hugging Face's Llama rotates halves (x_i, x_{i + head_dim / 2}).
    weight: [num_heads * head_dim, ...] (a numpy array) -> the same shape in HF order."""
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


# formats a stage reads as values (numpy arrays); the rest stay blocks (stages/gguf_matrix.py)
DENSE_FORMATS = ("F32", "F16", "BF16")


def stage_tensors(path: str | Path, names: list[str], config: Any) -> dict[str, Any]:
    """The tensors of Hugging Face names `names`, shaped as a torch Linear weight ([out, in]),
    q and k in HF's row order: an F32, F16 or BF16 tensor as an fp32 numpy array, a quantized
    matrix as a `GgufMatrix` of its blocks (uint8 [out, row bytes], a copy: the file is
    memory-mapped). One ConfigError naming a tensor the file lacks."""
    import numpy as np
    import torch

    from stages.gguf_matrix import GgufMatrix

    reader = open_gguf(path)
    arch = field(reader, "general.architecture")
    by_name = {hf_name(tensor.name, arch): tensor for tensor in reader.tensors}
    out: dict[str, Any] = {}
    for name in names:
        tensor = by_name.get(name)
        if tensor is None:
            raise ConfigError(f"{path} lacks the tensor for {name}; re-convert the file")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # [out, in] (or [d])
        kind = tensor.tensor_type.name
        if kind in DENSE_FORMATS:
            weight = _values(tensor).reshape(shape)
        else:  # rows of blocks: [out, row bytes]
            weight = np.array(tensor.data, dtype=np.uint8).reshape(shape[0], -1)
        if arch in _PERMUTED_QK and ".self_attn.q_proj." in name:
            weight = unpermute_rope(weight, config.num_heads)
        elif arch in _PERMUTED_QK and ".self_attn.k_proj." in name:
            weight = unpermute_rope(weight, config.num_kv_heads)
        if arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            weight = weight - 1.0  # back to the checkpoint's w (the family adds 1, as HF's)
        if kind not in DENSE_FORMATS:
            blocks = torch.from_numpy(np.ascontiguousarray(weight))
            weight = GgufMatrix.of(kind, blocks, shape[1])
        out[name] = weight
    return out


def matrix_formats(path: str | Path) -> tuple[str, int]:
    """Each tensor group's format(s), e.g. "attn_q Q4_K, ffn_down Q6_K x2+Q4_K x26", and the
    bytes the file holds of matrices (norms and biases, F32 in every file, left out)."""
    reader = open_gguf(path)
    groups: dict[str, dict[str, int]] = {}
    total = 0
    for tensor in reader.tensors:
        if len(tensor.shape) < 2:
            continue
        parts = tensor.name.split(".")
        group = parts[2] if parts[0] == "blk" else parts[0]
        kinds = groups.setdefault(group, {})
        kinds[tensor.tensor_type.name] = kinds.get(tensor.tensor_type.name, 0) + 1
        total += int(tensor.n_bytes)
    described = []
    for group, kinds in groups.items():
        if len(kinds) == 1:
            described.append(f"{group} {next(iter(kinds))}")
        else:
            described.append(f"{group} " + "+".join(f"{k} x{n}" for k, n in kinds.items()))
    return ", ".join(described), total


def formats_line(path: str | Path, dtype_name: str) -> str:
    """The start-up summary's line for a GGUF model: each tensor group's format(s) and the
    bytes the file holds, and what the stages hold of them."""
    described, total = matrix_formats(path)
    return (
        f"GGUF weights: {described} ({total / 2**20:.1f} MiB of matrices in the file); the CPU "
        "kernels hold Q4_0, Q4_1, Q5_0 and Q8_0 as codes read from the blocks, and Q4_K, Q5_K "
        f"and Q6_K too in bf16 (each stage's line says how many, in MiB); the rest as "
        f"{dtype_name} values"
    )
