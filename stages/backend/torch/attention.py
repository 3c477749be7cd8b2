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


def gather_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, inputs: ForwardInputs, scale: float
) -> torch.Tensor:
    """q: [T, h, d] (rotary applied); kv_layer: [2, slots, h_kv, d], this layer's K and V with
    this forward's tokens already written; scores scaled by `scale`. Returns [T, h, d]."""
    groups = inputs.decode_groups
    if not inputs.prefills and len(groups) == 1 and groups[0].rows is None:
        # Pure decode batch of similar lengths: one call, no scatter.
        return _decode(q, kv_layer, groups[0].key_slots, groups[0].key_len, groups[0].mask, scale)

    out = torch.empty_like(q)
    for p in inputs.prefills:
        k, v = (
            kv_layer.index_select(1, p.key_slots).transpose(1, 2).unsqueeze(1)
        )  # [1, h_kv, ctx, d]
        o = F.scaled_dot_product_attention(
            q[p.row_start : p.row_end].transpose(0, 1).unsqueeze(0),  # [1, h, n, d]
            k,
            v,
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=True,
        )  # [1, h, n, d]
        out[p.row_start : p.row_end] = o[0].transpose(0, 1)
    for g in groups:
        q_g = q if g.rows is None else q.index_select(0, g.rows)  # [n, h, d]
        o_g = _decode(q_g, kv_layer, g.key_slots, g.key_len, g.mask, scale)
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
) -> torch.Tensor:
    """One query per sequence: q [n, h, d] against n contexts padded to key_len -> [n, h, d]."""
    n = q.shape[0]
    kv = kv_layer.index_select(1, key_slots)  # [2, n * L, h_kv, d]
    k, v = kv.view(2, n, key_len, *kv.shape[2:]).transpose(2, 3)  # each [n, h_kv, L, d]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.squeeze(2)  # [n, h, 1, d] -> [n, h, d]
