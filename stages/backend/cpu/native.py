"""ppring's CPU kernels (the C in `stages/backend/cpu/csrc/`), compiled once per machine and
called through ctypes.

Why C, and why built here: attention must read each sequence's K and V where the block table
says they are, and torch has no op that walks a block table on the CPU. Gathering the context
into a dense tensor for SDPA copied every sequence's K and V in every layer, which cost as much
as the attention itself (PITFALLS.md). vLLM and SGLang ship compiled CPU kernels for this; a
wheel of ours would have to match every CPU, so the source is compiled on first use with
`-march=native` (a few seconds: every .c of that folder, in one compiler call, into one
library) into `$PPRING_CACHE/kernels/`, keyed by the sources (every .c and .h there), the
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
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from stages import kv_quant
from stages.backend.cpu.build import build, find_compiler
from stages.backend.cpu.calls import _ELEM_BYTES, _check, check_status, kv_kind
from stages.backend.cpu.matmul_kernels import PANEL, MatmulKernels
from stages.backend.switches import NATIVE_KERNELS_ENV as DISABLE_ENV
from stages.batch import BLOCK_SIZE

__all__ = ["PANEL", "NativeKernels", "check_status", "kernels", "kernels_for"]

logger = logging.getLogger(__name__)


_vp = ctypes.c_void_p


class NativeKernels(MatmulKernels):
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
            ctypes.c_int, ctypes.c_int, _vp, _vp, _vp, ctypes.c_int, ctypes.c_int, _vp, _vp, _vp,
            _vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_float,
        ]  # fmt: skip
        lib.ppr_paged_attention_window.restype = ctypes.c_int
        lib.ppr_paged_attention_window.argtypes = [
            *lib.ppr_paged_attention.argtypes,
            ctypes.c_int,
            ctypes.c_float,
        ]
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
        # AVX-512: int8 weights held in quads (backend/cpu/linear.py pack_int8_quads) read faster
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
        lib.ppr_has_amx_bf16.restype = ctypes.c_int
        # AMX tiles over the same panels (ppr_linear_bf16_amx), where the CPU has AMX-BF16 and
        # the kernel grants this process the tile state (asked here, once)
        self.amx_bf16 = self.bf16_dot and bool(lib.ppr_has_amx_bf16())
        lib.ppr_linear_bf16_amx.restype = ctypes.c_int
        lib.ppr_linear_bf16_amx.argtypes = [_vp] * 3 + [ctypes.c_int] * 3
        lib.ppr_prefill_attention_amx.restype = ctypes.c_int
        lib.ppr_prefill_attention_amx.argtypes = [_vp] * 3 + [ctypes.c_int] * 4 + [_vp]
        lib.ppr_prefill_attention_amx.argtypes += [ctypes.c_int, ctypes.c_int64]
        lib.ppr_prefill_attention_amx.argtypes += [ctypes.c_int] * 3 + [ctypes.c_float]
        lib.ppr_kv8_pairs.restype = ctypes.c_int
        lib.ppr_kv8_pairs.argtypes = [_vp, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _vp]
        lib.ppr_kv8_pairs.argtypes += [ctypes.c_int, _vp]
        lib.ppr_linear_grid_a8_amx.restype = ctypes.c_int
        lib.ppr_linear_grid_a8_amx.argtypes = [_vp] * 5 + [ctypes.c_int] * 4
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
            ctypes.c_int, ctypes.c_int, _vp, ctypes.c_int64, _vp, _vp, _vp, _vp, _vp,
            ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]  # fmt: skip
        lib.ppr_add_bias.restype = ctypes.c_int
        lib.ppr_add_bias.argtypes = [ctypes.c_int, _vp, ctypes.c_int64, _vp] + [ctypes.c_int] * 2
        lib.ppr_add.restype = ctypes.c_int
        lib.ppr_add.argtypes = [ctypes.c_int, _vp, _vp, _vp, ctypes.c_int, ctypes.c_int]
        lib.ppr_rms_norm_heads.restype = ctypes.c_int
        lib.ppr_rms_norm_heads.argtypes = [ctypes.c_int, _vp, ctypes.c_int64] + [ctypes.c_int] * 3
        lib.ppr_rms_norm_heads.argtypes += [_vp, ctypes.c_float, ctypes.c_int]
        lib.ppr_silu_mul.restype = None
        lib.ppr_silu_mul.argtypes = [ctypes.c_int, _vp, _vp, ctypes.c_int64, _vp] + [
            ctypes.c_int
        ] * 2
        lib.ppr_gelu_tanh_mul.restype = None
        lib.ppr_gelu_tanh_mul.argtypes = lib.ppr_silu_mul.argtypes
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
        # sizeof ppr_linear_t, ppr_layer_t, ppr_step_t: backend/cpu/fused_layer.py checks its
        # ctypes mirrors against them before it builds one
        self.struct_sizes = tuple(lib.ppr_struct_size(i) for i in range(3))
        lib.ppr_struct_offset.restype = ctypes.c_int64
        lib.ppr_struct_offset.argtypes = [ctypes.c_int] * 2
        # and the offset of every field of each, in declaration order (a nested struct is one
        # field): fused_layer.py checks its mirrors field by field too
        self.struct_offsets = tuple(_field_offsets(lib, i) for i in range(3))
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
        out: torch.Tensor | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q [T, h, d] (RoPE applied); kv_layer [2, slots, h_kv, d] with this step's K/V written;
        q_start, q_len, ctx_len [N] int32; block_table [N, max_blocks] int32 covering each
        context. Returns [T, h, d]: each row attends causally to its own sequence's keys. `out`
        [T, h, d] (like q): written there instead, only the rows of these N sequences.
        `window` > 0: a row at position p sees keys (p - window, p] only; `softcap` > 0: scores
        become softcap tanh(score / softcap) (csrc/attention_window.c, where either is set)."""
        num_tokens, num_heads, head_dim = q.shape
        _, num_slots, num_kv_heads, kv_dim = kv_layer.shape
        if kv_dim != head_dim:
            raise ValueError(f"q has head_dim {head_dim}, the KV cache {kv_dim}")
        kv_bytes = kv_kind(kv_layer, q)
        if block_table.dtype is not torch.int32 or not block_table.is_contiguous():
            raise ValueError("the block table must be contiguous int32")
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape:
            raise ValueError(f"out {tuple(out.shape)} is not shaped as q {tuple(q.shape)}")
        _check(out, q)
        for meta in (q_start, q_len, ctx_len):
            if meta.dtype is not torch.int32 or tuple(meta.shape) != tuple(q_start.shape[:1]):
                raise ValueError("q_start, q_len and ctx_len must be [N] int32 each")
        if block_table.dim() != 2 or block_table.shape[0] != q_start.shape[0]:
            raise ValueError("the block table must be [N, max_blocks], a row a sequence")
        if window < 0 or softcap < 0:
            raise ValueError(f"a window ({window}) and a soft cap ({softcap}) are >= 0")
        plain = window == 0 and softcap == 0
        call = self._lib.ppr_paged_attention if plain else self._lib.ppr_paged_attention_window
        extra = () if plain else (window, softcap)
        status = call(
            _ELEM_BYTES[q.dtype],
            kv_bytes,
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
            *extra,
        )
        check_status(status, "paged attention", num_tokens, num_slots)
        if status != 0:
            raise RuntimeError(
                f"paged attention failed for {num_heads} heads over {num_kv_heads} KV heads"
            )
        return out

    def prefill_attention_amx(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        out: torch.Tensor,
        q_start: int,
        q_len: int,
        ctx_len: int,
        table: torch.Tensor,
        scale: float,
    ) -> bool:
        """Rows [q_start, q_start + q_len) of out [T, h, d] (bf16, like q): one sequence's chunk
        attending causally to its ctx_len keys in the pages `table` [pages] int32 names, on AMX
        tiles (csrc/attention_amx.c). False where the kernels refuse (no AMX-BF16, a cache not
        held as pairs, a shape they do not take): the caller takes another path. Indices
        outside the tensors raise, as paged_attention's."""
        num_tokens, num_heads, head_dim = q.shape
        _, num_slots, num_kv_heads, _ = kv_layer.shape
        _check(q, kv_layer)
        _check(out, q)
        if out.shape != q.shape or kv_layer.shape[-1] != head_dim:
            raise ValueError("out must be shaped as q, and the cache's head_dim q's")
        if table.dtype is not torch.int32 or table.dim() != 1 or not table.is_contiguous():
            raise ValueError("the block table row must be contiguous int32 [pages]")
        status = self._lib.ppr_prefill_attention_amx(
            q.data_ptr(), kv_layer.data_ptr(), out.data_ptr(), num_tokens, q_start, q_len,
            ctx_len, table.data_ptr(), table.shape[0], num_slots, num_heads, num_kv_heads,
            head_dim, scale,
        )  # fmt: skip
        check_status(status, "prefill attention", num_tokens, num_slots)
        return status == 0

    def kv8_pairs(self, kv_layer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor | None:
        """The pages `pages` [n] (int32) of an 8-bit layer (stages/kv_quant.py) as pages 0..n of
        a bf16 cache in this build's pairs layout, [2, n * 16, h_kv, d]: what the AMX tiles read
        (csrc/kv8.c). None where this build holds no bf16 pairs for d."""
        kv_quant.check_layer(kv_layer)
        if not kv_layer.is_cpu:
            raise ValueError("the CPU kernels take CPU tensors")
        _, num_slots, num_kv_heads, head_dim = kv_layer.shape
        if not self.kv_as_pairs(torch.bfloat16, head_dim):
            return None
        if pages.dtype is not torch.int32 or pages.dim() != 1 or not pages.is_contiguous():
            raise ValueError("the pages must be contiguous int32 [n]")
        n = pages.shape[0]
        out = torch.empty(2, n * BLOCK_SIZE, num_kv_heads, head_dim, dtype=torch.bfloat16)
        status = self._lib.ppr_kv8_pairs(
            kv_layer.data_ptr(), num_slots, num_kv_heads, head_dim, pages.data_ptr(), n,
            out.data_ptr(),
        )  # fmt: skip
        check_status(status, "kv8_pairs", None, num_slots)
        if status != 0:
            raise RuntimeError(f"kv8_pairs refused a cache of head_dim {head_dim}")
        return out

    def kv_as_pairs(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this build holds a cache of this dtype and head_dim as pairs (ppring.h
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
        written into kv_layer [2, slots, h_kv, d] at slot_mapping [T] (int64). An 8-bit
        kv_layer (stages/kv_quant.py) takes them quantized, and qkv's k columns are left
        rotated (the store's scratch). cos, signed_sin: [T, d] fp32."""
        _, num_slots, num_kv_heads, head_dim = kv_layer.shape
        num_tokens, row = qkv.shape
        if row != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
            raise ValueError(
                f"qkv rows of {row} cannot hold {num_heads} + 2 x {num_kv_heads} heads"
            )
        kv_bytes = kv_kind(kv_layer, qkv)
        _check(qkv, qkv)
        if cos.dtype is not torch.float32 or cos.shape != (num_tokens, head_dim):
            raise ValueError("rope_store takes fp32 cos and sin tables of [T, head_dim]")
        if slot_mapping.dtype is not torch.int64 or slot_mapping.shape[0] != num_tokens:
            raise ValueError("slot_mapping must be [T] int64")
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype)
        status = self._lib.ppr_rope_store(
            _ELEM_BYTES[qkv.dtype],
            kv_bytes,
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
        return self._gated(self._lib.ppr_silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 I] (gate, then up) -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU)."""
        return self._gated(self._lib.ppr_gelu_tanh_mul, gate_up)

    @staticmethod
    def _gated(kernel: Any, gate_up: torch.Tensor) -> torch.Tensor:
        """A gated MLP's activation kernel over gate_up [T, 2 I] -> [T, I]."""
        _check(gate_up, gate_up)
        num_tokens, width = gate_up.shape
        out = torch.empty((num_tokens, width // 2), dtype=gate_up.dtype)
        start = gate_up.data_ptr()
        kernel(
            _ELEM_BYTES[gate_up.dtype], start, start + (width // 2) * gate_up.element_size(),
            width, out.data_ptr(), num_tokens, width // 2,
        )  # fmt: skip
        return out

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """y[:, :n] += bias[:n] in place and returns y: y [T, W] a tensor or a view whose rows
        may be strided (a column block of a wider matmul output) but whose columns are not;
        bias [>= n] contiguous, of y's dtype; n defaults to W. fp32 adds in fp32; bf16 rounds
        each sum once, as torch's bf16 `y + b` (bit for bit)."""
        if y.dim() != 2 or bias.dim() != 1:
            raise ValueError("add_bias takes y [T, W] and a bias [N]")
        _check(bias, y)
        if not y.is_cpu or (y.shape[1] > 1 and y.stride(1) != 1):
            raise ValueError("add_bias takes a CPU y whose rows each lie contiguous")
        num_rows, width = y.shape
        n = width if n is None else n
        if not 0 <= n <= min(width, bias.shape[0]):
            raise ValueError(f"add_bias: {n} columns do not fit y's {width} or the bias's "
                             f"{bias.shape[0]}")  # fmt: skip
        if num_rows and n:
            status = self._lib.ppr_add_bias(
                _ELEM_BYTES[y.dtype], y.data_ptr(), y.stride(0), bias.data_ptr(), num_rows, n
            )
            check_status(status, "add_bias", num_rows)
            if status != 0:
                raise RuntimeError(f"add_bias refused {y.dtype}")
        return y

    def add(
        self, h: torch.Tensor, residual: torch.Tensor | None, h_is_scratch: bool = False
    ) -> torch.Tensor:
        """h + residual [T, d] contiguous (h itself where residual is None), bf16 rounded once
        as torch's add; written over h where h_is_scratch, else into a new tensor."""
        if residual is None:
            return h
        _check(h, h)
        _check(residual, h)
        if h.dim() != 2 or residual.shape != h.shape:
            raise ValueError(f"add takes h and residual [T, d] alike, got {tuple(h.shape)} and "
                             f"{tuple(residual.shape)}")  # fmt: skip
        out = h if h_is_scratch else torch.empty_like(h)
        status = self._lib.ppr_add(
            _ELEM_BYTES[h.dtype], h.data_ptr(), residual.data_ptr(), out.data_ptr(), *h.shape
        )
        check_status(status, "add", h.shape[0])
        if status != 0:
            raise RuntimeError(f"add refused {h.dtype}")
        return out

    def rms_norm_heads(
        self,
        qkv: torch.Tensor,
        first_head: int,
        num_heads: int,
        head_dim: int,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """The RMSNorm of heads [first_head, first_head + num_heads) of every row of qkv [T, W]
        (contiguous; head h at columns [h D, h D + D)), times weight [D], in place; returns qkv.
        Each head's arithmetic is add_rms_norm's over that head as a row with no residual, to
        the bit (Qwen3's q heads, then its k heads, before the rotary)."""
        _check(qkv, qkv)
        _check(weight, qkv)
        if qkv.dim() != 2 or tuple(weight.shape) != (head_dim,):
            raise ValueError(f"rms_norm_heads takes qkv [T, W] and a weight [{head_dim}]")
        num_rows, width = qkv.shape
        if (
            min(first_head, num_heads) < 0
            or head_dim < 1
            or (first_head + num_heads) * head_dim > width
        ):
            raise ValueError(
                f"rms_norm_heads: heads [{first_head}, {first_head + num_heads}) of {head_dim} "
                f"do not fit rows of {width}"
            )
        status = self._lib.ppr_rms_norm_heads(
            _ELEM_BYTES[qkv.dtype], qkv.data_ptr(), width, first_head, num_heads, head_dim,
            weight.data_ptr(), eps, num_rows,
        )  # fmt: skip
        check_status(status, "rms_norm_heads", num_rows)
        if status != 0:
            raise RuntimeError(f"rms_norm_heads refused {qkv.dtype}")
        return qkv

    def decoder_layers(
        self, layers: int, num_layers: int, step: int, h_in: int, residual_in: int | None,
        residual_out: int, kv: int, kv_stride: int, h_out: int,
    ) -> None:  # fmt: skip
        """`num_layers` decoder layers, every kernel of each, in one call over raw addresses:
        the structs `layers` (back to back) and `step`, the buffers backend/cpu/fused_layer.py lays
        out (it checks them), and the cache at `kv`, a layer every `kv_stride` bytes."""
        status = self._lib.ppr_decoder_layers(
            layers, num_layers, step, h_in, residual_in, residual_out, kv, kv_stride, h_out
        )
        check_status(status, "the fused decoder layers")
        if status != 0:
            raise RuntimeError("a kernel of the fused decoder layer failed (see layers.c)")

    def layer_matmuls(
        self, layer: int, elem_bytes: int, rows: int, x_hidden: int, x_attn: int, x_act: int,
        y: int,
    ) -> None:  # fmt: skip
        """The four matmuls of the layer struct at `layer`, alone (backend/cpu/fused_layer.py)."""
        if self._lib.ppr_layer_matmuls(layer, elem_bytes, rows, x_hidden, x_attn, x_act, y):
            raise RuntimeError("a matmul of the fused decoder layer failed (see layers.c)")

    def greedy_head(
        self, head: int, elem_bytes: int, h: int, residual: int | None, norm_weight: int | None,
        eps: float, rows: int, max_rows: int, hidden: int, scratch: int, x_out: int | None,
        token_base: int, out: int, best: int | None, their_best: int | None,
        their_token: int | None,
    ) -> None:  # fmt: skip
        """A greedy finish of `rows` rows in one call over raw addresses (None: NULL): the
        lm_head's struct at `head` and the buffers backend/cpu/fused_layer.py GreedyHead lays out
        for `max_rows` rows; layers.c ppr_greedy_head says what each is."""
        status = self._lib.ppr_greedy_head(
            head, elem_bytes, h, residual, norm_weight, eps, rows, max_rows, hidden, scratch,
            x_out, token_base, out, best, their_best, their_token,
        )  # fmt: skip
        check_status(status, "the greedy lm_head", max_rows)
        if status != 0:
            raise RuntimeError("the lm_head's kernel refused (see layers.c)")

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
    return kernels(), "paged attention, matmuls and small ops in stages/backend/cpu/csrc"


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
        path = build(compiler)
        return NativeKernels(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return f"building them with {compiler} failed: {error}"


def _field_offsets(lib: ctypes.CDLL, which: int) -> tuple[int, ...]:
    """ppr_struct_offset's offsets of struct `which`, field after field until its -1."""
    offsets: list[int] = []
    while (offset := lib.ppr_struct_offset(which, len(offsets))) >= 0:
        offsets.append(offset)
    return tuple(offsets)
