"""The scheduler replica and the block allocator, without a ring: plain Python, microseconds."""

from __future__ import annotations

import random

import pytest

from protocol.errors import ProtocolError
from protocol.messages import NewRequest, Output, Reqs
from protocol.sampling import SamplingParams
from ring.block_allocator import BlockAllocator
from ring.config import RingConfig
from ring.roles import sampling_args
from ring.scheduler import DivergenceError, Scheduler


def test_random_allocate_free_never_hands_out_a_block_twice():
    rng = random.Random(0)
    pool = BlockAllocator(200)
    held: list[list[int]] = []
    for _ in range(5000):
        if held and (rng.random() < 0.5 or not pool.can_allocate(8)):
            blocks = held.pop(rng.randrange(len(held)))
            pool.free(blocks)
        else:
            n = rng.randint(1, 8)
            if pool.can_allocate(n):
                held.append(pool.allocate(n))
        flat = [b for blocks in held for b in blocks]
        assert len(flat) == len(set(flat))
        assert pool.num_free + len(flat) == 200
    for blocks in held:
        pool.free(blocks)
    assert pool.is_whole()


def test_double_free_is_an_error():
    pool = BlockAllocator(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(blocks)


def new(rid: str, num_prompt: int, max_new: int = 4) -> NewRequest:
    return NewRequest(rid, list(range(1, num_prompt + 1)), SamplingParams(max_new_tokens=max_new))


def test_a_request_that_can_never_fit_is_rejected_at_once():
    sched = Scheduler(RingConfig(), num_kv_blocks=5, context_length=100)
    finished = sched.apply_reqs(
        Reqs(0, 0, new=[new("long", 99, max_new=5), new("big", 50, max_new=50), new("ok", 5)])
    )
    reasons = {d.rid: d for d in finished}
    assert "context length 100" in reasons["long"].error
    assert "KV blocks" in reasons["big"].error and reasons["big"].finish_reason == "error"
    assert list(sched.requests) == ["ok"]


def test_admission_respects_the_micro_batch_and_total_caps():
    cfg = RingConfig(pp_size=4, max_running_requests=8)
    assert cfg.micro_batch_cap == 2
    sched = Scheduler(cfg, num_kv_blocks=1000, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new(f"r{i}", 3) for i in range(20)]))
    sizes = [len(sched.decide(slot, slot)[0].entries) for slot in range(4)]
    assert sizes == [2, 2, 2, 2]
    assert sched.num_running == 8 and len(sched.waiting) == 12


def test_an_output_with_the_wrong_digest_is_a_divergence():
    sched = Scheduler(RingConfig(), num_kv_blocks=100, context_length=100)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", 3)]))
    batch, _ = sched.decide(0, 0)
    with pytest.raises(DivergenceError, match="diverged"):
        sched.apply_output(Output(0, 0, "not-the-digest", token_ids=[5]))
    assert batch.entries


@pytest.mark.parametrize(
    "extra",
    [{"logprobs": [-1.0, -2.0]}, {"top_ids": []}, {"top_logprobs": [[-1.0], [-2.0]]}],
)
def test_an_output_whose_per_row_lists_miss_rows_is_a_divergence(extra):
    sched = Scheduler(RingConfig(), num_kv_blocks=100, context_length=100)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", 3)]))
    batch, _ = sched.decide(0, 0)
    with pytest.raises(DivergenceError, match="for 1 sampled requests"):
        sched.apply_output(Output(0, 0, batch.digest, token_ids=[5], **extra))


def test_an_output_carries_each_rows_top_logprobs_to_its_delta():
    sched = Scheduler(RingConfig(), num_kv_blocks=100, context_length=100)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", 3), new("b", 3)]))
    batch, _ = sched.decide(0, 0)
    assert len(batch.sampled) == 2
    output = Output(
        0, 0, batch.digest, [5, 6], [-0.5, -0.7], top_ids=[[5, 9], []],
        top_logprobs=[[-0.5, -1.0], []],
    )  # fmt: skip
    deltas = {d.rid: d for d in sched.apply_output(output)}
    assert (deltas["a"].top_ids, deltas["a"].top_logprobs) == ([5, 9], [-0.5, -1.0])
    assert (deltas["b"].top_ids, deltas["b"].top_logprobs) == (None, None)


def test_a_replayed_requests_earlier_output_counts_as_output_for_the_penalties():
    sched = Scheduler(RingConfig(), num_kv_blocks=100, context_length=100)
    penalised = SamplingParams(max_new_tokens=4, temperature=0.0, frequency_penalty=1.0)
    replay = NewRequest("a", [1, 2, 3, 7, 7], penalised, num_generated=2)  # 7, 7 were output
    sched.apply_reqs(Reqs(0, 0, new=[replay, NewRequest("b", [1, 2], penalised)]))
    batch, _ = sched.decide(0, 0)
    histories = sampling_args(batch)["histories"]
    assert [(h.prompt_ids, h.output_ids) for h in histories] == [([1, 2, 3], [7, 7]), ([1, 2], [])]
    sched.apply_output(Output(0, 0, batch.digest, token_ids=[9, 8]))
    req = sched.requests["a"]
    assert (req.penalty_history().prompt_ids, req.penalty_history().output_ids) == (
        [1, 2, 3], [7, 7, 9],
    )  # fmt: skip


