"""The small ops around a layer's matmuls, in torch or in the CPU kernels, chosen once per stage.

A decoder layer's work besides its matmuls and attention is: add + RMSNorm (twice), RoPE on q
and k with K and V stored in the paged cache, and SiLU(gate) * up; a sampling stage's greedy
rows add an argmax over the vocabulary. In torch that is about twenty ops a layer, each a
Python dispatch and a pass over memory; on a 2-core CPU at batch 32 they cost as much as a
third of the matmuls (RMSNorm alone, decomposed into pow/mean/rsqrt/mul, 8 ms a
step). `NativeOps` does each in one call of the kernels (`csrc/`); `TorchOps` is the same
arithmetic in torch, for a GPU (where issue-13's graphs take over) or a CPU without a C compiler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.backend.torch.attention import gather_attention
from stages.inputs import ForwardInputs
from stages.kv_cache import store_kv
from stages.sampler import row_argmax


class TorchOps:
    name = "torch"

    def rope_tables(
        self,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        dtype: torch.dtype,
        max_position: int | None = None,
        scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, d] in the stage dtype (the 1 broadcasts over heads), each
        multiplied by `scale` [d/2] fp32 where given (LongRoPE's attention factor).
        `max_position` is unused here (NativeOps reads its table with it)."""
        cos, sin = _rope_fp32(positions, inv_freq, scale)
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

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's GeGLU: gelu (tanh approximation) of the gate times up; [T, 2 I] -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.gelu(gate, approximate="tanh") * up

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] -> [N]: each row's first maximal index, NaN the largest (sampler.row_argmax)."""
        return row_argmax(logits)

    def add(
        self, h: torch.Tensor, residual: torch.Tensor | None, h_is_scratch: bool = False
    ) -> torch.Tensor:
        """h + residual [T, d] (h itself where residual is None), written over h where h is
        this step's own temporary: the residual stream of a layer that does not norm it."""
        if residual is None:
            return h
        return h.add_(residual) if h_is_scratch else h + residual

    def attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        inputs: ForwardInputs,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q [T, h, d] (rotary applied), kv_layer [2, slots, h_kv, d] with this forward's
        tokens written -> [T, h, d]; scores scaled by `scale` (1/sqrt(d) but for Granite and
        Gemma); `window` > 0: a query sees its last `window` positions only; `softcap` > 0:
        scores soft-capped (Gemma 2)."""
        return gather_attention(q, kv_layer, inputs, scale, window, softcap)

    def long_chunks(self, inputs: ForwardInputs) -> bool:
        """(torch's ops have no compiled layers to leave)"""
        return False


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
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, signed sin [T, d] fp32; the sine's first half is negated. With
    `scale` [d/2], both multiplied by it after (transformers' `attention_scaling`)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, d]
    cos, sin = angles.cos(), angles.sin()
    if scale is not None:
        both = torch.cat((scale, scale))  # [d]
        cos, sin = cos * both, sin * both
    sin[:, : freqs.shape[-1]].neg_()
    return cos, sin
