"""Phi-3, Phi-3.5 and Phi-4-mini (Microsoft): Llama's layer, its q, k, v held as one `qkv_proj`
and gate, up as one `gate_up_proj` in the checkpoint (in the order the blocks concatenate them
anyway), with LongRoPE (stages/config.py RopeScaling) and, in Phi-4-mini, a rotary over the
first 3/4 of each head (partial_rotary_factor: stages/models/blocks.py says how).

Phi-3-mini-4k's `sliding_window` (2047, shorter than its 4096 positions) windows every layer,
as transformers masks it."""

from __future__ import annotations

from typing import Any

from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_no_attention_bias, check_swiglu, sliding_windows


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    check_no_attention_bias(raw, source, "Phi-3")
    check_swiglu(raw, source)
    return LayerSpec(fused_projections=True)


FAMILY = Family("Phi-3", ("Phi3ForCausalLM",), read_spec, sliding_windows)
