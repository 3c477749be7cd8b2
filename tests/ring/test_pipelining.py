"""Pipelining is real: a filled ring keeps every stage busy; fewer batches than stages leave
stages idle exactly as the seed's load condition says; async depth hides a slow last stage.

These run simulated stages that sleep (no CPU), so the figures hold on a 2-core machine; the
floors are generous and `python -m bench.ring` reports the exact numbers.

A loaded host only ever makes a sleeping stage late, never early: every figure here can only
come out low. So a check that misses is measured again (`first_met`, up to three times), and a
ring that does not pipeline still fails all three. Each ring hop costs about a millisecond of
Python and sockets on top of the stage's sleep; at T0_S = 20 ms that overhead alone took stage
0's busy fraction a tenth below its ideal (CI, Dec 2026), so stages sleep 40 ms.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from protocol.sampling import SamplingParams
from ring.config import RingConfig
from tests.ring.conftest import SimSpec, sim_ring

# Throughput ratios: make test runs them after the parallel part, with nothing else running.
pytestmark = pytest.mark.serial

T0_S = 0.040
MAX_NEW = 12
ATTEMPTS = 3

Figures = TypeVar("Figures")


def first_met(measure: Callable[[], Figures], met: Callable[[Figures], bool]) -> Figures:
    """The first of up to ATTEMPTS measurements that meets `met`, else the last one (for the
    caller's assert to print)."""
    for _ in range(ATTEMPTS - 1):
        figures = measure()
        if met(figures):
            return figures
    return measure()


def run_load(cfg: RingConfig, spec: SimSpec, num_requests: int) -> tuple[float, float]:
    """Output tokens/s, and stage 0's busy fraction, for `num_requests` short-prompt requests
    admitted at once."""
    requests = [
        (f"q{i}", [1 + i], SamplingParams(max_new_tokens=MAX_NEW, seed=i))
        for i in range(num_requests)
    ]
    with sim_ring(cfg, spec) as ring:
        start = time.monotonic()
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=60)
        elapsed = time.monotonic() - start
        busy_s = ring.loops[0].stats.busy_s
        ring.stop()
    return num_requests * MAX_NEW / elapsed, busy_s / elapsed


@functools.cache
def hop_factor() -> float:
    """t0 over what a stage's step of t0 takes in a ring of four, its hop to the next included:
    measured once, from one micro-batch going round (four steps a token, none overlapped). A
    busy fraction cannot exceed this, however well the ring overlaps. On this project's 2-vCPU
    VMs a hop has cost 1-5 ms, mostly the wake-up of a vCPU that had gone idle (a thread
    spinning beside the ring took 0.5-1 ms off it), and at T0_S = 40 ms that moved stage 0's
    busy fraction 9-17% below the ideal on one host and not on another. Held above 0.75: a ring
    whose hops cost a third of a step fails here whatever its overlap."""
    tps, _ = run_load(RingConfig(pp_size=4, max_running_requests=4, pp_max_micro_batch_size=4),
                      SimSpec(t0_s=T0_S), 4)  # fmt: skip
    stage_step_s = 4 / tps / 4  # 4 tokens a step of the ring; 4 stages a step
    factor = min(1.0, T0_S / stage_step_s)
    assert factor > 0.75, f"a stage's step of {T0_S * 1e3:.0f} ms took {stage_step_s * 1e3:.1f}"
    return factor


def ideal_busy(num_batches: int, num_stages: int) -> float:
    """Stage 0's busy fraction for M < S micro-batches of MAX_NEW steps each, ramp included:
    stage 0 runs M * MAX_NEW forwards of t0; the last batch starts (M - 1) t0 after the first
    and needs MAX_NEW round trips of S t0. The seed's M/S is the limit for long runs."""
    return num_batches * MAX_NEW / (MAX_NEW * num_stages + num_batches - 1)


@pytest.mark.timeout(120)
def test_a_filled_four_stage_ring_runs_every_stage_at_once():
    spec = SimSpec(t0_s=T0_S)
    per_slot = 4
    filled = RingConfig(pp_size=4, max_running_requests=16, pp_max_micro_batch_size=per_slot)
    one_batch = RingConfig(pp_size=4, max_running_requests=4, pp_max_micro_batch_size=per_slot)
    single = RingConfig(pp_size=1, max_running_requests=4, pp_max_micro_batch_size=per_slot)

    def measure() -> tuple[float, float, float, float]:
        filled_tps, filled_busy = run_load(filled, spec, 16)
        one_batch_tps, _ = run_load(one_batch, spec, 4)
        single_tps, _ = run_load(single, spec, 4)
        return filled_tps, filled_busy, one_batch_tps, single_tps

    def met(figures: tuple[float, float, float, float]) -> bool:
        filled_tps, filled_busy, one_batch_tps, single_tps = figures
        return (
            filled_tps >= 3.0 * one_batch_tps
            and filled_tps >= 0.8 * single_tps
            and filled_busy > busy_floor
        )

    # Stage 0 busy as the ramp and the hops allow (0.94 x hop_factor), within 15%: a ring that
    # did not overlap its batches would be busy a quarter of the time
    busy_floor = 0.85 * ideal_busy(4, 4) * hop_factor()
    filled_tps, filled_busy, one_batch_tps, single_tps = first_met(measure, met)
    # Four micro-batches in flight finish one per t0; one alone needs four t0 per step.
    assert filled_tps >= 3.0 * one_batch_tps
    # A filled ring of S stages of time t0 keeps pace with one stage of time t0 (ideally 1.0,
    # 0.93 measured here alone; the ramp of S - 1 t0 and the hops take the rest).
    assert filled_tps >= 0.8 * single_tps
    assert filled_busy > busy_floor


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_batches", [1, 2, 3])
def test_fewer_batches_than_stages_leave_stages_idle(num_batches):
    # The seed's load condition: with M < S micro-batches in flight a stage is busy about M/S of
    # the time, so the idle fraction is about 1 - M/S (ideal_busy adds the ramp). Within 12% of
    # it: the hops' overhead took 3-5% here alone and 9% with both cores spun by other
    # processes; a ring that did not overlap its batches would stay at 1/S for every M.
    # (ideal_busy of steps t0 long, made as long as this host's hops make them: hop_factor)
    cfg = RingConfig(pp_size=4, max_running_requests=4 * num_batches, pp_max_micro_batch_size=4)
    ideal = ideal_busy(num_batches, 4) * hop_factor()
    _, busy = first_met(
        lambda: run_load(cfg, SimSpec(t0_s=T0_S), 4 * num_batches),
        lambda figures: abs(figures[1] - ideal) < 0.12 * ideal,
    )
    assert abs(busy - ideal) < 0.12 * ideal


@pytest.mark.timeout(180)
def test_async_depth_hides_a_slow_last_stage():
    # The last stage samples T0_S / 2 after its forward: a step of 1.5 t0 at depth 0.
    spec = SimSpec(t0_s=T0_S, sample_delay_s=T0_S / 2)

    def rate(depth: int) -> float:
        cfg = RingConfig(
            pp_size=4,
            pp_async_batch_depth=depth,
            max_running_requests=4 * (4 + depth),
            pp_max_micro_batch_size=4,
        )
        return run_load(cfg, spec, 4 * (4 + depth))[0]

    # Hiding the straggler would take a step from 1.5 t0 to t0 (1.5x); depth 1 hiding nothing
    # would be 1.0x. Both rates are measured again on a miss: a late wake-up can cost either.
    hidden, exposed = first_met(lambda: (rate(1), rate(0)), lambda r: r[0] > 1.2 * r[1])
    assert hidden > 1.2 * exposed
