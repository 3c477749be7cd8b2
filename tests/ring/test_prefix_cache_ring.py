"""The prefix cache on a simulated ring whose stages keep token ids as KV (SimSpec.kv_model):
a sampled token depends on what every stage reads back from the blocks its table names, so a
block matched for the wrong prefix, or reused while a request still reads it, changes tokens.
Thousands of requests share system prompts at random depths and continue earlier answers
(chats), some are aborted anywhere, and a small pool forces evictions and retractions."""

from __future__ import annotations

import random
import time

import pytest

from protocol.sampling import SamplingParams
from ring.config import RingConfig
from stages.batch import BLOCK_SIZE
from tests.ring.conftest import SimSpec, expected_tokens_kv, sim_ring

Request = tuple[str, list[int], SamplingParams]


def shared_prefix_requests(rng: random.Random, n: int, pp_size: int) -> list[Request]:
    """`n` requests: a system prompt cut at a random depth (a whole number of blocks or not)
    plus a question; a third continue an earlier request's prompt and its answer (a chat's
    next turn, whose cached blocks include decoded ones); a few share nothing."""
    roots = [[rng.randrange(1000) for _ in range(rng.randrange(20, 160))] for _ in range(5)]
    requests: list[Request] = []
    for i in range(n):
        max_new = rng.randint(1, 12) if rng.random() < 0.7 else rng.randint(30, 80)  # grow
        sampling = SamplingParams(max_new_tokens=max_new, seed=rng.randrange(2**40))
        question = [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        kind = rng.random()
        if kind < 0.33 and requests:
            _, before, earlier = rng.choice(requests)
            answer = expected_tokens_kv(before, earlier, pp_size)
            prompt = before + answer + question
        elif kind < 0.9:
            root = rng.choice(roots)
            depth = rng.choice([len(root), rng.randrange(len(root) + 1), BLOCK_SIZE * 2])
            prompt = root[:depth] + question
        else:
            prompt = question
        if len(prompt) > 400:  # a long chat starts again
            prompt = prompt[-150:]
        requests.append((f"q{i}", prompt, sampling))
    return requests


def run_workload(cfg: RingConfig, requests: list[Request], num_kv_blocks: int, seed: int):
    """Submit in random groups with random aborts; returns (driver, aborted ids, stats of
    stage 0's scheduler), the ring stopped and every stage's pool checked whole and alike."""
    rng = random.Random(seed)
    to_abort = {rid for rid, _, _ in requests if rng.random() < 0.08}
    with sim_ring(cfg, SimSpec(num_kv_blocks=num_kv_blocks, kv_model=True)) as ring:
        driver = ring.driver
        i = 0
        while i < len(requests):
            # a deep queue at once (the pool runs short: evictions, retractions), then groups
            group = requests[i : i + (100 if i == 0 else rng.randint(1, 40))]
            driver.submit_many(group)
            i += len(group)
            for rid, _, _ in group:
                if rid in to_abort and rng.random() < 0.3:
                    driver.abort(rid)  # most likely still waiting
            deadline = time.monotonic() + rng.random() * 0.01
            while driver.poll(max(deadline - time.monotonic(), 0)):
                pass
            for rid in to_abort:
                if driver.tokens.get(rid) and rid not in driver.finished and rng.random() < 0.5:
                    driver.abort(rid)  # mid-answer
        driver.wait_finished([r[0] for r in requests], timeout_s=500)
        stats = ring.loops[0].scheduler.stats
        assert ring.stop() == {r: 0 for r in range(cfg.pp_size)}
        keys = []
        for loop in ring.loops:
            pool = loop.scheduler.pool
            pool.check()
            assert pool.is_whole(), loop.prefix  # no block held, each free or cached, once
            keys.append(dict(pool._key_of))
        assert all(k == keys[0] for k in keys)  # every stage cached the same blocks
    return driver, to_abort, stats


def assert_every_answer_is_its_uncached_one(driver, requests, to_abort, pp_size) -> None:
    for rid, prompt, sampling in requests:
        finish = driver.finished[rid]
        assert driver.num_finishes[rid] == 1, rid
        expected = expected_tokens_kv(prompt, sampling, pp_size)
        tokens = driver.tokens.get(rid, [])
        if rid in to_abort and finish.finish_reason == "abort":
            assert tokens == expected[: len(tokens)], rid
        else:
            assert finish.finish_reason == "length", (rid, finish)
            assert tokens == expected, rid


SHAPES = [(pp, depth) for pp in (1, 2, 3, 4) for depth in (0, 1, 2)]
# Requests per shape in make test: the deeper rings' threads share two cores (1,000 requests
# take 7 s at PP=2 and 20-32 s at PP=4); `make test-long` runs 3,000 at every shape.
NUM_REQUESTS = {1: 3000, 2: 400, 3: 200, 4: 200}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("pp_size", "depth"), SHAPES)
def test_shared_prefixes_with_aborts_and_a_small_pool_give_every_uncached_answer(pp_size, depth):
    check_shared_prefixes(pp_size, depth, NUM_REQUESTS[pp_size])


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("pp_size", "depth"), [(1, 0), (3, 1)])
def test_longest_prefix_first_admission_gives_every_uncached_answer_too(pp_size, depth):
    check_shared_prefixes(pp_size, depth, NUM_REQUESTS[pp_size], policy="lpm")


