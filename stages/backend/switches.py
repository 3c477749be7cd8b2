"""The process environment's switches of how a stage computes, read once when the stage picks
its backend (stages/backend/__init__.py) and printed in its start-up summary where they differ
from the defaults. Code below the backend takes these values; it does not read os.environ."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from stages.errors import ConfigError

NATIVE_KERNELS_ENV = "PPRING_NATIVE_KERNELS"  # "0": torch's ops on a CPU
FUSED_LAYERS_ENV = "PPRING_FUSED_LAYERS"  # "0": a stage's layers one Python call per op
GRID_WEIGHTS_ENV = "PPRING_GRID_WEIGHTS"  # "0": every weight as panels, none as codes
GRID_ACTIVATIONS_ENV = "PPRING_GRID_ACTIVATIONS"
GRID_ACTIVATIONS = ("int8x2", "int8", "bf16")
TRITON_ATTENTION_ENV = "PPRING_TRITON_ATTENTION"  # "0": a GPU keeps torch's gather, no graphs
# "auto" (measured: backend/cpu/amx_choice.py), or a row count from which every bf16 matrix
# multiplies on AMX tiles; "0": never, nor long prefill chunks' attention: every row's result
# then independent of its batch (the vector kernels sum a row in one order whatever the batch)
AMX_ROWS_ENV = "PPRING_AMX_ROWS"

# field -> (variable, its default); "0" turns a default-on path off
_VARIABLES = {
    "native_kernels": (NATIVE_KERNELS_ENV, "1"),
    "fused_layers": (FUSED_LAYERS_ENV, "1"),
    "grid_weights": (GRID_WEIGHTS_ENV, "1"),
    "grid_activations": (GRID_ACTIVATIONS_ENV, "int8x2"),
    "triton_attention": (TRITON_ATTENTION_ENV, "1"),
    "amx_rows": (AMX_ROWS_ENV, "auto"),
}


@dataclass(frozen=True)
class Switches:
    native_kernels: bool = True  # ppring's CPU kernels (off: torch's ops on a CPU)
    fused_layers: bool = True  # a stage's layers in one kernel call (off: one call per op)
    grid_weights: bool = True  # GGUF-grid weights held as their codes (off: panels)
    grid_activations: str = "int8x2"  # how a bf16 stage multiplies codes (GRID_ACTIVATIONS)
    triton_attention: bool = True  # a GPU's paged decode attention (off: gather, no graphs)
    amx_rows: str = "auto"  # where bf16 matmuls move to AMX tiles: "auto" or a row count

    @classmethod
    def read(cls) -> Switches:
        """The switches as the environment sets them now; one ConfigError for a bad value."""
        return cls(
            native_kernels=_on("native_kernels"),
            fused_layers=_on("fused_layers"),
            grid_weights=_on("grid_weights"),
            grid_activations=grid_activations(),
            triton_attention=_on("triton_attention"),
            amx_rows=amx_rows(),
        )

    def changed(self) -> str:
        """The variables set away from their defaults, as a user would type them ("" none)."""
        default = Switches()
        out = []
        for field in fields(self):
            value = getattr(self, field.name)
            if value != getattr(default, field.name):
                variable, _ = _VARIABLES[field.name]
                out.append(f"{variable}={'0' if value is False else value}")
        return " ".join(out)


def grid_weights_on() -> bool:
    """PPRING_GRID_WEIGHTS alone, as the environment sets it now."""
    return _on("grid_weights")


def _on(name: str) -> bool:
    variable, default = _VARIABLES[name]
    return os.environ.get(variable, default) != "0"


def grid_activations() -> str:
    """How a bf16 stage multiplies weights held as grid codes: "int8x2" (GridA8Linear, each row
    of x quantized to int8 in two passes: the accuracy of bf16), "int8" (one pass, as llama.cpp
    does: up to twice as fast where the matmuls bind, ~3.6x bf16's KL divergence from fp32) or
    "bf16" (GridBf16Linear: the codes decoded to bf16, the same results as the bf16 panels)."""
    value = os.environ.get(GRID_ACTIVATIONS_ENV, "int8x2").strip().lower()
    if value not in GRID_ACTIVATIONS:
        raise ConfigError(
            f"{GRID_ACTIVATIONS_ENV}={value!r} is not a choice; give int8x2 (codes times int8 "
            "activations in two passes, the default), int8 (one pass, as llama.cpp) or bf16 "
            "(codes decoded to bf16)"
        )
    return value


def amx_rows() -> str:
    """PPRING_AMX_ROWS: "auto" (each matrix's row count from which AMX tiles win, measured once
    per machine: backend/cpu/amx_choice.py) or a whole number of rows from which every bf16
    matrix multiplies on the tiles where the CPU has them ("0": never)."""
    value = os.environ.get(AMX_ROWS_ENV, "auto").strip().lower()
    if value != "auto" and not value.isdigit():
        raise ConfigError(
            f"{AMX_ROWS_ENV}={value!r} is not a choice; give auto (measured, the default) or a "
            "whole number of rows from which bf16 matmuls run on AMX tiles (0: never)"
        )
    return value
