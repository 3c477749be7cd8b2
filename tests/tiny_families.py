"""Tiny random Qwen2, Qwen3, Phi-3, OLMo 2 and Granite folders for tests, built and saved by
transformers, so parity tests compare ppring against the reference implementation on exactly
the same weights.

What sets the families apart from Llama is made to show: every RMSNorm weight (Qwen3's per-head
q_norm and k_norm included) is perturbed away from 1.0, Qwen2's q/k/v biases are clearly
nonzero, and Qwen3's head_dim is not hidden_size / num_heads, so a missing bias or norm, or a
head size taken from the hidden size, changes the output. Phi-3's folders turn half of each head
(partial_rotary_factor 0.5) and, with LongRoPE, switch to the long factors past 64 positions;
Granite's multipliers are far from 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2  # as tests/tiny_llama.py's, in a folder without a tokenizer

# With a tokenizer, the vocabulary is laid out as Qwen's: byte-level BPE tokens first (here the
# 256 bytes alone, no merges, so a prompt is one token per UTF-8 byte), then special tokens.
TOKENIZER_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|reserved_{i}|>" for i in range(13))
)  # fmt: skip
TOKENIZER_VOCAB = 256 + len(TOKENIZER_SPECIALS)  # 272
TOKENIZER_EOS_ID = 256  # <|endoftext|>: BOS and EOS, as in a Qwen base model's config


def make_tiny_qwen2(
    path: str | Path,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    tied: bool = False,
    rope_theta: float = 1_000_000.0,  # Qwen2.5's
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    tokenizer: bool = False,
) -> Path:
    """Save a random-init fp32 Qwen2ForCausalLM (bias on q/k/v, none on o) to `path` and return
    the folder. `init_std`: transformers' initializer_range; at its default, greedy text
    repeats one token, at 0.2 it follows the context. `tokenizer`: with a byte-level BPE
    tokenizer that AutoTokenizer loads as Qwen2Tokenizer, as `ppring local` needs one; `vocab`
    must then be TOKENIZER_VOCAB."""
    config = Qwen2Config(
        **_common(num_layers, hidden, heads, kv_heads, intermediate, vocab, tied, tokenizer),
        initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        max_position_embeddings=max_positions,
        use_sliding_window=False,
    )
    return _save(Qwen2ForCausalLM, config, Path(path), seed, tokenizer)


def make_tiny_qwen3(
    path: str | Path,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,  # heads * head_dim = 128 != hidden: q_proj and o_proj are not square
    intermediate: int = 128,
    vocab: int = 256,
    tied: bool = False,
    rope_theta: float = 1_000_000.0,  # Qwen3's
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    tokenizer: bool = False,
) -> Path:
    """Save a random-init fp32 Qwen3ForCausalLM (per-head RMSNorm on q and k before the rotary,
    head_dim from config.json, no bias) to `path` and return the folder; `init_std` and
    `tokenizer` as in make_tiny_qwen2."""
    config = Qwen3Config(
        **_common(num_layers, hidden, heads, kv_heads, intermediate, vocab, tied, tokenizer),
        initializer_range=init_std,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        max_position_embeddings=max_positions,
        use_sliding_window=False,
    )
    return _save(Qwen3ForCausalLM, config, Path(path), seed, tokenizer)


# Phi-3's LongRoPE in miniature: past this many positions a sequence turns at the long factors
LONGROPE_ORIGINAL = 64


def make_tiny_phi3(
    path: str | Path,
    *,
    longrope: bool = False,
    partial_rotary: float = 0.5,
    window: int | None = None,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    tied: bool = False,
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    tokenizer: bool = False,
) -> Path:
    """Save a random-init fp32 Phi3ForCausalLM (one qkv_proj and one gate_up_proj, a rotary over
    `partial_rotary` of each head) to `path`; `longrope`: LongRoPE with random short and long
    factors and original_max_position_embeddings LONGROPE_ORIGINAL (so cos and sin are scaled by
    sqrt(1 + ln 8 / ln 64)); `window`: every layer sees that many positions (Phi-3-mini-4k's
    2047); `init_std` and `tokenizer` as in make_tiny_qwen2."""
    rotary_half = int(hidden // heads * partial_rotary) // 2
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if longrope:
        generator = torch.Generator().manual_seed(seed + 1000)
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(rotary_half, generator=generator)).tolist(),
            "long_factor": (2 + 6 * torch.rand(rotary_half, generator=generator)).tolist(),
            "original_max_position_embeddings": LONGROPE_ORIGINAL,
        }
    rope["partial_rotary_factor"] = partial_rotary
    config = Phi3Config(
        **_common(num_layers, hidden, heads, kv_heads, intermediate, vocab, tied, tokenizer),
        initializer_range=init_std,
        rope_parameters=rope,
        partial_rotary_factor=partial_rotary,
        original_max_position_embeddings=LONGROPE_ORIGINAL if longrope else max_positions,
        max_position_embeddings=max_positions,
        pad_token_id=None,
        sliding_window=window,
    )
    return _save(Phi3ForCausalLM, config, Path(path), seed, tokenizer)


TINY_WINDOW = 32  # the windowed folders' sliding window: two KV blocks


def make_tiny_mistral(
    path: str | Path,
    *,
    window: int = TINY_WINDOW,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    tied: bool = False,
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    tokenizer: bool = False,
) -> Path:
    """Save a random-init fp32 MistralForCausalLM whose every layer sees only the last `window`
    positions to `path`; options as make_tiny_qwen2's."""
    config = MistralConfig(
        **_common(num_layers, hidden, heads, kv_heads, intermediate, vocab, tied, tokenizer),
        initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=max_positions,
        sliding_window=window,
        pad_token_id=None,
    )
    return _save(MistralForCausalLM, config, Path(path), seed, tokenizer)


