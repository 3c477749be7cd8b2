"""The small ops of a layer (stages/backend/torch/ops.py says which) in ppring's CPU kernels:
one kernel call each, on the same values, and attention over the paged cache in place."""

from __future__ import annotations

import torch

from stages.backend.cpu.native import NativeKernels
from stages.backend.cpu.prefill_attention import PrefillAttention
from stages.backend.torch.ops import _rope_fp32
from stages.inputs import ForwardInputs


class NativeOps:
    """The same ops as TorchOps, one kernel call each (CPU, float32 or bfloat16): the kernels'
    own methods, which take the same arguments."""

    name = "native"

    def __init__(self, kernels: NativeKernels, prefill: PrefillAttention | None = None) -> None:
        """`prefill`: long prefill chunks' attention (on AMX tiles, where the CPU has them), or
        None."""
        self.add_rms_norm = kernels.add_rms_norm
        self.rope_store = kernels.rope_store
        self.silu_mul = kernels.silu_mul
        self.gelu_tanh_mul = kernels.gelu_tanh_mul
        self.row_argmax = kernels.row_argmax
        self._kernels = kernels
        self._ropes: dict[tuple[int, ...], RopeTable] = {}  # rope_table's, by what makes them
        self.prefill = prefill

    @classmethod
    def for_stage(
        cls, kernels: NativeKernels, dtype: torch.dtype | None, tiles: bool = True
    ) -> NativeOps:
        """The ops of a stage computing in `dtype`: long prefill chunks on AMX tiles where the
        CPU has them, the stage computes in bf16 and `tiles` (PPRING_AMX_ROWS is not 0)
        allows them (backend/cpu/prefill_attention.py)."""
        prefill = None
        if dtype == torch.bfloat16 and kernels.amx_bf16 and tiles:
            prefill = PrefillAttention(kernels)
        return cls(kernels, prefill)

    def long_chunks(self, inputs: ForwardInputs) -> bool:
        """Whether this batch has a chunk whose attention is not the paged kernel's (the fused
        stack, whose attention is, leaves such a batch to the layers' calls)."""
        return (
            self.prefill is not None
            and inputs.paged is not None
            and self.prefill.takes(inputs.paged)
        )

    def attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        inputs: ForwardInputs,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """TorchOps.attention, reading K and V in place a 16-slot page at a time (on a stage
        with the kernels every forward's inputs carry the paged metadata: stages/inputs.py);
        a long prefill chunk's on AMX tiles where `prefill` takes it."""
        paged = inputs.paged
        assert paged is not None
        if window or softcap:  # (csrc/attention_window.c; the tiles take neither)
            return self._kernels.paged_attention(
                q, kv_layer, paged.q_start, paged.q_len, paged.ctx_len, paged.block_table,
                scale, window=window, softcap=softcap,
            )  # fmt: skip
        if self.prefill is not None and self.prefill.takes(paged):
            return self.prefill(q, kv_layer, paged, scale)
        return self._kernels.paged_attention(
            q, kv_layer, paged.q_start, paged.q_len, paged.ctx_len, paged.block_table, scale
        )

    def add(
        self, h: torch.Tensor, residual: torch.Tensor | None, h_is_scratch: bool = False
    ) -> torch.Tensor:
        """TorchOps.add in one kernel call (the same bits: the sum rounded once)."""
        return self._kernels.add(h, residual, h_is_scratch)

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """TorchOps.add_bias in one kernel call (the same bits)."""
        return self._kernels.add_bias(y, bias, bias.shape[0])

    def rms_norm_heads(
        self,
        qkv: torch.Tensor,
        first_head: int,
        num_heads: int,
        head_dim: int,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """TorchOps.rms_norm_heads in one kernel call (the bits of add_rms_norm on each head)."""
        return self._kernels.rms_norm_heads(qkv, first_head, num_heads, head_dim, weight, eps)

    def rope_tables(
        self,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        dtype: torch.dtype,
        max_position: int | None = None,
        scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, d] fp32 (times `scale` [d/2] where given); the kernel rounds them
        to the dtype where it must. With `max_position` (the largest of `positions`), rows of a
        table kept across steps."""
        if max_position is None:
            return _rope_fp32(positions, inv_freq, scale)
        return self.rope_table(inv_freq, scale).rows(positions, max_position)

    def rope_table(
        self,
        inv_freq: torch.Tensor,
        scale: torch.Tensor | None = None,
        long_inv_freq: torch.Tensor | None = None,
        long_from: int = 0,
    ) -> RopeTable:
        """The table kept across steps for these frequencies (a stage has one or two)."""
        key = (id(inv_freq), id(scale), id(long_inv_freq), long_from)
        table = self._ropes.get(key)
        if table is None:
            table = self._ropes[key] = RopeTable(inv_freq, scale, long_inv_freq, long_from)
        return table


class RopeTable:
    """cos and signed sin of positions [0, P), fp32 [P, d] each, as _rope_fp32 computes them
    (the same ops on every element, so each row equals that position's own computation bit for
    bit: tests/stages/test_ops.py); P doubles when a step asks for a later position.

    Why: a single stream's decode step computed its one row of each with seven torch ops, and
    between the kernels' weight streams every op runs with the interpreter out of cache: 140 us
    a step on the 2-core Zen 4, against 11 us when timed alone. Two index_selects replace them.
    The table costs 2 x 4 x d bytes a position: 4 MiB at SmolLM2's 8192.

    With `long_inv_freq` (LongRoPE), the rows from `long_from` on are of those frequencies:
    what a decode step of a sequence that far along takes (stages/models/blocks.py Rotary)."""

    MIN_POSITIONS = 1024

    def __init__(
        self,
        inv_freq: torch.Tensor,
        scale: torch.Tensor | None = None,
        long_inv_freq: torch.Tensor | None = None,
        long_from: int = 0,
    ) -> None:
        self.inv_freq = inv_freq  # [d/2] fp32
        self.scale = scale  # [d/2] fp32 or None
        self.long_inv_freq, self.long_from = long_inv_freq, long_from
        self.cos, self.sin = self._rows(self.MIN_POSITIONS)

    def _rows(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = _rope_fp32(torch.arange(size), self.inv_freq, self.scale)
        if self.long_inv_freq is not None and size > self.long_from:
            cos[self.long_from :], sin[self.long_from :] = _rope_fp32(
                torch.arange(self.long_from, size), self.long_inv_freq, self.scale
            )
        return cos, sin

    def rows(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long, none above max_position -> cos, signed sin [T, d] fp32."""
        cos, sin = self.covering(max_position)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def covering(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables, cos and signed sin [P, d] fp32, grown to P > max_position (a
        kernel given positions reads its rows there: csrc/ops.c rope_store_rows)."""
        size = self.cos.shape[0]
        if max_position >= size:
            while size <= max_position:
                size *= 2
            self.cos, self.sin = self._rows(size)
        return self.cos, self.sin
