"""The start-up handshake refuses a stage that serves another model (ring/control.py)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from protocol.messages import RingError, RingReady
from ring.config import RingConfig
from ring.harness import ThreadRing
from ring.loop import ModelInfo
from tests.ring.conftest import sim_ring


def start_up_failure(ring: ThreadRing) -> tuple[dict[int, int], RingError | None]:
    """Run a ring that should stop at start-up: each stage's exit code, and the error report
    the frontend side got (waited for up to 10 s after the stages exit)."""
    with ring:
        codes = ring.join(timeout_s=20)
        deadline = time.monotonic() + 10
        while ring.driver.ring_error() is None and time.monotonic() < deadline:
            ring.driver.poll(0.05)
        return codes, ring.driver.ring_error()


@pytest.mark.timeout(60)
def test_a_stage_that_loaded_another_model_stops_the_whole_ring_at_start_up():
    ring = sim_ring(RingConfig(pp_size=3, ring_timeout_s=10))
    ring.model_for = lambda c: ModelInfo(4096, config_hash="other" if c.rank == 2 else "mine")
    codes, error = start_up_failure(ring)
    assert codes == {0: 1, 1: 1, 2: 1}  # no stage serves, none hangs
    assert error is not None and error.rank == 2
    assert "[pp2] config_hash differs from stage 0's" in error.message
    assert "every stage must serve the same model" in error.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flag, mine, theirs",
    [
        ("chunked_prefill_size", 512, 128),  # a CPU node's default at PP >= 2 beside a GPU's
        ("max_running_requests", 64, 32),
        ("pp_max_micro_batch_size", None, 8),
        ("disable_radix_cache", False, True),  # one stage with no prefix cache
        ("schedule_policy", "fcfs", "lpm"),
    ],
)
def test_a_stage_whose_scheduling_flags_differ_stops_the_whole_ring_at_start_up(flag, mine, theirs):
    """Each stage's scheduler replica decides every batch itself: one deciding by other flags
    would silently diverge, so the handshake compares them as each stage resolved them."""
    ring = sim_ring(RingConfig(pp_size=3, ring_timeout_s=10, **{flag: mine}))
    ring.cfg_for = lambda c: dataclasses.replace(c, **{flag: theirs}) if c.rank == 1 else c
    codes, error = start_up_failure(ring)
    assert codes == {0: 1, 1: 1, 2: 1}
    assert error is not None and error.rank == 1
    assert f"[pp1] {flag} differs from stage 0's ({theirs!r} vs {mine!r})" in error.message


@pytest.mark.timeout(60)
def test_a_stage_whose_kv_cache_stores_another_dtype_stops_the_whole_ring_at_start_up():
    """--kv-cache-dtype as each stage resolved it (ModelInfo.kv_cache_dtype): a ring stores
    alike, so one stage with an 8-bit cache beside bf16 ones is refused in one sentence."""
    ring = sim_ring(RingConfig(pp_size=3, ring_timeout_s=10))
    ring.model_for = lambda c: ModelInfo(4096, kv_cache_dtype="int8" if c.rank == 1 else "auto")
    codes, error = start_up_failure(ring)
    assert codes == {0: 1, 1: 1, 2: 1}
    assert error is not None and error.rank == 1
    assert "[pp1] kv_cache_dtype differs from stage 0's ('int8' vs 'auto')" in error.message


@pytest.mark.timeout(60)
def test_the_ring_is_ready_only_once_every_stage_has_allocated_and_they_allocate_at_once():
    """Stage 0 tells the frontend the ring is ready after the last stage's KV cache exists, so a
    first request never waits for a stage still allocating; the stages allocate in parallel."""
    allocating_s = {0: 0.05, 1: 0.6, 2: 0.6}  # stage 0 is done long before the others
    spans: dict[int, tuple[float, float]] = {}
    ring = sim_ring(RingConfig(pp_size=3, ring_timeout_s=10))
    make_sim = ring.make_stage

    def make(cfg: RingConfig):
        stage = make_sim(cfg)
        allocate = stage.allocate_kv

        def slow_allocate(num_blocks: int) -> None:
            started = time.monotonic()
            time.sleep(allocating_s[cfg.rank])  # touching a large cache's pages
            allocate(num_blocks)
            spans[cfg.rank] = (started, time.monotonic())

        stage.allocate_kv = slow_allocate
        return stage

    ring.make_stage = make
    with ring:
        deadline = time.monotonic() + 20
        while not any(isinstance(c, RingReady) for c in ring.driver.ctrl):
            assert time.monotonic() < deadline, "the ring never said it was ready"
            ring.driver.poll(0.01)
        ready_at = time.monotonic()
        assert ring.stop() == {0: 0, 1: 0, 2: 0}
    assert sorted(spans) == [0, 1, 2]
    assert ready_at >= max(end for _, end in spans.values())
    # At once, not in turn: stage 2 starts before stage 1 is done.
    assert spans[2][0] < spans[1][1]
