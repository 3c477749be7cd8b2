"""The CPU kernels' attention with a sliding window and a soft cap (csrc/attention_window.c),
against a plain softmax in fp64: every row sees exactly the keys (p - window, p], scores capped
as cap tanh(s / cap), at every build level this CPU runs (the bf16 cache as pairs where the
build holds it so); pages behind a row's window are never read (they hold NaN here: a window's
blocks go back to the pool and another sequence may write them); and the metadata is checked as
the plain kernel's is."""

from __future__ import annotations

import math
import random

import pytest
import torch

from stages.backend.cpu import native
from stages.batch import BLOCK_SIZE
from tests.stages.test_native import kernels, scattered_chunks  # noqa: F401  (the fixture)

SPECS = [(0, 40), (17, 1), (100, 1), (5, 9), (0, 1), (64, 64), (15, 1), (16, 1), (3, 30), (80, 7)]


def attend(
    kernels: native.NativeKernels,  # noqa: F811
    q: torch.Tensor,
    kv: torch.Tensor,
    chunks: list[tuple[int, int, list[int]]],
    window: int,
    softcap: float,
) -> torch.Tensor:
    i32 = torch.int32
    lengths = [n for _, n, _ in chunks]
    width = max(len(b) for _, _, b in chunks)
    return kernels.paged_attention(
        q,
        kernels.to_cache_layout(kv),
        torch.tensor([sum(lengths[:i]) for i in range(len(chunks))], dtype=i32),
        torch.tensor(lengths, dtype=i32),
        torch.tensor([s + n for s, n, _ in chunks], dtype=i32),
        torch.tensor([b + [0] * (width - len(b)) for _, _, b in chunks], dtype=i32),
        q.shape[-1] ** -0.5,
        window=window,
        softcap=softcap,
    )


def reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    chunks: list[tuple[int, int, list[int]]],
    window: int,
    softcap: float,
) -> torch.Tensor:
    """q [T, h, d]; row p of a chunk sees keys (p - window, p] (all of [0, p] for window 0)."""
    out = torch.empty_like(q, dtype=torch.float64)
    group = q.shape[1] // kv.shape[2]
    row = 0
    for start, n, blocks in chunks:
        for i in range(n):
            p = start + i
            lo = max(0, p - window + 1) if window else 0
            slots = torch.tensor(
                [blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(lo, p + 1)]
            )
            k = kv[0, slots].double().repeat_interleave(group, dim=1)  # [keys, h, d]
            v = kv[1, slots].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,chd->hc", q[row + i].double(), k) / math.sqrt(q.shape[-1])
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[row + i] = torch.einsum("hc,chd->hd", scores.softmax(-1), v)
        row += n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("window", "softcap"), [(20, 0.0), (16, 0.0), (1, 0.0), (0, 5.0), (37, 2.0)]
)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (8, 2, 24)])
def test_windowed_and_capped_attention_matches_a_plain_softmax(
    kernels: native.NativeKernels,  # noqa: F811
    dtype: torch.dtype,
    window: int,
    softcap: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    chunks, num_blocks = scattered_chunks(SPECS, random.Random(window + head_dim), spare_blocks=3)
    torch.manual_seed(window)
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, kv_heads, head_dim).to(dtype)
    # what some row of the batch sees; every other slot (behind every window, past every
    # context) NaN: a read of one would show
    seen = set()
    for start, n, blocks in chunks:
        for p in range(start, start + n):
            lo = max(0, p - window + 1) if window else 0
            seen |= {
                blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(lo, p + 1)
            }
    unseen = sorted(set(range(num_blocks * BLOCK_SIZE)) - seen)
    kv[:, unseen] = float("nan")
    q = (torch.randn(sum(n for _, n, _ in chunks), heads, head_dim) * 3).to(dtype)
    got = attend(kernels, q, kv, chunks, window, softcap)
    assert not got.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    expected = reference(q, kv, chunks, window, softcap)
    assert (got.double() - expected).abs().max().item() < tolerance


def test_a_window_longer_than_every_context_is_the_plain_kernel(
    kernels: native.NativeKernels,  # noqa: F811
) -> None:
    chunks, num_blocks = scattered_chunks(SPECS, random.Random(3))
    torch.manual_seed(3)
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, 2, 32)
    q = torch.randn(sum(n for _, n, _ in chunks), 4, 32)
    windowed = attend(kernels, q, kv, chunks, window=1000, softcap=0.0)
    plain = attend(kernels, q, kv, chunks, window=0, softcap=0.0)
    torch.testing.assert_close(windowed, plain, atol=1e-6, rtol=1e-5)
    capped = attend(kernels, q, kv, chunks, window=0, softcap=5.0)  # a cap alone: this kernel
    torch.testing.assert_close(capped.double(), reference(q, kv, chunks, 0, 5.0), atol=1e-5, rtol=0)


def test_the_windowed_kernel_checks_its_metadata_as_the_plain_one(
    kernels: native.NativeKernels,  # noqa: F811
) -> None:
    chunks, num_blocks = scattered_chunks([(0, 20)], random.Random(0))
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, 1, 16)
    q = torch.randn(20, 2, 16)
    bad = [(0, 20, [chunks[0][2][0], num_blocks])]  # a block past the pool
    with pytest.raises(IndexError, match="block"):
        attend(kernels, q, kv, bad, window=8, softcap=0.0)
    with pytest.raises(ValueError, match=">= 0"):
        attend(kernels, q, kv, chunks, window=-1, softcap=0.0)
