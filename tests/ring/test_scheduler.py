"""The scheduler replica and its KV block pool, without a ring: plain Python, microseconds."""

from __future__ import annotations

import random

import pytest

from protocol.errors import ProtocolError
from protocol.messages import NewRequest, Output, Reqs
from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.prefix_cache import PrefixCache
from ring.roles import sampling_args
from ring.scheduler import DivergenceError, Scheduler


def test_random_allocate_release_never_hands_out_a_block_twice():
    rng = random.Random(0)
    pool = PrefixCache(200)
    held: list[list[int]] = []
    for _ in range(5000):
        if held and (rng.random() < 0.5 or pool.num_available < 8):
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(blocks)
        else:
            n = rng.randint(1, 8)
            if n <= pool.num_available:
                held.append(pool.allocate(n))
        flat = [b for blocks in held for b in blocks]
        assert len(flat) == len(set(flat))
        assert pool.num_available + len(flat) == 200
    for blocks in held:
        pool.release(blocks)
    assert pool.is_whole()


def test_a_double_release_is_an_error():
    pool = PrefixCache(4)
    blocks = pool.allocate(2)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(blocks)


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
    batch, _ = sched.decide(0, 0)
    # Slot 0 fills itself, then admits into the others (their first chunks run here: tiny
    # prompts are not split); every slot holds its cap and no more.
    assert len(batch.entries) == 8
    assert [len(s) for s in sched.slots] == [2, 2, 2, 2]
    assert sched.num_running == 8 and len(sched.waiting) == 12
    assert [len(sched.decide(slot, slot)[0].entries) for slot in (1, 2, 3)] == [0, 0, 0]


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
    for slot in range(3):
        sched.decide(slot, slot)
    assert [len(s) for s in sched.slots] == [11, 11, 10]


def two_slots_with_one_prompt_run_for_the_other() -> tuple[Scheduler, object]:
    """Slot 0's step admits a into itself and, full at its share (1 of 2 present), b into
    slot 1: both prompts (unsplit: 8 tokens) run and sample in slot 0's batch."""
    sched = Scheduler(RingConfig(pp_size=2, max_running_requests=4), 1000, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", 4, max_new=3), new("b", 4, max_new=3)]))
    batch, _ = sched.decide(0, 0)
    return sched, batch


def test_a_full_slot_runs_the_prompt_of_a_request_it_admits_into_the_next():
    sched, batch0 = two_slots_with_one_prompt_run_for_the_other()
    assert [(e.req.rid, e.chunk.num_tokens, e.chunk.sample) for e in batch0.entries] == [
        ("a", 4, True),
        ("b", 4, True),
    ]
    assert [[r.rid for r in s] for s in sched.slots] == [["a"], ["b"]]
    batch1, _ = sched.decide(1, 1)  # b's token is in flight: slot 1 has nothing to run
    assert batch1.entries == []
    sched.apply_output(Output(0, 0, batch0.digest, token_ids=[5, 6]))  # due at step 1's end
    batch2, _ = sched.decide(0, 2)
    sched.apply_output(Output(1, 1, batch1.digest, token_ids=[]))
    batch3, _ = sched.decide(1, 3)
    # b decodes at step 3, as it would have had slot 1's own step 1 run its prompt (its token
    # then due at step 2's end): the same first-token step, and slot 1's step 1 is free.
    assert [(e.req.rid, e.chunk.token_ids) for e in batch2.entries] == [("a", [5])]
    assert [(e.req.rid, e.chunk.token_ids) for e in batch3.entries] == [("b", [6])]


def test_a_prompt_continued_in_another_slot_may_end_there():
    cfg = RingConfig(pp_size=2, max_running_requests=8, chunked_prefill_size=64)
    sched = Scheduler(cfg, num_kv_blocks=1000, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("p", 100)]))
    batch0, _ = sched.decide(0, 0)  # 100 pending over 2 slots: 50 here
    batch1, _ = sched.decide(1, 1)  # slot 1 has 50 of budget: the rest of p, which samples
    assert [(e.chunk.num_tokens, e.chunk.sample) for e in batch0.entries + batch1.entries] == [
        (50, False),
        (50, True),
    ]
    assert [[r.rid for r in s] for s in sched.slots] == [["p"], []]  # p still decodes in 0
    sched.apply_output(Output(0, 0, batch0.digest, token_ids=[]))
    batch2, _ = sched.decide(0, 2)
    assert batch2.entries == []  # its token is not back yet
    sched.apply_output(Output(1, 1, batch1.digest, token_ids=[8]))
    batch3, _ = sched.decide(1, 3)
    batch4, _ = sched.decide(0, 4)
    assert batch3.entries == [] and [e.chunk.token_ids for e in batch4.entries] == [[8]]


def test_an_output_for_a_request_aborted_meanwhile_is_dropped():
    sched, batch0 = two_slots_with_one_prompt_run_for_the_other()
    sched.apply_reqs(Reqs(1, 1, aborts=["b"]))
    _, finished = sched.decide(1, 1)  # b's slot comes round before b's output is back
    assert [(d.rid, d.finish_reason) for d in finished] == [("b", "abort")]
    deltas = sched.apply_output(Output(0, 0, batch0.digest, token_ids=[5, 6]))
    assert [(d.rid, d.token_id) for d in deltas] == [("a", 5)]  # nothing more for b
    assert "b" not in sched.requests


def test_an_output_for_a_request_retracted_meanwhile_is_dropped_and_sampled_again():
    sched, batch0 = two_slots_with_one_prompt_run_for_the_other()
    b = sched.requests["b"]
    sched._retract(b)  # as slot 1's step would, short of KV, while b's output is in flight
    deltas = sched.apply_output(Output(0, 0, batch0.digest, token_ids=[5, 6]))
    assert [d.rid for d in deltas] == ["a"]
    assert b.output_ids == [] and b in sched.waiting
    batch1, _ = sched.decide(1, 1)  # readmitted: its whole prompt again, and it samples
    assert [(e.req.rid, e.chunk.num_tokens, e.chunk.sample) for e in batch1.entries] == [
        ("b", 4, True)
    ]
