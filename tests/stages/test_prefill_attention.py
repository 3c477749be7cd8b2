"""A long prefill chunk's attention on SDPA over K and V gathered from the paged cache
(backend/cpu/prefill_attention.py), the rest of its batch on the paged kernel: held to a plain
softmax in float64 over the same cache, in both of its layouts (rows, and a bf16 cache's pairs),
with stale slots past every context holding NaN; and where a stage takes that path."""

from __future__ import annotations

import random

import pytest
import torch

from stages.backend.cpu import native, prefill_attention
from stages.backend.cpu.ops import NativeOps
from stages.backend.cpu.prefill_attention import PrefillAttention
from stages.batch import BLOCK_SIZE
from stages.inputs import PagedAttn
from tests.stages.conftest import Chain, drive_teacher_forced
from tests.stages.test_native import reference_attention, scattered_chunks


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    built = native.kernels()
    assert built is not None, native.unavailable_reason()
    return built


def paged_for(chunks: list[tuple[int, int, list[int]]]) -> PagedAttn:
    i32 = torch.int32
    lengths = [n for _, n, _ in chunks]
    width = max(len(b) for _, _, b in chunks)
    return PagedAttn(
        q_start=torch.tensor([sum(lengths[:i]) for i in range(len(chunks))], dtype=i32),
        q_len=torch.tensor(lengths, dtype=i32),
        ctx_len=torch.tensor([s + n for s, n, _ in chunks], dtype=i32),
        block_table=torch.tensor([b + [0] * (width - len(b)) for _, _, b in chunks], dtype=i32),
        max_q_len=max(lengths),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128), (4, 4, 16)])
def test_long_chunks_on_sdpa_and_the_rest_paged_match_a_plain_softmax(
    kernels: native.NativeKernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    # a fresh prompt of 40 rows (square: is_causal), a chunk of 37 rows after 100 keys (a mask
    # aligned bottom-right), and short chunks and decodes that stay on the paged kernel
    specs = [(0, 40), (17, 1), (100, 37), (5, 9), (0, 1), (64, 30), (3, 2)]
    chunks, num_blocks = scattered_chunks(specs, random.Random(heads), spare_blocks=3)
    torch.manual_seed(head_dim)
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, kv_heads, head_dim).to(dtype)
    written = {
        blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for s, n, blocks in chunks
        for p in range(s + n)
    }
    for slot in set(range(kv.shape[1])) - written:  # whatever stale slots hold must not leak
        kv[:, slot] = float("nan")
    q = torch.randn(sum(n for _, n in specs), heads, head_dim).to(dtype)
    prefill = PrefillAttention(kernels, min_rows=30)
    paged = paged_for(chunks)
    assert prefill.takes(paged)
    got = prefill(q, kernels.to_cache_layout(kv), paged, head_dim**-0.5)
    expected = reference_attention(q, kv, chunks)
    assert not got.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - expected).abs().max().item() < tolerance
    # and the rows the paged kernel computes are its own, bit for bit
    alone = kernels.paged_attention(
        q, kernels.to_cache_layout(kv), paged.q_start, paged.q_len, paged.ctx_len,
        paged.block_table, head_dim**-0.5,
    )  # fmt: skip
    short_rows = [
        row
        for (start, n), first in zip(specs, paged.q_start.tolist(), strict=True)
        if n < 30
        for row in range(first, first + n)
    ]
    assert torch.equal(got[short_rows], alone[short_rows])


def test_a_block_id_outside_the_cache_is_one_error(kernels: native.NativeKernels) -> None:
    chunks, num_blocks = scattered_chunks([(0, 40)], random.Random(1))
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, 1, 16)
    paged = paged_for(chunks)
    paged.block_table[0, 1] = num_blocks  # one past the pool
    with pytest.raises(IndexError, match="block id"):
        PrefillAttention(kernels, min_rows=8)(torch.randn(40, 1, 16), kv, paged, 0.25)


def test_a_stage_sends_long_chunks_to_sdpa_only_in_bf16_with_amx(
    kernels: native.NativeKernels,
) -> None:
    bf16 = NativeOps.for_stage(kernels, torch.bfloat16)
    assert (bf16.prefill is not None) == kernels.amx_bf16
    assert NativeOps.for_stage(kernels, torch.float32).prefill is None


def test_a_stage_takes_sdpa_for_its_long_chunks_with_the_paged_paths_logits(
    kernels: native.NativeKernels, tiny_dirs, monkeypatch
) -> None:
    """bf16, tiny Llama: prompts of 150 and 60 tokens in chunks of up to 140 (the first chunk
    of 140 rows goes to SDPA, the fused stack left for the layers' calls), decodes after: the
    logits of every position within bf16's reach of the stage with every chunk paged."""
    if not kernels.amx_bf16:
        pytest.skip("long chunks go to SDPA only where the CPU has AMX tiles")
    seqs = [[(5 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((160, 70))]
    taken = []
    original = PrefillAttention.__call__

    def counted(self, q, kv_layer, paged, scale):
        taken.append(q.shape[0])
        return original(self, q, kv_layer, paged, scale)

    def run(min_rows: int) -> list[torch.Tensor]:
        monkeypatch.setattr(prefill_attention, "PREFILL_ROWS", min_rows)
        chain = Chain(tiny_dirs["gqa"], [2, 2], dtype="bfloat16")
        return drive_teacher_forced(chain, seqs, [150, 60], chunk_size=140, stagger=1)

    monkeypatch.setattr(PrefillAttention, "__call__", counted)
    paged_only = run(10**9)
    assert not taken
    with_sdpa = run(100)
    assert taken  # (each stage's layers, for the batches with the 140-row chunk)
    for got, expected in zip(with_sdpa, paged_only, strict=True):
        assert torch.isfinite(got).all()
        assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gathered_context_is_the_cache_in_rows(
    kernels: native.NativeKernels, dtype: torch.dtype
) -> None:
    """SDPA's K and V (where the tiles refuse) from the cache in either layout: the context's
    slots, in order, in rows."""
    (chunk,), num_blocks = scattered_chunks([(30, 7)], random.Random(3), spare_blocks=2)
    start, n, blocks = chunk
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, 3, 64).to(dtype)
    context = start + n
    slots = torch.tensor(
        [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context)]
    )
    table = torch.tensor(blocks, dtype=torch.int32)
    k, v = PrefillAttention(kernels)._context(kernels.to_cache_layout(kv), table, context, dtype)
    assert torch.equal(k, kv[0, slots].transpose(0, 1))
    assert torch.equal(v, kv[1, slots].transpose(0, 1))
