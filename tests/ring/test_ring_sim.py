"""Ring simulation: the real loop and transport (threads over inproc://), simulated stages whose
last stage samples a token known in advance, so every token of every request is checked."""

from __future__ import annotations

import random
import time

import pytest

from protocol.messages import RequestDelta
from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.loop import deltas_due
from ring.request import Req
from tests.ring.conftest import SimSpec, expected_tokens, random_requests, sim_ring


def submit_at_random_times(ring, requests, rng: random.Random) -> None:
    """Requests arrive in random groups while the ring runs."""
    i = 0
    while i < len(requests):
        n = rng.randint(1, 20)
        ring.driver.submit_many(requests[i : i + n])
        i += n
        deadline = time.monotonic() + rng.random() * 0.02
        while ring.driver.poll(max(deadline - time.monotonic(), 0)):
            pass


def assert_all_exact(ring, requests) -> None:
    driver = ring.driver
    for rid, prompt, sampling in requests:
        assert driver.tokens[rid] == expected_tokens(prompt, sampling), rid
        assert driver.num_finishes[rid] == 1, rid
    ring_codes = ring.stop()
    assert ring_codes == {r: 0 for r in range(ring.cfg.pp_size)}
    for loop in ring.loops:  # the pool is whole again on every stage
        assert loop.scheduler.pool.is_whole(), loop.prefix
        assert loop.scheduler.is_idle()


# Every depth up to PP=4; at PP=8 (7-9 s each) two depths, so make test stays under 10 minutes.
RING_SHAPES = [(pp, depth) for pp in (1, 2, 3, 4) for depth in (0, 1, 2, 3)] + [(8, 0), (8, 3)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pp_size", "depth"), RING_SHAPES)
def test_every_request_gets_exactly_its_tokens(pp_size, depth):
    rng = random.Random(pp_size * 10 + depth)
    cfg = RingConfig(
        pp_size=pp_size,
        pp_async_batch_depth=depth,
        max_running_requests=32,
        chunked_prefill_size=128,
    )
    requests = random_requests(rng, 200)
    with sim_ring(cfg) as ring:
        submit_at_random_times(ring, requests, rng)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=90)
        assert_all_exact(ring, requests)
        assert all(d.finish_reason == "length" for d in ring.driver.finished.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pp_size", "depth"), [(1, 1), (2, 0), (3, 2), (4, 1)])
def test_a_stage_without_overlap_gets_the_same_tokens(pp_size, depth):
    """A CPU stage runs its forward inside launch (nothing to overlap with): the loop sends the
    proxy as soon as it has it and applies the due output afterwards."""
    rng = random.Random(100 + pp_size * 10 + depth)
    cfg = RingConfig(pp_size=pp_size, pp_async_batch_depth=depth, max_running_requests=16)
    requests = random_requests(rng, 60)
    with sim_ring(cfg, SimSpec(t0_s=0.001, overlap=False)) as ring:
        submit_at_random_times(ring, requests, rng)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=90)
        assert_all_exact(ring, requests)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("pp_size", "depth", "overlap"), [(2, 0, True), (2, 0, False), (3, 1, True), (4, 2, False)]
)
def test_a_split_lm_head_gets_every_request_exactly_its_tokens(pp_size, depth, overlap):
    """Stage 0 samples from the last stage's share and sends the output round the ring: every
    stage applies the same tokens at the same step (a lost or reordered share is a step gap)."""
    rng = random.Random(200 + pp_size * 10 + depth)
    cfg = RingConfig(
        pp_size=pp_size,
        pp_async_batch_depth=depth,
        max_running_requests=16,
        chunked_prefill_size=128,
        split_lm_head=True,
    )
    requests = random_requests(rng, 80)
    with sim_ring(cfg, SimSpec(t0_s=0.0005, overlap=overlap)) as ring:
        submit_at_random_times(ring, requests, rng)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=90)
        assert_all_exact(ring, requests)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("depth", "split"), [(0, False), (0, True), (1, False)])
