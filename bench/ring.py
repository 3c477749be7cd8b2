"""`ppring bench ring`: the real loop and transport, simulated stages that only take time.

    ppring bench ring [--t0-ms 5] [--steps 600] [--threads] [--quick] [--out DIR]

Measures, in one run, and writes `bench_ring.json` and `bench_ring.png` into `--out`:
- pipeline efficiency vs S (1, 2, 4, 8) and `pp_async_batch_depth` (0, 1, 2): micro-batches
  per second x t0, in the steady state of a filled ring (1.0 = one micro-batch leaves the ring
  every t0, the ideal); the end-to-end figure (fill and drain included) is kept beside it;
- throughput vs `pp_async_batch_depth` (0-3) at S=4 with a last stage whose tokens are ready
  10 ms after a 20 ms forward (the sampling straggler async depth hides);
- stage 0's idle fraction vs the number of micro-batches in flight, against the seed's load
  condition (idle = 1 - M/S when M < S).
Stages are processes over loopback TCP (the real thing) unless `--threads`; the idle table
always uses threads, because it reads stage 0's busy time from the loop itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.harness import RingDriver, ThreadRing
from ring.loop import ModelInfo
from ring.sim_stage import SimStage

PER_SLOT = 4  # requests per micro-batch
STEADY = (0.2, 0.8)  # the share of all tokens between which the steady state is timed
_ids = itertools.count()


def measure(
    pp_size: int,
    depth: int,
    num_batches: int,
    t0_s: float,
    steps: int,
    sample_delay_s: float = 0.0,
    processes: bool = True,
) -> dict[str, float]:
    """`num_batches` micro-batches of PER_SLOT decoding requests, for about `steps` steps."""
    cfg = RingConfig(
        pp_size=pp_size,
        pp_async_batch_depth=depth,
        max_running_requests=PER_SLOT * num_batches,
        pp_max_micro_batch_size=PER_SLOT,
    )
    # Each request decodes for `rounds` trips round the ring: about `steps` steps in all.
    rounds = max(steps // cfg.pp_loop_size, 4)
    requests = [
        (f"b{i}", [1], SamplingParams(max_new_tokens=rounds, seed=i))
        for i in range(PER_SLOT * num_batches)
    ]
    busy = None  # processes do not report it back
    if processes:
        from launch.procs import ProcessRing

        args = [
            "--stage-impl", "sim", "--sim-t0-ms", str(t0_s * 1000),
            "--sim-sample-delay-ms", str(sample_delay_s * 1000),
            "--pp-async-batch-depth", str(depth),
            "--max-running-requests", str(cfg.max_running_requests),
            "--pp-max-micro-batch-size", str(PER_SLOT),
        ]  # fmt: skip
        with ProcessRing(pp_size, args) as ring:
            ring.wait_ready(timeout_s=120)
            timing = _drive(ring.driver, requests)
            ring.shutdown()
    else:

        def make(c: RingConfig) -> SimStage:
            delay = sample_delay_s if c.is_last_stage else 0.0
            return SimStage(
                is_first_stage=c.is_first_stage,
                is_last_stage=c.is_last_stage,
                t0_s=t0_s,
                sample_delay_s=delay,
            )

        with ThreadRing(cfg, make, ModelInfo(context_length=1 << 20), f"b{next(_ids)}") as ring:
            timing = _drive(ring.driver, requests)
            busy = ring.loops[0].stats.busy_s
            ring.stop()
    tokens = len(requests) * rounds
    steady_rate = timing["steady_tokens"] / timing["steady_s"]
    return {
        "pp_size": pp_size,
        "depth": depth,
        "micro_batches": num_batches,
        "t0_ms": t0_s * 1000,
        "sample_delay_ms": sample_delay_s * 1000,
        "tokens": tokens,
        "tokens_per_s": round(steady_rate, 1),
        "efficiency": round(steady_rate / PER_SLOT * t0_s, 4),
        "end_to_end_efficiency": round(tokens / timing["elapsed_s"] / PER_SLOT * t0_s, 4),
        "idle_fraction": None if busy is None else round(1 - busy / timing["elapsed_s"], 4),
    }


def _drive(driver: RingDriver, requests: list) -> dict[str, float]:
    """Submit everything at once; time the whole run and its steady middle (STEADY)."""
    rids = [r[0] for r in requests]
    total = sum(r[2].max_new_tokens for r in requests)
    marks: dict[float, tuple[float, int]] = {}
    start = time.monotonic()
    driver.submit_many(requests)
    deadline = start + 600
    while len(driver.finished) < len(rids):
        if time.monotonic() > deadline:
            raise TimeoutError("the simulated ring did not finish within 600 s")
        driver.poll(0.05)
        if (error := driver.ring_error()) is not None:
            raise RuntimeError(f"the ring reported an error: {error.message}")
        got = sum(len(driver.tokens[rid]) for rid in rids)
        for share in STEADY:
            if share not in marks and got >= share * total:
                marks[share] = (time.monotonic(), got)
    elapsed = time.monotonic() - start
    (t_lo, n_lo), (t_hi, n_hi) = marks[STEADY[0]], marks[STEADY[1]]
    if t_hi - t_lo < 0.05 or n_hi <= n_lo:  # too short a run to see a steady state
        return {"elapsed_s": elapsed, "steady_s": elapsed, "steady_tokens": total}
    return {"elapsed_s": elapsed, "steady_s": t_hi - t_lo, "steady_tokens": n_hi - n_lo}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ppring bench ring", description=__doc__.split("\n\n")[0])
    parser.add_argument("--t0-ms", type=float, default=5.0, help="each stage's forward time")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 600)")
    parser.add_argument("--threads", action="store_true", help="stages as threads, not processes")
    parser.add_argument("--quick", action="store_true", help="fewer steps and points")
    parser.add_argument("--out", type=Path, default=Path("."), help="where JSON and PNG go")
    args = parser.parse_args(argv)
    if args.t0_ms <= 0:
        parser.error("--t0-ms must be positive")
    args.steps = args.steps or (200 if args.quick else 600)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = args.t0_ms / 1000
    processes = not args.threads
    where = "processes over loopback TCP" if processes else "threads over inproc://"
    started = time.monotonic()

    depths = (0, 1) if args.quick else (0, 1, 2)
    print(f"pipeline efficiency, filled ring, t0 = {args.t0_ms:g} ms, {PER_SLOT} requests per")
    print(f"micro-batch, stages as {where} (steady state; end to end in brackets)")
    print(f"{'S':>3}" + "".join(f"{f'depth {d}':>18}" for d in depths))
    efficiency = []
    for pp_size in (1, 2, 4, 8):
        row = [
            measure(pp_size, d, pp_size + d, t0, args.steps, processes=processes) for d in depths
        ]
        efficiency += row
        cells = "".join(f"{r['efficiency']:>10.3f} ({r['end_to_end_efficiency']:.3f})" for r in row)
        print(f"{pp_size:>3}{cells}", flush=True)

    slow_t0, delay = 0.020, 0.010
    print(f"\nslow last stage: S=4, t0 = 20 ms, tokens ready {delay * 1000:g} ms after the forward")
    print(f"{'depth':>6}{'tokens/s':>11}{'vs depth 0':>12}")
    by_depth = []
    for depth in (0, 1, 2, 3):
        r = measure(4, depth, 4 + depth, slow_t0, args.steps // 3, delay, processes=processes)
        by_depth.append(r)
        base = by_depth[0]["tokens_per_s"]
        print(f"{depth:>6}{r['tokens_per_s']:>11.0f}{r['tokens_per_s'] / base:>11.2f}x", flush=True)

    print(f"\nstage 0 idle fraction, S=4, t0 = {args.t0_ms:g} ms, threads (seed: 1 - M/S, M < S)")
    print(f"{'M':>3}{'measured':>10}{'seed':>8}")
    idle = []
    for num_batches in (1, 2, 3, 4):
        r = measure(4, 0, num_batches, t0, args.steps, processes=False)
        r["seed_idle_fraction"] = max(1 - num_batches / 4, 0.0)
        idle.append(r)
        print(f"{num_batches:>3}{r['idle_fraction']:>10.3f}{r['seed_idle_fraction']:>8.3f}")

    result = {
        "bench": "ring",
        "command": "ppring bench ring " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "stages_as": where,
        "t0_ms": args.t0_ms,
        "requests_per_micro_batch": PER_SLOT,
        "efficiency": efficiency,
        "async_depth": by_depth,
        "idle": idle,
        "wall_s": round(time.monotonic() - started, 1),
    }
    json_path, png_path = args.out / "bench_ring.json", args.out / "bench_ring.png"
    json_path.write_text(json.dumps(result, indent=1, allow_nan=False))
    plot(result, png_path)
    print(f"\nwrote {json_path} and {png_path} ({result['wall_s']:.0f} s)")
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eff, ax_depth, ax_idle) = plt.subplots(1, 3, figsize=(15, 4.2))
    depths = sorted({r["depth"] for r in result["efficiency"]})
    for depth in depths:
        rows = [r for r in result["efficiency"] if r["depth"] == depth]
        ax_eff.plot(
            [r["pp_size"] for r in rows], [r["efficiency"] for r in rows], "o-",
            label=f"depth {depth}",
        )  # fmt: skip
    ax_eff.axhline(1.0, color="gray", linestyle=":")
    ax_eff.set_xscale("log", base=2)
    ax_eff.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax_eff.set_ylim(0, 1.05)
    ax_eff.set_xlabel("stages S")
    ax_eff.set_ylabel("pipeline efficiency")
    ax_eff.set_title(f"filled ring, t0 = {result['t0_ms']:g} ms, {result['stages_as']}", fontsize=9)
    ax_eff.legend()

    rows = result["async_depth"]
    ax_depth.bar([str(r["depth"]) for r in rows], [r["tokens_per_s"] for r in rows])
    ax_depth.set_xlabel("pp_async_batch_depth")
    ax_depth.set_ylabel("tokens/s")
    ax_depth.set_title("S=4, t0 = 20 ms, tokens ready 10 ms late", fontsize=9)

    rows = result["idle"]
    ms = [r["micro_batches"] for r in rows]
    ax_idle.plot(ms, [r["idle_fraction"] for r in rows], "o-", label="measured")
    ax_idle.plot(ms, [r["seed_idle_fraction"] for r in rows], "s--", label="seed: 1 - M/S")
    ax_idle.set_xticks(ms)
    ax_idle.set_ylim(0, 1)
    ax_idle.set_xlabel("micro-batches in flight M (S=4)")
    ax_idle.set_ylabel("stage 0 idle fraction")
    ax_idle.legend()
    for ax in (ax_eff, ax_depth, ax_idle):
        ax.grid(alpha=0.3)
    fig.suptitle("ppring bench ring: the real loop and transport, simulated stages")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
