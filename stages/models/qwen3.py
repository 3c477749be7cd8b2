"""Qwen3 (dense): Llama's layer with an RMSNorm of every q and k head before the rotary.

Its head_dim is set in config.json and is not hidden_size / num_heads (Qwen3-0.6B: 16 heads of
128 over a hidden size of 1024), so q and o are not square. `attention_bias` (false in every
released checkpoint) puts a bias on q, k, v and o, as transformers' Qwen3Attention does."""

from __future__ import annotations

from typing import Any

from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_full_attention, check_swiglu


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    check_swiglu(raw, source)
    check_full_attention(raw, source)
    bias = bool(raw.get("attention_bias"))
    return LayerSpec(qkv_bias=bias, o_bias=bias, qk_norm=True)


FAMILY = Family("Qwen3", ("Qwen3ForCausalLM",), read_spec)
