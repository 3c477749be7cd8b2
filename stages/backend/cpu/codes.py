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


# ppring.h's GRID_K4, GRID_K5, GRID_K6: a k-quant's format as the kernels name it (its `bits`);
# any other name is a join of Q6_K rows with Q4_K or Q5_K rows ("Q4_K+Q6_K"): GRID_KM
K_QUANT_KINDS = {"Q4_K": 20, "Q5_K": 21, "Q6_K": 22}
K_QUANT_JOIN = 23


def k_quant_kind(name: str) -> int:
    return K_QUANT_KINDS.get(name, K_QUANT_JOIN)


def k_quant_planes(name: str) -> int:
    """Planes of high bits beside the nibbles: Q4_K 0, Q5_K 1, Q6_K and a join 2."""
    return {"Q4_K": 0, "Q5_K": 1}.get(name, 2)


@dataclass(frozen=True)
class KQuads:
    """A k-quant weight [N, K] (GGUF's Q4_K, Q5_K, Q6_K) in the layout of csrc/matmul_a8.c's
    k-quant micro-kernel (ppr_linear_grid_a8 with bits GRID_K4/K5/K6): per panel of 16
    channels, the codes' low nibbles as GridQuads' 4-bit groups ([K / 8, 64] bytes), then their
    high bits (Q5_K: bit 4; Q6_K: bits 4 and 5) as 64-bit masks, per group of 8 k a mask per
    plane and half (bit 4 c + j: channel c's k 8 g + 4 half + j), uint8 [P, K * 8 + K / 8 *
    16 * planes]; d fp32 [P, K / 32, 16] (Q6_K: [P, K / 16, 16]) and m fp32 [P, K / 32, 16]
    (Q6_K: None, its codes being q + 32); a join of Q6_K with Q4_K/Q5_K rows ("Q4_K+Q6_K":
    ppring.h's GRID_KM) 6-bit codes, d and m per 16, [P, K / 16, 16] each."""

    name: str  # "Q4_K", "Q5_K" or "Q6_K"
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    out_features: int  # N
    in_features: int  # K

    WHAT: ClassVar[str] = "k-quant codes"

    def __post_init__(self) -> None:
        """The kernels read these tensors' raw memory: shapes and dtypes checked once, here."""
        n, k = self.out_features, self.in_features
        panels, planes = -(-n // PANEL), k_quant_planes(self.name)
        join = self.bits == K_QUANT_JOIN
        group = 16 if self.name == "Q6_K" or join else 32
        offsets = 16 if join else 32
        tensors = [t for t in (self.codes, self.scale, self.offset) if t is not None]
        if (
            (self.name not in K_QUANT_KINDS and not (join and "Q6_K" in self.name))
            or k <= 0
            or k % BLOCK
            or self.codes.dtype != torch.uint8
            or tuple(self.codes.shape) != (panels, k * 8 + k // 8 * 16 * planes)
            or self.scale.dtype != torch.float32
            or tuple(self.scale.shape) != (panels, k // group, PANEL)
            or (self.offset is None) != (self.name == "Q6_K")
            or (self.offset is not None and self.offset.dtype != torch.float32)
            or (
                self.offset is not None
                and tuple(self.offset.shape) != (panels, k // offsets, PANEL)
            )
            or not all(t.is_contiguous() and t.is_cpu for t in tensors)
        ):
            raise ValueError(f"{self.WHAT} do not fit K = {k} and N = {n}")

    @property
    def bits(self) -> int:  # (the kernels' name for the format)
        return k_quant_kind(self.name)

    @property
    def nbytes(self) -> int:
        tensors = [self.codes, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)
