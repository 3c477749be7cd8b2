"""Qwen2 and Qwen2.5: Llama's layer with a bias on the q, k and v projections (none on o).

transformers' Qwen2Attention builds q_proj, k_proj and v_proj with bias=True and o_proj
without, whatever the config says; the rotary is Llama's rotate-half with the config's theta
(1e6 for Qwen2.5)."""

from __future__ import annotations

from typing import Any

from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_full_attention, check_swiglu


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    check_swiglu(raw, source)
    check_full_attention(raw, source)
    return LayerSpec(qkv_bias=True)


FAMILY = Family("Qwen2", ("Qwen2ForCausalLM",), read_spec)
