"""OLMo 2 (AI2): attention and the MLP read the residual stream un-normed and their outputs are
normed before they join it (`post_attention_layernorm`, `post_feedforward_layernorm`), and q
and k are each normed over the whole projection before the rotary (weights [h d_head] and
[h_kv d_head]), as transformers' Olmo2DecoderLayer and Olmo2Attention compute them.

In bf16 transformers' Olmo2RMSNorm rounds once (weight times the fp32 normed row), where ppring's
norm rounds twice as Llama's does; float32 is the same arithmetic."""

from __future__ import annotations

from typing import Any

from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_no_attention_bias, check_swiglu


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    check_no_attention_bias(raw, source, "OLMo 2")
    check_swiglu(raw, source)
    return LayerSpec(qk_norm=True, qk_norm_whole=True, norms="post")


FAMILY = Family("OLMo 2", ("Olmo2ForCausalLM",), read_spec)
