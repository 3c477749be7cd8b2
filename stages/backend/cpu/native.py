"""ppring's CPU kernels (`cpu_kernels.c`), compiled once per machine and called through ctypes.

Why C, and why built here: attention must read each sequence's K and V where the block table
says they are, and torch has no op that walks a block table on the CPU. Gathering the context
into a dense tensor for SDPA copied every sequence's K and V in every layer, which cost as much
as the attention itself (PITFALLS.md). vLLM and SGLang ship compiled CPU kernels for this; a
wheel of ours would have to match every CPU, so the source is compiled on first use with
`-march=native` (about one second) into `$PPRING_CACHE/kernels/`, keyed by the source, the
compiler and this CPU's feature flags, and reused afterwards.

The kernels use OpenMP and link `libgomp.so.1` by soname; torch has already loaded its own
copy under that soname, so the kernels run on torch's thread pool with torch's thread count.
With no C compiler, or `PPRING_NATIVE_KERNELS=0`, `kernels()` returns None and the stage runs
the torch path (gather + SDPA, F.linear). `kernels_for(device, dtype)` is the one place that
decides whether a stage uses them, and says why not, for the start-up log.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from stages.backend.cpu.codes import BLOCK as GRID_BLOCK
from stages.backend.cpu.codes import GridCodes, GridPairs, GridQuads
from stages.batch import BLOCK_SIZE

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
DISABLE_ENV = "PPRING_NATIVE_KERNELS"  # "0": use the torch paths
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# No -march: the compiler's baseline (x86-64 without AVX2 here), so the portable C paths run;
# the tests build this too, so both are checked on every machine.
PORTABLE_CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")
# A test-only build (`make test-asan`): every build of the kernels under AddressSanitizer and
# UBSan, any report fatal. The interpreter must have libasan preloaded (LD_PRELOAD).
SANITIZE_ENV = "PPRING_SANITIZE"  # "1": sanitized builds
SANITIZE_CFLAGS = (
    "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
)  # fmt: skip
COMPILE_TIMEOUT_S = 120

_vp = ctypes.c_void_p
PANEL = 16  # output channels per panel of a packed fp32 weight (cpu_kernels.c's PANEL)


class NativeKernels:
    """The loaded library. Every tensor argument must be a contiguous CPU tensor of the dtype the
    method names; the methods check shapes, since a wrong one would read out of bounds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.ppr_block_size.restype = ctypes.c_int
        if lib.ppr_block_size() != BLOCK_SIZE:
            raise RuntimeError(f"{path} was built for another block size")
        lib.ppr_panel_width.restype = ctypes.c_int
        if lib.ppr_panel_width() != PANEL:
            raise RuntimeError(f"{path} was built for another panel width")
        lib.ppr_paged_attention.restype = ctypes.c_int
        lib.ppr_paged_attention.argtypes = [
            ctypes.c_int, _vp, _vp, _vp, ctypes.c_int, ctypes.c_int, _vp, _vp, _vp, _vp,
            ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_float,
        ]  # fmt: skip
        lib.ppr_pack_f32.restype = None
        lib.ppr_pack_f32.argtypes = [_vp, _vp] + [ctypes.c_int] * 2
        lib.ppr_linear_f32.restype = None
        lib.ppr_linear_f32.argtypes = [_vp, _vp, _vp] + [ctypes.c_int] * 3
        lib.ppr_linear_grid.restype = ctypes.c_int
        lib.ppr_linear_grid.argtypes = [_vp] * 5 + [ctypes.c_int] * 4
        lib.ppr_unpack_grid.restype = ctypes.c_int
        lib.ppr_unpack_grid.argtypes = [_vp] * 4 + [ctypes.c_int] * 3
        lib.ppr_grid_codes.restype = ctypes.c_int64
        lib.ppr_grid_codes.argtypes = [_vp, ctypes.c_int, ctypes.c_int, _vp, ctypes.c_int, _vp]
        lib.ppr_grid_codes.argtypes += [ctypes.c_int, ctypes.c_int, _vp, _vp]
        lib.ppr_linear_int8.restype = None
        lib.ppr_linear_int8.argtypes = [ctypes.c_int] + [_vp] * 4 + [ctypes.c_int] * 3
        lib.ppr_linear_int8_quads.restype = ctypes.c_int
        lib.ppr_linear_int8_quads.argtypes = [ctypes.c_int] + [_vp] * 4 + [ctypes.c_int] * 3
        lib.ppr_int8_quads.restype = ctypes.c_int
        # AVX-512: int8 weights held in quads (stages/linear.py pack_int8_quads) read faster
        self.int8_quads = bool(lib.ppr_int8_quads())
        lib.ppr_quantize_rows_q16.restype = ctypes.c_int
        lib.ppr_quantize_rows_q16.argtypes = [ctypes.c_int, _vp] + [ctypes.c_int] * 2 + [_vp] * 2
        lib.ppr_has_bf16_dot.restype = ctypes.c_int
        # vdpbf16ps: a bf16 stage's matmuls run here (ppr_linear_bf16) instead of in oneDNN
        self.bf16_dot = bool(lib.ppr_has_bf16_dot())
        lib.ppr_pack_bf16.restype = None
        lib.ppr_pack_bf16.argtypes = [_vp, _vp] + [ctypes.c_int] * 2
        lib.ppr_linear_bf16.restype = ctypes.c_int
        lib.ppr_linear_bf16.argtypes = [_vp] * 3 + [ctypes.c_int] * 3
        lib.ppr_linear_grid_bf16.restype = ctypes.c_int
        lib.ppr_linear_grid_bf16.argtypes = [_vp] * 5 + [ctypes.c_int] * 4
        lib.ppr_unpack_grid_bf16.restype = ctypes.c_int
        lib.ppr_unpack_grid_bf16.argtypes = [_vp] * 4 + [ctypes.c_int] * 3
        lib.ppr_has_a8_dot.restype = ctypes.c_int
        # vpdpbusd as well: grid codes multiply int8-quantized activations (ppr_linear_grid_a8)
        self.a8_dot = bool(lib.ppr_has_a8_dot())
        lib.ppr_linear_grid_a8.restype = ctypes.c_int
        lib.ppr_linear_grid_a8.argtypes = [_vp] * 5 + [ctypes.c_int] * 5
        lib.ppr_grid_a8_rows.restype = ctypes.c_int
        lib.ppr_grid_a8_rows.argtypes = [_vp] * 5 + [ctypes.c_int] * 4
        lib.ppr_add_rms_norm.restype = None
        lib.ppr_add_rms_norm.argtypes = (
            [ctypes.c_int] + [_vp] * 5 + [ctypes.c_int] * 2 + [ctypes.c_float]
        )
        lib.ppr_rope_store.restype = ctypes.c_int
        lib.ppr_rope_store.argtypes = [
            ctypes.c_int, _vp, ctypes.c_int64, _vp, _vp, _vp, _vp, _vp, ctypes.c_int64,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]  # fmt: skip
        lib.ppr_silu_mul.restype = None
        lib.ppr_silu_mul.argtypes = [ctypes.c_int, _vp, _vp, ctypes.c_int64, _vp] + [
            ctypes.c_int
        ] * 2
        lib.ppr_kv_as_pairs.restype = ctypes.c_int
        lib.ppr_kv_as_pairs.argtypes = [ctypes.c_int] * 2
        lib.ppr_decoder_layers.restype = ctypes.c_int
        lib.ppr_decoder_layers.argtypes = [_vp, ctypes.c_int] + [_vp] * 5 + [ctypes.c_int64, _vp]
        lib.ppr_layer_matmuls.restype = ctypes.c_int
        lib.ppr_layer_matmuls.argtypes = [_vp, ctypes.c_int, ctypes.c_int] + [_vp] * 4
        lib.ppr_greedy_head.restype = ctypes.c_int
        lib.ppr_greedy_head.argtypes = [_vp, ctypes.c_int] + [_vp] * 3
        lib.ppr_greedy_head.argtypes += [ctypes.c_float] + [ctypes.c_int] * 3 + [_vp, _vp]
        lib.ppr_greedy_head.argtypes += [ctypes.c_int64, _vp, _vp, _vp, _vp]
        lib.ppr_struct_size.restype = ctypes.c_int64
        lib.ppr_struct_size.argtypes = [ctypes.c_int]
        # sizeof ppr_linear_t, ppr_layer_t, ppr_step_t: stages/fused_layer.py checks its
        # ctypes mirrors against them before it builds one
        self.struct_sizes = tuple(lib.ppr_struct_size(i) for i in range(3))
        lib.ppr_row_argmax.restype = None
        lib.ppr_row_argmax.argtypes = [ctypes.c_int, _vp, ctypes.c_int64, _vp] + [ctypes.c_int] * 2
        self._lib = lib

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        q_start: torch.Tensor,
        q_len: torch.Tensor,
        ctx_len: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [T, h, d] (RoPE applied); kv_layer [2, slots, h_kv, d] with this step's K/V written;
        q_start, q_len, ctx_len [N] int32; block_table [N, max_blocks] int32 covering each
        context. Returns [T, h, d]: each row attends causally to its own sequence's keys."""
        num_tokens, num_heads, head_dim = q.shape
        _, num_slots, num_kv_heads, kv_dim = kv_layer.shape
        if kv_dim != head_dim:
            raise ValueError(f"q has head_dim {head_dim}, the KV cache {kv_dim}")
        _check(q, kv_layer)
        _check(kv_layer, kv_layer)
        if block_table.dtype is not torch.int32 or not block_table.is_contiguous():
            raise ValueError("the block table must be contiguous int32")
        out = torch.empty_like(q)
        for meta in (q_start, q_len, ctx_len):
            if meta.dtype is not torch.int32 or tuple(meta.shape) != tuple(q_start.shape[:1]):
                raise ValueError("q_start, q_len and ctx_len must be [N] int32 each")
        if block_table.dim() != 2 or block_table.shape[0] != q_start.shape[0]:
            raise ValueError("the block table must be [N, max_blocks], a row a sequence")
        status = self._lib.ppr_paged_attention(
            _ELEM_BYTES[q.dtype],
            q.data_ptr(),
            kv_layer.data_ptr(),
            out.data_ptr(),
            num_tokens,
            q_start.shape[0],
            q_start.data_ptr(),
            q_len.data_ptr(),
            ctx_len.data_ptr(),
            block_table.data_ptr(),
            block_table.shape[1],
            num_slots,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        check_status(status, "paged attention", num_tokens, num_slots)
        if status != 0:
            raise RuntimeError(
                f"paged attention failed for {num_heads} heads over {num_kv_heads} KV heads"
            )
        return out

    def kv_as_pairs(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this build holds a cache of this dtype and head_dim as pairs (cpu_kernels.c
        kv_as_pairs: bf16 where vdpbf16ps runs attention). rope_store writes that layout and
        paged_attention reads it; nothing else reads a stage's cache."""
        if dtype not in _ELEM_BYTES:
            return False
        return bool(self._lib.ppr_kv_as_pairs(_ELEM_BYTES[dtype], head_dim))

    def to_cache_layout(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """A copy of kv_layer [2, slots, h_kv, d] (rows: torch's layout) in this build's: where
        kv_as_pairs, each page's keys as [h_kv, d / 2, 16, 2] and values as [h_kv, 8, d, 2]."""
        return self._relayout(kv_layer, to_pairs=True)

    def from_cache_layout(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """The inverse of to_cache_layout: a copy in rows."""
        return self._relayout(kv_layer, to_pairs=False)

    def _relayout(self, kv_layer: torch.Tensor, to_pairs: bool) -> torch.Tensor:
        _, num_slots, num_kv_heads, head_dim = kv_layer.shape
        if not self.kv_as_pairs(kv_layer.dtype, head_dim):
            return kv_layer.clone()
        pages, h, d = num_slots // BLOCK_SIZE, num_kv_heads, head_dim
        # Per half of the cache: a page in rows, as (slot, head, pair, element) for K and
        # (slot pair, element, head, dimension) for V, and the permutation to its pairs.
        views = (
            ((pages, BLOCK_SIZE, h, d // 2, 2), (0, 2, 3, 1, 4)),
            ((pages, BLOCK_SIZE // 2, 2, h, d), (0, 3, 1, 4, 2)),
        )
        halves = []
        for half, (rows_shape, to_pair) in zip(kv_layer, views, strict=True):
            if to_pairs:
                moved = half.reshape(rows_shape).permute(to_pair)
            else:
                pairs_shape = tuple(rows_shape[i] for i in to_pair)
                back = tuple(sorted(range(5), key=to_pair.__getitem__))  # the inverse
                moved = half.reshape(pairs_shape).permute(back)
            halves.append(moved.reshape(num_slots, h, d))
        return torch.stack(halves)

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
        """x [M, K] @ W^T -> [M, N] fp32, for W held as grid codes (stages/grid.py): the same
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
    ) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N], bf16, for W [N, K] packed by `pack_bf16`; sums in fp32,
        each result rounded once. Only where `bf16_dot` (AVX512_BF16). `in_features`: K, where
        the caller knows it (the panels hold ceil(K / 2) pairs, so an odd K is ambiguous)."""
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
        if self._lib.ppr_linear_bf16(
            x.data_ptr(), panels.data_ptr(), y.data_ptr(), m, out_features, k
        ):
            raise RuntimeError("these kernels were built without AVX512_BF16: use F.linear")
        return y

    def linear_grid_bf16(self, x: torch.Tensor, pairs: GridPairs) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] bf16, for W held as grid codes in the bf16 layout
        (stages/grid.py GridPairs): the same result as linear_bf16 over W's bf16 panels. Only
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

    def linear_grid_a8(self, x: torch.Tensor, quads: GridQuads, passes: int = 2) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] bf16, for W held as grid codes in the int8-activation
        layout (stages/grid.py GridQuads): each row of x quantized to int8 per block of 32 in
        `passes` passes (2: the second quantizes what the first missed), the products summed in
        integers (cpu_kernels.c ppr_linear_grid_a8). Only where `a8_dot`."""
        if passes not in (1, 2):
            raise ValueError(f"linear_grid_a8 quantizes x in 1 or 2 passes, not {passes}")
        return self._bf16_over_codes(
            self._lib.ppr_linear_grid_a8, "linear_grid_a8", x, quads,
            "kernels without AVX512_BF16 and VNNI, or no memory", passes,
        )  # fmt: skip

    def grid_a8_rows(self, quads: GridQuads, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight held as `quads`, [T, K] bf16: stages/grid.py
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

    def add_rms_norm(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        h_is_scratch: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual'): residual' = h + residual (h alone when residual is None), and
        x = rmsnorm(residual') * weight; h, residual [T, d] contiguous, weight [d].
        h_is_scratch: h is this step's own temporary, so residual' may be written over it."""
        _check(h, weight)
        if residual is not None:
            _check(residual, h)
        residual_out = h if h_is_scratch else torch.empty_like(h)
        x = torch.empty_like(h)
        self._lib.ppr_add_rms_norm(
            _ELEM_BYTES[h.dtype],
            h.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            residual_out.data_ptr(),
            x.data_ptr(),
            h.shape[0],
            h.shape[1],
            eps,
        )
        return x, residual_out

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_layer: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """qkv [T, (h + 2 h_kv) * d] -> q [T, h, d] with RoPE applied; k (rotated) and v are
        written into kv_layer [2, slots, h_kv, d] at slot_mapping [T] (int64).
        cos, signed_sin: [T, d] fp32."""
        _, num_slots, num_kv_heads, head_dim = kv_layer.shape
        num_tokens, row = qkv.shape
        if row != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
            raise ValueError(
                f"qkv rows of {row} cannot hold {num_heads} + 2 x {num_kv_heads} heads"
            )
        _check(qkv, kv_layer)
        if cos.dtype is not torch.float32 or cos.shape != (num_tokens, head_dim):
            raise ValueError("rope_store takes fp32 cos and sin tables of [T, head_dim]")
        if slot_mapping.dtype is not torch.int64 or slot_mapping.shape[0] != num_tokens:
            raise ValueError("slot_mapping must be [T] int64")
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype)
        status = self._lib.ppr_rope_store(
            _ELEM_BYTES[qkv.dtype],
            qkv.data_ptr(),
            row,
            q.data_ptr(),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            slot_mapping.data_ptr(),
            kv_layer.data_ptr(),
            num_slots,
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        check_status(status, "rope_store", num_tokens, num_slots)
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 I] (gate, then up) -> silu(gate) * up [T, I]."""
        _check(gate_up, gate_up)
        num_tokens, width = gate_up.shape
        out = torch.empty((num_tokens, width // 2), dtype=gate_up.dtype)
        start = gate_up.data_ptr()
        self._lib.ppr_silu_mul(
            _ELEM_BYTES[gate_up.dtype],
            start,
            start + (width // 2) * gate_up.element_size(),
            width,
            out.data_ptr(),
            num_tokens,
            width // 2,
        )
        return out

    def decoder_layers(
        self, layers: int, num_layers: int, step: int, h_in: int, residual_in: int | None,
        residual_out: int, kv: int, kv_stride: int, h_out: int,
    ) -> None:  # fmt: skip
        """`num_layers` decoder layers, every kernel of each, in one call over raw addresses:
        the structs `layers` (back to back) and `step`, the buffers stages/fused_layer.py lays
        out (it checks them), and the cache at `kv`, a layer every `kv_stride` bytes."""
        status = self._lib.ppr_decoder_layers(
            layers, num_layers, step, h_in, residual_in, residual_out, kv, kv_stride, h_out
        )
        check_status(status, "the fused decoder layers")
        if status != 0:
            raise RuntimeError("a kernel of the fused decoder layer failed (see cpu_kernels.c)")

    def layer_matmuls(
        self, layer: int, elem_bytes: int, rows: int, x_hidden: int, x_attn: int, x_act: int,
        y: int,
    ) -> None:  # fmt: skip
        """The four matmuls of the layer struct at `layer`, alone (stages/fused_layer.py)."""
        if self._lib.ppr_layer_matmuls(layer, elem_bytes, rows, x_hidden, x_attn, x_act, y):
            raise RuntimeError("a matmul of the fused decoder layer failed (see cpu_kernels.c)")

    def greedy_head(
        self, head: int, elem_bytes: int, h: int, residual: int | None, norm_weight: int | None,
        eps: float, rows: int, max_rows: int, hidden: int, scratch: int, x_out: int | None,
        token_base: int, out: int, best: int | None, their_best: int | None,
        their_token: int | None,
    ) -> None:  # fmt: skip
        """A greedy finish of `rows` rows in one call over raw addresses (None: NULL): the
        lm_head's struct at `head` and the buffers stages/fused_layer.py GreedyHead lays out
        for `max_rows` rows; cpu_kernels.c ppr_greedy_head says what each is."""
        status = self._lib.ppr_greedy_head(
            head, elem_bytes, h, residual, norm_weight, eps, rows, max_rows, hidden, scratch,
            x_out, token_base, out, best, their_best, their_token,
        )  # fmt: skip
        check_status(status, "the greedy lm_head", max_rows)
        if status != 0:
            raise RuntimeError("the lm_head's kernel refused (see cpu_kernels.c)")

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] fp32 or bf16 (rows may be strided) -> [N] int64: each row's first maximal
        index, NaN the largest, as torch's argmax(dim=-1)."""
        if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in _ELEM_BYTES:
            raise ValueError("row_argmax takes [N, V] fp32 or bf16 with unit stride along V")
        num_rows, vocab = logits.shape
        out = torch.empty(num_rows, dtype=torch.int64)
        if num_rows and vocab:
            self._lib.ppr_row_argmax(
                _ELEM_BYTES[logits.dtype], logits.data_ptr(), logits.stride(0), out.data_ptr(),
                num_rows, vocab,
            )  # fmt: skip
        return out


_ELEM_BYTES = {torch.float32: 4, torch.bfloat16: 2}

# cpu_kernels.c's PPR_BAD_*: what an index the caller passed lies outside of (the kernels check
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


def _check(t: torch.Tensor, like: torch.Tensor) -> None:
    """The kernels read raw memory, so a tensor of the wrong dtype, device or layout would be
    read as the wrong bytes: t must be a contiguous CPU tensor of `like`'s float32/bf16 dtype.
    (Cheap checks: a layer makes a dozen of these calls per step.)"""
    if t.dtype is not like.dtype or t.dtype not in _ELEM_BYTES or not t.is_cpu:
        raise ValueError(f"the CPU kernels take float32 or bfloat16 CPU tensors, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError("the CPU kernels take contiguous tensors")


def kernels() -> NativeKernels | None:
    """The kernels, built on first use; None where they cannot be (see unavailable_reason)."""
    kernels_or_reason = _load()
    return kernels_or_reason if isinstance(kernels_or_reason, NativeKernels) else None


def kernels_for(device: torch.device, dtype: torch.dtype) -> tuple[NativeKernels | None, str]:
    """The kernels a stage on `device` computing in `dtype` uses (None: torch's ops), and why,
    for the start-up log. The one place that decides: attention, the matmuls and the small ops
    all follow it."""
    if device.type != "cpu":
        return None, f"they are CPU-only; {device.type} runs torch's ops"
    if dtype not in _ELEM_BYTES:
        return None, f"they take float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    reason = unavailable_reason()
    if reason is not None:
        return None, f"they are not available: {reason}"
    return kernels(), "paged attention, matmuls and small ops in stages/cpu_kernels.c"


def unavailable_reason() -> str | None:
    """Why kernels() is None, in one sentence; None when they are loaded."""
    kernels_or_reason = _load()
    return None if isinstance(kernels_or_reason, NativeKernels) else kernels_or_reason


@functools.cache
def _load() -> NativeKernels | str:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0 turns them off"
    compiler = find_compiler()
    if compiler is None:
        return "no C compiler (gcc or cc, or $CC) was found to build them"
    try:
        path = _build(compiler)
        return NativeKernels(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return f"building them with {compiler} failed: {error}"


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256(
        b"\0".join(
            [source, version.encode(), " ".join(_flags(CFLAGS)).encode(), _cpu_signature().encode()]
        )
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if not target.is_file():
        compile_kernels(target, compiler, CFLAGS)
        logger.info("built the CPU kernels: %s", target)
    return target


def compile_kernels(target: Path, compiler: str, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Compile cpu_kernels.c into `target`. Stage processes starting together may all build:
    each writes its own file and renames it into place, which is atomic, so a reader never
    sees half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler, *_flags(cflags), "-o", partial, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr else "")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _flags(cflags: tuple[str, ...]) -> tuple[str, ...]:
    """`cflags`, with the sanitizers' where PPRING_SANITIZE=1 asks for them."""
    return (*cflags, *SANITIZE_CFLAGS) if os.environ.get(SANITIZE_ENV) == "1" else cflags


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    return platform.machine() + flags


def cache_dir() -> Path:
    """`$PPRING_CACHE`, else ~/.cache/ppring: where ppring keeps what it builds once."""
    env = os.environ.get("PPRING_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ppring"
