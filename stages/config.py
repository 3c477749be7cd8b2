"""The model's shape, read once from a Hugging Face folder's config.json.

Torch-free, so the launcher and rendezvous can read a config and compare hashes cheaply.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from protocol.dtypes import dtype_bytes
from stages.errors import ConfigError
from stages.gguf_file import FREQ_FACTORS, config_dicts, is_gguf
from stages.layer_spec import LayerSpec
from stages.models import family_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")

# The dtypes a stage may compute in (protocol/dtypes.py holds their sizes).
STAGE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling. `linear` divides every frequency by `factor`; `llama3` divides
    only the low frequencies, blending across [low_freq_factor, high_freq_factor]. `longrope`
    (Phi-3): frequency i divided by short_factor[i] for a sequence whose forward reaches no
    further than original_max_position_embeddings, by long_factor[i] beyond, and cos and sin
    scaled by attention_factor. `freq_factors` (a GGUF file's rope_freqs): frequency i divided
    by factors[i]."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str  # the checkpoint's dtype name ("bfloat16"), not the dtype a stage runs in
    architecture: str = "LlamaForCausalLM"
    layer_spec: LayerSpec = LayerSpec()  # what its family's layers add to Llama's
    partial_rotary_factor: float = 1.0  # the share of each head's dims the rotary turns
    # Granite's scalars (1.0 / None elsewhere): the embedding's rows are multiplied by the
    # first, the logits divided by the second; attention scores are scaled by the third
    # instead of 1/sqrt(head_dim)
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # each layer's sliding window (attention sees the last that many positions), 0 for a layer
    # that sees all of them; () where no layer has one
    layer_windows: tuple[int, ...] = ()
    # Gemma 3: the windowed layers' own rotary (theta, scaling); None: every layer's is the one
    # above
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None
    # Gemma: the embedding multiplier rounded to the stage dtype first (transformers makes it a
    # tensor of the weights' dtype), where Granite's multiplies as a Python float
    embedding_multiplier_in_dtype: bool = False
    # Gemma 2: the logits become cap tanh(logits / cap); 0: as they are
    final_logit_softcap: float = 0.0

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """From a Hugging Face folder or a .gguf file (its metadata: stages/gguf_file.py)."""
        if is_gguf(path):
            raw, generation = config_dicts(path)
            return cls.from_dict(raw, generation, source=str(path))
        return cls.from_folder(path)

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ConfigError(
                f"{folder} has no config.json; pass --model a local Hugging Face model folder "
                "(config.json plus *.safetensors)"
            )
        raw = read_config_json(config_path)
        generation = _read_optional_json(folder / "generation_config.json")
        return cls.from_dict(raw, generation, source=str(folder))

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> ModelConfig:
        architecture, family = family_for(raw, source)
        hidden_size = _get_int(raw, "hidden_size", source)
        num_heads = _get_int(raw, "num_attention_heads", source)
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        max_positions = _get_int(raw, "max_position_embeddings", source)
        layer_spec = family.read_spec(raw, source)
        rope_theta, rope_scaling, partial_rotary = _read_rope(raw, source, int(head_dim))
        sliding_rope = _read_sliding_rope(raw, source, int(head_dim))
        eos = None
        if generation is not None:
            eos = generation.get("eos_token_id")
        if eos is None:
            eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            hidden_size=hidden_size,
            num_layers=_get_int(raw, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=int(head_dim),
            intermediate_size=_get_int(raw, "intermediate_size", source),
            vocab_size=_get_int(raw, "vocab_size", source),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(int(t) for t in eos_ids),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            architecture=architecture,
            layer_spec=layer_spec,
            partial_rotary_factor=partial_rotary,
            sliding_rope_theta=sliding_rope[0],
            sliding_rope_scaling=sliding_rope[1],
            **family.read_scalars(raw, source),
        )

    @property
    def config_hash(self) -> str:
        """sha256 of the canonical JSON of every field: equal on two nodes iff they loaded the
        same model shape (checked at rendezvous)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def rotary_dim(self) -> int:
        """Each head's first rotary_dim dims are rotated, the rest pass through (Phi-4-mini:
        0.75 of 128)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_long_from(self) -> int | None:
        """LongRoPE: a sequence longer than this turns at the long factors (ring/scheduler.py
        `_rope_long`); None where the rotary has one set of frequencies."""
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type != "longrope":
            return None
        return scaling.original_max_position_embeddings

    def window_of(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for none."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def kv_window(self) -> int | None:
        """Where every layer has a window, the longest: the positions behind a sequence's next
        one that any layer can still see (the scheduler gives the blocks before them back to
        the pool: ring/scheduler.py). None where some layer sees all."""
        if not self.layer_windows or not all(self.layer_windows):
            return None
        return max(self.layer_windows)

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return self.head_dim**-0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token_per_layer(self, dtype: object) -> int:
        """K and V of one token in one layer: 2 * h_kv * d_head * bytes per element."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)


