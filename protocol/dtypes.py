"""Every dtype ppring names, in one torch-free table every layer may import.

A dtype's canonical name is how torch and config.json spell it ("bfloat16"), so
`getattr(torch, name)` is the torch dtype; its aliases are the short names people type
(`ppring plan --dtype bf16`). Which dtypes a stage may compute in is the stage's own choice
(stages/config.py); which may travel in a message is the `on_wire` column here, because the
codec must size a frame from its header before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Dtype:
    name: str  # canonical: torch's and config.json's spelling
    num_bytes: int  # per element
    aliases: tuple[str, ...] = ()  # short names people type
    on_wire: bool = False  # the codec carries tensors of this dtype


TABLE = (
    Dtype("float32", 4, ("fp32",), on_wire=True),
    Dtype("bfloat16", 2, ("bf16",), on_wire=True),
    Dtype("float16", 2, ("fp16",), on_wire=True),
    Dtype("float8_e4m3fn", 1, ("fp8",)),
    Dtype("int8", 1),
    Dtype("int32", 4, on_wire=True),
    Dtype("int64", 8, on_wire=True),
)

# Canonical name or alias -> row.
_BY_SPELLING = {spelling: row for row in TABLE for spelling in (row.name, *row.aliases)}

# Canonical name -> row, for the dtypes a message may carry.
WIRE_DTYPES = {row.name: row for row in TABLE if row.on_wire}


def lookup(dtype: object) -> Dtype:
    """The row for a canonical name, an alias, or a torch.dtype (read through its str, so this
    module never imports torch). Raises ValueError naming every known spelling."""
    spelling = str(dtype).removeprefix("torch.")
    row = _BY_SPELLING.get(spelling)
    if row is None:
        raise ValueError(f"unknown dtype {spelling!r}; use one of {', '.join(_BY_SPELLING)}")
    return row


def canonical(dtype: object) -> str:
    """The canonical name of a dtype given by name, alias or torch.dtype: "bf16" -> "bfloat16"."""
    return lookup(dtype).name


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of a dtype given by name, alias or torch.dtype."""
    return lookup(dtype).num_bytes


def spellings(name: str) -> tuple[str, ...]:
    """A dtype's canonical name followed by its aliases: what a command line may accept."""
    row = lookup(name)
    return (row.name, *row.aliases)
