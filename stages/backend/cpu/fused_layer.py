"""A stage's decoder layers in one kernel call (csrc/layers.c `ppr_decoder_layers`).

A layer is nine kernel calls (two norms, four matmuls, RoPE and the cache store, attention,
SiLU): called one by one from Python, each pays for a module call, torch.empty, checks and a
ctypes call, ~70 us a layer on the 2-core EPYC, which at one row is as much time as a third of
the layer's matmuls. Here the weights' pointers and shapes are put into C structs once, at
load; a forward allocates its scratch once for all layers and makes one ctypes call for all of
them. The C side runs the same kernels in the same order on the same values, so the output is
bit for bit what LayerWeights.forward computes (tests/stages/test_fused_layer.py holds it to
that).

Used where every piece is a CPU kernel: NativeOps, paged attention, and every matrix in one of
the kernels' layouts (not DenseLinear). `PPRING_FUSED_LAYERS=0` turns it off (to compare).
`GreedyHead` does the same for a greedy decode batch's finish: the final norm, the lm_head and
the argmax, and with the lm_head split each stage's part of them.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import TYPE_CHECKING

import torch
from torch import nn

from stages.backend.cpu.calls import _ELEM_BYTES, _grid_pointers
from stages.backend.cpu.linear import (
    CpuBf16Linear,
    CpuLinear,
    GridA8Linear,
    GridBf16Linear,
    GridLinear,
    Int8Linear,
)
from stages.backend.cpu.native import NativeKernels
from stages.backend.switches import FUSED_LAYERS_ENV

if TYPE_CHECKING:
    from stages.inputs import ForwardInputs
    from stages.interface import LayerWeights
    from stages.kv_cache import KVCache

DISABLE_ENV = FUSED_LAYERS_ENV  # "0": one Python call per op (read once: switches.py)


# csrc/ppring.h's enum of matrix kinds
_F32, _GRID_F32, _BF16, _GRID_BF16, _INT8, _GRID_A8, _INT8_QUADS, _GRID_A8_1 = range(1, 9)


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("panels", ctypes.c_void_p),
        ("code_rows", ctypes.c_int32),
        ("amx_rows", ctypes.c_int32),  # calls of at least this many rows on AMX tiles; 0: never
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("input_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("hidden", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("qkv_bias", ctypes.c_void_p),  # [(H + 2 Hkv) D] or NULL (Qwen2)
        ("o_bias", ctypes.c_void_p),  # [d] or NULL
        ("q_norm", ctypes.c_void_p),  # [D] or NULL: every q head's RMSNorm (Qwen3)
        ("k_norm", ctypes.c_void_p),  # [D] or NULL: every k head's
        ("attn_out_norm", ctypes.c_void_p),  # [d] or NULL: attention's output normed (OLMo 2)
        ("mlp_out_norm", ctypes.c_void_p),  # [d] or NULL: the MLP's
        ("qk_norm_whole", ctypes.c_int32),  # 1: q_norm, k_norm span the projections (OLMo 2)
        ("window", ctypes.c_int32),  # > 0: attention sees the last `window` positions
        ("softcap", ctypes.c_float),  # > 0: scores soft-capped (Gemma 2)
        ("gelu", ctypes.c_int32),  # 1: GeGLU's gelu_tanh gate (Gemma); 0: silu
        ("rope_local", ctypes.c_int32),  # 1: the step's second rotary tables (Gemma 3)
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("elem_bytes", ctypes.c_int32),
        ("num_tokens", ctypes.c_int32),
        ("num_seqs", ctypes.c_int32),
        ("table_stride", ctypes.c_int32),
        ("num_slots", ctypes.c_int64),
        ("max_tokens", ctypes.c_int32),  # rows the scratch holds
        ("rope_rows", ctypes.c_int32),  # with positions: rows of cos and sin
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),  # NULL: cos, sin are [T, D] rows; else tables at these
        ("slot_mapping", ctypes.c_void_p),
        ("q_start", ctypes.c_void_p),
        ("q_len", ctypes.c_void_p),
        ("ctx_len", ctypes.c_void_p),
        ("block_table", ctypes.c_void_p),
        ("scale", ctypes.c_float),
        ("x", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
        ("q", ctypes.c_void_p),
        ("attn", ctypes.c_void_p),
        ("h", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("act", ctypes.c_void_p),
        ("cos_local", ctypes.c_void_p),  # the rope_local layers' tables, or NULL
        ("sin_local", ctypes.c_void_p),
        ("kv_bytes", ctypes.c_int32),  # the cache's kind: elem_bytes, or 1 (8-bit: ppring.h)
    ]


def _check_mirrors(kernels: NativeKernels) -> None:
    """The structs above mirror the kernels' (stages/backend/cpu/csrc/ppring.h) by hand: a
    field added, moved or retyped on one side alone would make C read that field or a later
    one at the wrong offset, so their sizes and every field's offset must agree."""
    mirrors = (_Linear, _Layer, _Step)
    ours = tuple(ctypes.sizeof(struct) for struct in mirrors)
    if ours != kernels.struct_sizes:
        raise RuntimeError(
            f"stages/backend/cpu/fused_layer.py's ctypes structs (sizes {ours}) do not match "
            f"ppring.h's ({kernels.struct_sizes}): update them together"
        )
    c_names = ("ppr_linear_t", "ppr_layer_t", "ppr_step_t")
    for struct, c_name, theirs in zip(mirrors, c_names, kernels.struct_offsets, strict=True):
        names = [field[0] for field in struct._fields_]
        offsets = [getattr(struct, name).offset for name in names]
        for i in range(max(len(names), len(theirs))):
            mine = offsets[i] if i < len(offsets) else None
            their = theirs[i] if i < len(theirs) else None
            if mine != their:
                field = names[i] if i < len(names) else f"#{i} (none here)"
                raise RuntimeError(
                    f"stages/backend/cpu/fused_layer.py's {struct.__name__} field {field} lies "
                    f"at offset {mine}, ppring.h's {c_name} field {i} at {their}: update them "
                    "together"
                )


