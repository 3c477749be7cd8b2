"""The scheduler replica with its prefix cache, without a ring: what an admission matches, when a
filled block becomes matchable, what the digest covers, and the switch that turns it off."""

from __future__ import annotations

from protocol.messages import NewRequest, Output, Reqs
from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.scheduler import Scheduler
from stages.batch import BLOCK_SIZE

SYSTEM = list(range(1000, 1000 + 3 * BLOCK_SIZE + 5))  # three full blocks and 5 tokens


def new(rid: str, prompt: list[int], max_new: int = 2) -> NewRequest:
    return NewRequest(rid, prompt, SamplingParams(max_new_tokens=max_new))


def run_until_idle(sched: Scheduler, step: int = 0) -> int:
    """One slot: decide, answer with token 7, until nothing runs; returns the next step."""
    while sched.has_work:
        batch, _ = sched.decide(0, step)
        sched.apply_output(Output(0, step, batch.digest, token_ids=[7] * len(batch.sampled)))
        step += 1
    return step


def test_a_second_prompt_prefills_only_what_the_first_did_not_leave_cached():
    sched = Scheduler(RingConfig(), num_kv_blocks=100, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", SYSTEM + [1, 2])]))
    step = run_until_idle(sched)
    assert sched.pool.num_cached == 3 and sched.pool.is_whole()
    sched.apply_reqs(Reqs(0, 1, new=[new("b", SYSTEM + [3, 4, 5])]))
    batch, _ = sched.decide(0, step)
    (entry,) = batch.entries
    assert entry.admitted and entry.chunk.start_pos == 3 * BLOCK_SIZE
    assert entry.chunk.token_ids == SYSTEM[3 * BLOCK_SIZE :] + [3, 4, 5]
    assert sched.stats.prefix_hit_tokens == 3 * BLOCK_SIZE
    deltas = sched.apply_output(Output(0, step, batch.digest, token_ids=[9]))
    assert deltas[0].cached_tokens == 3 * BLOCK_SIZE  # told with the first token only
    batch, _ = sched.decide(0, step + 1)
    deltas = sched.apply_output(Output(0, step + 1, batch.digest, token_ids=[9]))
    assert deltas[0].cached_tokens == 0 and deltas[0].finish_reason == "length"


def test_an_answer_s_blocks_are_cached_for_the_next_turn():
    sched = Scheduler(RingConfig(), num_kv_blocks=100, context_length=1000)
    prompt = list(range(BLOCK_SIZE - 3))
    sched.apply_reqs(Reqs(0, 0, new=[new("turn1", prompt, max_new=2 * BLOCK_SIZE)]))
    step = run_until_idle(sched)
    answer = [7] * (2 * BLOCK_SIZE)
    # its last token's KV was never computed: two full blocks of prompt + answer, not three
    assert sched.pool.num_cached == 2
    sched.apply_reqs(Reqs(0, 1, new=[new("turn2", prompt + answer + [5])]))
    batch, _ = sched.decide(0, step)
    assert batch.entries[0].chunk.start_pos == 2 * BLOCK_SIZE


def test_blocks_filled_in_one_decision_are_matched_only_by_later_ones():
    cfg = RingConfig(max_running_requests=8)
    sched = Scheduler(cfg, num_kv_blocks=100, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", SYSTEM), new("b", SYSTEM)]))
    batch, _ = sched.decide(0, 0)
    # b is admitted in the batch that writes a's blocks: it must not read them there
    assert [e.chunk.start_pos for e in batch.entries] == [0, 0]
    sched.apply_reqs(Reqs(0, 1, new=[new("c", SYSTEM)]))
    sched.apply_output(Output(0, 0, batch.digest, token_ids=[7, 7]))
    batch, _ = sched.decide(0, 1)
    assert {e.req.rid: e.chunk.start_pos for e in batch.entries}["c"] == 3 * BLOCK_SIZE


def test_two_replicas_whose_caches_differ_digest_their_admission_differently():
    replicas = [Scheduler(RingConfig(), num_kv_blocks=100, context_length=1000) for _ in "ab"]
    digests = []
    for i, sched in enumerate(replicas):
        sched.apply_reqs(Reqs(0, 0, new=[new("a", SYSTEM + [1])]))
        step = run_until_idle(sched)
        if i == 1:
            assert sched.pool.forget_idle() == 3
        sched.apply_reqs(Reqs(0, 1, new=[new("b", SYSTEM + [2])]))
        batch, _ = sched.decide(0, step)
        digests.append(batch.digest)
    assert digests[0] != digests[1]


def test_a_retracted_request_finds_its_own_blocks_again():
    sched = Scheduler(RingConfig(), num_kv_blocks=6, context_length=1000)
    prompts = [list(range(16)), list(range(100, 115))]  # 4 blocks each once they have 40 more
    sched.apply_reqs(Reqs(0, 0, new=[new(rid, p, max_new=40) for rid, p in zip("ab", prompts)]))
    step = 0
    while not sched.stats.num_retractions:
        batch, _ = sched.decide(0, step)
        sched.apply_output(Output(0, step, batch.digest, token_ids=[3] * len(batch.sampled)))
        step += 1
    (retracted,) = sched.waiting
    assert retracted.rid == "b" and len(retracted.output_ids) >= BLOCK_SIZE
    while retracted in sched.waiting:
        batch, _ = sched.decide(0, step)
        sched.apply_output(Output(0, step, batch.digest, token_ids=[3] * len(batch.sampled)))
        step += 1
    assert sched.stats.prefix_hit_tokens > 0  # its full blocks were still cached
    run_until_idle(sched, step)
    sched.pool.check()
    assert sched.pool.is_whole()


def test_the_switch_turns_matching_off():
    sched = Scheduler(RingConfig(disable_radix_cache=True), num_kv_blocks=100, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", SYSTEM + [1])]))
    step = run_until_idle(sched)
    assert sched.pool.num_cached == 0
    sched.apply_reqs(Reqs(0, 1, new=[new("b", SYSTEM + [1])]))
    batch, _ = sched.decide(0, step)
    assert batch.entries[0].chunk.start_pos == 0 and sched.stats.prefix_hit_tokens == 0


def one_at_a_time(policy: str) -> Scheduler:
    """A one-request scheduler whose cache holds SYSTEM's three full blocks."""
    cfg = RingConfig(max_running_requests=1, schedule_policy=policy)
    sched = Scheduler(cfg, num_kv_blocks=100, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("warm", SYSTEM + [1])]))
    run_until_idle(sched)
    return sched


def admitted_in_order(sched: Scheduler, step: int = 100) -> list[str]:
    order = []
    while sched.has_work:
        batch, _ = sched.decide(0, step)
        order += [e.req.rid for e in batch.entries if e.admitted]
        sched.apply_output(Output(0, step, batch.digest, token_ids=[7] * len(batch.sampled)))
        step += 1
    return order


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_by_arrival():
    for policy, expected in (("fcfs", ["x", "y", "z"]), ("lpm", ["y", "z", "x"])):
        sched = one_at_a_time(policy)
        prompts = {"x": list(range(60)), "y": SYSTEM + [2], "z": SYSTEM[:20] + [3]}
        sched.apply_reqs(Reqs(0, 1, new=[new(rid, p) for rid, p in prompts.items()]))
        assert admitted_in_order(sched) == expected, policy


def test_lpm_passes_a_request_over_a_bounded_number_of_times():
    from ring.scheduler import LPM_MAX_PASSES

    sched = one_at_a_time("lpm")
    sched.apply_reqs(Reqs(0, 1, new=[new("cold", list(range(60)))]))
    hot = [new(f"hot{i}", SYSTEM + [i]) for i in range(LPM_MAX_PASSES + 5)]
    sched.apply_reqs(Reqs(0, 2, new=hot))
    order = admitted_in_order(sched)
    assert order.index("cold") == LPM_MAX_PASSES  # then arrival order puts it first
