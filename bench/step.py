"""`ppring bench step`: one stage's decode step time against the floors it measures itself.

    ppring bench step [--model DIR] [--dtype auto] [--quantization none|int8] [--device]
                      [--batch-sizes 1,16,64] [--context 512]

Two floors, both measured in the same run on the same device:
- the memory bound: a decode step reads every weight once (an untied embedding table only in
  the rows it looks up) and each sequence's KV once, so it costs at least (weight bytes + KV
  bytes) over the memory bandwidth, measured here as a large tensor copy (bytes read + bytes
  written, per second). It binds a small batch ("weights" is the weight share alone);
- the compute floor: the same step's matmuls alone (every weight matrix of the stage, called
  the way the stage calls it, in a loop with nothing else, at the batch's row count) plus the
  step's KV bytes over the copy bandwidth. It binds a batch of many rows on a CPU, where
  matmuls are compute-bound; the ratio step / floor is what attention, the small ops and the
  host add on top. F.linear on the same weights is timed too, for comparison.
The bench loads the whole model as one stage (PP=1), prefills `--context` tokens for each of B
sequences, then times decode steps exactly as the ring runs them (`StageRunner.run`: inputs
built from block tables, the forward, sampling, and the token ids back on the host), median of
`--steps`. The steps run in `--rounds` groups with a copy between groups (and after the last):
each batch's bounds use the median of those copies, taken under the host's load of the moment
its steps ran (on this shared 2-core host one copy figure moved 25-31 GB/s within a minute, and
42 against 28 between two runs, so a bound measured once at start-up moved the ratio by a
third). It prints a table and writes `bench_step.json` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from stages.config import KV_CACHE_DTYPES

WARMUP_STEPS = 3
PREFILL_CHUNK_TOKENS = 2048  # per forward while filling the cache: bounds activation memory


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ppring bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--quantization", choices=("none", "int8"), default="none")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="what the KV cache stores (auto: the dtype; int8: 8-bit codes and scales)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch-sizes", default="1,16,64", help="sequences per decode step")
    parser.add_argument("--context", type=int, default=512, help="tokens in each sequence's KV")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--copy-mib", type=int, default=None, help="copy size (default: auto)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="groups a batch's steps are timed in, a bandwidth copy between groups",
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="where the JSON goes")
    parser.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="CUDA: decode batches up to this size replay as graphs (default: the largest batch)",
    )
    parser.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: time eager steps")
    args = parser.parse_args(argv)
    try:
        args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        parser.error("--batch-sizes takes comma-separated numbers, e.g. 1,16,64")
    if min(args.batch_sizes) < 1 or min(args.context, args.steps, args.threads, args.rounds) < 1:
        parser.error("--batch-sizes, --context, --steps, --threads and --rounds must be >= 1")
    return args


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CopyProbe:
    """A device-to-device tensor copy of `nbytes`, made once; each call is its bandwidth now."""

    def __init__(self, device: Any, nbytes: int) -> None:
        import torch

        self.device = device
        self.src = torch.randn(nbytes // 4, device=device)  # fp32; random, never zeros
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # (first touch)
        synchronize(device)

    def __call__(self, repeats: int = 3) -> float:
        """Bytes/s, counting bytes read plus bytes written: the median of `repeats` copies
        after a warm-up copy."""
        self.dst.copy_(self.src)
        synchronize(self.device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.dst.copy_(self.src)
            synchronize(self.device)
            times.append(time.perf_counter() - start)
        return 2 * self.src.numel() * self.src.element_size() / statistics.median(times)


def matmul_modules(runner: Any) -> list[Any]:
    """Every weight matrix of the stage as the stage calls it (its linear modules), in order."""
    model = runner.model
    modules = [
        proj
        for layer in model.layers
        for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]
    return modules + ([model.lm_head] if model.is_last_stage else [])


def time_matmuls(runner: Any, batch: int, repeats: int) -> dict[str, float | None]:
    """Median seconds of one pass over every matmul of a decode step at `batch` rows: as the
    stage runs them (its layers' in one C call each where it fuses them, its modules
    otherwise), and through F.linear on the same (unquantized) weights."""
    import torch
    import torch.nn.functional as F

    modules = matmul_modules(runner)
    widths = {m.in_features for m in modules}
    inputs = {k: torch.randn(batch, k, device=runner.device).to(runner.dtype) for k in widths}
    # F.linear's reference needs the plain [N, K] weights: packed ones are unpacked for it
    weights = [
        m.dense_weight() if hasattr(m, "dense_weight") else getattr(m, "weight", None)
        for m in modules
    ]

    def median(fn: Any) -> float:
        with torch.inference_mode():
            fn()
            times = []
            for _ in range(repeats):
                synchronize(runner.device)
                start = time.perf_counter()
                fn()
                synchronize(runner.device)
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    fused = runner.model.fused
    if fused is not None:
        # The layers' matmuls as the step runs them, one C call a layer
        # (stages/backend/cpu/fused_layer.py); what follows the layers' four each in `modules`
        # (the lm_head), as modules.
        layer_matmuls = fused.matmuls(batch)
        head = modules[4 * len(runner.model.layers) :]
        own = median(lambda: (layer_matmuls(), [m(inputs[m.in_features]) for m in head]))
    else:
        own = median(lambda: [m(inputs[m.in_features]) for m in modules])
    dense = None
    if all(w is not None for w in weights):
        dense = median(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])
    return {"stage_s": own, "f_linear_s": dense}


def tokens_per_sequence(context: int, steps: int, rounds: int) -> int:
    """The cache slots one sequence of `time_decode` fills: its prompt, the warm-up steps, one
    untimed step after each round's copy, and the timed steps. The KV pool is sized from this
    and the block tables are cut from it, so the two cannot disagree."""
    return context + WARMUP_STEPS + min(rounds, steps) + steps


def time_decode(
    runner: Any, batch: int, context: int, steps: int, probe: CopyProbe, rounds: int
) -> dict[str, Any]:
    """Prefill `batch` sequences of `context` random tokens, then time decode steps of all of
    them together; the KV read per step grows by one token per step. The timed steps run in
    `rounds` groups (at most one a step), `probe` measuring the copy bandwidth before each
    group and after the last: "bandwidths", bytes/s. After each copy one step runs untimed:
    the copy has just evicted every cache (the interpreter's own state included), which the
    next step would pay for and a step in the ring does not."""
    import random

    from stages.batch import SeqChunk, blocks_needed

    rng = random.Random(batch)
    vocab = runner.config.vocab_size
    per_seq = blocks_needed(tokens_per_sequence(context, steps, rounds))
    rounds = min(rounds, steps)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    # Fill the cache a few sequences per forward, as a chunked prefill would.
    for i in range(batch):
        for start in range(0, context, PREFILL_CHUNK_TOKENS):
            tokens = prompts[i][start : start + PREFILL_CHUNK_TOKENS]
            done = start + len(tokens) == context
            runner.run([SeqChunk(tokens, start, tables[i], sample=done)])
    last = [rng.randrange(vocab) for _ in range(batch)]
    position = context

    def step() -> float:
        """One decode step of every sequence at `position`: its seconds."""
        nonlocal last, position
        chunks = [SeqChunk([last[i]], position, tables[i], sample=True) for i in range(batch)]
        synchronize(runner.device)
        start = time.perf_counter()
        out = runner.run(chunks)  # token ids come back as Python ints: the step is finished
        synchronize(runner.device)
        last, position = out.token_ids, position + 1
        return time.perf_counter() - start

    for _ in range(WARMUP_STEPS):
        step()
    times: list[float] = []
    timed_positions: list[int] = []
    bandwidths: list[float] = []
    for r in range(rounds):  # round r times steps [r * steps // rounds, (r + 1) * ...)
        bandwidths.append(probe())
        step()  # untimed: the copy left every cache cold
        for _ in range(r * steps // rounds, (r + 1) * steps // rounds):
            timed_positions.append(position)
            times.append(step())
    bandwidths.append(probe())
    return {
        "bandwidths": bandwidths,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "mean_context": statistics.mean(timed_positions),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from bench.serve import machine_info
    from launch.prepare_model import resolve_model
    from stages.batch import blocks_needed
    from stages.config import ModelConfig
    from stages.dtype import resolve_dtype
    from stages.kv_cache import bytes_per_block, kv_bytes_per_token, resolve_kv_cache_dtype
    from stages.runner import StageRunner

    model_dir = Path(resolve_model(args.model))
    config = ModelConfig.from_path(model_dir)
    device = torch.device(args.device)
    choice = resolve_dtype(args.dtype, device, config.torch_dtype)
    args.dtype = choice.name
    max_batch = max(args.batch_sizes)
    blocks = max_batch * blocks_needed(tokens_per_sequence(args.context, args.steps, args.rounds))
    kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, choice.dtype, device)
    block_bytes = bytes_per_block(config, config.num_layers, args.dtype, kv_cache_dtype)
    started = time.monotonic()
    runner = StageRunner(
        model_dir,
        0,
        config.num_layers,
        kv_budget_bytes=blocks * block_bytes,
        dtype=args.dtype,
        device=device,
        num_threads=args.threads,
        quantization=args.quantization,
        kv_cache_dtype=kv_cache_dtype,
        cuda_graph_max_bs=0
        if args.disable_cuda_graph
        else args.cuda_graph_max_bs or max(args.batch_sizes),
    )
    runner.allocate_kv(blocks)  # on CUDA this captures the decode graphs
    graphs = runner.graphs
    weight_bytes = runner.parameter_bytes
    # A decode step reads every weight once, except an untied embedding table: of that it
    # reads only the B rows of this step's tokens. A matrix held both as grid codes and as bf16
    # panels is read once, one way or the other, by the batch's rows (weight_bytes_read).
    embed = runner.model.embed_tokens  # None: the lm_head serves the lookup (tied)
    head = getattr(runner.model.lm_head, "weight", None)
    untied_embedding = 0 if embed is None or head is embed else embed.numel() * embed.element_size()
    read_bytes = {b: runner.weight_bytes_read(b) - untied_embedding for b in args.batch_sizes}
    # A copy several times any cache: 1/8 of the weights, at least 256 MiB, at most 4 GiB.
    copy_mib = args.copy_mib or min(4096, max(256, weight_bytes // 8 // 2**20))
    probe = CopyProbe(device, copy_mib * 2**20)
    start_bandwidth = probe(10)  # for the header; each batch measures its own among its steps
    # what a decode step reads per token of context: codes and scales for an 8-bit cache
    kv_per_token = kv_bytes_per_token(config, config.num_layers, args.dtype, kv_cache_dtype)
    print(
        f"ppring bench step: {model_dir.name}, {args.dtype} ({choice.reason}), "
        f"weights {args.quantization if args.quantization != 'none' else 'unquantized'}, "
        f"on {device}, {args.threads} threads; "
        f"weights {weight_bytes / 1e9:.2f} GB held ({read_summary(read_bytes)}; matrices "
        f"{formats_summary(runner.weight_bytes_by_format())}), "
        f"KV {runner.kv_cache_description} {kv_per_token / 1024:.1f} KiB/token; "
        f"copy bandwidth {start_bandwidth / 1e9:.1f} GB/s at start ({copy_mib} MiB, read + "
        "write; each batch's bounds use copies among its own steps); "
        + (
            f"CUDA graphs for batches up to {graphs.sizes[-1]} ({graphs.capture_s:.1f} s to "
            "capture)"
            if graphs is not None
            else "no CUDA graphs"
        ),
        flush=True,
    )
    rows = []
    for batch in args.batch_sizes:
        replays = graphs.replays if graphs is not None else 0
        timing = time_decode(runner, batch, args.context, args.steps, probe, args.rounds)
        replayed = graphs is not None and graphs.replays > replays
        matmuls = time_matmuls(runner, batch, max(5, args.steps // 2))
        bandwidth = statistics.median(timing["bandwidths"])  # measured among its steps
        kv_bytes = batch * timing["mean_context"] * kv_per_token
        bound_weights_s = read_bytes[batch] / bandwidth
        bound_s = (read_bytes[batch] + kv_bytes) / bandwidth
        # The compute floor takes the faster of the stage's matmuls and F.linear's, so a slow
        # matmul of ours cannot flatter the ratio.
        fastest = min(x for x in (matmuls["stage_s"], matmuls["f_linear_s"]) if x is not None)
        floor_s = fastest + kv_bytes / bandwidth
        rows.append(
            {
                "batch": batch,
                "context": args.context,
                "cuda_graph": replayed,
                "step_ms": round(1000 * timing["median_s"], 6),
                "step_min_ms": round(1000 * timing["min_s"], 6),
                "tokens_per_s": round(batch / timing["median_s"], 1),
                "weight_read_bytes": read_bytes[batch],
                "kv_read_bytes": round(kv_bytes),
                "bound_weights_ms": round(1000 * bound_weights_s, 6),
                "bound_ms": round(1000 * bound_s, 6),
                "of_bound": round(bound_s / timing["median_s"], 3),
                "over_weights_bound": round(timing["median_s"] / bound_weights_s, 3),
                # to the ns: a tiny model's fused matmuls take a few us, and the ratios below
                # must be recomputable from the figures written
                "matmuls_ms": round(1000 * matmuls["stage_s"], 6),
                "f_linear_ms": (
                    None
                    if matmuls["f_linear_s"] is None
                    else round(1000 * matmuls["f_linear_s"], 6)
                ),
                "kv_ms": round(1000 * kv_bytes / bandwidth, 6),
                "copy_bandwidth_bytes_per_s": round(bandwidth),
                "copy_bandwidths": [round(b) for b in timing["bandwidths"]],
                "floor_ms": round(1000 * floor_s, 6),
                "over_floor": round(timing["median_s"] / floor_s, 3),
            }
        )
        r = rows[-1]
        print(
            f"  batch {batch:>3}{' (graph)' if replayed else ''}: step {r['step_ms']:8.2f} ms; "
            f"{r['over_weights_bound']:.2f}x the "
            f"weight-read bound ({r['bound_weights_ms']:.2f} ms), {r['over_floor']:.2f}x the "
            f"floor ({r['floor_ms']:.2f} ms = matmuls {r['matmuls_ms']:.2f} "
            f"[F.linear {r['f_linear_ms']}] + KV {r['kv_ms']:.2f}); copies among its steps "
            f"{' '.join(f'{b / 1e9:.1f}' for b in timing['bandwidths'])} GB/s",
            flush=True,
        )
    result = {
        "bench": "step",
        "command": "ppring bench step " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            **machine_info(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "model": str(model_dir),
        "dtype": args.dtype,
        "dtype_reason": choice.reason,
        "quantization": args.quantization,
        "device": str(device),
        "threads": args.threads,
        "weight_bytes": weight_bytes,
        "weight_bytes_by_format": runner.weight_bytes_by_format(),
        "kv_cache_dtype": kv_cache_dtype,
        "kv_bytes_per_token": kv_per_token,
        "copy_bandwidth_bytes_per_s": round(start_bandwidth),  # at start-up; rows: their own
        "copy_mib": copy_mib,
        "cuda_graph_sizes": graphs.sizes if graphs is not None else [],
        "cuda_graph_capture_s": round(graphs.capture_s, 2) if graphs is not None else None,
        "rows": rows,
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_step.json"
    path.write_text(json.dumps(result, indent=1, allow_nan=False))
    print()
    print(table(result))
    print(f"\nwrote {path} ({result['wall_s']:.0f} s)")
    return 0


def formats_summary(held: dict[str, int]) -> str:
    """ "Q4_K 40.1 MiB + Q6_K 12.0 MiB + bf16 panels 1.0 MiB": what the matrices are held as."""
    parts = sorted(held.items(), key=lambda item: -item[1])
    return " + ".join(f"{kind} {num / 2**20:.1f} MiB" for kind, num in parts) or "none"


def read_summary(read_bytes: dict[int, int]) -> str:
    """'0.10 GB read per step', or per batch size where they differ (grid codes up to a few
    rows, bf16 panels above)."""
    if len(set(read_bytes.values())) == 1:
        return f"{next(iter(read_bytes.values())) / 1e9:.2f} GB read per step"
    each = ", ".join(f"{b}: {n / 1e9:.2f}" for b, n in read_bytes.items())
    return f"GB read per step by batch: {each}"


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'batch':>5}{'context':>9}{'step ms':>10}{'tok/s':>10}{'weights ms':>12}"
        f"{'x weights':>11}{'matmuls ms':>12}{'KV ms':>8}{'floor ms':>10}{'x floor':>9}"
        f"{'copy GB/s':>11}"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['batch']:>5}{r['context']:>9}{r['step_ms']:>10.2f}{r['tokens_per_s']:>10.1f}"
            f"{r['bound_weights_ms']:>12.2f}{r['over_weights_bound']:>11.2f}"
            f"{r['matmuls_ms']:>12.2f}{r['kv_ms']:>8.2f}{r['floor_ms']:>10.2f}"
            f"{r['over_floor']:>9.2f}{r['copy_bandwidth_bytes_per_s'] / 1e9:>11.1f}"
        )
    lines.append(
        "weights = weight bytes read / copy bandwidth (copy GB/s: read + write, the median of "
        "copies made among that batch's timed steps); floor = the step's matmuls alone (the "
        "faster of the stage's and F.linear) + KV bytes / copy bandwidth"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
