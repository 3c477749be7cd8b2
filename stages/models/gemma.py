"""Gemma 2 and Gemma 3 (text) (Google), as transformers' Gemma2 and Gemma3 models compute them:

- four RMSNorms a layer, before and after attention and the MLP ("sandwich"), each multiplying
  by (1 + weight), the final norm too;
- a GeGLU MLP (gelu with the tanh approximation, `hidden_activation` gelu_pytorch_tanh);
- the embedding's rows multiplied by sqrt(hidden_size), that factor first rounded to the
  weights' dtype (a tensor of their dtype in transformers);
- attention scaled by query_pre_attn_scalar^-0.5, not head_dim's;
- windowed layers (`layer_types` "sliding_attention", `sliding_window`) between full ones;
- Gemma 2: attention scores and the final logits soft-capped (cap tanh(x / cap));
- Gemma 3: an RMSNorm of every q and k head (1 + weight too) before the rotary, and the windowed
  layers' own rotary (rope_parameters per layer type: stages/config.py)."""

from __future__ import annotations

from typing import Any

from stages.errors import ConfigError
from stages.layer_spec import LayerSpec
from stages.models.family import Family, check_no_attention_bias

GEMMA3 = "Gemma3ForCausalLM"


def read_spec(raw: dict[str, Any], source: str) -> LayerSpec:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(
            f"{source} uses hidden_activation={act}; ppring implements Gemma's gelu_pytorch_tanh"
        )
    check_no_attention_bias(raw, source, "Gemma")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(
            f"{source} sets use_bidirectional_attention (an encoder's attention), which ppring "
            "does not implement; serve a causal Gemma"
        )
    gemma3 = GEMMA3 in (raw.get("architectures") or ())
    softcap = raw.get("attn_logit_softcapping") or 0.0
    return LayerSpec(
        norms="sandwich",
        norm_offset=True,
        activation="gelu_tanh",
        qk_norm=gemma3,
        attn_softcap=float(softcap),
    )


def read_scalars(raw: dict[str, Any], source: str) -> dict[str, Any]:
    hidden = raw.get("hidden_size")
    scalar = raw.get("query_pre_attn_scalar")
    if not isinstance(hidden, int) or not isinstance(scalar, int | float) or scalar <= 0:
        raise ConfigError(
            f"{source} lacks hidden_size or a positive query_pre_attn_scalar; re-export it"
        )
    return {
        "embedding_multiplier": hidden**0.5,
        "embedding_multiplier_in_dtype": True,
        "attention_multiplier": float(scalar) ** -0.5,
        "final_logit_softcap": float(raw.get("final_logit_softcapping") or 0.0),
        "layer_windows": _windows(raw, source),
    }


def _windows(raw: dict[str, Any], source: str) -> tuple[int, ...]:
    """Each layer's window: `sliding_window` for a "sliding_attention" layer, 0 for a
    "full_attention" one; without `layer_types` (older Gemma 2 folders) every other layer from
    the first, as transformers fills them in."""
    layers = raw.get("num_hidden_layers")
    window = raw.get("sliding_window")
    if not isinstance(layers, int) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"{source} lacks num_hidden_layers or a sliding_window > 0")
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(
            f"{source}'s layer_types are not {layers} of sliding_attention and full_attention"
        )
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


FAMILY = Family("Gemma", ("Gemma2ForCausalLM", GEMMA3), read_spec, read_scalars)
