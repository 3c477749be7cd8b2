"""The CPU kernels' matmuls, one method each: weights packed in panels (fp32, bf16), held as
GGUF grid codes (fp32, bf16, times int8 activations) or as int8 with scales. A part of
`NativeKernels` (stages/backend/cpu/native.py), which loads the library and declares every
entry point's argument types; here only the calls.
"""

from __future__ import annotations

import ctypes

import torch

from stages.backend.cpu.calls import _ELEM_BYTES, _check, _grid_pointers
from stages.backend.cpu.codes import BLOCK as GRID_BLOCK
from stages.backend.cpu.codes import GridCodes, GridPairs, GridQuads

PANEL = 16  # output channels per panel of a packed fp32 weight (ppring.h's PANEL)


class MatmulKernels:
    """The matmul half of NativeKernels (it sets `_lib` and the capability flags)."""

    _lib: ctypes.CDLL
    bf16_dot: bool
    amx_bf16: bool
    a8_dot: bool

    def pack_f32(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] fp32 -> panels [ceil(N / 16), K, 16]: panels[p, k, j] = weight[16p + j, k],
        zero past N; the layout `linear_f32` reads."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("pack_f32 takes a float32 CPU weight [N, K]")
        weight = weight.contiguous()
        n, k = weight.shape
        panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32)
        self._lib.ppr_pack_f32(weight.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def linear_f32(self, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N], fp32, for W [N, K] packed by `pack_f32` (N = out_features);
        every panel is read from memory once per call, whatever M is."""
        x = x.contiguous()
        m, k = x.shape
        if (
            x.dtype != torch.float32
            or panels.dtype != torch.float32
            or tuple(panels.shape) != (-(-out_features // PANEL), k, PANEL)
            or not panels.is_contiguous()
        ):
            raise ValueError(
                f"linear_f32 takes float32 x [M, K] and panels [ceil(N / {PANEL}), K, {PANEL}] "
                f"from pack_f32; got x {tuple(x.shape)} {x.dtype}, panels "
                f"{tuple(panels.shape)} {panels.dtype} for N = {out_features}"
            )
        y = torch.empty(m, out_features, dtype=torch.float32)
        self._lib.ppr_linear_f32(x.data_ptr(), panels.data_ptr(), y.data_ptr(), m, out_features, k)
        return y

    def linear_grid(self, x: torch.Tensor, grid: GridCodes) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] fp32, for W held as grid codes (backend/cpu/grid.py): the same
        values, and so the same result, as linear_f32 over W's fp32 panels."""
        x = x.contiguous()
        m, k = x.shape
        if k != grid.in_features:  # the codes themselves were checked when they were made
            raise ValueError(f"grid codes do not fit K = {k} and N = {grid.out_features}")
        if x.dtype != torch.float32:
            raise ValueError(f"linear_grid takes float32 x, got {x.dtype}")
        y = torch.empty(m, grid.out_features, dtype=torch.float32)
        status = self._lib.ppr_linear_grid(
            x.data_ptr(), *_grid_pointers(grid), y.data_ptr(), m, grid.out_features, k, grid.bits
        )
        if status != 0:
            raise RuntimeError("linear_grid could not allocate its panel buffers")
        return y

    def grid_codes(
        self,
        w: torch.Tensor,
        candidates: torch.Tensor,
        offset: torch.Tensor | None,
        q_min: int,
        q_max: int,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """w [N, K] fp32 (K a multiple of 32); candidates [B, C] fp32 scales per block of 32
        along a row (B = N K / 32); offset [B] or None. (q [N, K] int8, d [B]) where every
        block has a candidate d with w = d * q (+ offset) exactly, else None."""
        n, k = w.shape
        num_blocks = n * k // GRID_BLOCK
        w, candidates = w.contiguous(), candidates.contiguous()
        if (
            k % GRID_BLOCK
            or w.dtype != torch.float32
            or candidates.dtype != torch.float32
            or candidates.dim() != 2
            or candidates.shape[0] != num_blocks
            or (offset is not None and tuple(offset.shape) != (num_blocks,))
        ):
            raise ValueError("grid_codes takes w [N, K] and per-block candidates [N K / 32, C]")
        if offset is not None:
            offset = offset.to(torch.float32).contiguous()
        codes = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(num_blocks, dtype=torch.float32)
        missing = self._lib.ppr_grid_codes(
            w.data_ptr(),
            n,
            k,
            candidates.data_ptr(),
            candidates.shape[1],
            None if offset is None else offset.data_ptr(),
            q_min,
            q_max,
            codes.data_ptr(),
            scale.data_ptr(),
        )
        return None if missing else (codes, scale)

    def unpack_grid(self, grid: GridCodes) -> torch.Tensor:
        """The fp32 panels [ceil(N / 16), K, 16] the codes stand for, decoded by the kernel."""
        k = grid.in_features
        panels = torch.empty(grid.codes.shape[0], k, PANEL, dtype=torch.float32)
        self._lib.ppr_unpack_grid(
            *_grid_pointers(grid), panels.data_ptr(), grid.out_features, k, grid.bits
        )
        return panels

    def linear_int8(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, quads: bool = False
    ) -> torch.Tensor:
        """(x [M, K] @ weight [N, K] int8^T) * scale [N] fp32 -> [M, N] in x's dtype (fp32 or
        bf16: the kernel reads and writes either, so a bf16 stage converts nothing around it).
        quads: weight's bytes are pack_int8_quads' order (only where `int8_quads`)."""
        x = x.contiguous()
        (m, k), n = x.shape, weight.shape[0]
        if weight.shape[1] != k or weight.dtype != torch.int8 or scale.shape != (n,):
            raise ValueError("linear_int8 takes x [M, K], an int8 weight [N, K] and scale [N]")
        if not weight.is_contiguous():
            raise ValueError("linear_int8 reads the weight's memory: it must be contiguous")
        _check(x, x)
        y = torch.empty(m, n, dtype=x.dtype)
        args = (
            _ELEM_BYTES[x.dtype], x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(),
            m, n, k,
        )  # fmt: skip
        if not quads:
            self._lib.ppr_linear_int8(*args)
        elif self._lib.ppr_linear_int8_quads(*args):
            raise RuntimeError(
                "linear_int8 over quads: these kernels lack AVX-512, N % 4 or K % 32 is not 0, "
                "or no memory for a buffer"
            )
        return y

    def quantize_rows_q16(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [M, K] fp32 or bf16 -> (xq [M, K] int16, scales [M] fp32): each row rounded as
        linear_int8 rounds it before multiplying; None where this build's int8 matmul widens
        to fp32 instead (no AVX2)."""
        x = x.contiguous()
        _check(x, x)
        m, k = x.shape
        xq, scales = torch.empty(m, k, dtype=torch.int16), torch.empty(m)
        ok = self._lib.ppr_quantize_rows_q16(
            _ELEM_BYTES[x.dtype], x.data_ptr(), m, k, xq.data_ptr(), scales.data_ptr()
        )
        return (xq, scales) if ok == 0 else None

    def pack_bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] bf16 -> panels [ceil(N / 16), ceil(K / 2), 16, 2]: panels[p, i, j, e] =
        weight[16p + j, 2i + e], zero past N and K; the layout `linear_bf16` reads."""
        if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError("pack_bf16 takes a bfloat16 CPU weight [N, K]")
        weight = weight.contiguous()
        n, k = weight.shape
        panels = torch.empty(-(-n // PANEL), -(-k // 2), PANEL, 2, dtype=torch.bfloat16)
        self._lib.ppr_pack_bf16(weight.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def linear_bf16(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        out_features: int,
        in_features: int | None = None,
        amx: bool = False,
    ) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N], bf16, for W [N, K] packed by `pack_bf16`; sums in fp32,
        each result rounded once. Only where `bf16_dot` (AVX512_BF16). `in_features`: K, where
        the caller knows it (the panels hold ceil(K / 2) pairs, so an odd K is ambiguous).
        `amx`: on AMX tiles (csrc/matmul_amx.c) where `amx_bf16` and K % 32 == 0, else with
        vdpbf16ps."""
        x = x.contiguous()
        m, k = x.shape
        if (
            (in_features is not None and k != in_features)
            or x.dtype is not torch.bfloat16
            or panels.dtype is not torch.bfloat16
            or tuple(panels.shape) != (-(-out_features // PANEL), -(-k // 2), PANEL, 2)
            or not panels.is_contiguous()
        ):
            raise ValueError(
                f"linear_bf16 takes bf16 x [M, K] and panels [ceil(N / {PANEL}), "
                f"ceil(K / 2), {PANEL}, 2] from pack_bf16; got x {tuple(x.shape)} {x.dtype}, "
                f"panels {tuple(panels.shape)} {panels.dtype} for N = {out_features}"
            )
        y = torch.empty(m, out_features, dtype=torch.bfloat16)
        if m == 0:
            return y
        args = (x.data_ptr(), panels.data_ptr(), y.data_ptr(), m, out_features, k)
        if amx and self.amx_bf16 and k % 32 == 0 and self._lib.ppr_linear_bf16_amx(*args) == 0:
            return y
        if self._lib.ppr_linear_bf16(*args):
            raise RuntimeError("these kernels were built without AVX512_BF16: use F.linear")
        return y

    def linear_grid_bf16(self, x: torch.Tensor, pairs: GridPairs) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] bf16, for W held as grid codes in the bf16 layout
        (backend/cpu/grid.py GridPairs): the same result as linear_bf16 over W's bf16 panels. Only
        where `bf16_dot`."""
        return self._bf16_over_codes(
            self._lib.ppr_linear_grid_bf16, "linear_grid_bf16", x, pairs,
            "kernels without AVX512_BF16, or no memory for a buffer",
        )  # fmt: skip

    def _bf16_over_codes(
        self,
        kernel,
        name: str,
        x: torch.Tensor,
        grid: GridPairs | GridQuads,
        refused: str,
        *more: int,
    ) -> torch.Tensor:
        """x [M, K] bf16 @ W^T -> [M, N] bf16 through `kernel`, for W held as `grid`; `more`:
        the kernel's arguments after the shapes."""
        x = x.contiguous()
        m, k = x.shape
        if k != grid.in_features:  # the codes themselves were checked when they were made
            raise ValueError(f"{grid.WHAT} do not fit K = {k} and N = {grid.out_features}")
        if x.dtype is not torch.bfloat16:
            raise ValueError(f"{name} takes bfloat16 x, got {x.dtype}")
        y = torch.empty(m, grid.out_features, dtype=torch.bfloat16)
        status = kernel(
            x.data_ptr(),
            *_grid_pointers(grid),
            y.data_ptr(),
            m,
            grid.out_features,
            k,
            grid.bits,
            *more,
        )
        if status != 0:
            raise RuntimeError(f"{name} failed: {refused}")
        return y

    def unpack_grid_bf16(self, pairs: GridPairs) -> torch.Tensor:
        """The bf16 panels [ceil(N / 16), K / 2, 16, 2] (pack_bf16's layout) the codes stand
        for, decoded by the kernel."""
        k = pairs.in_features
        panels = torch.empty(pairs.codes.shape[0], k // 2, PANEL, 2, dtype=torch.bfloat16)
        if self._lib.ppr_unpack_grid_bf16(
            *_grid_pointers(pairs), panels.data_ptr(), pairs.out_features, k, pairs.bits
        ):
            raise RuntimeError("these kernels were built without AVX512_BF16")
        return panels

    def linear_grid_a8(
        self, x: torch.Tensor, quads: GridQuads, passes: int = 2, amx: bool = False
    ) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] bf16, for W held as grid codes in the int8-activation
        layout (backend/cpu/grid.py GridQuads): each row of x quantized to int8 per block of 32 in
        `passes` passes (2: the second quantizes what the first missed), the products summed in
        integers (matmul_a8.c ppr_linear_grid_a8). Only where `a8_dot`. `amx` (where
        `amx_bf16`): x unquantized, times the codes decoded to bf16 a unit at a time, on AMX
        tiles (csrc/matmul_amx.c ppr_linear_grid_a8_amx)."""
        if passes not in (1, 2):
            raise ValueError(f"linear_grid_a8 quantizes x in 1 or 2 passes, not {passes}")
        if amx and self.amx_bf16 and x.shape[0] > 0:
            try:
                return self._bf16_over_codes(
                    self._lib.ppr_linear_grid_a8_amx, "linear_grid_a8", x, quads, "refused"
                )
            except RuntimeError:
                pass  # refused (a shape the tiles do not take, no memory): the integer kernel
        return self._bf16_over_codes(
            self._lib.ppr_linear_grid_a8, "linear_grid_a8", x, quads,
            "kernels without AVX512_BF16 and VNNI, or no memory", passes,
        )  # fmt: skip

    def grid_a8_rows(self, quads: GridQuads, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight held as `quads`, [T, K] bf16: backend/cpu/grid.py
        quad_rows(quads, ids) rounded to bf16, bit for bit (a tied lm_head's embedding lookup).
        Only where `a8_dot`."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], quads.in_features, dtype=torch.bfloat16)
        self.grid_a8_rows_at(quads, ids.data_ptr(), out.data_ptr(), ids.shape[0])
        return out

    def grid_a8_rows_at(self, quads: GridQuads, ids_at: int, out_at: int, rows: int) -> None:
        """grid_a8_rows over raw addresses: ids [rows] int64 at ids_at, out [rows, K] bf16 at
        out_at."""
        status = self._lib.ppr_grid_a8_rows(
            *_grid_pointers(quads), ids_at, out_at, rows, quads.out_features, quads.in_features,
            quads.bits,
        )  # fmt: skip
        if status != 0:
            raise ValueError(
                f"grid_a8_rows: token ids must lie in [0, {quads.out_features}) "
                "(or these kernels lack AVX512_BF16 and VNNI)"
            )