@pytest.mark.timeout(200)
def test_a_split_lm_head_ring_gives_every_uncached_answer_too():
    check_shared_prefixes(3, 1, NUM_REQUESTS[3], split_lm_head=True)


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("pp_size", "depth"), SHAPES)
def test_shared_prefixes_with_three_thousand_requests(pp_size, depth):
    check_shared_prefixes(pp_size, depth, 3000)


def check_shared_prefixes(
    pp_size: int, depth: int, num_requests: int, policy: str = "fcfs", split_lm_head=False
) -> None:
    rng = random.Random(100 * pp_size + depth)
    cfg = RingConfig(
        pp_size=pp_size,
        pp_async_batch_depth=depth,
        max_running_requests=24,
        chunked_prefill_size=64,
        schedule_policy=policy,
        split_lm_head=split_lm_head,
    )
    requests = shared_prefix_requests(rng, num_requests, pp_size)
    # 24 running requests of up to 30 blocks would need far more: evictions and retractions
    driver, to_abort, stats = run_workload(cfg, requests, num_kv_blocks=48, seed=pp_size)
    assert_every_answer_is_its_uncached_one(driver, requests, to_abort, pp_size)
    cached = [driver.cached_tokens[rid] for rid in driver.cached_tokens]
    assert sum(cached) > 0.15 * stats.prefix_query_tokens  # the cache was used (~30% here)
    assert sum(cached) <= stats.prefix_hit_tokens  # what the requests were told was true
    assert all(c % BLOCK_SIZE == 0 for c in cached)
    assert stats.num_retractions > 0


@pytest.mark.timeout(120)
def test_the_disabled_cache_computes_every_prompt_whole_with_the_same_answers():
    rng = random.Random(7)
    cfg = RingConfig(pp_size=2, pp_async_batch_depth=1, disable_radix_cache=True)
    requests = shared_prefix_requests(rng, 200, 2)
    driver, to_abort, stats = run_workload(cfg, requests, num_kv_blocks=400, seed=7)
    assert_every_answer_is_its_uncached_one(driver, requests, to_abort, 2)
    assert stats.prefix_hit_tokens == 0 and not any(driver.cached_tokens.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("pp_size", "rank", "depth"), [(2, 1, 0), (3, 0, 1), (4, 2, 2)])
def test_a_stage_whose_cache_differs_stops_the_ring_at_the_step_it_decides_from_it(
    pp_size, rank, depth
):
    cfg = RingConfig(
        pp_size=pp_size,
        pp_async_batch_depth=depth,
        debug_fault=("forget", rank, 1),
        ring_timeout_s=5,
    )
    prompt = list(range(100))
    with sim_ring(cfg, SimSpec(kv_model=True)) as ring:
        driver = ring.driver
        driver.submit_many([("a", prompt, SamplingParams(max_new_tokens=3, seed=1))])
        driver.wait_finished(["a"], timeout_s=20)
        # b matches a's six blocks everywhere but on `rank`, which forgets them as b waits
        driver.submit_many([("b", prompt + [5], SamplingParams(max_new_tokens=3, seed=1))])
        with pytest.raises(RuntimeError, match="ring reported an error"):
            driver.wait_finished(["b"], timeout_s=30)
        codes = ring.join(timeout_s=20)
        errors = [c for c in driver.ctrl if c.op == "error"]
        forgot_at = ring.loops[rank].forgot_at
    assert codes == {r: 1 for r in range(pp_size)}  # every stage stopped, none hangs
    assert forgot_at is not None
    message = errors[0].message
    # caught at the very step whose batch the forgetful stage decided without the blocks
    assert "diverged" in message and f"step {forgot_at}:" in message, message
    assert "b" not in driver.tokens or not driver.tokens["b"]
