"""A weight held as the GGUF grid codes it came from, in the layouts the CPU kernels read
(stages/backend/cpu/grid.py finds them; csrc/ documents each layout where its kernel reads it).
Plain containers, checked once when made: the kernels read their raw memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

BLOCK = 32  # weights per scale along a row (GGUF's QK4_1 and QK8_0)
PANEL = 16  # output channels per panel (csrc/)


@dataclass(frozen=True)
class _Codes:
    """A weight [N, K] as grid codes in one of the kernels' layouts (the subclasses)."""

    bits: int  # 4 (Q4_1) or 8 (Q8_0)
    codes: torch.Tensor
    scale: torch.Tensor  # [P, K / 32, 16]: d
    offset: torch.Tensor | None  # [P, K / 32, 16]: m (4 bits), None (8 bits)
    out_features: int  # N

    WHAT: ClassVar[str]  # for the error
    SCALE_DTYPE: ClassVar[torch.dtype]
    K_PER_ROW: ClassVar[int]  # K per row of codes along axis 1

    def _code_layout(self, panels: int, k: int) -> tuple[torch.dtype, tuple[int, ...]]:
        raise NotImplementedError

    def __post_init__(self) -> None:
        """The kernels read these tensors' raw memory, so their shapes and dtypes are checked
        once, here (the dataclass is frozen), not on every call."""
        panels = -(-self.out_features // PANEL)
        k = self.in_features if self.codes.dim() == 3 else -1
        code_dtype, code_shape = self._code_layout(panels, k)
        scales = (panels, k // BLOCK, PANEL)
        tensors = [t for t in (self.codes, self.scale, self.offset) if t is not None]
        if (
            self.bits not in (4, 8)
            or k % BLOCK
            or self.codes.dtype != code_dtype
            or tuple(self.codes.shape) != code_shape
            or tuple(self.scale.shape) != scales
            or self.scale.dtype != self.SCALE_DTYPE
            or (self.offset is None) != (self.bits == 8)
            or (self.offset is not None and tuple(self.offset.shape) != scales)
            or (self.offset is not None and self.offset.dtype != self.SCALE_DTYPE)
            or not all(t.is_contiguous() and t.is_cpu for t in tensors)
        ):
            raise ValueError(f"{self.WHAT} do not fit K = {k} and N = {self.out_features}")

    @property
    def in_features(self) -> int:
        return self.K_PER_ROW * self.codes.shape[1]  # K

    @property
    def nbytes(self) -> int:
        tensors = [self.codes, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def name(self) -> str:
        return "Q4_1" if self.bits == 4 else "Q8_0"


@dataclass(frozen=True)
class GridCodes(_Codes):
    """In the panel layout of csrc/matmul_f32.c's fp32 grid matmul (ppr_linear_grid): codes uint8
    [P, K, 8] (4 bits) or int8 [P, K, 16] (8 bits); d and m fp32."""

    WHAT: ClassVar[str] = "grid codes"
    SCALE_DTYPE: ClassVar[torch.dtype] = torch.float32
    K_PER_ROW: ClassVar[int] = 1

    def _code_layout(self, panels: int, k: int) -> tuple[torch.dtype, tuple[int, ...]]:
        return (torch.uint8, (panels, k, 8)) if self.bits == 4 else (torch.int8, (panels, k, 16))


@dataclass(frozen=True)
class GridPairs(_Codes):
    """In the layout of csrc/matmul_bf16.c's bf16 grid matmul (ppr_linear_grid_bf16): per panel of
    16 channels and K pair, the codes in the lane order their decoding lands in, uint8
    [P, K / 2, 16] (4 bits) or int8 [P, K / 2, 32] (8 bits); d and m as the fp16 numbers
    they are."""

    WHAT: ClassVar[str] = "grid pairs"
    SCALE_DTYPE: ClassVar[torch.dtype] = torch.float16
    K_PER_ROW: ClassVar[int] = 2

    def _code_layout(self, panels: int, k: int) -> tuple[torch.dtype, tuple[int, ...]]:
        if self.bits == 4:
            return torch.uint8, (panels, k // 2, PANEL)
        return torch.int8, (panels, k // 2, 2 * PANEL)


@dataclass(frozen=True)
class GridQuads(_Codes):
    """In the layout of csrc/matmul_a8.c's int8-activation grid matmul (ppr_linear_grid_a8): per
    panel of 16 channels, groups of 64 bytes, byte 4 c + j for channel c, so that vpdpbusd sums
    four products per channel lane. uint8 [P, K / 8, 64] (4 bits: a group holds 8 k, k 0-3 in
    the low nibbles, 4-7 in the high ones) or [P, K / 4, 64] (8 bits: q + 128); d and m as the
    fp16 numbers they are."""

    WHAT: ClassVar[str] = "grid quads"
    SCALE_DTYPE: ClassVar[torch.dtype] = torch.float16

    def _code_layout(self, panels: int, k: int) -> tuple[torch.dtype, tuple[int, ...]]:
        return torch.uint8, (panels, k // (8 if self.bits == 4 else 4), 4 * PANEL)

    @property
    def in_features(self) -> int:  # K: a group holds 8 k (4 bits) or 4 (8 bits)
        return (8 if self.bits == 4 else 4) * self.codes.shape[1]