def test_stage_0_tells_the_frontend_once_a_round(depth, split):
    """Without overlap (a CPU ring), stage 0 sends the frontend one message a round of slots:
    in a steady decode it tells of every running request once. Unbatched, a round of L slots
    would be L messages."""
    cfg = RingConfig(
        pp_size=2, pp_async_batch_depth=depth, max_running_requests=8, split_lm_head=split
    )
    new_tokens = 30
    requests = [
        (f"r{i}", [i + 1] * 4, SamplingParams(max_new_tokens=new_tokens, seed=i)) for i in range(8)
    ]
    with sim_ring(cfg, SimSpec(t0_s=0.0005, overlap=False)) as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=30)
        assert_all_exact(ring, requests)
    messages = ring.driver.messages
    assert all(len(rids) == len(set(rids)) for rids in messages)  # a request once a message
    assert sum(len(rids) == len(requests) for rids in messages) >= new_tokens - 5
    # a first token or a finish goes at once: a few more messages than rounds, not L times
    assert len(messages) <= new_tokens + 2 * cfg.pp_loop_size


def test_a_first_token_a_finish_or_an_idle_ring_do_not_wait_for_the_round():
    def req(rid: str, num_out: int) -> Req:
        return Req(rid, [1, 2], SamplingParams(), 0, output_ids=list(range(num_out)))

    running = {"a": req("a", 5), "b": req("b", 1)}
    later, first = RequestDelta("a", 7, None, ""), RequestDelta("b", 7, None, "")
    finish = RequestDelta("c", 7, None, "length")  # finished: no longer running
    assert not deltas_due(0, 2, False, [later], running)  # mid-round: held
    assert deltas_due(1, 2, False, [later], running)  # the round's last step
    assert deltas_due(0, 1, False, [later], running)  # one slot: every step ends a round
    assert deltas_due(0, 2, True, [later], running)  # nothing else would send them
    assert deltas_due(0, 2, False, [later, first], running)
    assert deltas_due(3, 3, False, [finish], running)
    assert not deltas_due(3, 3, False, [later], running)


@pytest.mark.timeout(120)
def test_stop_token_ids_finish_a_request_with_stop():
    rng = random.Random(5)
    requests = random_requests(rng, 40, max_new=30)
    # Stop on the 3rd token each request would produce.
    requests = [
        (
            rid,
            p,
            SamplingParams(
                max_new_tokens=30,
                seed=s.seed,
                stop_token_ids=[expected_tokens(p, SamplingParams(30, seed=s.seed))[2]],
            ),
        )
        for rid, p, s in requests
    ]
    with sim_ring(RingConfig(pp_size=3)) as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=60)
        for rid, prompt, sampling in requests:
            tokens = ring.driver.tokens[rid]
            assert tokens == expected_tokens(prompt, sampling)
            assert ring.driver.finished[rid].finish_reason == "stop"
        assert_all_exact(ring, requests)


