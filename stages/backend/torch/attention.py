"""Attention over the paged KV cache for a packed batch mixing prefill chunks and decodes, as
torch computes it (the gather way below); each backend's ops say which way a stage takes.

Reads exactly the cache slots the block tables name (the metadata in `inputs.py` is built from
them), so a block that belongs to no sequence in the batch is never touched. Three ways:

- paged (CPU, stages/backend/cpu/ops.py): the kernels walk each sequence's block table and read
  K and V in place, one 16-slot page at a time, with an online softmax; one call per layer for
  the whole batch.
- paged (GPU, decode-only batches, stages/backend/cuda/ops.py): the same walk as a Triton kernel
  (stages/backend/cuda/triton_attention.py), whose fixed-shape inputs a CUDA graph can replay.
- gather (GPU, or a CPU without a C compiler): K and V of the named slots are gathered, in one
  index_select, into a dense tensor for PyTorch's SDPA. GQA is handled by `enable_gqa`: K/V stay
  at h_kv heads, never expanded to h.

Measured on the 2-core EPYC, one layer of SmolLM2 (9 heads, 3 KV heads, d 64), 32 decodes at
context 512, fp32: gather + SDPA 6.0-7.5 ms, paged 2.4 ms; the gather alone was most of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.inputs import ForwardInputs
from stages.kv_cache import gather_kv


def gather_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    inputs: ForwardInputs,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q: [T, h, d] (rotary applied); kv_layer: [2, slots, h_kv, d], this layer's K and V with
    this forward's tokens already written; scores scaled by `scale`. `window` > 0: a query at
    position p sees keys (p - window, p] only (transformers' sliding window); `softcap` > 0:
    scores become softcap tanh(score / softcap) before the softmax. Returns [T, h, d]."""
    groups = inputs.decode_groups
    if not inputs.prefills and len(groups) == 1 and groups[0].rows is None:
        # Pure decode batch of similar lengths: one call, no scatter.
        g = groups[0]
        return _decode(q, kv_layer, g.key_slots, g.key_len, g.mask, scale, window, softcap)

    out = torch.empty_like(q)
    for p in inputs.prefills:
        key_slots, mask = p.key_slots, p.mask
        if window:  # only the keys some query of the chunk sees
            ctx, n = key_slots.shape[0], p.row_end - p.row_start
            lo = max(0, ctx - n - window + 1)
            key_slots = key_slots[lo:]
            query_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]  # [n, 1]
            key_pos = torch.arange(lo, ctx, device=q.device)[None, :]  # [1, ctx - lo]
            mask = (key_pos <= query_pos) & (key_pos > query_pos - window)  # [n, ctx - lo]
        k, v = (
            gather_kv(kv_layer, key_slots, q.dtype).transpose(1, 2).unsqueeze(1)
        )  # [1, h_kv, L, d]
        o = _sdpa(
            q[p.row_start : p.row_end].transpose(0, 1).unsqueeze(0),  # [1, h, n, d]
            k, v, mask, scale, softcap,
        )  # fmt: skip  # [1, h, n, d]
        out[p.row_start : p.row_end] = o[0].transpose(0, 1)
    for g in groups:
        q_g = q if g.rows is None else q.index_select(0, g.rows)  # [n, h, d]
        o_g = _decode(q_g, kv_layer, g.key_slots, g.key_len, g.mask, scale, window, softcap)
        if g.rows is None:
            out.copy_(o_g)
        else:
            out.index_copy_(0, g.rows, o_g)
    return out


def _decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    key_slots: torch.Tensor,
    key_len: int,
    mask: torch.Tensor | None,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query per sequence: q [n, h, d] against n contexts padded to key_len -> [n, h, d]."""
    n = q.shape[0]
    kv = gather_kv(kv_layer, key_slots, q.dtype)  # [2, n * L, h_kv, d]
    k, v = kv.view(2, n, key_len, *kv.shape[2:]).transpose(2, 3)  # each [n, h_kv, L, d]
    if window and key_len > window:
        # each row's context: its real keys (a padded row's are its first); it sees the last
        # `window` of them
        key_pos = torch.arange(key_len, device=q.device)  # [L]
        ctx = (
            torch.full((n,), key_len, device=q.device) if mask is None else mask.view(n, -1).sum(1)
        )
        seen = key_pos[None, :] >= (ctx[:, None] - window)  # [n, L]
        real = seen if mask is None else seen & mask.view(n, -1)
        mask = real.view(n, 1, 1, key_len)
    # a causal mask over one query is no mask: the query is the context's last position
    o = _sdpa(q.unsqueeze(2), k, v, mask, scale, softcap, causal=False)
    return o.squeeze(2)  # [n, h, 1, d] -> [n, h, d]


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    causal: bool = True,
) -> torch.Tensor:
    """q [B, h, n, d], k and v [B, h_kv, L, d], mask [.., n, L] bool (None: causal, bottom-right
    aligned where `causal`, else none) -> [B, h, n, d]. PyTorch's SDPA, or where a soft cap
    applies (which SDPA does not take) the same as transformers' eager attention: scores in
    the dtype, capped, masked, softmax in fp32."""
    is_causal = causal and mask is None
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap  # [B, h, n, L]
    if is_causal:
        n, L = scores.shape[-2:]
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
