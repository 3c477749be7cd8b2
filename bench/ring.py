"""Ring simulation benchmark: the real loop and transport, simulated stages that sleep.

    python -m bench.ring [--t0-ms 5] [--steps 400] [--processes]

Prints, from one run:
- pipeline efficiency vs S: measured micro-batches per second x t0 (1.0 = one micro-batch
  leaves the ring every t0, the ideal of a filled pipeline);
- throughput vs pp_async_batch_depth with a last stage that is slow to hand over its tokens;
- stage 0's idle fraction vs the number of micro-batches in flight, against the seed's load
  condition (idle = 1 - M/S when M < S).
"""

from __future__ import annotations

import argparse
import itertools
import time

from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.local import ThreadRing
from ring.loop import ModelInfo
from ring.sim_stage import SimStage

PER_SLOT = 4
_ids = itertools.count()


def measure(
    pp_size: int,
    depth: int,
    num_batches: int,
    t0_s: float,
    steps: int,
    sample_delay_s: float = 0.0,
) -> dict[str, float]:
    """Run `num_batches` micro-batches of PER_SLOT decoding requests for about `steps` steps."""
    cfg = RingConfig(
        pp_size=pp_size,
        pp_async_batch_depth=depth,
        max_running_requests=PER_SLOT * num_batches,
        pp_max_micro_batch_size=PER_SLOT,
    )

    def make(c: RingConfig) -> SimStage:
        return SimStage(
            is_first_stage=c.is_first_stage,
            is_last_stage=c.is_last_stage,
            t0_s=t0_s,
            sample_delay_s=sample_delay_s if c.is_last_stage else 0.0,
        )

    # Each request decodes for `rounds` of the ring: about `steps` steps in all.
    rounds = max(steps // cfg.pp_loop_size, 2)
    requests = [
        (f"b{i}", [1], SamplingParams(max_new_tokens=rounds, seed=i))
        for i in range(PER_SLOT * num_batches)
    ]
    if PROCESSES:
        elapsed, busy = _run_processes(cfg, t0_s, sample_delay_s, requests)
    else:
        with ThreadRing(cfg, make, ModelInfo(context_length=1 << 20), f"b{next(_ids)}") as ring:
            start = time.monotonic()
            ring.driver.submit_many(requests)
            ring.driver.wait_finished([r[0] for r in requests], timeout_s=600)
            elapsed = time.monotonic() - start
            busy = ring.loops[0].stats.busy_s
            ring.stop()
    tokens = len(requests) * rounds
    batches_per_s = tokens / PER_SLOT / elapsed
    return {
        "tokens_per_s": tokens / elapsed,
        "efficiency": batches_per_s * t0_s,
        "idle_fraction": 1 - busy / elapsed,
    }


def _run_processes(cfg: RingConfig, t0_s: float, delay_s: float, requests) -> tuple[float, float]:
    """The same load on S stage processes over loopback TCP. Busy time is not reported back
    from the processes; the idle table is measured with threads."""
    from launch.procs import ProcessRing

    args = [
        "--stage-impl", "sim", "--sim-t0-ms", str(t0_s * 1000),
        "--sim-sample-delay-ms", str(delay_s * 1000),
        "--pp-async-batch-depth", str(cfg.pp_async_batch_depth),
        "--max-running-requests", str(cfg.max_running_requests),
        "--pp-max-micro-batch-size", str(cfg.pp_max_micro_batch_size),
    ]  # fmt: skip
    with ProcessRing(cfg.pp_size, args) as ring:
        ring.wait_ready(timeout_s=120)
        start = time.monotonic()
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=600)
        elapsed = time.monotonic() - start
        ring.shutdown()
    return elapsed, float("nan")


PROCESSES = False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="ring simulation benchmark")
    parser.add_argument("--t0-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument(
        "--processes", action="store_true", help="stages as processes over loopback TCP"
    )
    args = parser.parse_args(argv)
    global PROCESSES
    PROCESSES = args.processes
    t0 = args.t0_ms / 1000

    print(f"pipeline efficiency, filled ring, t0 = {args.t0_ms:g} ms, {PER_SLOT} requests/batch")
    print(f"{'S':>3}{'depth':>7}{'tokens/s':>11}{'efficiency':>12}")
    for pp_size in (1, 2, 4, 8):
        for depth in (0, 1):
            r = measure(pp_size, depth, pp_size + depth, t0, args.steps)
            print(f"{pp_size:>3}{depth:>7}{r['tokens_per_s']:>11.0f}{r['efficiency']:>12.3f}")

    slow_t0, delay = 0.020, 0.010
    print(f"\nslow last stage: S=4, t0 = 20 ms, tokens ready {delay * 1000:g} ms after the forward")
    print(f"{'depth':>6}{'tokens/s':>11}{'vs depth 0':>12}")
    base = None
    for depth in (0, 1, 2, 3):
        r = measure(4, depth, 4 + depth, slow_t0, args.steps // 4, sample_delay_s=delay)
        base = base or r["tokens_per_s"]
        print(f"{depth:>6}{r['tokens_per_s']:>11.0f}{r['tokens_per_s'] / base:>11.2f}x")

    if PROCESSES:
        return
    print(f"\nidle fraction of stage 0, S=4, t0 = {args.t0_ms:g} ms (seed: 1 - M/S when M < S)")
    print(f"{'M':>3}{'measured':>10}{'seed':>8}")
    for num_batches in (1, 2, 3, 4):
        r = measure(4, 0, num_batches, t0, args.steps)
        print(f"{num_batches:>3}{r['idle_fraction']:>10.3f}{max(1 - num_batches / 4, 0):>8.3f}")


if __name__ == "__main__":
    main()
