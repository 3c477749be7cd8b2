"""Llama (1-3.x, SmolLM, TinyLlama, ...) and Mistral without a sliding window: the plain layer."""

from __future__ import annotations

from typing import Any

from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_no_attention_bias, check_no_window, check_swiglu


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    if "MistralForCausalLM" in (raw.get("architectures") or ()):
        check_no_window(raw, source)
    check_no_attention_bias(raw, source, "Llama")
    check_swiglu(raw, source)
    return LayerSpec()


FAMILY = Family("Llama", ("LlamaForCausalLM", "MistralForCausalLM"), read_spec)
