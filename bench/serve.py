"""`ppring bench serve`: the serving sweep, every layout and the baseline side by side in one run.

    ppring bench serve [--quick] [--workload mixed|equal|multiturn] [--pp-sizes 1,2]
                       [--concurrency 32] [--hf-dtypes float32,bfloat16] [--hf-compile] [--out DIR]

Two seeded workloads (bench/workload.py): `mixed` (prompts of 16-512 tokens, 16-128 new
tokens each) and `equal` (prompts of 8-120 tokens, every request 64 new tokens: equal work,
where a static batch wastes nothing on finished requests, the comparison that flatters ppring
least). For each layout it starts a local ring itself (`ppring local`, stages sharing this
machine's cores: PP=1 gets every thread, PP=2 half each), warms it up untimed (its first
requests, a few new tokens each, at the highest concurrency), then sends the same workload as
- a closed loop of `--concurrency` requests in flight (saturation: as soon as one finishes the
  next is sent); a list such as `--concurrency 1,16,64` runs one closed loop per level, each
  on the workload's first max(2C, a few) requests, and
- Poisson arrivals at a sweep of rates from light load to past saturation (the rates are
  fractions of the first layout's closed-loop capacity at the highest concurrency, so every
  layout sees the same rates); `--no-sweep` skips them.
It records per request TTFT, TPOT and end-to-end latency as the client sees them, and per run
the output tokens/s. Then the same prompts go through Hugging Face `generate` on static batches
of each concurrency, once per `--hf-dtypes` (bench/hf_baseline.py), and with `--hf-compile`
once more per dtype with a static KV cache and `torch.compile` (layouts "... compiled"). It writes
`bench_serve.json` and `bench_serve.png` (TPOT p50/p99 and output tokens/s, vs rate and, for
several concurrencies, vs concurrency) into `--out`, and prints a table.

`--repeats N` (closed loops only, `--no-sweep`) keeps every ring up and every baseline loaded at
once and measures all of them N times in alternated rounds, every other one in reverse order
(`round_order`): on a shared host one run moved 30%, so a comparison is claimed from the median
round of each point and the median of the per-round ratios (PP=2 / PP=1, each layout / the
first baseline), all rounds kept in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.clients import NativeBackend, OpenAIBackend
from bench.workload import Workload, make_workload
from stages.config import KV_CACHE_DTYPES

FULL_RATE_FRACTIONS = (0.15, 0.4, 0.7, 1.0)
QUICK_RATE_FRACTIONS = (0.15, 0.75)
# (requests, prompt tokens, output tokens, seconds of arrivals per rate, requests per rate >=)
FULL = (64, "16,512", "16,128", 40.0, 6)
QUICK = (32, "16,256", "8,48", 15.0, 4)
# --workload equal: every request the same work, prompts of 8-120 tokens, 64 new tokens each.
# A static batch then wastes nothing on requests that are done, so this is the comparison
# that flatters ppring least (HF generate still pads prompts to the batch's longest).
EQUAL = ("8,120", "64,64")
READY_TIMEOUT_S = 600.0
WARMUP_TOKENS = 8  # new tokens per request of a server's untimed warm-up pass


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ppring bench serve", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--pp-sizes", default="1,2", help="layouts to compare, e.g. 1,2,4")
    parser.add_argument(
        "--concurrency", default="32", help="closed-loop requests in flight; a list: 1,16,64"
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests in the workload; each closed loop runs all of them (default: 64, quick "
        "32, or twice the highest --concurrency if more; then a closed loop of C runs the first "
        "max(2C, a few))",
    )
    parser.add_argument(
        "--rates", default=None, help="requests/s to sweep, e.g. 0.5,1,2 (default: fractions "
        "of the first layout's closed-loop capacity)",
    )  # fmt: skip
    parser.add_argument(
        "--point-seconds", type=float, default=None,
        help="how long each rate's arrivals last, at most (default 40, quick 15)",
    )  # fmt: skip
    parser.add_argument(
        "--workload",
        choices=("mixed", "equal", "multiturn"),
        default="mixed",
        help="mixed: prompts 16-512, outputs 16-128 tokens; equal: prompts 8-120, every output "
        "64 tokens (equal work per request); multiturn: chats behind a shared system prompt, "
        "with and without the prefix cache (bench/multiturn.py)",
    )
    parser.add_argument("--chats", type=int, default=8, help="multiturn: chats at once")
    parser.add_argument("--turns", type=int, default=6, help="multiturn: turns per chat")
    parser.add_argument(
        "--system-words", type=int, default=700, help="multiturn: the shared system prompt"
    )
    parser.add_argument("--turn-tokens", type=int, default=24, help="multiturn: tokens a turn")
    parser.add_argument(
        "--schedule-policies", default="fcfs", help="multiturn: a ring with the cache per "
        "admission policy, e.g. fcfs,lpm (ppring local --schedule-policy)",
    )  # fmt: skip
    parser.add_argument("--prompt-tokens", default=None, help="MIN,MAX, log-uniform (16,512)")
    parser.add_argument("--output-tokens", default=None, help="MIN,MAX, uniform (16,128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores to use")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--quantization", choices=("none", "int8"), default="none")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="what each stage's KV cache stores (ppring local's); several, e.g. auto,int8: a "
        "ring of each per layout, named 'PP=1 KV int8' (with --repeats, alternated)",
    )
    parser.add_argument(
        "--pp-async-batch-depth", type=int, default=None, help="the rings' (ppring local's default)"
    )
    parser.add_argument(
        "--pp-max-micro-batch-size",
        type=int,
        default=None,
        help="the rings' (default: C over the slots, rounded up)",
    )
    parser.add_argument(
        "--chunked-prefill-size", type=int, default=None, help="the rings' (ppring local's default)"
    )
    parser.add_argument(
        "--split-lm-head",
        choices=("auto", "on", "off"),
        default=None,
        help="the rings' (ppring local's default: auto)",
    )
    parser.add_argument(
        "--hf-dtypes",
        default="float32",
        help="HF generate baselines, e.g. float32,bfloat16 (float32: what a user gets by default)",
    )
    parser.add_argument(
        "--hf-compile", action="store_true", help="also each HF generate baseline with a static "
        "KV cache and torch.compile (warmed up untimed first), as \"HF generate ... compiled\"",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--disable-cuda-graph", action="store_true", help="CUDA rings: every step eagerly"
    )
    parser.add_argument(
        "--backend", default=None, help="how requests are sent: ppring (its ZeroMQ client; "
        "the default), openai (its OpenAI HTTP API), or both: ppring,openai (alternated)",
    )  # fmt: skip
    parser.add_argument(
        "--base-url", default=None, help="an OpenAI-compatible server to bench instead of "
        "ppring's rings, e.g. http://127.0.0.1:8000/v1 (implies --backend openai)",
    )  # fmt: skip
    parser.add_argument(
        "--served-model", default=None, help="with --base-url (default: the first of /v1/models)"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="with --base-url: sent as "
        "`Authorization: Bearer KEY` (default: $OPENAI_API_KEY, as OpenAI's clients read it)",
    )  # fmt: skip
    parser.add_argument(
        "--trace-steps", type=Path, default=None, help="each ring's stages write one JSON line "
        "per step under DIR/pp<N> (ppring local --trace-steps)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-memory-gib", type=float, default=None, help="KV budget per stage (ppring local's)"
    )
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="rings without the prefix cache (ppring local's): the warm-up and every --repeats "
        "round send the same prompts, which a cache would serve from its blocks",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the rings' logs here")
    parser.add_argument("--no-baseline", action="store_true", help="skip HF generate")
    parser.add_argument("--no-sweep", action="store_true", help="closed loops only, no rates")
    parser.add_argument(
        "--repeats", type=int, default=1, help="closed loops only (with --no-sweep): every ring "
        "and baseline up at once, each point measured this many times in alternated rounds; "
        "the median round is reported, every round's tok/s kept in the JSON",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a small sweep: under 5 minutes")
    parser.add_argument("--out", type=Path, default=Path("."), help="where JSON and PNG go")
    args = parser.parse_args(argv)
    num, prompt, output, seconds, args.min_point_requests = QUICK if args.quick else FULL
    if args.workload == "equal":
        prompt, output = EQUAL
    # Asked for: every closed loop runs exactly that many (a user comparing engines sets it).
    args.closed_requests = args.num_requests
    args.num_requests = num if args.num_requests is None else args.num_requests
    args.prompt_tokens = args.prompt_tokens or prompt
    args.output_tokens = args.output_tokens or output
    args.point_seconds = seconds if args.point_seconds is None else args.point_seconds
    try:
        args.pp_sizes = [int(x) for x in args.pp_sizes.split(",")]
        args.concurrencies = sorted(int(x) for x in args.concurrency.split(","))
        args.rates = [float(x) for x in args.rates.split(",")] if args.rates else None
        args.prompt_tokens = tuple(int(x) for x in args.prompt_tokens.split(","))
        args.hf_dtypes = [x.strip() for x in args.hf_dtypes.split(",") if x.strip()]
        args.kv_cache_dtypes = [x.strip() for x in args.kv_cache_dtype.split(",") if x.strip()]
        args.output_tokens = tuple(int(x) for x in args.output_tokens.split(","))
    except ValueError:
        parser.error(
            "--pp-sizes, --concurrency, --rates and the token ranges take comma-separated numbers"
        )
    if len(args.prompt_tokens) != 2 or len(args.output_tokens) != 2:
        parser.error("--prompt-tokens and --output-tokens take MIN,MAX")
    if any(s < 1 for s in args.pp_sizes) or (args.rates and any(r <= 0 for r in args.rates)):
        parser.error("--pp-sizes must be >= 1 and --rates > 0")
    if min(*args.concurrencies, args.num_requests, args.threads) < 1 or args.point_seconds <= 0:
        parser.error("--concurrency, --num-requests, --threads and --point-seconds must be > 0")
    if args.closed_requests is None:
        # Room for every closed loop's requests: with only C of them a loop of C never refills a
        # place, and measures one static batch's ramp and tail, not C in flight. The workload's
        # first requests do not change with its size (one seeded stream).
        args.num_requests = max(
            args.num_requests,
            *(closed_loop_requests(c, args.min_point_requests) for c in args.concurrencies),
        )
    if args.kv_memory_gib is not None and args.kv_memory_gib <= 0:
        parser.error("--kv-memory-gib must be > 0")
    if (
        len(set(args.pp_sizes)) != len(args.pp_sizes)
        or (args.rates and len(set(args.rates)) != len(args.rates))
        or len(set(args.concurrencies)) != len(args.concurrencies)
    ):
        parser.error("name each layout in --pp-sizes, each --concurrency and each rate once")
    if any(d not in ("float32", "bfloat16") for d in args.hf_dtypes):
        parser.error("--hf-dtypes takes float32 and/or bfloat16")
    default = "openai" if args.base_url else "ppring"
    args.backends = [x.strip() for x in (args.backend or default).split(",") if x.strip()]
    if not args.backends or any(b not in ("ppring", "openai") for b in args.backends):
        parser.error("--backend takes ppring, openai, or ppring,openai")
    if args.base_url and args.backends != ["openai"]:
        parser.error("--base-url benches an OpenAI server: --backend openai only")
    if args.no_sweep and args.rates:
        parser.error("--no-sweep and --rates contradict each other; pick one")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if not args.kv_cache_dtypes or any(k not in KV_CACHE_DTYPES for k in args.kv_cache_dtypes):
        parser.error(f"--kv-cache-dtype takes some of {', '.join(KV_CACHE_DTYPES)}")
    args.schedule_policies = [x.strip() for x in args.schedule_policies.split(",") if x.strip()]
    if not args.schedule_policies or any(p not in ("fcfs", "lpm") for p in args.schedule_policies):
        parser.error("--schedule-policies takes fcfs, lpm, or fcfs,lpm")
    if min(args.chats, args.turns, args.system_words, args.turn_tokens) < 1:
        parser.error("--chats, --turns, --system-words and --turn-tokens must be >= 1")
    if args.repeats > 1 and args.workload != "multiturn" and (not args.no_sweep or args.base_url):
        parser.error("--repeats alternates ppring's own rings' closed loops: add --no-sweep, "
                     "and leave out --base-url")  # fmt: skip
    args.concurrency = args.concurrencies[-1]  # the ring's capacity; saturation is measured here
    return args


# -- one ring ------------------------------------------------------------------------------------


@contextmanager
def local_ring(
    args: argparse.Namespace,
    model_dir: Path,
    pp_size: int,
    log_dir: Path,
    tag: str | None = None,
    extra: list[str] | None = None,
    kv_cache_dtype: str | None = None,
):
    """`ppring local` for one layout; yields the frontend's address and, when a backend wants
    it, its OpenAI API's URL (else None). Stopped by PID. `tag`: its log folder (default
    pp<N>); `extra`: more `ppring local` flags; `kv_cache_dtype`: its --kv-cache-dtype (default:
    the first asked)."""
    tag = tag or f"pp{pp_size}"
    kv_cache_dtype = kv_cache_dtype or args.kv_cache_dtypes[0]
    from launch.procs import ROOT, ProcessGroup, find_free_base_port, wait_for_ready_line

    port = find_free_base_port(16)
    http_port = port + 15 if "openai" in args.backends else 0  # the ring takes the first few
    threads = max(1, args.threads // pp_size)
    cmd = [
        sys.executable, "-m", "launch", "local", "--model", str(model_dir),
        "--http-port", str(http_port),
        "--pp-size", str(pp_size),
        "--max-running-requests", str(args.concurrency), "--port", str(port),
        "--dtype", args.dtype, "--device", args.device,
        "--quantization", args.quantization, "--kv-cache-dtype", kv_cache_dtype,
        "--log-dir", str(log_dir / tag), *(extra or []),
    ]  # fmt: skip
    if args.device == "cpu":  # a GPU stage takes its own default (launch.flags.stage_threads)
        cmd += ["--threads-per-stage", str(threads)]
    if args.disable_cuda_graph:
        cmd += ["--disable-cuda-graph"]
    if args.pp_async_batch_depth is not None:
        cmd += ["--pp-async-batch-depth", str(args.pp_async_batch_depth)]
    if args.pp_max_micro_batch_size is not None:
        cmd += ["--pp-max-micro-batch-size", str(args.pp_max_micro_batch_size)]
    if args.chunked_prefill_size is not None:
        cmd += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    if args.split_lm_head is not None:
        cmd += ["--split-lm-head", args.split_lm_head]
    if args.kv_memory_gib is not None:
        cmd += ["--kv-memory-gib", str(args.kv_memory_gib)]
    if args.disable_radix_cache and "--disable-radix-cache" not in (extra or []):
        cmd += ["--disable-radix-cache"]
    if args.trace_steps is not None:
        cmd += ["--trace-steps", str(args.trace_steps / tag)]
    (log_dir / tag).mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        addr = wait_for_ready_line(server, READY_TIMEOUT_S)
        yield addr, f"http://127.0.0.1:{http_port}/v1" if http_port else None
    finally:
        ProcessGroup([server]).stop(grace_s=60)  # SIGTERM: a graceful ring shutdown


# -- one point of the sweep ----------------------------------------------------------------------


@dataclass
class Point:
    layout: str
    rate: float | None  # requests/s; None: closed loop
    concurrency: int | None
    records: list[dict[str, float]]
    elapsed_s: float
    rounds_tps: list[float] | None = None  # with --repeats: every round's tok/s, in order

    @property
    def tokens_per_s(self) -> float:
        return sum(r["output_tokens"] for r in self.records) / self.elapsed_s

    def summary(self) -> dict[str, Any]:
        tokens = sum(r["output_tokens"] for r in self.records)
        out: dict[str, Any] = {
            "layout": self.layout,
            "rate_rps": self.rate,
            "closed_loop_concurrency": self.concurrency,
            "num_requests": len(self.records),
            "output_tokens": tokens,
            "elapsed_s": round(self.elapsed_s, 3),
            "output_tokens_per_s": round(self.tokens_per_s, 2),
        }
        if self.rounds_tps is not None:
            out["output_tokens_per_s_rounds"] = [round(x, 2) for x in self.rounds_tps]
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            values = sorted(r[key] for r in self.records if r[key] is not None)
            for pct in (50, 99):
                value = _percentile(values, pct)
                out[f"{key[:-2]}_p{pct}_ms"] = None if value is None else round(1000 * value, 2)
        return out


def _percentile(sorted_values: list[float], pct: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(pct / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


async def run_point(
    backend: NativeBackend | OpenAIBackend,
    workload: Workload,
    layout: str,
    rate: float | None,
    concurrency: int,
    seed: int,
    progress,
) -> Point:
    """Closed loop (`rate` None): `concurrency` requests in flight until all are done.
    Otherwise Poisson arrivals at `rate` requests/s, seeded."""
    records: list[dict[str, float]] = []

    async def one(request) -> None:
        records.append(await client.request(request, progress))

    async with backend as client:
        start = time.perf_counter()
        if rate is None:
            queue = list(workload.requests)

            async def worker() -> None:
                while queue:
                    await one(queue.pop(0))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(seed)
            tasks = []
            for request in workload.requests:
                tasks.append(asyncio.create_task(one(request)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return Point(layout, rate, concurrency if rate is None else None, records, elapsed)


# -- the whole bench -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model_dir = _resolve_model(args.model)
    from stages.config import ModelConfig

    if args.workload == "multiturn":
        from bench.multiturn import run

        return run(args, argv, model_dir)
    config = ModelConfig.from_path(model_dir)
    try:
        workload = make_workload(
            args.num_requests,
            args.seed,
            vocab_size=config.vocab_size,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
        )
    except ValueError as exc:
        raise SystemExit(f"ppring bench serve: {exc}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    shape = workload.describe()
    print(f"ppring bench serve: {model_dir.name}, {args.dtype} ("
          f"{_resolved_dtype(args, model_dir)}) on {args.device}, "
          f"{args.threads} threads; {len(workload.requests)} requests "
          f"({shape['prompt_tokens_min']}-{shape['prompt_tokens_max']} prompt tokens, "
          f"{shape['output_tokens_min']}-{shape['output_tokens_max']} output tokens)",
          flush=True)  # fmt: skip

    points: list[Point] = []
    baselines: list[Point] = []
    if args.repeats > 1:
        with _log_dir(args.log_dir) as logs:
            _alternated(args, argv, model_dir, workload, logs, points, baselines, started)
        write_results(args, argv, model_dir, workload, points, baselines, started)
        return 0
    with _log_dir(args.log_dir) as logs:
        if args.base_url:  # someone else's server: no ring of ours
            target = Target(
                f"openai {args.base_url}", None, args.base_url, args.served_model, args.api_key
            )
            _sweep(args, [target], workload, points)
        for pp_size, kv in [] if args.base_url else ring_layouts(args):
            ring = local_ring(args, model_dir, pp_size, logs, *ring_names(args, pp_size, kv))
            with ring as (addr, http_url):
                _sweep(args, _targets(args, pp_size, addr, http_url, kv), workload, points)
            # Written after every layout and baseline: a later failure loses nothing measured.
            write_results(args, argv, model_dir, workload, points, baselines, started, quiet=True)
    for name, hf_dtype, compiled in hf_baselines(args):
        from bench.hf_baseline import HFGenerate

        hf = HFGenerate(model_dir, args.threads, hf_dtype, args.device, compiled=compiled)
        for concurrency in args.concurrencies:
            sub = _closed_subset(
                workload, concurrency, args.min_point_requests, args.closed_requests
            )
            baselines.append(_measure_hf(name, hf, sub, concurrency))
            write_results(args, argv, model_dir, workload, points, baselines, started, quiet=True)
        del hf
    write_results(args, argv, model_dir, workload, points, baselines, started)
    return 0


def _measure_hf(name: str, hf, workload: Workload, concurrency: int) -> Point:
    """One closed-loop point of an HF generate baseline (static batches of `concurrency`)."""
    with _progress(workload, f"{name} C={concurrency}") as bar:
        run = hf.run(workload, concurrency, on_tokens=bar.update)
    point = Point(name, None, concurrency, run["records"], run["elapsed_s"])
    print(f"  {name} (static batches of {concurrency}): {point.tokens_per_s:.1f} tok/s",
          flush=True)  # fmt: skip
    return point


def _alternated(
    args: argparse.Namespace,
    argv: list[str] | None,
    model_dir: Path,
    workload: Workload,
    logs: Path,
    points: list[Point],
    baselines: list[Point],
    started: float,
) -> None:
    """--repeats: every layout's ring up (and warmed up) and every baseline loaded at once, then
    `repeats` rounds, each measuring every closed-loop point of every server in the same order,
    so a slow minute of a shared host falls on one round of each, not on one layout. Each
    point's median round (by tok/s) goes into `points` / `baselines`, with all rounds' tok/s."""
    from bench.hf_baseline import HFGenerate

    rounds: dict[tuple[str, int], list[Point]] = {}
    with ExitStack() as rings:
        targets: list[Target] = []
        for pp_size, kv in ring_layouts(args):
            addr, http_url = rings.enter_context(
                local_ring(args, model_dir, pp_size, logs, *ring_names(args, pp_size, kv))
            )
            targets += _targets(args, pp_size, addr, http_url, kv)
        for target in targets:
            _warm_up(target, workload, max(args.concurrencies), args.seed)
        hfs = [
            (name, HFGenerate(model_dir, args.threads, hf_dtype, args.device, compiled=compiled))
            for name, hf_dtype, compiled in hf_baselines(args)
        ]
        servers = [*targets, *hfs]
        for n in range(args.repeats):
            print(f" round {n + 1} of {args.repeats}", flush=True)
            for concurrency, server in round_order(n, args.concurrencies, servers):
                sub = _closed_subset(
                    workload, concurrency, args.min_point_requests, args.closed_requests
                )
                if isinstance(server, Target):
                    point = _measure(server, sub, None, concurrency, args.seed)
                else:
                    point = _measure_hf(*server, sub, concurrency)
                rounds.setdefault((point.layout, concurrency), []).append(point)
            points[:], baselines[:] = _medians(rounds, {t.layout for t in targets})
            write_results(args, argv, model_dir, workload, points, baselines, started, quiet=True)


def round_order(n: int, concurrencies: list[int], servers: list[Any]) -> list[tuple[int, Any]]:
    """Round `n`'s points in the order they are measured: every concurrency's servers (rings,
    then baselines) in the order given, and every odd round the same sequence backwards (A B,
    then B A). Each point then sits as often early in a round as late, next to the same
    neighbours on either side, so neither a drift of the host over a round nor the point run
    just before (`generate` loading the cores and caches in the bench's own process) favours
    one point of a comparison."""
    order = [(concurrency, server) for concurrency in concurrencies for server in servers]
    return order[::-1] if n % 2 else order


def _medians(
    rounds: dict[tuple[str, int], list[Point]], ring_layouts: set[str]
) -> tuple[list[Point], list[Point]]:
    """Each point's median round by tok/s, carrying every round's tok/s; split into the rings'
    points and the baselines'."""
    points, baselines = [], []
    order = list(dict.fromkeys(layout for layout, _ in rounds))  # as the table lists them
    for (layout, _), measured in sorted(rounds.items(), key=lambda kv: order.index(kv[0][0])):
        median = dataclasses.replace(
            _lower_median(measured, key=lambda p: p.tokens_per_s),
            rounds_tps=[p.tokens_per_s for p in measured],
        )
        (points if layout in ring_layouts else baselines).append(median)
    return points, baselines


def _lower_median(values, key=None):
    """The middle value, the lower of the two middles for an even count (one that was measured,
    not an average of two)."""
    ranked = sorted(values, key=key)
    return ranked[(len(ranked) - 1) // 2]


@dataclass
class Target:
    """Where one layout's requests go: ppring's ZeroMQ frontend, or an OpenAI HTTP API."""

    layout: str
    addr: str | None
    http_url: str | None  # ".../v1": requests go over HTTP
    model: str | None = None
    api_key: str | None = None  # --base-url's: someone else's server may want one

    def backend(self) -> NativeBackend | OpenAIBackend:
        if self.http_url is not None:
            return OpenAIBackend(self.http_url, self.model, self.api_key)
        return NativeBackend(self.addr)


def ring_layouts(args: argparse.Namespace) -> list[tuple[int, str]]:
    """Every ring to bench: each PP size with each --kv-cache-dtype."""
    return [(pp_size, kv) for pp_size in args.pp_sizes for kv in args.kv_cache_dtypes]


def ring_names(args: argparse.Namespace, pp_size: int, kv: str) -> tuple[str, None, str]:
    """local_ring's tag, extra flags and KV dtype for one ring: its log folder pp<N>, or
    pp<N>-kv-<dtype> where several KV dtypes are benched."""
    tag = f"pp{pp_size}" if len(args.kv_cache_dtypes) == 1 else f"pp{pp_size}-kv-{kv}"
    return tag, None, kv


def _targets(
    args: argparse.Namespace, pp_size: int, addr: str, http_url: str | None, kv: str = "auto"
) -> list[Target]:
    """One layout's ring as each --backend reaches it: its ZeroMQ client ("PP=2") or its
    OpenAI API ("PP=2 HTTP"); "PP=2 KV int8" where several KV dtypes are benched."""
    name = f"PP={pp_size}" if len(args.kv_cache_dtypes) == 1 else f"PP={pp_size} KV {kv}"
    return [
        Target(f"{name} HTTP", addr, http_url) if b == "openai" else Target(name, addr, None)
        for b in args.backends
    ]


def _sweep(
    args: argparse.Namespace, targets: list[Target], workload: Workload, points: list[Point]
) -> None:
    """Closed loops at each concurrency, then (unless --no-sweep) Poisson arrivals at each
    rate, for every target of one server, alternated point by point."""
    for target in targets:
        _warm_up(target, workload, max(args.concurrencies), args.seed)
    for concurrency in args.concurrencies:  # closed loops first: they set the rates
        sub = _closed_subset(workload, concurrency, args.min_point_requests, args.closed_requests)
        for target in targets:
            points.append(_measure(target, sub, None, concurrency, args.seed))
    if args.no_sweep:
        return
    if args.rates is None:  # the first layout's capacity at the highest concurrency
        capacity_rps = len(points[-len(targets)].records) / points[-len(targets)].elapsed_s
        fractions = QUICK_RATE_FRACTIONS if args.quick else FULL_RATE_FRACTIONS
        args.rates = [round(f * capacity_rps, 3) for f in fractions]
    for rate in args.rates:
        sub = _subset(workload, rate, args.point_seconds, args.min_point_requests)
        for target in targets:
            points.append(_measure(target, sub, rate, args.concurrency, args.seed))


def hf_layout(dtype: str, compiled: bool = False) -> str:
    """The baseline's name: plain "HF generate" for float32, what a user gets by default."""
    name = "HF generate" if dtype == "float32" else f"HF generate {dtype}"
    return name + " compiled" if compiled else name


def hf_baselines(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(layout, dtype, compiled) of each HF generate baseline, in the order they run: eager
    first (the first of them is the JSON's "baseline"), compiled last, as they take longest
    (compiling) and a run cut short then keeps the eager ones."""
    if args.no_baseline:
        return []
    runs = [(d, False) for d in args.hf_dtypes]
    runs += [(d, True) for d in args.hf_dtypes] if args.hf_compile else []
    return [(hf_layout(d, compiled), d, compiled) for d, compiled in runs]


def _warm_up(target: Target, workload: Workload, concurrency: int, seed: int) -> None:
    """Untimed, before a server's first point: its first `concurrency` requests, cut to
    WARMUP_TOKENS new tokens each, all at once, so the first timed point does not pay for a
    fresh server's first prefills and batch shapes (vLLM's and SGLang's bench_serving send a
    warm-up request first for the same reason; a pass at full width also touches the pages a
    full batch needs, which cost 1-6 s per GiB on these VMs)."""
    requests = [
        dataclasses.replace(r, max_new_tokens=min(r.max_new_tokens, WARMUP_TOKENS))
        for r in workload.requests[:concurrency]
    ]
    warm = Workload(workload.seed, requests)
    with _progress(warm, f"{target.layout} warm-up") as bar:
        asyncio.run(run_point(target.backend(), warm, target.layout, None, concurrency, seed, bar))


def _measure(
    target: Target, workload: Workload, rate: float | None, concurrency: int, seed: int
) -> Point:
    """One point of the sweep against a running server, with a progress bar; prints its line."""
    what = f"closed C={concurrency}" if rate is None else f"{rate:.2f} req/s"
    layout = target.layout
    with _progress(workload, f"{layout} {what}") as bar:
        backend = target.backend()
        point = asyncio.run(run_point(backend, workload, layout, rate, concurrency, seed, bar))
    s = point.summary()
    print(f"  {layout:>5} {what:>13}: {s['output_tokens_per_s']:7.1f} tok/s, "
          f"TPOT p50 {_ms(s['tpot_p50_ms'])}", flush=True)  # fmt: skip
    return point


def _progress(workload: Workload, desc: str):
    from tqdm import tqdm

    return tqdm(
        total=workload.num_output_tokens, desc=desc, unit="tok", leave=False, file=sys.stderr
    )


@contextmanager
def _log_dir(keep: Path | None):
    """The rings' logs: in `keep` if given (kept), else in a temporary folder."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="ppring-bench-") as tmp:
        yield Path(tmp)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def write_results(
    args: argparse.Namespace,
    argv: list[str] | None,
    model_dir: Path,
    workload: Workload,
    points: list[Point],
    baselines: list[Point],
    started: float,
    quiet: bool = False,
) -> None:
    """bench_serve.json and bench_serve.png into --out; the table on stdout unless quiet."""
    result = {
        "bench": "serve",
        "command": "ppring bench serve " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "model": str(model_dir),
        "dtype": args.dtype,
        "dtype_resolved": _resolved_dtype(args, model_dir),
        "quantization": args.quantization,
        "kv_cache_dtypes": args.kv_cache_dtypes,
        "disable_radix_cache": args.disable_radix_cache,
        "workload_kind": args.workload,
        "device": args.device,
        "threads": args.threads,
        "concurrency": args.concurrency,
        "concurrencies": args.concurrencies,
        "workload": workload.describe(),
        "points": [p.summary() for p in points],
        # The first baseline (float32, when asked) at the highest concurrency: the saturation
        # figures; and all of them.
        "baseline": _top_baseline(baselines, args.concurrency),
        "baselines": [b.summary() for b in baselines],
        "requests": {
            f"{p.layout} {'closed C=' + str(p.concurrency) if p.rate is None else p.rate}": (
                p.records
            )
            for p in [*points, *baselines]
        },
        "wall_s": round(time.monotonic() - started, 1),
    }
    result["headline"] = headline(result)
    json_path = args.out / "bench_serve.json"
    json_path.write_text(json.dumps(result, indent=1, allow_nan=False))
    png_path = args.out / "bench_serve.png"
    plot(result, png_path)
    if not quiet:
        print()
        print(table(result))
        print(f"\nwrote {json_path} and {png_path} ({result['wall_s']:.0f} s)")


def _top_baseline(baselines: list[Point], concurrency: int) -> dict[str, Any] | None:
    top = [b for b in baselines if b.concurrency == concurrency]
    return top[0].summary() if top else None


def _resolved_dtype(args: argparse.Namespace, model_dir: Path) -> str:
    """What `--dtype` means on this machine (auto resolved), for the JSON and the title."""
    if args.dtype != "auto":
        return args.dtype
    from stages.config import ModelConfig
    from stages.dtype import resolve_dtype

    return resolve_dtype("auto", args.device, ModelConfig.from_path(model_dir).torch_dtype).name


def _subset(workload: Workload, rate: float, point_seconds: float, min_requests: int) -> Workload:
    """At a low rate, the first requests only: a point's arrivals last `point_seconds` at most
    (but it keeps `min_requests`, so its percentiles mean something)."""
    n = min(len(workload.requests), max(min_requests, round(rate * point_seconds)))
    return Workload(workload.seed, workload.requests[:n])


def closed_loop_requests(concurrency: int, min_requests: int) -> int:
    """How many requests a closed loop of `concurrency` runs unless --num-requests says: twice
    its places, so each is refilled once, and at least `min_requests`."""
    return max(2 * concurrency, min_requests)


def _closed_subset(
    workload: Workload, concurrency: int, min_requests: int, asked: int | None = None
) -> Workload:
    """A closed loop runs `asked` requests when --num-requests said how many (all of the
    workload); otherwise the first max(2C, min_requests): enough that places are refilled,
    not so many that a low concurrency takes all day."""
    n = asked if asked is not None else closed_loop_requests(concurrency, min_requests)
    n = min(len(workload.requests), n)
    return Workload(workload.seed, workload.requests[:n])


def _resolve_model(model: str | None) -> Path:
    from launch.prepare_model import resolve_model

    return Path(resolve_model(model))


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the README quotes: saturation tokens/s (the closed loop at the highest
    concurrency) per layout and for HF generate, the ratios, TPOT p50 at the lightest load, and,
    for several concurrencies, tokens/s and TPOT p50 at each."""
    top = result["concurrency"]
    closed_all = [p for p in result["points"] if p["rate_rps"] is None]
    closed = {p["layout"]: p for p in closed_all if p["closed_loop_concurrency"] == top}
    out: dict[str, Any] = {
        "saturation_tokens_per_s": {k: p["output_tokens_per_s"] for k, p in closed.items()}
    }
    rated = [p for p in result["points"] if p["rate_rps"] is not None]
    if rated:
        light = min(p["rate_rps"] for p in rated)
        out["light_load_rate_rps"] = light
        out["light_load_tpot_p50_ms"] = {
            p["layout"]: p["tpot_p50_ms"] for p in rated if p["rate_rps"] == light
        }
    base = result["baseline"]
    if base:
        out["saturation_tokens_per_s"]["HF generate"] = base["output_tokens_per_s"]
        out["hf_generate_tpot_p50_ms"] = base["tpot_p50_ms"]
        out["vs_hf_generate"] = {
            k: round(p["output_tokens_per_s"] / base["output_tokens_per_s"], 2)
            for k, p in closed.items()
        }
    baselines_all = result.get("baselines") or []
    for b in baselines_all:
        if b["layout"] != "HF generate" and b["closed_loop_concurrency"] == top:
            out["saturation_tokens_per_s"][b["layout"]] = b["output_tokens_per_s"]
            out["vs_" + b["layout"].replace(" ", "_").lower()] = {
                k: round(p["output_tokens_per_s"] / b["output_tokens_per_s"], 2)
                for k, p in closed.items()
            }
    if len({p["closed_loop_concurrency"] for p in closed_all}) > 1 and baselines_all:
        ratios: dict[str, dict[str, float]] = {}
        for b in baselines_all:
            for p in closed_all:
                if p["closed_loop_concurrency"] == b["closed_loop_concurrency"]:
                    key = f"{p['layout']} / {b['layout']}"
                    ratios.setdefault(str(p["closed_loop_concurrency"]), {})[key] = round(
                        p["output_tokens_per_s"] / b["output_tokens_per_s"], 2
                    )
        out["closed_loop_vs_baselines"] = ratios
    if "PP=1" in closed and "PP=2" in closed:
        out["pp2_over_pp1"] = round(
            closed["PP=2"]["output_tokens_per_s"] / closed["PP=1"]["output_tokens_per_s"], 2
        )
    http = {  # the same ring through its OpenAI API against its ZeroMQ client
        k: round(p["output_tokens_per_s"] / closed[k[: -len(" HTTP")]]["output_tokens_per_s"], 2)
        for k, p in closed.items()
        if k.endswith(" HTTP") and k[: -len(" HTTP")] in closed
    }
    if http:
        out["http_over_native"] = http
    paired = _paired_ratios(closed_all, baselines_all)
    if paired:
        out["median_of_round_ratios"] = paired
    baselines = result.get("baselines") or ([base] if base else [])
    if len({p["closed_loop_concurrency"] for p in closed_all}) > 1:
        for key, field in (("tokens_per_s", "output_tokens_per_s"), ("tpot_p50_ms", "tpot_p50_ms")):
            by_concurrency: dict[str, dict[str, float]] = {}
            for p in [*closed_all, *baselines]:
                by_concurrency.setdefault(str(p["closed_loop_concurrency"]), {})[p["layout"]] = p[
                    field
                ]
            out[f"closed_loop_{key}"] = by_concurrency
    return out


def _paired_ratios(
    closed: list[dict[str, Any]], baselines: list[dict[str, Any]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """With --repeats: per concurrency, each layout over the first baseline and PP=2 over PP=1,
    round by round (a round measures both within minutes of each other) and their median."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for concurrency in sorted({p["closed_loop_concurrency"] for p in closed}):
        at = {
            p["layout"]: p["output_tokens_per_s_rounds"]
            for p in [*closed, *baselines]
            if p["closed_loop_concurrency"] == concurrency and "output_tokens_per_s_rounds" in p
        }
        pairs = [(k, baselines[0]["layout"]) for k in at if baselines and k.startswith("PP=")]
        pairs += [("PP=2", "PP=1")] if "PP=1" in at and "PP=2" in at else []
        for layout in at:  # an 8-bit cache over the stage dtype's, at each PP size
            if layout.startswith("PP=") and layout.endswith(" KV int8"):
                pairs.append((layout, layout.removesuffix(" KV int8") + " KV auto"))
        for num, den in pairs:
            if den not in at:
                continue
            per_round = [a / b for a, b in zip(at[num], at[den])]
            out.setdefault(str(concurrency), {})[f"{num} / {den}"] = {
                "median": round(_lower_median(per_round), 3),
                "rounds": [round(x, 3) for x in per_round],
            }
    return out


def table(result: dict[str, Any]) -> str:
    baselines = result.get("baselines") or ([result["baseline"]] if result["baseline"] else [])
    rows = [*result["points"], *baselines]
    width = max([14, *(len(p["layout"]) + 2 for p in rows)])  # the layout column
    lines = [
        f"{'layout':<{width}}{'load':>14}{'req':>5}{'tok/s':>9}{'TTFT p50':>12}{'TPOT p50':>11}"
        f"{'TPOT p99':>11}{'e2e p50':>10}",
    ]
    for p in rows:
        load = (
            f"{p['rate_rps']:.2f} req/s"
            if p["rate_rps"] is not None
            else f"closed C={p['closed_loop_concurrency']}"
        )
        lines.append(
            f"{p['layout']:<{width}}{load:>14}{p['num_requests']:>5}"
            f"{p['output_tokens_per_s']:>9.1f}{_ms(p['ttft_p50_ms']):>12}"
            f"{_ms(p['tpot_p50_ms']):>11}{_ms(p['tpot_p99_ms']):>11}"
            f"{p['e2e_p50_ms'] / 1000:>9.1f}s"
        )
    head = result["headline"]
    if "vs_hf_generate" in head:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in head["vs_hf_generate"].items())
        lines.append(f"\nsaturation vs HF generate (C={result['concurrency']}): {ratios}")
    for key, values in head.items():
        if key.startswith("vs_hf_generate_"):
            ratios = ", ".join(f"{k} {v:.2f}x" for k, v in values.items())
            lines.append(f"saturation vs {key[3:]} (C={result['concurrency']}): {ratios}")
    for concurrency, values in head.get("closed_loop_vs_baselines", {}).items():
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in values.items())
        lines.append(f"C={concurrency}: {ratios}")
    if "pp2_over_pp1" in head:
        lines.append(f"PP=2 / PP=1 at saturation: {head['pp2_over_pp1']:.2f}x")
    for concurrency, values in head.get("median_of_round_ratios", {}).items():
        for key, value in values.items():
            rounds = " ".join(f"{x:.2f}" for x in value["rounds"])
            lines.append(f"C={concurrency}: {key}, median of rounds {value['median']:.2f}x "
                         f"({rounds})")  # fmt: skip
    for layout, ratio in head.get("http_over_native", {}).items():
        lines.append(f"{layout} (OpenAI API) / its ZeroMQ client at saturation: {ratio:.2f}x")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """TPOT and tokens/s vs request rate (the sweep, closed loops as squares past it) and, for
    several concurrencies or no sweep, vs closed-loop concurrency; HF generate in gray."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rated = [p for p in result["points"] if p["rate_rps"] is not None]
    closed = [p for p in result["points"] if p["rate_rps"] is None]
    by_rate = bool(rated)
    by_concurrency = len({p["closed_loop_concurrency"] for p in closed}) > 1 or not rated
    rows = int(by_rate) + int(by_concurrency)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.5 * rows), squeeze=False)
    layouts = sorted({p["layout"] for p in result["points"]})
    colors = {layout: f"C{i}" for i, layout in enumerate(layouts)}
    row = 0
    if by_rate:
        ax_tpot, ax_tput = axes[row]
        row += 1
        right = max(p["rate_rps"] for p in rated) * 1.25  # closed loops sit past the sweep
        top = result["concurrency"]
        for layout in layouts:
            mine = sorted((p for p in rated if p["layout"] == layout), key=lambda p: p["rate_rps"])
            color = colors[layout]
            _curves(ax_tpot, ax_tput, "rate_rps", mine, layout, color, "o")
            for p in closed:
                if p["layout"] == layout and p["closed_loop_concurrency"] == top:
                    ax_tpot.plot([right], [p["tpot_p50_ms"]], "s", color=color)
                    ax_tput.plot([right], [p["output_tokens_per_s"]], "s", color=color)
        base = result["baseline"]
        if base:
            label = f"HF generate, static batches of {base['closed_loop_concurrency']}"
            ax_tpot.axhline(
                base["tpot_p50_ms"], color="gray", linestyle=":", label=f"{label} (p50)"
            )
            ax_tput.axhline(base["output_tokens_per_s"], color="gray", linestyle=":", label=label)
        for ax in (ax_tpot, ax_tput):
            ax.set_xlabel(f"request rate (req/s); squares: closed loop of {top}")
    if by_concurrency:
        ax_tpot, ax_tput = axes[row]
        baselines = result.get("baselines") or ([result["baseline"]] if result["baseline"] else [])
        series = [(layout, colors[layout], "o") for layout in layouts]
        hf_layouts = sorted({b["layout"] for b in baselines})
        series += [  # compiled baselines point down
            (name, ("gray", "black")[i % 2], "v" if name.endswith(" compiled") else "^")
            for i, name in enumerate(hf_layouts)
        ]
        for layout, color, marker in series:
            mine = sorted(
                (p for p in [*closed, *baselines] if p["layout"] == layout),
                key=lambda p: p["closed_loop_concurrency"],
            )
            if mine:
                _curves(ax_tpot, ax_tput, "closed_loop_concurrency", mine, layout, color, marker)
        for ax in (ax_tpot, ax_tput):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("closed-loop concurrency (requests in flight)")
    for ax_tpot, ax_tput in axes:
        for ax, ylabel in ((ax_tpot, "TPOT (ms)"), (ax_tput, "output tokens/s")):
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    model = Path(result["model"]).name
    rounds = max((len(p.get("output_tokens_per_s_rounds", ())) for p in closed), default=0)
    fig.suptitle(
        f"ppring bench serve: {model}, {result.get('dtype_resolved', result['dtype'])} on "
        f"{result['device']}, {result['threads']} threads, {result.get('workload_kind', 'mixed')}"
        " workload" + (f", median of {rounds} alternated rounds" if rounds > 1 else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _curves(ax_tpot, ax_tput, x_key: str, points: list, label: str, color: str, marker: str):
    """One layout's TPOT p50 (solid) and p99 (dashed), and its tokens/s, against `x_key`."""
    xs = [p[x_key] for p in points]
    tpot = [p["tpot_p50_ms"] for p in points]
    ax_tpot.plot(xs, tpot, marker + "-", color=color, label=f"{label} p50")
    tpot = [p["tpot_p99_ms"] for p in points]
    ax_tpot.plot(xs, tpot, marker + "--", color=color, label=f"{label} p99")
    tokens = [p["output_tokens_per_s"] for p in points]
    ax_tput.plot(xs, tokens, marker + "-", color=color, label=label)


def machine_info() -> dict[str, Any]:
    """Where a bench ran, for its JSON."""
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


if __name__ == "__main__":
    sys.exit(main())
