"""Granite 3 (IBM): Llama's layer with four scalars from config.json. The embedding's rows are
multiplied by `embedding_multiplier`; attention and the MLP's outputs by `residual_multiplier`
before each joins the residual stream; attention scores are scaled by `attention_multiplier`
instead of 1/sqrt(head_dim); the logits are divided by `logits_scaling` (transformers'
GraniteModel and GraniteForCausalLM). How the blocks apply each: stages/models/blocks.py."""

from __future__ import annotations

from typing import Any

from stages.errors import ConfigError
from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_no_attention_bias, check_swiglu


def _scalar(raw: dict[str, Any], name: str, source: str) -> float:
    value = raw.get(name, 1.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{source} sets {name}={value!r}; a Granite config needs a number > 0")
    return float(value)


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    check_no_attention_bias(raw, source, "Granite")
    check_swiglu(raw, source)
    return LayerSpec(residual_multiplier=_scalar(raw, "residual_multiplier", source))


def read_scalars(raw: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        "embedding_multiplier": _scalar(raw, "embedding_multiplier", source),
        "logits_scaling": _scalar(raw, "logits_scaling", source),
        "attention_multiplier": _scalar(raw, "attention_multiplier", source),
    }


FAMILY = Family("Granite", ("GraniteForCausalLM",), read_spec, read_scalars)
