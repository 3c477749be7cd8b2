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


# --- LongRoPE: a sequence past the original context, computed again at the long factors --------

LONG_FROM = 3 * BLOCK_SIZE  # ModelInfo.rope_long_from of a LongRoPE model


def test_a_longrope_sequence_is_computed_again_whole_when_it_reaches_past_the_switch():
    """As transformers' Phi-3 recomputes its cache the first time a sequence gets past
    original_max_position_embeddings: the decode that would take it there is a prefill of the
    whole sequence at the long factors instead, and it samples from its last position."""
    sched = Scheduler(
        RingConfig(), num_kv_blocks=100, context_length=1000, rope_long_from=LONG_FROM
    )
    prompt = list(range(LONG_FROM - 2))
    sched.apply_reqs(Reqs(0, 0, new=[new("a", prompt, max_new=6)]))
    chunks, step = [], 0
    while sched.has_work:
        batch, _ = sched.decide(0, step)
        chunks += [e.chunk for e in batch.entries]
        sched.apply_output(Output(0, step, batch.digest, token_ids=[7] * len(batch.sampled)))
        step += 1
    starts = [(c.start_pos, c.num_tokens, c.rope_long) for c in chunks]
    # prompt (46 tokens) and one decode at the short factors (positions 0-46, 47 tokens), then
    # the token at position 47 takes the sequence to 48 = LONG_FROM, still not past it; the
    # next would: 49 tokens, all of them again at the long factors, then decodes long
    assert starts == [
        (0, LONG_FROM - 2, False), (LONG_FROM - 2, 1, False), (LONG_FROM - 1, 1, False),
        (0, LONG_FROM + 1, True), (LONG_FROM + 1, 1, True), (LONG_FROM + 2, 1, True),
    ]  # fmt: skip
    assert all(c.sample for c in chunks)
    assert sched.stats.num_rope_recomputes == 1 and sched.stats.num_retractions == 0
    # the short blocks stay cached under their own keys, the long ones under others
    assert sched.pool.num_cached == 2 * (LONG_FROM // BLOCK_SIZE) and sched.pool.is_whole()


def test_a_longrope_prompt_past_the_switch_is_long_in_every_chunk_and_matches_only_long_blocks():
    cfg = RingConfig(chunked_prefill_size=BLOCK_SIZE)
    sched = Scheduler(cfg, num_kv_blocks=100, context_length=1000, rope_long_from=LONG_FROM)
    short = list(range(LONG_FROM - 8))  # short: computed at the short factors
    sched.apply_reqs(Reqs(0, 0, new=[new("short", short, max_new=1)]))
    step = run_until_idle(sched)
    long = short + list(range(500, 520))  # the same first blocks, but past the switch
    sched.apply_reqs(Reqs(0, 1, new=[new("long", long, max_new=1)]))
    batch, _ = sched.decide(0, step)
    (entry,) = batch.entries
    # nothing of the short prompt's blocks is K and V at the long factors: none matched
    assert entry.chunk.start_pos == 0 and entry.chunk.rope_long
    step = run_until_idle(sched, step)
    assert sched.stats.prefix_hit_tokens == 0
    # a third, long too, finds the second's blocks
    sched.apply_reqs(Reqs(0, 2, new=[new("again", long + [1], max_new=1)]))
    batch, _ = sched.decide(0, step)
    assert batch.entries[0].chunk.rope_long
    assert batch.entries[0].chunk.start_pos == len(long) // BLOCK_SIZE * BLOCK_SIZE


def test_without_longrope_no_chunk_is_long():
    sched = Scheduler(RingConfig(), num_kv_blocks=100, context_length=1000)
    sched.apply_reqs(Reqs(0, 0, new=[new("a", list(range(200)), max_new=3)]))
    batch, _ = sched.decide(0, 0)
    assert not batch.entries[0].chunk.rope_long


# --- sliding windows: the blocks behind every layer's window go back to the pool --------------

WINDOW = 2 * BLOCK_SIZE


def test_a_windowed_sequence_holds_a_bounded_number_of_blocks_as_it_grows():
    """One sequence of a model whose every layer sees its last 32 positions, grown to 10x its
    window by prefill chunks and then decodes: it never holds more than the window's blocks and
    a chunk's; what it gives back is cached (a later prompt with its start finds it), and at
    the end the pool is whole."""
    cfg = RingConfig(chunked_prefill_size=BLOCK_SIZE)
    sched = Scheduler(cfg, num_kv_blocks=40, context_length=1000, kv_window=WINDOW)
    prompt = list(range(4 * WINDOW + 5))
    sched.apply_reqs(Reqs(0, 0, new=[new("a", prompt, max_new=6 * WINDOW)]))
    step, held, tables = 0, [], []
    while sched.has_work:
        batch, _ = sched.decide(0, step)
        tables += [list(e.chunk.block_ids) for e in batch.entries]
        held.append(sched.pool.num_blocks - sched.pool.num_available)
        sched.apply_output(Output(0, step, batch.digest, token_ids=[7] * len(batch.sampled)))
        step += 1
    assert len(tables[-1]) == -(-(10 * WINDOW + 5) // BLOCK_SIZE)  # the table still names all
    assert max(held) <= WINDOW // BLOCK_SIZE + 2  # the window's blocks, the block it writes
    assert sched.pool.is_whole()
    # the given-back blocks stayed cached: a new prompt with the same start finds them
    sched.apply_reqs(Reqs(0, 1, new=[new("b", prompt + [1], max_new=1)]))
    batch, _ = sched.decide(0, step)
    assert batch.entries[0].chunk.start_pos == len(prompt) // BLOCK_SIZE * BLOCK_SIZE


def test_a_windowed_prompt_longer_than_the_pool_is_served_not_refused():
    cfg = RingConfig(chunked_prefill_size=BLOCK_SIZE)
    sched = Scheduler(cfg, num_kv_blocks=8, context_length=10_000, kv_window=WINDOW)
    finished = sched.apply_reqs(Reqs(0, 0, new=[new("a", list(range(40 * BLOCK_SIZE)))]))
    assert not finished  # 40 blocks of prompt through an 8-block pool
    run_until_idle(sched)
    assert sched.pool.is_whole()
    # without a window the same prompt is refused in one sentence
    plain = Scheduler(cfg, num_kv_blocks=8, context_length=10_000)
    (refused,) = plain.apply_reqs(Reqs(0, 0, new=[new("a", list(range(40 * BLOCK_SIZE)))]))
    assert refused.finish_reason == "error" and "KV blocks" in refused.error
