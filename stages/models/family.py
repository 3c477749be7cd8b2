"""A model family as the registry holds it: the architectures it answers to and how it reads
its layer's spec out of a config.json. Torch-free (stages/config.py reads it at start-up)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.errors import ConfigError
from stages.layer_spec import LayerSpec


@dataclass(frozen=True)
class Family:
    name: str  # as a user says it: "Qwen3"
    architectures: tuple[str, ...]  # config.json `architectures` values it serves
    # (config.json as a dict, the folder's name for messages) -> the spec, or one ConfigError
    # naming what this family's folder asks for that ppring does not implement
    read_spec: Callable[[dict[str, Any], str], LayerSpec]
    # (config.json, folder name) -> the ModelConfig fields of a family's own scalars (Granite's
    # multipliers), by name; none elsewhere
    read_scalars: Callable[[dict[str, Any], str], dict[str, Any]] = lambda raw, source: {}


def check_swiglu(raw: dict[str, Any], source: str) -> None:
    """Every family here has a SwiGLU MLP without bias."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source} uses hidden_act={act}; ppring implements only silu (SwiGLU)")
    if raw.get("mlp_bias"):
        raise ConfigError(
            f"{source} has bias terms (mlp_bias), which ppring does not implement; serve a "
            "model without them"
        )


def check_full_attention(raw: dict[str, Any], source: str) -> None:
    """Qwen-style configs: a window only where `use_sliding_window` or `layer_types` asks."""
    windowed = raw.get("use_sliding_window") or "sliding_attention" in (
        raw.get("layer_types") or ()
    )
    if windowed:
        raise ConfigError(
            f"{source} uses sliding-window attention (use_sliding_window / layer_types), which "
            "ppring does not implement; serve a model with full attention in every layer"
        )


def sliding_windows(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Llama-style configs (Mistral, Phi-3): every layer windowed where `sliding_window` is
    shorter than the context (transformers masks with it whenever it is set), none elsewhere;
    as ModelConfig fields."""
    window = raw.get("sliding_window")
    max_positions = raw.get("max_position_embeddings")
    if window is None or (isinstance(max_positions, int) and window >= max_positions):
        return {}
    layers = raw.get("num_hidden_layers")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"{source} sets sliding_window={window!r}; a window is a count > 0")
    if not isinstance(layers, int) or isinstance(layers, bool):
        raise ConfigError(f"{source} lacks an integer num_hidden_layers; re-export it")
    return {"layer_windows": (window,) * layers}


def check_no_attention_bias(raw: dict[str, Any], source: str, family: str) -> None:
    if raw.get("attention_bias"):
        raise ConfigError(
            f"{source} has bias terms (attention_bias), which ppring implements for Qwen2 and "
            f"Qwen3 but not for {family}; serve a {family} model without them"
        )
