"""Decode attention on a GPU that reads the paged KV cache in place, as a Triton kernel.

Why a kernel of our own: a decode step is launch-bound on a GPU (issue 13), and the torch path
(backend/torch/attention.py, "gather") builds a padded copy of every context with shapes that change
every step, which no CUDA graph can replay. This kernel takes fixed-shape inputs (the batch's
block table [B, max_blocks] and context lengths [B]) and loops over each context's pages on the
device, so one captured launch serves every step of a batch size, whatever the lengths.

One program per (sequence, KV head) handles that head's whole query group (GQA: h / h_kv query
heads share one K/V read; MQA is the group of all heads). It walks the context 64 keys (four
16-slot pages) at a time with an online softmax in fp32: scores [G, 64] = q [G, d] @ k^T, the
running max and sum per query head, acc [G, d] += p @ v. The group is padded to 16 rows and d
to a power of two for `tl.dot`; padded rows and columns are masked out of the loads and stores.
fp32 inputs multiply in IEEE fp32 (not TF32), so fp32 stages keep their tolerance to
transformers.

At small batches B * h_kv programs leave most of a GPU idle (8 at batch 1 for Llama-3-8B, on 132
multiprocessors), each walking its context alone. So inside a graph each context is split into
parts (flash-decoding): a third grid axis, each part keeping its own max, sum and unnormalized
output, and a second kernel joins them, weighting each part by exp(its max - the overall max).

Triton ships with the CUDA builds of torch; on a machine without it `available()` is False and
the stage keeps the torch path. Under TRITON_INTERPRET=1 the same kernel runs on CPU tensors,
which is how the CPU tests check it against `reference_decode`.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from stages.backend.switches import TRITON_ATTENTION_ENV as DISABLE_ENV
from stages.batch import BLOCK_SIZE

PAGES_PER_ITERATION = 4  # keys per loop iteration: 4 pages of 16
MAX_SPLITS = 16  # parts a context is walked in, at most
MIN_DOT_ROWS = 16  # tl.dot needs every dimension >= 16


def available() -> bool:
    """Triton is importable (CUDA builds of torch ship it; the CPU build does not)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def unusable_reason(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> str | None:
    """Why a stage on `device` cannot use the kernel for its heads and dtype, or None. Checked
    once at start-up by building it and comparing one small batch with `reference_decode`: a
    machine whose Triton cannot compile (no C compiler, no Python headers) or a kernel that
    is wrong there falls back to torch's path with one log line, instead of failing requests."""
    if os.environ.get(DISABLE_ENV) == "0":
        return f"{DISABLE_ENV}=0"
    if not available():
        return "Triton is not installed"
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 4 * BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(3, num_heads, head_dim, generator=gen)
    table = torch.tensor([[2, 0, 3, 1], [1, 3, 0, 2], [3, 2, 1, 0]], dtype=torch.int32)
    ctx_len = torch.tensor([1, 40, 64], dtype=torch.int32)
    args = (q.to(device, dtype), kv.to(device, dtype), table.to(device), ctx_len.to(device))
    expected = reference_decode(*args, head_dim**-0.5).float()
    limit = 1e-4 if dtype == torch.float32 else 3e-2
    for num_splits in (1, 2):  # whole contexts, and in parts joined after (graphs)
        try:
            got = paged_decode(*args, head_dim**-0.5, num_splits).float()
        except Exception as exc:  # a compiler or driver error: whatever it is, fall back
            return f"the kernel failed to build or run ({type(exc).__name__}: {exc})"
        error = (got - expected).abs().max().item()
        if not error < limit:
            return f"the kernel's result is off by {error:.2e} ({num_splits} parts)"
    return None


def splits_for(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many parts each context is split into (flash-decoding): one program per (sequence,
    KV head) leaves most of a GPU idle at small batches, each program walking its whole context
    alone; with parts, programs cover at least two per multiprocessor and a second kernel joins
    them. One on a CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    target = 2 * _multiprocessors(device)
    return max(1, min(MAX_SPLITS, -(-target // (num_seqs * num_kv_heads))))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Asked once: graph steps cut their inputs every replay (stages/backend/cuda/graphs.py)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
    num_splits: int = 1,
) -> torch.Tensor:
    """One query per sequence against its paged context.

    q: [B, h, d] (rotary applied); kv_layer: [2, slots, h_kv, d], K then V, this step's tokens
    already written; block_table: [B, max_blocks] int32, the blocks of each sequence in position
    order (entries past its context are never read); ctx_len: [B] int32, keys of each sequence
    (>= 1). `num_splits` > 1: each context is walked in that many parts, joined after (a
    second launch: worth it inside a CUDA graph at small batches, `splits_for`). Returns
    [B, h, d] in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, num_kv_heads, kv_dim = kv_layer.shape
    if kv_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q [{num_seqs}, {num_heads}, {head_dim}] does not fit K/V of {num_kv_heads} heads "
            f"of {kv_dim}"
        )
    if q.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("paged_decode needs q and the cache contiguous in their last dim")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    group = num_heads // num_kv_heads
    dim_pad = max(MIN_DOT_ROWS, _next_power_of_2(head_dim))
    out = torch.empty_like(q)
    keys, values = kv_layer[0], kv_layer[1]  # [slots, h_kv, d] each
    # The parts' unnormalized outputs [B, h, S, d] and their running max and sum [B, h, S], in
    # fp32; with one part the kernel writes `out` itself and these are not read.
    parts = num_splits if num_splits > 1 else 0
    acc = torch.empty(num_seqs, num_heads, parts, head_dim, device=q.device)
    stats = torch.empty(2, num_seqs, num_heads, parts, device=q.device)  # max, sum
    attend, join = _kernels()
    attend[(num_seqs, num_kv_heads, num_splits)](
        q,
        keys,
        values,
        out,
        acc,
        stats,
        block_table,
        ctx_len,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        scale,
        NUM_SPLITS=num_splits,
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=max(MIN_DOT_ROWS, _next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        PAGE=BLOCK_SIZE,
        BLOCK_N=BLOCK_SIZE * PAGES_PER_ITERATION,
        IEEE=q.dtype == torch.float32,
    )
    if num_splits > 1:
        join[(num_seqs, num_heads)](
            acc,
            stats,
            out,
            num_seqs,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=_next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
        )
    return out


def reference_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time (for tests): [B, h, d]."""
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        n = int(ctx_len[row])
        pos = torch.arange(n)
        slots = block_table[row].long().cpu()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k, v = kv_layer[:, slots.to(kv_layer.device)].float()  # [n, h_kv, d] each
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [n, h, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * scale  # [h, n]
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


_compiled = None


def _kernels():  # -> the jitted Triton kernels (attend, join)
    """Defined on first use: importing this module must not need Triton."""
    global _compiled
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    @triton.jit
    def attend_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        acc_ptr,
        stats_ptr,
        block_table_ptr,
        ctx_len_ptr,
        stride_q_seq,
        stride_q_head,
        stride_kv_slot,
        stride_kv_head,
        stride_out_seq,
        stride_out_head,
        stride_table_seq,
        scale,
        NUM_SPLITS: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_keys = tl.load(ctx_len_ptr + seq)
        # This part's keys: [key_start, key_end), whole loop iterations of BLOCK_N.
        per_split = tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
        key_start = split * per_split
        key_end = tl.minimum(key_start + per_split, num_keys)
        rows = tl.arange(0, GROUP_PAD)  # query heads of this group (padded)
        dims = tl.arange(0, DIM_PAD)
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM
        heads = kv_head * GROUP + rows
        q = tl.load(
            q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [G, D]
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        keys_n = tl.arange(0, BLOCK_N)
        for first in range(key_start, key_end, BLOCK_N):
            pos = first + keys_n  # [N] positions in the sequence
            key_ok = pos < key_end
            block = tl.load(
                block_table_ptr + seq * stride_table_seq + pos // PAGE, mask=key_ok, other=0
            )
            slot = block.to(tl.int64) * PAGE + pos % PAGE  # [N]
            kv_offsets = slot[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [N, D]
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G, N]
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            p = tl.exp(scores - new_max[:, None])  # [G, N]
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [N, D]
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            running_max = new_max
        out_mask = row_ok[:, None] & dim_ok[None, :]
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
                (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )
        else:
            # [B, h, S, d] and [2, B, h, S], contiguous; an empty part leaves max -inf, sum 0.
            part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [G]
            tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
            tl.store(stats_ptr + part, running_max, mask=row_ok)
            tl.store(stats_ptr + tl.num_programs(0) * NUM_HEADS * NUM_SPLITS + part,
                     running_sum, mask=row_ok)  # fmt: skip

    @triton.jit
    def join_kernel(
        acc_ptr,
        stats_ptr,
        out_ptr,
        num_seqs,
        stride_out_seq,
        stride_out_head,
        NUM_HEADS: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, DIM_PAD)
        split_ok = splits < NUM_SPLITS
        part = (seq * NUM_HEADS + head) * NUM_SPLITS + splits  # [S]
        part_max = tl.load(stats_ptr + part, mask=split_ok, other=float("-inf"))
        part_sum = tl.load(stats_ptr + num_seqs * NUM_HEADS * NUM_SPLITS + part, mask=split_ok,
                           other=0.0)  # fmt: skip
        top = tl.max(part_max, axis=0)  # finite: the first part holds at least one key
        weight = tl.exp(part_max - top)  # [S]; 0 for an empty part
        acc = tl.load(
            acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
            mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :],
            other=0.0,
        )  # [S, D]
        total = tl.sum(acc * weight[:, None], axis=0) / tl.sum(part_sum * weight, axis=0)
        tl.store(
            out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
            total.to(out_ptr.dtype.element_ty),
            mask=dims < HEAD_DIM,
        )

    _compiled = attend_kernel, join_kernel
    return _compiled
