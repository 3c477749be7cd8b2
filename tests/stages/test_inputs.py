from __future__ import annotations

import pytest

from stages.batch import BLOCK_SIZE, SeqChunk, blocks_needed
from stages.inputs import build_inputs


def test_packed_ids_positions_and_slots() -> None:
    chunks = [
        SeqChunk([10, 11, 12], start_pos=0, block_ids=[7], sample=True),
        SeqChunk([20], start_pos=17, block_ids=[2, 5], sample=True),
        SeqChunk([30, 31], start_pos=15, block_ids=[9, 4], sample=False),
    ]
    inputs = build_inputs(chunks)
    assert inputs.input_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert inputs.positions.tolist() == [0, 1, 2, 17, 15, 16]
    # slot = block_ids[pos // 16] * 16 + pos % 16
    assert inputs.slot_mapping.tolist() == [112, 113, 114, 81, 159, 64]
    assert inputs.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert inputs.sample_rows.tolist() == [2, 3]  # the last row of each sampled chunk
    assert inputs.num_tokens == 6


def test_prefill_metadata_covers_exactly_the_context() -> None:
    chunk = SeqChunk([1] * 4, start_pos=14, block_ids=[3, 8], sample=True)
    prefill = build_inputs([chunk]).prefills[0]
    assert prefill.key_slots.tolist() == list(range(48, 64)) + [128, 129]
    assert prefill.mask is not None and prefill.mask.shape == (4, 18)
    # query i (position 14 + i) sees keys 0 .. 14 + i
    assert prefill.mask.sum(dim=1).tolist() == [15, 16, 17, 18]
    fresh = build_inputs([SeqChunk([1] * 4, 0, [3], True)]).prefills[0]
    assert fresh.mask is None  # plain causal


def test_decode_groups_bound_padding_and_mask_it() -> None:
    lengths = [300, 290, 20, 3, 260]
    chunks = [
        SeqChunk([1], n - 1, list(range(i * 20, i * 20 + 20)), True) for i, n in enumerate(lengths)
    ]
    groups = build_inputs(chunks).decode_groups
    assert [g.key_len for g in groups] == [300, 20]
    long, short = groups
    assert long.rows is not None and long.rows.tolist() == [0, 1, 4]
    assert short.rows is not None and short.rows.tolist() == [2, 3]
    assert long.mask is not None and long.mask.sum(dim=-1).flatten().tolist() == [300, 290, 260]
    # padding repeats each sequence's position-0 slot, a slot it owns
    slots = short.key_slots.view(2, 20)
    first_slot = 60 * BLOCK_SIZE  # chunk 3's first block is 60
    assert slots[1, :3].tolist() == [first_slot, first_slot + 1, first_slot + 2]
    assert set(slots[1, 3:].tolist()) == {first_slot}


def test_uniform_decode_batch_is_one_group_in_batch_order() -> None:
    chunks = [
        SeqChunk([1], 99 + i % 3, [i, 50 + i, 100 + i, 150 + i, 200 + i, 250 + i, 300 + i], True)
        for i in range(8)
    ]
    (group,) = build_inputs(chunks).decode_groups
    assert group.rows is None and group.key_len == 102


@pytest.mark.parametrize(
    ("chunk", "needle"),
    [
        (SeqChunk([], 0, [0], True), "at least one token"),
        (SeqChunk([1, 2], 15, [0], True), "cannot hold 17 tokens"),
        (SeqChunk([1], -1, [0], True), "start_pos"),
    ],
)
def test_bad_chunks_fail_loudly(chunk: SeqChunk, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_inputs([chunk])


def test_empty_batch_fails() -> None:
    with pytest.raises(ValueError):
        build_inputs([])


def test_blocks_needed() -> None:
    assert [blocks_needed(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert BLOCK_SIZE == 16
