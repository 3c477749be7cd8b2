"""The model families ppring serves, by config.json `architectures[0]` (DESIGN.md §13).

One small file per family holds what sets it apart: the `LayerSpec` it reads from its config
(stages/layer_spec.py) and the checks of what it asks for that ppring does not implement. The
layers themselves are built from shared blocks (stages/models/blocks.py) that take the spec.
Torch-free: stages/config.py reads the registry at start-up. Nothing here imports a backend.

Adding a family: README.md, "Adding a model family".
"""

from __future__ import annotations

from typing import Any

from stages.errors import ConfigError
from stages.models import gemma, granite, llama, olmo2, phi3, qwen2, qwen3
from stages.models.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    olmo2.FAMILY,
    granite.FAMILY,
    gemma.FAMILY,
)
REGISTRY: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.architectures}
SERVED_ARCHITECTURES: tuple[str, ...] = tuple(REGISTRY)


def family_for(raw: dict[str, Any], source: str) -> tuple[str, Family]:
    """The first of config.json's `architectures` that a family serves, and that family; else
    one ConfigError naming every architecture served."""
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in REGISTRY:
            return name, REGISTRY[name]
    found = ", ".join(architectures) or f"model_type={raw.get('model_type')}"
    raise ConfigError(
        f"{source} is a {found} model, which ppring does not serve (it serves "
        f"{', '.join(SERVED_ARCHITECTURES)}); pass --model a Llama-family folder of one of those"
    )
