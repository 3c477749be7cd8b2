"""Llama (1-3.x, SmolLM, TinyLlama, ...) and Mistral: the plain layer, Mistral's with its
sliding window where its config sets one shorter than the context."""

from __future__ import annotations

from typing import Any

from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_no_attention_bias, check_swiglu, sliding_windows


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    check_no_attention_bias(raw, source, "Llama")
    check_swiglu(raw, source)
    return LayerSpec()


def read_scalars(raw: dict[str, Any], source: str) -> dict[str, Any]:
    # Mistral's window (transformers' Llama has none: a Llama config's is ignored there too)
    if "MistralForCausalLM" in (raw.get("architectures") or ()):
        return sliding_windows(raw, source)
    return {}


FAMILY = Family("Llama", ("LlamaForCausalLM", "MistralForCausalLM"), read_spec, read_scalars)
