"""What every ctypes call into the CPU kernels shares: the element sizes they take, the checks
of a tensor before its raw memory is handed over, and the one-sentence errors for the PPR_BAD_*
statuses with which the kernels refuse an index (ppring.h)."""

from __future__ import annotations

import torch

from stages.backend.cpu.codes import GridCodes, GridPairs, GridQuads
from stages.batch import BLOCK_SIZE

_ELEM_BYTES = {torch.float32: 4, torch.bfloat16: 2}

# ppring.h's PPR_BAD_*: what an index the caller passed lies outside of (the kernels check
# before they write anything), raised as the torch path raises it: IndexError for an index,
# ValueError for a count or range
_BAD_INDEX = {
    -2: (IndexError, "a cache slot lies outside the KV pool{slots}"),
    -3: (IndexError, "a block id lies outside the KV pool{blocks}"),
    -4: (ValueError, "a row count or a query's rows lie outside the{rows} rows given"),
    -5: (IndexError, "a position lies outside the rotary tables' rows"),
    -6: (ValueError, "a context is shorter than its query or longer than its block table"),
}


def check_status(status: int, what: str, rows: int | None = None, slots: int | None = None) -> None:
    """Raise the one-sentence error for a kernel's PPR_BAD_* status; other statuses pass."""
    if status not in _BAD_INDEX:
        return
    kind, sentence = _BAD_INDEX[status]
    sentence = sentence.format(
        slots=f"'s {slots} slots" if slots is not None else "",
        blocks=f"'s {slots // BLOCK_SIZE} blocks" if slots is not None else "",
        rows=f" {rows}" if rows is not None else "",
    )
    raise kind(f"{what}: {sentence}; nothing was written")


def _grid_pointers(grid: GridCodes | GridPairs | GridQuads) -> tuple[int, int, int | None]:
    """codes, scale and offset (None for Q8_0) of `grid`, as the kernels take them."""
    offset = None if grid.offset is None else grid.offset.data_ptr()
    return grid.codes.data_ptr(), grid.scale.data_ptr(), offset


def kv_kind(kv_layer: torch.Tensor, like: torch.Tensor) -> int:
    """The kernels' name for a cache layer's kind (csrc/ppring.h kv_kind_ok): its element size
    where it is of `like`'s dtype, 1 for an 8-bit layer, whose scales must follow its codes
    (stages/kv_quant.py check_layer); a ValueError for anything else."""
    if kv_layer.dtype is torch.int8:
        from stages import kv_quant

        kv_quant.check_layer(kv_layer)  # the scales lie inside its buffer
        if like.dtype not in _ELEM_BYTES or not kv_layer.is_cpu:
            raise ValueError(
                f"the CPU kernels take float32 or bfloat16 CPU tensors, got {like.dtype}"
            )
        return 1
    _check(kv_layer, like)
    return _ELEM_BYTES[kv_layer.dtype]


def _check(t: torch.Tensor, like: torch.Tensor) -> None:
    """The kernels read raw memory, so a tensor of the wrong dtype, device or layout would be
    read as the wrong bytes: t must be a contiguous CPU tensor of `like`'s float32/bf16 dtype.
    (Cheap checks: a layer makes a dozen of these calls per step.)"""
    if t.dtype is not like.dtype or t.dtype not in _ELEM_BYTES or not t.is_cpu:
        raise ValueError(f"the CPU kernels take float32 or bfloat16 CPU tensors, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError("the CPU kernels take contiguous tensors")
