"""The small ops around a layer's matmuls, in torch or in the CPU kernels, chosen once per stage.

A decoder layer's work besides its matmuls and attention is: add + RMSNorm (twice), RoPE on q
and k with K and V stored in the paged cache, and SiLU(gate) * up; a sampling stage's greedy
rows add an argmax over the vocabulary. In torch that is about twenty ops a layer, each a
Python dispatch and a pass over memory; on a 2-core CPU at batch 32 they cost as much as a
third of the matmuls (RMSNorm alone, decomposed into pow/mean/rsqrt/mul, 8 ms a
step). `NativeOps` does each in one call of `cpu_kernels.c`; `TorchOps` is the same arithmetic in
torch, for a GPU (where issue-13's graphs take over) or a CPU without a C compiler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.kv_cache import store_kv
from stages.native import NativeKernels
from stages.sampler import row_argmax


class TorchOps:
    name = "torch"

    def rope_tables(
        self,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        dtype: torch.dtype,
        max_position: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, d] in the stage dtype (the 1 broadcasts over heads).
        `max_position` is unused here (NativeOps reads its table with it)."""
        cos, sin = _rope_fp32(positions, inv_freq)
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)

    def add_rms_norm(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        h_is_scratch: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(h + residual) * weight, h + residual); [T, d] each. h_is_scratch: h is
        this step's own temporary, which the sum may overwrite (the kernels do)."""
        residual = h if residual is None else h + residual
        return rms_norm(residual, weight, eps), residual

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_layer: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """qkv [T, (h + 2 h_kv) d] -> q [T, h, d] rotated; k rotated and v stored at the slots."""
        num_tokens = qkv.shape[0]
        _, _, num_kv_heads, head_dim = kv_layer.shape
        q, k, v = qkv.split(
            (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1
        )
        q = apply_rope(q.view(num_tokens, num_heads, head_dim), cos, sin)  # [T, h, d]
        k = apply_rope(k.view(num_tokens, num_kv_heads, head_dim), cos, sin)
        store_kv(kv_layer, slot_mapping, k, v.view(num_tokens, num_kv_heads, head_dim))
        return q

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """y [T, N] (a matmul's own output) + bias [N], in place: one rounding in bf16, as
        transformers' separate add."""
        return y.add_(bias)

    def rms_norm_heads(
        self,
        qkv: torch.Tensor,
        first_head: int,
        num_heads: int,
        head_dim: int,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """qkv [T, W] with heads [first_head, first_head + num_heads) of head_dim each replaced,
        in place, by their RMSNorm times weight [head_dim] (Qwen3's q and k norms)."""
        lo, hi = first_head * head_dim, (first_head + num_heads) * head_dim
        heads = qkv[:, lo:hi].unflatten(1, (num_heads, head_dim))  # [T, n, D]
        qkv[:, lo:hi] = rms_norm(heads, weight, eps).flatten(1)
        return qkv

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] -> [N]: each row's first maximal index, NaN the largest (sampler.row_argmax)."""
        return row_argmax(logits)


class NativeOps:
    """The same ops as TorchOps, one kernel call each (CPU, float32 or bfloat16): the kernels'
    own methods, which take the same arguments."""

    name = "native"

    def __init__(self, kernels: NativeKernels) -> None:
        self.add_rms_norm = kernels.add_rms_norm
        self.rope_store = kernels.rope_store
        self.silu_mul = kernels.silu_mul
        self.row_argmax = kernels.row_argmax
        self._kernels = kernels
        self._rope: RopeTable | None = None

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, d] fp32; the kernel rounds them to the dtype where it must.
        With `max_position` (the largest of `positions`), rows of a table kept across steps."""
        if max_position is None:
            return _rope_fp32(positions, inv_freq)
        return self.rope_table(inv_freq).rows(positions, max_position)

    def rope_table(self, inv_freq: torch.Tensor) -> RopeTable:
        """The table kept across steps for `inv_freq` (the stage's one)."""
        if self._rope is None or self._rope.inv_freq is not inv_freq:
            self._rope = RopeTable(inv_freq)
        return self._rope


class RopeTable:
    """cos and signed sin of positions [0, P), fp32 [P, d] each, as _rope_fp32 computes them
    (the same ops on every element, so each row equals that position's own computation bit for
    bit: tests/stages/test_ops.py); P doubles when a step asks for a later position.

    Why: a single stream's decode step computed its one row of each with seven torch ops, and
    between the kernels' weight streams every op runs with the interpreter out of cache: 140 us
    a step on the 2-core Zen 4, against 11 us when timed alone. Two index_selects replace them.
    The table costs 2 x 4 x d bytes a position: 4 MiB at SmolLM2's 8192."""

    MIN_POSITIONS = 1024

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq  # [d/2] fp32
        self.cos, self.sin = _rope_fp32(torch.arange(self.MIN_POSITIONS), inv_freq)

    def rows(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long, none above max_position -> cos, signed sin [T, d] fp32."""
        cos, sin = self.covering(max_position)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def covering(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables, cos and signed sin [P, d] fp32, grown to P > max_position (a
        kernel given positions reads its rows there: cpu_kernels.c rope_store_rows)."""
        size = self.cos.shape[0]
        if max_position >= size:
            while size <= max_position:
                size *= 2
            self.cos, self.sin = _rope_fp32(torch.arange(size), self.inv_freq)
        return self.cos, self.sin


Ops = TorchOps | NativeOps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, d] -> [T, d]; statistics in fp32 whatever the dtype, as transformers does.

    In fp32 one fused op, not transformers' eight (on a GPU each op costs a launch), with
    bit-identical results. In bf16 it rounds where transformers does: the normalized row to
    bf16, then its product with the weight. Rounding once instead (one fused op) moved the
    default model's logits by up to 1.4 from transformers' in bf16 and turned its greedy answer
    to "What is the capital of France?" into "L'Étoile, la Marseillaise, ..."."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; rotate-half convention (the layout Hugging Face checkpoints use).

    rotate_half(x) = [-x2, x1] is roll(x, d/2) = [x2, x1] with its first half negated, and that
    sign lives in `signed_sin` (computed once per forward): four ops per call instead of seven,
    the same arithmetic exactly (a sign flip rounds nothing)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _rope_fp32(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, signed sin [T, d] fp32; the sine's first half is negated."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, d]
    sin = angles.sin()
    sin[:, : freqs.shape[-1]].neg_()
    return angles.cos(), sin