# (module class, stage dtype) -> ppring.h's kind; int8 runs in either dtype
_KINDS = {
    (CpuLinear, torch.float32): _F32,
    (GridLinear, torch.float32): _GRID_F32,
    (CpuBf16Linear, torch.bfloat16): _BF16,
    (GridBf16Linear, torch.bfloat16): _GRID_BF16,
    (GridA8Linear, torch.bfloat16): _GRID_A8,
}


# a layer's norm weights and optional tensors (stages/layer_spec.py); None where it lacks one
_EXTRAS = (
    "input_norm", "post_attn_norm", "qkv_bias", "o_bias", "q_norm", "k_norm", "attn_out_norm",
    "mlp_out_norm",
)  # fmt: skip


def _projections(layer: LayerWeights) -> tuple[nn.Module, ...]:
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


def _linear(proj: nn.Module, dtype: torch.dtype) -> _Linear | None:
    """The struct for one matrix module, or None if the kernels cannot run it in `dtype`."""
    if isinstance(proj, Int8Linear):
        n, k = proj.qweight.shape
        kind = _INT8_QUADS if proj.quads else _INT8
        return _Linear(kind, n, k, 0, proj.qweight.data_ptr(), proj.scale.data_ptr(), None)
    kind = _KINDS.get((type(proj), dtype))
    if kind is None:
        return None
    if kind == _GRID_A8 and proj.passes == 1:
        kind = _GRID_A8_1
    n, k = proj.out_features, proj.in_features
    amx_rows = getattr(proj, "amx_rows", 0)  # (fp32 matrices have no tiles)
    if kind in (_F32, _BF16):
        return _Linear(kind, n, k, 0, proj.panels.data_ptr(), None, None, None, 0, amx_rows)
    if kind == _GRID_BF16:  # held both ways: the codes up to code_rows rows, then the panels
        pointers = (*_grid_pointers(proj.grid), proj.panels.data_ptr())
        return _Linear(kind, n, k, proj.grid.bits, *pointers, proj.code_rows, amx_rows)
    return _Linear(kind, n, k, proj.grid.bits, *_grid_pointers(proj.grid), None, 0, amx_rows)


