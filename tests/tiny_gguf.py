"""GGUF files for tests, written with the `gguf` package from the tiny Hugging Face folders
(tests/tiny_llama.py, tests/tiny_families.py): metadata as llama.cpp's converter writes it, q
and k rows in llama.cpp's order for a `llama` model, each tensor in a format the test picks.
Q4_0, Q4_1, Q5_0 and Q8_0 come from the package's own quantizers; it has none for the k-quants,
so Q4_K, Q5_K and Q6_K blocks are random codes with small finite scales, which both ppring and
transformers read through the package's dequantization (and any other format random bytes, for
the tests of what is refused)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from stages.gguf_file import _GLOBAL_TENSORS, layer_tensors

Q = gguf.GGMLQuantizationType
ROW_FORMATS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def permute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of stages/gguf_file.py unpermute_rope)."""
    head_dim = weight.shape[0] // num_heads
    halves = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


# the fp16 super-block scale that makes random codes weights of about 0.05 (a trained model's
# size): Q4_K's reach 63 x 15 of it, Q5_K's 63 x 31, Q6_K's 127 x 32
K_SCALES = {Q.Q4_K: 1e-4, Q.Q5_K: 5e-5, Q.Q6_K: 2e-5}


def k_quant_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of random super-blocks (256 weights each); a Q4_K, Q5_K or Q6_K block's
    fp16 scales small and finite (K_SCALES), another format's whatever the bytes say."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block_size == 0
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    shape = (rows, cols // block_size)
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d (fp16)
        d = rng.uniform(0.5, 1.5, size=(*shape, 1)) * K_SCALES[qtype]
        blocks[..., 208:210] = d.astype(np.float16).view(np.uint8)
    elif qtype in K_SCALES:  # Q4_K: d dmin scales[12] qs[128]; Q5_K: d dmin scales[12] qh qs
        d = rng.uniform(0.5, 1.5, size=(*shape, 2)) * K_SCALES[qtype]
        blocks[..., 0:4] = d.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def llama3_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """Llama 3's rotary scaling as the divisor of each frequency [head_dim / 2] fp32, the
    published rule (wavelengths past original / low_freq_factor slowed by `factor`, those
    under original / high_freq_factor kept, a blend between), which llama.cpp writes as
    rope_freqs."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for wavelength in 2 * np.pi / inv_freq:
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            blend = (original / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - blend) / factor + blend))
    return np.asarray(out, dtype=np.float32)


def encode(weight: np.ndarray, fmt: str, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    """A tensor's data in `fmt` as GGUFWriter takes it, and its type."""
    qtype = Q[fmt]
    if fmt == "F32" or weight.ndim == 1:
        return weight.astype(np.float32), Q.F32
    if fmt == "F16":
        return weight.astype(np.float16), qtype
    try:
        return gguf.quants.quantize(weight.astype(np.float32), qtype), qtype
    except NotImplementedError:  # the package quantizes no k-quant
        return k_quant_blocks(*weight.shape, qtype, rng), qtype


def write_gguf(
    folder: Path,
    out: Path,
    formats: dict[str, str] | None = None,
    default_format: str = "F32",
    seed: int = 0,
) -> Path:
    """`folder`'s model (a llama or qwen2 Hugging Face folder with the byte-level tokenizer)
    as a GGUF file at `out`. `formats`: GGUF tensor name stem (`attn_q`, `ffn_down`,
    `token_embd`, ...) -> format; others take `default_format`; 1-D tensors stay F32."""
    config = json.loads((folder / "config.json").read_text())
    arch = {
        "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Gemma2ForCausalLM": "gemma2",
        "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
        "GraniteForCausalLM": "granite",
    }[config["architectures"][0]]  # fmt: skip
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(out, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers' (the windowed: 10^4)
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    writer.add_rope_freq_base(theta)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":  # as llama.cpp's converter: one divisor a frequency
        head_dim = config["hidden_size"] // heads
        writer.add_tensor("rope_freqs.weight", llama3_factors(rope, theta, head_dim))
    writer.add_vocab_size(config["vocab_size"])
    _add_family(writer, arch, config, head_dim)
    _add_tokenizer(writer, folder, config)
    rng = np.random.default_rng(seed)
    formats = formats or {}
    names = {hf: gg for gg, hf in _GLOBAL_TENSORS.items()}
    layer_names = {hf: gg for gg, hf in layer_tensors(arch).items()}
    for name, weight in sorted(load_file(str(folder / "model.safetensors")).items()):
        stem, _, suffix = name.rpartition(".")
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            gg = layer_names[rest]
            gguf_name, fmt_key = f"blk.{layer}.{gg}.{suffix}", gg
        else:
            gguf_name, fmt_key = f"{names[stem]}.{suffix}", names[stem]
        if arch in ("llama", "granite") and fmt_key in ("attn_q", "attn_k") and suffix == "weight":
            weight = permute_rope(weight, heads if fmt_key == "attn_q" else kv_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            weight = weight + 1  # as llama.cpp's converter stores Gemma's norms
        data, qtype = encode(weight, formats.get(fmt_key, default_format), rng)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_family(writer: gguf.GGUFWriter, arch: str, config: dict, head_dim: int) -> None:
    """The metadata llama.cpp's converter writes for Gemma 2/3, Phi-3 and Granite beyond
    Llama's."""
    if arch.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "granite":  # as llama.cpp's converter names them
        writer.add_float32("granite.attention.scale", config["attention_multiplier"])
        writer.add_float32("granite.embedding_scale", config["embedding_multiplier"])
        writer.add_float32("granite.residual_scale", config["residual_multiplier"])
        writer.add_float32("granite.logit_scale", config["logits_scaling"])
    if arch == "phi3":
        rope = config.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(head_dim * partial))
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
        if rope.get("rope_type") == "longrope":  # the factors as tensors, as llama.cpp's
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for which in ("long", "short"):
                factors = np.asarray(rope[f"{which}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{which}.weight", factors)


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, config: dict) -> None:
    """The folder's byte-level BPE tokenizer (tests/tiny_families.py) as llama.cpp's gpt2
    tokenizer metadata: its tokens in id order, no merges."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert len(tokens) == config["vocab_size"]
    special = {added["content"] for added in data.get("added_tokens", [])}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))  # (transformers' converter reads them)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["eos_token_id"])  # (Phi-3's config defaults to 32000)


def tiny_gguf_pair(
    root: Path, formats: dict[str, dict[str, str]], seeds: tuple[int, int, int]
) -> dict[str, Path]:
    """ "llama" and "qwen2" -> a GGUF file each, in a folder of its own under `root` (transformers
    loads one as folder + name): tiny models of hidden 256 (so every matrix's K fits the
    k-quants' 256-weight blocks) with the byte-level tokenizer, in `formats[name]`; `seeds`:
    the Llama's, the Qwen2's and the k-quant codes'."""
    from tests.tiny_families import (
        TOKENIZER_EOS_ID,
        TOKENIZER_VOCAB,
        byte_level_tokenizer,
        make_tiny_qwen2,
    )
    from tests.tiny_llama import make_tiny_llama

    shape = {"hidden": 256, "intermediate": 512, "vocab": TOKENIZER_VOCAB}
    llama = make_tiny_llama(
        root / "llama-hf", **shape, eos_token_id=TOKENIZER_EOS_ID, seed=seeds[0]
    )
    byte_level_tokenizer().save_pretrained(llama)
    qwen2 = make_tiny_qwen2(
        root / "qwen2-hf", **shape, tokenizer=True, seed=seeds[1], init_std=0.05
    )
    files = {}
    for name, folder in (("llama", llama), ("qwen2", qwen2)):
        (root / name).mkdir()
        files[name] = write_gguf(folder, root / name / f"{name}.gguf", formats[name], seed=seeds[2])
    return files