@pytest.mark.timeout(180)
def test_aborts_at_random_points_leave_the_others_unaffected():
    rng = random.Random(11)
    cfg = RingConfig(
        pp_size=4, pp_async_batch_depth=1, max_running_requests=32, chunked_prefill_size=64
    )
    requests = random_requests(rng, 500, max_prompt=300, max_new=30)
    to_abort = set(rng.sample([r[0] for r in requests], 150))
    with sim_ring(cfg, SimSpec(num_kv_blocks=400, t0_s=0.0005)) as ring:
        driver = ring.driver
        i = 0
        while i < len(requests):
            batch = requests[i : i + 25]
            driver.submit_many(batch)
            i += 25
            # Abort some at once (waiting), some after a few steps (prefilling or decoding).
            for rid, _, _ in batch:
                if rid in to_abort and rng.random() < 0.3:
                    driver.abort(rid)
            deadline = time.monotonic() + rng.random() * 0.03
            while time.monotonic() < deadline:
                driver.poll(0.002)
            pending = [r for r in to_abort if r not in driver.finished]
            for rid in rng.sample(pending, min(len(pending), 4)):
                driver.abort(rid)  # wherever it is: likely waiting, maybe prefilling
        # Abort the rest as they decode: each one that has produced a token so far.
        sent: set[str] = set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not set(to_abort) <= set(driver.finished):
            driver.poll(0.002)
            for rid in to_abort:
                if driver.tokens.get(rid) and rid not in sent:
                    driver.abort(rid)
                    sent.add(rid)
        driver.wait_finished([r[0] for r in requests], timeout_s=150)
        reasons = {"waiting": 0, "mid": 0}
        for rid, prompt, sampling in requests:
            finish = driver.finished[rid]
            expected = expected_tokens(prompt, sampling)
            if rid in to_abort and finish.finish_reason == "abort":
                # Whatever arrived before the abort is a prefix of the right answer.
                assert driver.tokens[rid] == expected[: len(driver.tokens[rid])]
                reasons["mid" if driver.tokens[rid] else "waiting"] += 1
            else:
                assert finish.finish_reason == "length"
                assert driver.tokens[rid] == expected, rid
            assert driver.num_finishes[rid] == 1
        assert reasons["waiting"] > 0 and reasons["mid"] > 0
        assert_all_exact_pool(ring)


def assert_all_exact_pool(ring) -> None:
    assert ring.stop() == {r: 0 for r in range(ring.cfg.pp_size)}
    for loop in ring.loops:
        assert loop.scheduler.pool.is_whole(), loop.prefix


@pytest.mark.timeout(120)
def test_requests_needing_three_times_the_pool_all_finish_right():
    rng = random.Random(3)
    cfg = RingConfig(pp_size=4, max_running_requests=64, chunked_prefill_size=256)
    num_blocks = 40
    requests = random_requests(rng, 48, max_prompt=16, max_new=120)
    need = sum(-(-(len(p) + s.max_new_tokens) // 16) for _, p, s in requests)
    assert need >= 3 * num_blocks
    with sim_ring(cfg, SimSpec(num_kv_blocks=num_blocks)) as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=100)
        retractions = ring.loops[0].scheduler.stats.num_retractions
        assert_all_exact(ring, requests)
    assert retractions > 0  # the pool really ran out, and retraction recovered


@pytest.mark.timeout(60)
def test_admission_caps_hold_on_every_stage():
    rng = random.Random(8)
    cfg = RingConfig(pp_size=4, max_running_requests=8)
    requests = random_requests(rng, 60, max_new=12)
    with sim_ring(cfg) as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=50)
        stats = [loop.scheduler.stats for loop in ring.loops]
        assert_all_exact(ring, requests)
    for s in stats:
        assert s.max_batch_requests == 2
        assert s.max_running_requests == 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fault", "error"), [("diverge", "diverged"), ("drop", "step gap")])
@pytest.mark.parametrize(("pp_size", "rank", "t0_s"), [(4, 1, 0.0), (2, 0, 0.005)])
def test_a_fault_stops_the_ring_with_a_clear_error(fault, error, pp_size, rank, t0_s):
    """(2, 0, 5 ms): stage 0 overlaps a forward with waiting for the last stage's output; a
    proxy it drops must still show as a step gap, not as a ring timeout."""
    rng = random.Random(2)
    cfg = RingConfig(pp_size=pp_size, debug_fault=(fault, rank, 6), ring_timeout_s=5)
    requests = random_requests(rng, 30, max_new=20)
    with sim_ring(cfg, SimSpec(t0_s=t0_s)) as ring:
        ring.driver.submit_many(requests)
        with pytest.raises(RuntimeError, match="ring reported an error"):
            ring.driver.wait_finished([r[0] for r in requests], timeout_s=30)
        codes = ring.join(timeout_s=20)
        errors = [c for c in ring.driver.ctrl if c.op == "error"]
    assert codes == {r: 1 for r in range(pp_size)}  # every stage stopped, none hangs
    message = errors[0].message
    assert error in message and "step 6" in message and "[pp" in message