class FusedLayers:
    """Layers [start, end) of one stage, run by one call of ppr_decoder_layers. Holds raw
    pointers into the layers' weights: the stage module owns them and outlives this."""

    HELD_ROWS = 64  # forwards of up to this many rows reuse one scratch buffer

    def __init__(
        self,
        layers: list[LayerWeights],
        matrices: list[list[_Linear]],
        kernels: NativeKernels,
        dtype: torch.dtype,
    ) -> None:
        """`matrices`: each layer's four structs (`_linear`), in `_projections`' order."""
        self._call = kernels.decoder_layers
        self._matmuls = kernels.layer_matmuls
        self.dtype = dtype
        first = layers[0]
        self.hidden = first.qkv_proj.in_features
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim = first.head_dim
        self.intermediate = first.down_proj.in_features
        self.scale = first.attention_scale
        layer_structs = [
            _Layer(
                *four,
                _address(layer.input_norm),
                _address(layer.post_attn_norm),
                layer.eps,
                self.hidden,
                self.intermediate,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                # what the family adds (stages/layer_spec.py); NULL where it does not
                _address(layer.qkv_bias),
                _address(layer.o_bias),
                _address(layer.q_norm),
                _address(layer.k_norm),
                _address(layer.attn_out_norm),
                _address(layer.mlp_out_norm),
                int(layer.qk_norm_whole),
                layer.window,
                layer.softcap,
                int(layer.activation == "gelu_tanh"),
                int(layer.rope_local),
            )
            for layer, four in zip(layers, matrices, strict=True)
        ]
        # back to back, as ppr_decoder_layers walks them; kept alive: C reads them
        self._layers = (_Layer * len(layer_structs))(*layer_structs)
        self._layers_at = ctypes.addressof(self._layers)
        self._held: torch.Tensor | None = None  # scratch kept between steps (_scratch)

    @classmethod
    def build(
        cls, layers: list[LayerWeights], kernels: NativeKernels | None, dtype: torch.dtype
    ) -> FusedLayers | None:
        """FusedLayers where every layer can run as one call, else None (the Python path:
        `refusal` says why)."""
        if cls.refusal(layers, kernels, dtype) is not None:
            return None
        assert kernels is not None
        matrices = [[_linear(proj, dtype) for proj in _projections(layer)] for layer in layers]
        _check_mirrors(kernels)
        return cls(layers, matrices, kernels, dtype)

    @staticmethod
    def refusal(
        layers: list[LayerWeights], kernels: NativeKernels | None, dtype: torch.dtype
    ) -> str | None:
        """Why these layers cannot run as one call, in a few words for the start-up line;
        None where they can."""
        if kernels is None:
            return "no CPU kernels"
        if not layers or dtype not in _ELEM_BYTES:
            return f"the kernels' layer stack takes float32 or bfloat16, not {dtype}"
        if len({layer.attention_scale for layer in layers}) != 1:
            return "its layers scale attention differently"
        for layer in layers:
            for proj in _projections(layer):
                if _linear(proj, dtype) is None:
                    return f"a {type(proj).__name__} matrix is not one of the kernels' layouts"
            for name in _EXTRAS:
                tensor = getattr(layer, name)
                if tensor is not None and (tensor.dtype != dtype or not tensor.is_contiguous()):
                    # the kernels read them as raw rows in the stage dtype
                    return f"its {name} is not contiguous in the stage dtype"
        return None

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        inputs: ForwardInputs,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, d] (read only), residual [T, d] or None -> (h, residual) after every layer.
        cos, sin [T, head_dim] fp32 (ops.rope_tables); `local`: the same of the rope_local
        layers' rotary (Gemma 3's windowed layers); inputs.paged is set (CPU attention)."""
        paged = inputs.paged
        assert paged is not None and h.dtype == self.dtype
        # what the kernels read as raw memory (stages/inputs.py builds them so; checked once
        # a forward, as the layer-by-layer path checks them once a call)
        assert paged.block_table.dtype == torch.int32 and paged.block_table.is_contiguous()
        assert inputs.slot_mapping.dtype == torch.int64 and cos.dtype == torch.float32
        h = h.contiguous()  # a received frame's tensor may be a view; the kernels read rows
        residual = None if residual is None else residual.contiguous()
        num_tokens, d = h.shape
        # the kernels write through raw addresses: `buffer` lives until the call returns
        buffer, scratch = self._scratch(num_tokens)
        out, residual_out = torch.empty(2, num_tokens, d, dtype=self.dtype).unbind(0)
        step = _Step(
            _ELEM_BYTES[self.dtype],
            num_tokens,
            paged.q_start.shape[0],
            paged.block_table.shape[1],
            kv.num_slots,
            num_tokens,  # the scratch is laid out for these rows
            cos.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            None,  # cos and sin are the rows of this step's positions
            inputs.slot_mapping.data_ptr(),
            paged.q_start.data_ptr(),
            paged.q_len.data_ptr(),
            paged.ctx_len.data_ptr(),
            paged.block_table.data_ptr(),
            self.scale,
            *scratch,
            *((None, None) if local is None else (local[0].data_ptr(), local[1].data_ptr())),
            kv.kv_bytes,
        )
        self.run_at(
            ctypes.addressof(step), h.data_ptr(), _address(residual), residual_out.data_ptr(),
            *kv_address(kv), out.data_ptr(),
        )  # fmt: skip
        del buffer
        return out, residual_out

    def run_at(
        self, step_at: int, h_at: int, residual_at: int | None, residual_out_at: int,
        kv_at: int, kv_stride: int, h_out_at: int,
    ) -> None:  # fmt: skip
        """Every layer over raw addresses: the `_Step` at step_at, h [T, d] at h_at, the
        residual [T, d] at residual_at (None: the model's first layer), the cache at kv_at
        (`kv_address`), the outputs [T, d] at residual_out_at and h_out_at (either may be its
        input's address)."""
        self._call(
            self._layers_at, len(self._layers), step_at, h_at, residual_at, residual_out_at,
            kv_at, kv_stride, h_out_at,
        )  # fmt: skip

    def step_struct(
        self, num_slots: int, scratch: list[int], max_tokens: int, kv_bytes: int
    ) -> _Step:
        """A `_Step` of this stage's fixed fields (the cache's slots, the attention scale, the
        scratch addresses from `scratch_for(max_tokens)`), the per-step ones zero:
        stages/backend/cpu/kept_decode.py keeps one and fills those each step."""
        step = _Step()
        step.elem_bytes, step.num_slots = _ELEM_BYTES[self.dtype], num_slots
        step.kv_bytes = kv_bytes
        step.max_tokens = max_tokens
        step.scale = self.scale
        step.x, step.qkv, step.q, step.attn, step.h, step.gate_up, step.act = scratch
        return step

    def scratch_for(self, num_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """A buffer of its own and the addresses in it of every layer's temporaries, for any
        forward of up to `num_tokens` rows (the kernels read row t at t times a row's width,
        so a layout for more rows serves fewer); the caller keeps the buffer alive."""
        sizes = self._scratch_sizes(num_tokens)
        return self._layout(torch.empty(self._scratch_elems(sizes), dtype=self.dtype), sizes)

    def _scratch(self, num_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """A buffer and, in _Step's order, the addresses in it of every layer's temporaries
        for `num_tokens` rows (`_layout`). Up to HELD_ROWS rows the buffer is kept from step to
        step: nine allocations a step cost a single stream ~60 us (backend/cpu/ops.py RopeTable
        says why small things cost that much there)."""
        sizes = self._scratch_sizes(num_tokens)
        needed = self._scratch_elems(sizes)
        buffer = self._held
        if buffer is None or buffer.numel() < needed:
            buffer = torch.empty(needed, dtype=self.dtype)
            if num_tokens <= self.HELD_ROWS:
                self._held = buffer
        return self._layout(buffer, sizes)

    def _scratch_sizes(self, num_tokens: int) -> list[int]:
        """Elements of each temporary for `num_tokens` rows, in _Step's order (x, qkv, q, attn,
        h, gate_up, act; each consumed within the layer that wrote it), rounded up to 64
        bytes."""
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        widths = (
            self.hidden,
            (heads + 2 * kv_heads) * head_dim,
            heads * head_dim,
            heads * head_dim,
            self.hidden,
            2 * self.intermediate,
            self.intermediate,
        )
        align = 64 // _ELEM_BYTES[self.dtype]  # elements in 64 bytes
        return [-(-num_tokens * width // align) * align for width in widths]

    def _scratch_elems(self, sizes: list[int]) -> int:
        """What a buffer for temporaries of `sizes` holds: room to align its start too."""
        return sum(sizes) + 64 // _ELEM_BYTES[self.dtype]

    def _layout(self, buffer: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
        """`buffer` and the 64-byte aligned addresses of temporaries of `sizes` in it."""
        base = -(-buffer.data_ptr() // 64) * 64
        addresses, offset = [], 0
        for size in sizes:
            addresses.append(base + offset * _ELEM_BYTES[self.dtype])
            offset += size
        return buffer, addresses

    def matmuls(self, rows: int) -> MatmulPass:
        """A call that runs every layer's four matmuls alone at `rows` rows, as forward runs
        them: what a step's compute floor counts (bench/step.py)."""
        return MatmulPass(self, rows)


class MatmulPass:
    """Every layer's four matmuls of a FusedLayers alone at `rows` rows, each call. Its inputs
    are random, made once: x_hidden [rows, d], x_attn [rows, H D], x_act [rows, I]; every
    matmul writes y from its start as [rows, N] (the last: the last layer's down_proj, [rows,
    d]). The kernels read and write these by address: they live as long as this."""

    def __init__(self, fused: FusedLayers, rows: int) -> None:
        dtype, heads = fused.dtype, fused.num_heads * fused.head_dim
        self.x_hidden, self.x_attn, self.x_act = (
            torch.randn(rows, n).to(dtype) for n in (fused.hidden, heads, fused.intermediate)
        )
        widest = (fused.num_heads + 2 * fused.num_kv_heads) * fused.head_dim
        self.y = torch.empty(rows, max(widest, 2 * fused.intermediate, fused.hidden), dtype=dtype)
        self._args = (
            _ELEM_BYTES[dtype], rows, self.x_hidden.data_ptr(), self.x_attn.data_ptr(),
            self.x_act.data_ptr(), self.y.data_ptr(),
        )  # fmt: skip
        self._call = fused._matmuls
        self._layer_at = [ctypes.addressof(layer) for layer in fused._layers]

    def __call__(self) -> None:
        for at in self._layer_at:
            self._call(at, *self._args)


class GreedyHead:
    """A stage's greedy finish when every row of a batch samples plain-greedy (a decode batch
    of plain greedy requests), in one call of ppr_greedy_head: the kernels the step otherwise
    calls one by one, so the tokens are the same. What goes is their Python: wrappers,
    allocations and checks, ~100 us a call on the 2-core Zen 4, where code runs out of cache
    between weight streams (stages/backend/cpu/ops.py RopeTable). Three finishes:

    - `tokens`: the last stage of a whole lm_head: final norm, lm_head, argmax;
    - `share`: the last stage of a split lm_head: final norm, its rows' logits, their maxima;
    - `join`: the first stage of a split lm_head: its rows' maxima against the last stage's.
    """

    HELD_ROWS = FusedLayers.HELD_ROWS  # the most rows tokens_at takes

    def __init__(
        self,
        head: _Linear,
        norm_weight: torch.Tensor | None,
        eps: float,
        dtype: torch.dtype,
        token_base: int,
        kernels: NativeKernels,
    ) -> None:
        self._call = kernels.greedy_head
        self._head = head  # kept alive: C reads it
        self._head_at = ctypes.addressof(head)
        self.norm_weight = norm_weight  # [d]; None on the first stage of a split lm_head
        self.eps = eps
        self.dtype = dtype
        self.token_base = token_base  # the stage's first vocabulary row
        self._held: torch.Tensor | None = None  # tokens_at's scratch and tokens, made at need
        self._held_out = array("q")
        self._held_at = (0, 0, 0)  # their addresses and the norm weight's

    @classmethod
    def build(
        cls, lm_head: nn.Module, norm_weight: torch.Tensor | None, eps: float,
        dtype: torch.dtype, token_base: int, kernels: NativeKernels | None,
    ) -> GreedyHead | None:  # fmt: skip
        """GreedyHead where the kernels hold the lm_head, else None (the step's calls)."""
        if kernels is None or dtype not in _ELEM_BYTES:
            return None
        head = _linear(lm_head, dtype)
        if head is None:
            return None
        _check_mirrors(kernels)
        return cls(head, norm_weight, eps, dtype, token_base, kernels)

    def tokens(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """h, residual [N, d] -> [N] int64: each row's greedy token (the first maximal logit)."""
        out, _, _ = self._finish(h, residual, keep_x=False, want_best=False)
        return out

    def tokens_at(self, h_at: int, residual_at: int, rows: int) -> list[int]:
        """`tokens` over raw rows (backend/cpu/kept_decode.py's buffers): h and residual [rows, d]
        in the stage dtype at h_at and residual_at, rows at most HELD_ROWS; the scratch and
        the tokens go to buffers kept between calls. Returns each row's greedy token."""
        self._finish_at(h_at, residual_at, rows, None, self._kept()[1], None)
        return self._held_out[:rows].tolist()

    def share_at(
        self, h_at: int, residual_at: int, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`share` over raw rows, as `tokens_at` takes them: x [rows, d], each row's maximal
        logit [rows] and its token [rows] int64, fresh tensors (they leave for the first
        stage)."""
        x = torch.empty(rows, self._head.k, dtype=self.dtype)
        best = torch.empty(rows, dtype=self.dtype)
        token = torch.empty(rows, dtype=torch.int64)
        self._finish_at(h_at, residual_at, rows, x.data_ptr(), token.data_ptr(), best.data_ptr())
        return x, best, token

    def _kept(self) -> tuple[int, int, int]:
        """The addresses of the kept scratch and tokens (made at first need) and of the norm
        weight."""
        if self._held is None:  # h + residual, x [HELD_ROWS, d] each and the logits [., V]
            assert self.norm_weight is not None
            hidden, vocab = self._head.k, self._head.n
            self._held = torch.empty(self.HELD_ROWS * (2 * hidden + vocab), dtype=self.dtype)
            self._held_out = array("q", bytes(8 * self.HELD_ROWS))  # [HELD_ROWS] int64
            self._held_at = (
                self._held.data_ptr(),
                self._held_out.buffer_info()[0],
                self.norm_weight.data_ptr(),
            )
        return self._held_at

    def _finish_at(
        self, h_at: int, residual_at: int, rows: int, x_at: int | None, out_at: int,
        best_at: int | None,
    ) -> None:  # fmt: skip
        """The last stage's one call over raw rows, its scratch kept between calls."""
        assert 0 < rows <= self.HELD_ROWS and self.norm_weight is not None
        scratch_at, _, norm_at = self._kept()
        self._call(
            self._head_at, _ELEM_BYTES[self.dtype], h_at, residual_at, norm_at, self.eps, rows,
            self.HELD_ROWS, self._head.k, scratch_at, x_at, self.token_base, out_at, best_at,
            None, None,
        )  # fmt: skip

    def share(
        self, h: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h, residual [N, d] -> x [N, d] (the final norm's output, for the first stage), and
        over this stage's rows each row's maximal logit [N] and its token [N] int64."""
        token, x, best = self._finish(h, residual, keep_x=True, want_best=True)
        return x, best, token

    def join(
        self, x: torch.Tensor, their_best: torch.Tensor, their_token: torch.Tensor
    ) -> torch.Tensor:
        """x [N, d] (normed), the last stage's maxima [N] and tokens [N] -> [N] int64: each
        row's greedy token over the whole vocabulary."""
        their_best = their_best.to(self.dtype).contiguous()
        their_token = their_token.to(torch.int64).contiguous()
        assert their_best.shape == their_token.shape == x.shape[:1]
        out, _, _ = self._finish(x, None, False, False, their_best, their_token)
        return out

    def _finish(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        keep_x: bool,
        want_best: bool,
        their_best: torch.Tensor | None = None,
        their_token: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        h = h.contiguous()
        rows, hidden = h.shape
        assert h.dtype == self.dtype and (residual is None) == (self.norm_weight is None)
        if residual is not None:
            residual = residual.contiguous()
            assert residual.dtype == self.dtype and residual.shape == h.shape
        # h + residual [N, d], x [N, d], logits [N, V]
        scratch = torch.empty(rows * (2 * hidden + self._head.n), dtype=self.dtype)
        x = torch.empty(rows, hidden, dtype=self.dtype) if keep_x else None
        best = torch.empty(rows, dtype=self.dtype) if want_best else None
        out = torch.empty(rows, dtype=torch.int64)
        self._call(
            self._head_at, _ELEM_BYTES[self.dtype], h.data_ptr(), _address(residual),
            _address(self.norm_weight), self.eps, rows, rows, hidden, scratch.data_ptr(),
            _address(x), self.token_base, out.data_ptr(), _address(best),
            _address(their_best), _address(their_token),
        )  # fmt: skip
        return out, x, best


def kv_address(kv: KVCache) -> tuple[int, int]:
    """The cache's address and the bytes from one layer's part to the next."""
    return kv.data.data_ptr(), kv.data.stride(0) * kv.data.element_size()


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
