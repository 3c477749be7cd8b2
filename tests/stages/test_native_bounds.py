"""No caller can make the CPU kernels write (or read) outside the buffers it described.

Every entry point of stages/backend/cpu/csrc/ that takes cache slots, block ids, positions or row
ranges checks them all against the sizes it was given, once a call, before it writes anything,
and the wrapper raises one sentence: an IndexError for an index, a ValueError for a count or a
range, as the torch path raises them. Each test hands one entry point one bad value and checks
the sentence, and that the cache it would have written is unchanged. (`make test-asan` runs
these and the other kernel tests under AddressSanitizer and UBSan.)"""

from __future__ import annotations

import ctypes
from array import array
from pathlib import Path

import pytest
import torch

from stages.backend.cpu import native
from stages.batch import BLOCK_SIZE, SeqChunk
from tests.stages.conftest import Chain

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
NUM_BLOCKS = 4
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    built = native.kernels()
    if built is None:
        pytest.skip(f"no CPU kernels: {native.unavailable_reason()}")
    return built


def _i32(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def attention_call(
    kernels: native.NativeKernels,
    *,
    num_tokens: int = 3,
    q_start: int = 0,
    q_len: int = 3,
    ctx_len: int = 20,
    table: list[int] | None = None,
) -> torch.Tensor:
    """One sequence's attention over a cache of NUM_BLOCKS blocks; by default valid: 3 query
    rows at positions 17-19 over blocks [2, 1]."""
    q = torch.randn(num_tokens, HEADS, HEAD_DIM)
    kv = torch.randn(2, NUM_SLOTS, KV_HEADS, HEAD_DIM)
    return kernels.paged_attention(
        q, kv, _i32([q_start]), _i32([q_len]), _i32([ctx_len]), _i32([table or [2, 1]]),
        HEAD_DIM**-0.5,
    )  # fmt: skip


def test_valid_attention_metadata_runs(kernels: native.NativeKernels) -> None:
    assert attention_call(kernels).shape == (3, HEADS, HEAD_DIM)


@pytest.mark.parametrize(
    ("bad", "error", "sentence"),
    [
        ({"table": [2, NUM_BLOCKS]}, IndexError, "a block id lies outside the KV pool's 4 blocks"),
        ({"table": [-1, 1]}, IndexError, "a block id lies outside the KV pool"),
        ({"q_start": 1}, ValueError, "query's rows lie outside the 3 rows given"),
        ({"q_start": -1}, ValueError, "rows lie outside"),
        ({"q_len": 4, "num_tokens": 3}, ValueError, "rows lie outside the 3 rows given"),
        ({"ctx_len": 33}, ValueError, "longer than its block table"),
        ({"ctx_len": 2}, ValueError, "shorter than its query"),
    ],
    ids=["block-past-pool", "block-negative", "rows-past-end", "rows-negative", "rows-too-many",
         "context-past-table", "context-short"],
)  # fmt: skip
def test_attention_refuses_metadata_outside_its_sizes(
    kernels: native.NativeKernels, bad: dict[str, object], error: type, sentence: str
) -> None:
    with pytest.raises(error, match=sentence) as raised:
        attention_call(kernels, **bad)  # type: ignore[arg-type]
    assert str(raised.value).endswith("nothing was written")


@pytest.mark.parametrize("slot", [NUM_SLOTS, -1, 2**40])
def test_rope_store_refuses_a_slot_outside_the_cache(
    kernels: native.NativeKernels, slot: int
) -> None:
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    cos, sin = torch.ones(3, HEAD_DIM), torch.zeros(3, HEAD_DIM)
    kv = torch.zeros(2, NUM_SLOTS, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([0, slot, 5])
    with pytest.raises(IndexError, match="rope_store: a cache slot lies outside the KV pool's 64"):
        kernels.rope_store(qkv, cos, sin, slots, kv, HEADS)
    assert not kv.any()  # slot 0, before the bad one, was not written either


@pytest.fixture(scope="module")
def fused_chain(tiny_dirs: dict[str, Path]) -> Chain:
    chain = Chain(tiny_dirs["gqa"], [4])
    if chain.stages[0].model.fused is None:
        pytest.skip("this stage's layers do not run fused here")
    return chain


class _StepArrays:
    """A decode step's metadata for the fused layers' `_Step`, as backend/cpu/kept_decode.py lays it
    out: int64 positions [n] and slots [n]; int32 q_start, q_len, ctx_len [n] and block tables
    [n, width]."""

    def __init__(self, positions: list[int], slots: list[int], tables: list[list[int]]) -> None:
        n = len(positions)
        self.longs = array("q", positions + slots)
        self.ints = array("i", list(range(n)) + [1] * n + [p + 1 for p in positions])
        for table in tables:
            self.ints.extend(table)
        self.width = len(tables[0])

    def fill(self, step: object, n: int) -> None:
        longs, ints = self.longs.buffer_info()[0], self.ints.buffer_info()[0]
        step.num_tokens = step.num_seqs = n  # type: ignore[attr-defined]
        step.table_stride = self.width  # type: ignore[attr-defined]
        step.positions, step.slot_mapping = longs, longs + 8 * n  # type: ignore[attr-defined]
        step.q_start, step.q_len = ints, ints + 4 * n  # type: ignore[attr-defined]
        step.ctx_len, step.block_table = ints + 8 * n, ints + 12 * n  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("what", "error", "sentence"),
    [
        ("slot", IndexError, "a cache slot lies outside the KV pool"),
        ("block", IndexError, "a block id lies outside the KV pool"),
        ("position", IndexError, "a position lies outside the rotary tables' rows"),
        ("rows", ValueError, "a row count or a query's rows lie outside"),
    ],
)
def test_the_fused_layers_refuse_a_step_outside_their_sizes(
    fused_chain: Chain, what: str, error: type, sentence: str
) -> None:
    stage = fused_chain.stages[0]
    fused, kv = stage.model.fused, stage.kv
    assert fused is not None and kv is not None
    max_rows = 2
    scratch, addresses = fused.scratch_for(max_rows)
    step = fused.step_struct(kv.num_slots, addresses, max_rows, kv.kv_bytes)
    num_blocks = kv.num_slots // BLOCK_SIZE
    cos, sin = stage.model.ops.rope_table(stage.model.inv_freq).covering(40)
    step.cos, step.sin, step.rope_rows = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
    positions, slots, tables = [3, 20], [3, BLOCK_SIZE + 4], [[0, 1], [0, 1]]
    rows = 2
    if what == "slot":
        slots[1] = kv.num_slots
    elif what == "block":
        tables[1][1] = num_blocks
    elif what == "position":
        positions[0] = cos.shape[0]
    else:
        rows = max_rows + 1
        positions, slots, tables = positions + [5], slots + [5], tables + [[0, 1]]
    arrays = _StepArrays(positions, slots, tables)
    arrays.fill(step, rows)
    h = torch.randn(rows, fused.hidden).to(fused.dtype)
    out = torch.empty(2, rows, fused.hidden, dtype=fused.dtype)
    kv_before = kv.data.clone()
    with pytest.raises(error, match=sentence):
        fused.run_at(
            ctypes.addressof(step), h.data_ptr(), None, out[1].data_ptr(),
            kv.data.data_ptr(), kv.data.stride(0) * kv.data.element_size(), out[0].data_ptr(),
        )  # fmt: skip
    assert torch.equal(kv.data, kv_before)
    del scratch


def test_a_block_id_past_the_pool_fails_the_step_on_every_path(
    tiny_dirs: dict[str, Path], stage_path: str
) -> None:
    """A scheduler bug that hands a stage a block the pool does not have: the torch path's
    IndexError, and the native one's, before the cache is touched."""
    (stage,) = Chain(tiny_dirs["gqa"], [4]).stages
    assert stage.kv is not None
    past = stage.kv.num_slots // BLOCK_SIZE
    kv_before = stage.kv.data.clone()
    with pytest.raises(IndexError):
        stage.run([SeqChunk([5, 6, 7], 0, [past], sample=True)])
    if stage_path == "native":
        assert torch.equal(stage.kv.data, kv_before)


def test_the_greedy_head_refuses_more_rows_than_its_buffers_hold(fused_chain: Chain) -> None:
    stage = fused_chain.stages[0]
    head = stage.model.greedy_head
    if head is None:
        pytest.skip("this stage's greedy finish runs call by call")
    kernels = native.kernels()
    assert kernels is not None
    rows, hidden, vocab = 2, head._head.k, head._head.n
    h = torch.randn(rows + 1, hidden).to(head.dtype)
    scratch = torch.empty(rows * (2 * hidden + vocab), dtype=head.dtype)
    out = torch.full((rows + 1,), -7, dtype=torch.int64)
    args = (head.norm_weight.data_ptr(), head.eps)
    with pytest.raises(ValueError, match="the greedy lm_head: a row count .* outside the 2 rows"):
        kernels.greedy_head(
            head._head_at, native._ELEM_BYTES[head.dtype], h.data_ptr(), h.data_ptr(), *args,
            rows + 1, rows, hidden, scratch.data_ptr(), None, 0, out.data_ptr(), None, None,
            None,
        )  # fmt: skip
    with pytest.raises(ValueError, match="a row count"):  # rows of another width than K
        kernels.greedy_head(
            head._head_at, native._ELEM_BYTES[head.dtype], h.data_ptr(), h.data_ptr(), *args,
            rows, rows, hidden + 1, scratch.data_ptr(), None, 0, out.data_ptr(), None, None,
            None,
        )  # fmt: skip
    assert (out == -7).all()