def make_tiny_gemma(
    path: str | Path,
    *,
    version: int = 2,
    window: int = TINY_WINDOW,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,  # heads * head_dim = 128 != hidden, as in Gemma
    intermediate: int = 128,
    vocab: int = 256,
    tied: bool = True,  # as Gemma's
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    tokenizer: bool = False,
    llama_cpp: bool = False,
) -> Path:
    """Save a random-init fp32 Gemma2ForCausalLM (`version` 2) or Gemma3ForCausalLM (3) to
    `path`: windowed layers (`window`) between full ones (Gemma 2: every other from the first;
    Gemma 3 here: the second full, the rest windowed), query_pre_attn_scalar 24 (not head_dim),
    Gemma 2's soft caps small enough to bite (attention 2, logits 4), Gemma 3's windowed layers
    at theta 10^4 and its full ones at 10^6 with linear scaling x8; options as
    make_tiny_qwen2's. `llama_cpp`: only what a GGUF file can say (llama.cpp assumes the rest):
    query_pre_attn_scalar = head_dim, Gemma 3's layers five windowed of each six."""
    common = _common(num_layers, hidden, heads, kv_heads, intermediate, vocab, tied, tokenizer)
    shared = dict(
        **common, initializer_range=init_std, head_dim=head_dim, sliding_window=window,
        max_position_embeddings=max_positions, pad_token_id=None,
        query_pre_attn_scalar=head_dim if llama_cpp else 24,
    )  # fmt: skip
    if version == 2:
        config = Gemma2Config(
            **shared,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_logit_softcapping=2.0,
            final_logit_softcapping=4.0,
        )
        return _save(Gemma2ForCausalLM, config, Path(path), seed, tokenizer)
    layer_types = ["sliding_attention"] * num_layers
    layer_types[1] = "full_attention"
    if llama_cpp:
        layer_types = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)
        ]
    config = Gemma3TextConfig(
        **shared,
        layer_types=layer_types,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        },
    )
    config.architectures = ["Gemma3ForCausalLM"]
    return _save(Gemma3ForCausalLM, config, Path(path), seed, tokenizer)


def make_tiny_olmo2(
    path: str | Path,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    tied: bool = False,
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    tokenizer: bool = False,
) -> Path:
    """Save a random-init fp32 Olmo2ForCausalLM (norms after attention and the MLP, q and k
    normed over their whole projections) to `path`; options as make_tiny_qwen2's."""
    config = Olmo2Config(
        **_common(num_layers, hidden, heads, kv_heads, intermediate, vocab, tied, tokenizer),
        initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        max_position_embeddings=max_positions,
        pad_token_id=None,
    )
    return _save(Olmo2ForCausalLM, config, Path(path), seed, tokenizer)


def make_tiny_granite(
    path: str | Path,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    tied: bool = True,  # as Granite 3's
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    tokenizer: bool = False,
) -> Path:
    """Save a random-init fp32 GraniteForCausalLM to `path`, its four multipliers far from 1
    (embedding x12, residual x0.22 as Granite 3's, attention 0.4 where 1/sqrt(16) would be
    0.25, logits / 8); options as make_tiny_qwen2's."""
    config = GraniteConfig(
        **_common(num_layers, hidden, heads, kv_heads, intermediate, vocab, tied, tokenizer),
        initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=max_positions,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.4,
        logits_scaling=8.0,
        pad_token_id=None,
    )
    return _save(GraniteForCausalLM, config, Path(path), seed, tokenizer)


def _common(
    num_layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tied: bool,
    tokenizer: bool,
) -> dict[str, Any]:
    if tokenizer and vocab != TOKENIZER_VOCAB:
        raise ValueError(f"a folder with the tokenizer has vocab {TOKENIZER_VOCAB}, not {vocab}")
    bos, eos = (TOKENIZER_EOS_ID,) * 2 if tokenizer else (BOS_TOKEN_ID, EOS_TOKEN_ID)
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def _save(model_class: type, config: Any, path: Path, seed: int, tokenizer: bool) -> Path:
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Random init leaves norms at 1.0 and biases at 0: move both, so a missing or
            # misplaced one shows up in the logits.
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("_proj.bias"):
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        byte_level_tokenizer().save_pretrained(path)
    return path


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen's tokenizer in miniature: GPT-2's byte-to-character map, Qwen2's pre-tokenizer,
    no merges, then TOKENIZER_SPECIALS. Saved, AutoTokenizer loads it as Qwen2Tokenizer for a
    qwen2 folder and as a plain tokenizers backend for a qwen3 one: the same ids either way."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="")
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token in TOKENIZER_SPECIALS])
    eos = TOKENIZER_SPECIALS[0]
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos)
