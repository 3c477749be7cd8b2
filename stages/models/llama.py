"""Llama (1-3.x, SmolLM, TinyLlama, ...) and Mistral without a sliding window: the plain layer."""

from __future__ import annotations

from typing import Any

from stages.errors import ConfigError
from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_swiglu


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    if "MistralForCausalLM" in (raw.get("architectures") or ()):
        window = raw.get("sliding_window")
        max_positions = raw.get("max_position_embeddings")
        if window is not None and (not isinstance(max_positions, int) or window < max_positions):
            raise ConfigError(
                f"{source} uses sliding-window attention (sliding_window={window} < "
                f"max_position_embeddings={max_positions}), which ppring does not implement; "
                "serve a model without a sliding window"
            )
    if raw.get("attention_bias"):
        raise ConfigError(
            f"{source} has bias terms (attention_bias), which ppring implements for Qwen2 and "
            "Qwen3 but not for Llama; serve a Llama model without them"
        )
    check_swiglu(raw, source)
    return LayerSpec()


FAMILY = Family("Llama", ("LlamaForCausalLM", "MistralForCausalLM"), read_spec)