# --kv-cache-dtype, SGLang's flag and names (stages/kv_cache.py resolve_kv_cache_dtype says what
# a stage stores for each): auto, the stage dtype; bf16 the same on a bf16 stage; int8 8-bit
# codes with scales (stages/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")


def read_config_json(config_path: Path) -> dict[str, Any]:
    """A model's config.json as a dict, or one ConfigError saying what is wrong with it."""
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{config_path} is not readable JSON ({exc}); fix or re-export it"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path} holds no JSON object; pass a model's config.json")
    return raw


def _read_sliding_rope(
    raw: dict[str, Any], source: str, head_dim: int
) -> tuple[float | None, RopeScaling | None]:
    """Gemma 3's rotary of its windowed layers: transformers >= 5 writes `rope_parameters`
    per layer type, older folders `rope_local_base_freq`; (None, None) where there is none."""
    params = raw.get("rope_parameters") or {}
    if "sliding_attention" in params:
        theta, scaling, _ = _read_rope(raw, source, head_dim, params["sliding_attention"] or {})
        return theta, scaling
    if "rope_local_base_freq" in raw:
        return float(raw["rope_local_base_freq"]), None
    return None, None


def _read_rope(
    raw: dict[str, Any], source: str, head_dim: int, params: dict[str, Any] | None = None
) -> tuple[float, RopeScaling | None, float]:
    """(theta, scaling, partial_rotary_factor) of a config, or of `params` (one layer type's
    rope_parameters)."""
    # transformers >= 5 writes `rope_parameters` (theta inside), per layer type where those
    # differ (Gemma 3: the full-attention layers' are the model's); older folders write
    # `rope_theta` beside an optional `rope_scaling` dict. Accept both.
    if params is None:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if "full_attention" in params:
            params = params["full_attention"] or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == FREQ_FACTORS and params.get("factors"):
        factors = tuple(float(f) for f in params["factors"])
        return theta, RopeScaling(FREQ_FACTORS, factors=factors), 1.0
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source} uses rope_type={rope_type}, which ppring does not implement; "
            f"serve a model with rope_type one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise ConfigError(
            f"{source} sets partial_rotary_factor={partial}, which turns {rotary_dim} of "
            f"{head_dim} dims of a head; ppring needs an even count of them, and of the rest"
        )
    if rope_type == "default":
        return theta, None, partial
    try:
        if rope_type == "linear":
            return theta, RopeScaling("linear", factor=float(params["factor"])), partial
        if rope_type == "longrope":
            return theta, _longrope(raw, params, source, rotary_dim), partial
        return (
            theta,
            RopeScaling(
                "llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings", raw["max_position_embeddings"])
                ),
            ),
            partial,
        )
    except KeyError as exc:
        raise ConfigError(
            f"{source} sets rope_type={rope_type} without {exc.args[0]}; add it to the config"
        ) from None


def _longrope(
    raw: dict[str, Any], params: dict[str, Any], source: str, rotary_dim: int
) -> RopeScaling:
    """Phi-3's LongRoPE, as transformers computes it (modeling_rope_utils): the attention
    factor, where the config gives none, from max / original positions."""
    original = int(
        params.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
    )
    short = tuple(float(f) for f in params["short_factor"])
    long = tuple(float(f) for f in params["long_factor"])
    if len(short) != rotary_dim // 2 or len(long) != rotary_dim // 2:
        raise ConfigError(
            f"{source}'s longrope factors hold {len(short)} and {len(long)} values; the rotary "
            f"turns {rotary_dim} dims, so each needs {rotary_dim // 2}"
        )
    factor = params.get("factor")
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeScaling(
        "longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=short,
        long_factor=long,
        attention_factor=float(attention_factor),
    )


def _get_int(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source} lacks an integer {key}; re-export the model's config.json")
    return value


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