def test_min_tokens_suppresses_the_stop_ids_until_enough_are_out():
    sched = Scheduler(RingConfig(), num_kv_blocks=100, context_length=100)
    sched.eos_token_ids = (2,)
    wants = SamplingParams(max_new_tokens=6, temperature=0.0, min_tokens=2, stop_token_ids=[9])
    free = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    sched.apply_reqs(Reqs(0, 0, new=[NewRequest("a", [1], wants), NewRequest("b", [1], free)]))
    suppressed = []
    for step in range(3):
        batch, _ = sched.decide(0, step)
        histories = {e.req.rid: h for e, h in zip(batch.entries, sampling_args(batch)["histories"])}
        suppressed.append(list(histories["a"].suppressed_ids))
        assert histories["b"] is None  # nothing to suppress, no penalty: no history
        # A peer that samples a stop id anyway: it is taken as a token, not as the end.
        deltas = sched.apply_output(Output(0, step, batch.digest, token_ids=[9, 2]))
        reasons = {d.rid: d.finish_reason for d in deltas}
    assert suppressed == [[2, 9], [2, 9], []]  # EOS and stop id while fewer than 2 are out
    assert reasons == {"a": "stop", "b": ""}  # the third: past min_tokens, 9 stops it


@pytest.mark.parametrize("num_generated", [-1, 5])
def test_num_generated_must_leave_a_prompt(num_generated):
    with pytest.raises(ProtocolError, match=r"num_generated must be in \[0, 5\)"):
        NewRequest("a", [1, 2, 3, 4, 5], SamplingParams(), num_generated=num_generated)


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decodes_flowing():
    cfg = RingConfig(chunked_prefill_size=16)
    sched = Scheduler(cfg, num_kv_blocks=100, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("short", 4, max_new=10)]))
    batch, _ = sched.decide(0, 0)
    sched.apply_output(Output(0, 0, batch.digest, token_ids=[7]))
    sched.apply_reqs(Reqs(0, 1, new=[new("long", 40)]))
    chunks = []
    for step in range(1, 4):
        batch, _ = sched.decide(0, step)
        sizes = {e.req.rid: e.chunk.num_tokens for e in batch.entries}
        assert sizes["short"] == 1  # the decode rides along with every prefill chunk
        chunks.append(sizes["long"])
        sched.apply_output(Output(0, step, batch.digest, token_ids=[7] * len(batch.sampled)))
    assert chunks == [16, 16, 8]  # the prefill budget; decodes do not count against it


def test_kv_exhaustion_retracts_the_newest_request_and_requeues_it():
    sched = Scheduler(RingConfig(), num_kv_blocks=4, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", 16, max_new=40), new("b", 15, max_new=40)]))
    batch, _ = sched.decide(0, 0)
    assert [e.req.rid for e in batch.entries] == ["a", "b"]
    step = 1
    while "b" not in [r.rid for r in sched.waiting]:
        sched.apply_output(Output(0, step - 1, batch.digest, token_ids=[3] * len(batch.sampled)))
        batch, _ = sched.decide(0, step)
        step += 1
    assert sched.stats.num_retractions == 1
    assert [r.rid for r in sched.slots[0]] == ["a"]


def test_with_two_slots_a_prompt_is_spread_over_both_and_samples_in_its_own():
    cfg = RingConfig(pp_size=2, max_running_requests=8, chunked_prefill_size=512)
    sched = Scheduler(cfg, num_kv_blocks=1000, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("p", 143)]))
    plan = []
    for step in range(3):
        batch, _ = sched.decide(step % 2, step)
        plan += [(step % 2, e.req.rid, e.chunk.num_tokens, e.chunk.sample) for e in batch.entries]
        if batch.sampled:
            sched.apply_output(Output(step % 2, step, batch.digest, token_ids=[9]))
    # 143 pending over 2 slots: 72 in slot 0; slot 1, with nothing of its own, continues the
    # prompt with its share of the 71 left (it may not run the last chunk: that one samples,
    # and the request decodes in slot 0); slot 0 runs the rest, which samples.
    assert plan == [(0, "p", 72, False), (1, "p", 36, False), (0, "p", 35, True)]
    assert sched.stats.num_continued_chunks == 1
    assert [r.rid for r in sched.slots[0]] == ["p"] and sched.slots[1] == []
    assert sched.requests["p"].output_ids == [9]


def test_one_slot_and_short_prompts_are_not_spread():
    one = Scheduler(RingConfig(chunked_prefill_size=512), num_kv_blocks=1000, context_length=1000)
    one.apply_reqs(Reqs(0, 0, new=[new("p", 143)]))
    assert [e.chunk.num_tokens for e in one.decide(0, 0)[0].entries] == [143]
    two = Scheduler(RingConfig(pp_size=2), num_kv_blocks=1000, context_length=1000)
    two.apply_reqs(Reqs(0, 0, new=[new("q", 40)]))  # 20 per slot is under MIN_PREFILL_CHUNK
    assert [e.chunk.num_tokens for e in two.decide(0, 0)[0].entries] == [40]


def test_admission_keeps_slots_level_when_fewer_requests_than_the_caps_allow():
    """32 requests under a running cap of 64 in 3 slots (cap 22 each): 11, 11 and 10, not
    whatever order the prefill budget happened to admit them in."""
    cfg = RingConfig(pp_size=2, pp_async_batch_depth=1, max_running_requests=64)
    assert cfg.micro_batch_cap == 22
    sched = Scheduler(cfg, num_kv_blocks=1000, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new(f"r{i}", 3) for i in range(32)]))
    sizes = [len(sched.decide(slot, slot)[0].entries) for slot in range(3)]
    assert sizes == [11, 11, 10]
