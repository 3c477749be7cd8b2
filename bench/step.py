"""`ppring bench step`: one stage's decode step time against the memory-bandwidth bound.

    ppring bench step [--model DIR] [--dtype] [--device] [--batch-sizes 1,16,64] [--context 512]

Decode is memory-bound: each step reads every weight once (an untied embedding table only in the
rows it looks up), and each sequence's KV once, and does little arithmetic per byte. So the
floor of a step is (weight bytes read + KV bytes read) over
the memory bandwidth, and that bandwidth is measured here, on the same device, as a large
tensor copy (bytes read + bytes written, per second). The bench loads the whole model as one
stage (PP=1), prefills `--context` tokens for each of B sequences, then times decode steps
exactly as the ring runs them (`StageRunner.run`: inputs built from block tables, the forward,
sampling, and the token ids back on the host), median of `--steps`. It prints a table and
writes `bench_step.json` into `--out`.
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

WARMUP_STEPS = 3
PREFILL_CHUNK_TOKENS = 2048  # per forward while filling the cache: bounds activation memory


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ppring bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch-sizes", default="1,16,64", help="sequences per decode step")
    parser.add_argument("--context", type=int, default=512, help="tokens in each sequence's KV")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--copy-mib", type=int, default=None, help="copy size (default: auto)")
    parser.add_argument("--out", type=Path, default=Path("."), help="where the JSON goes")
    args = parser.parse_args(argv)
    try:
        args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        parser.error("--batch-sizes takes comma-separated numbers, e.g. 1,16,64")
    if min(args.batch_sizes) < 1 or args.context < 1 or args.steps < 1 or args.threads < 1:
        parser.error("--batch-sizes, --context, --steps and --threads must be >= 1")
    return args


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: Any, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device tensor copy, counting bytes read plus bytes written, the
    median of `repeats` after a warm-up."""
    import torch

    src = torch.randn(nbytes // 4, device=device)  # fp32; random, never zeros
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def time_decode(runner: Any, batch: int, context: int, steps: int) -> dict[str, float]:
    """Prefill `batch` sequences of `context` random tokens, then time decode steps of all of
    them together; the KV read per step grows by one token per step."""
    import random

    from stages.batch import SeqChunk, blocks_needed

    rng = random.Random(batch)
    vocab = runner.config.vocab_size
    total = context + WARMUP_STEPS + steps
    per_seq = blocks_needed(total)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    # Fill the cache a few sequences per forward, as a chunked prefill would.
    for i in range(batch):
        for start in range(0, context, PREFILL_CHUNK_TOKENS):
            tokens = prompts[i][start : start + PREFILL_CHUNK_TOKENS]
            done = start + len(tokens) == context
            runner.run([SeqChunk(tokens, start, tables[i], sample=done)])
    last = [rng.randrange(vocab) for _ in range(batch)]
    times = []
    for step in range(WARMUP_STEPS + steps):
        chunks = [SeqChunk([last[i]], context + step, tables[i], sample=True) for i in range(batch)]
        synchronize(runner.device)
        start = time.perf_counter()
        out = runner.run(chunks)  # token ids come back as Python ints: the step is finished
        synchronize(runner.device)
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
        last = out.token_ids
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "mean_context": context + WARMUP_STEPS + (steps - 1) / 2,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from bench.serve import machine_info
    from launch.prepare_model import resolve_model
    from stages.batch import blocks_needed
    from stages.config import ModelConfig
    from stages.kv_cache import bytes_per_block
    from stages.runner import StageRunner

    model_dir = Path(resolve_model(args.model))
    config = ModelConfig.from_folder(model_dir)
    device = torch.device(args.device)
    max_batch = max(args.batch_sizes)
    blocks = max_batch * blocks_needed(args.context + WARMUP_STEPS + args.steps)
    block_bytes = bytes_per_block(config, config.num_layers, args.dtype)
    started = time.monotonic()
    runner = StageRunner(
        model_dir,
        0,
        config.num_layers,
        kv_budget_bytes=blocks * block_bytes,
        dtype=args.dtype,
        device=device,
        num_threads=args.threads,
    )
    runner.allocate_kv(blocks)
    weight_bytes = runner.parameter_bytes
    # A decode step reads every weight once, except an untied embedding table: of that it
    # reads only the B rows of this step's tokens.
    embed = runner.model.embed_tokens
    untied_embedding = 0 if runner.model.lm_head is embed else embed.numel() * embed.element_size()
    read_bytes = weight_bytes - untied_embedding
    # A copy several times any cache: 1/8 of the weights, at least 256 MiB, at most 4 GiB.
    copy_mib = args.copy_mib or min(4096, max(256, weight_bytes // 8 // 2**20))
    bandwidth = copy_bandwidth(device, copy_mib * 2**20)
    kv_per_token = config.num_layers * config.kv_bytes_per_token_per_layer(args.dtype)
    print(
        f"ppring bench step: {model_dir.name}, {args.dtype} on {device}, {args.threads} threads; "
        f"weights {weight_bytes / 1e9:.2f} GB ({read_bytes / 1e9:.2f} GB read per step), "
        f"KV {kv_per_token / 1024:.0f} KiB/token; "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s ({copy_mib} MiB, read + write)",
        flush=True,
    )
    rows = []
    for batch in args.batch_sizes:
        timing = time_decode(runner, batch, args.context, args.steps)
        kv_bytes = batch * timing["mean_context"] * kv_per_token
        bound_weights_s = read_bytes / bandwidth
        bound_s = (read_bytes + kv_bytes) / bandwidth
        rows.append(
            {
                "batch": batch,
                "context": args.context,
                "step_ms": round(1000 * timing["median_s"], 3),
                "step_min_ms": round(1000 * timing["min_s"], 3),
                "tokens_per_s": round(batch / timing["median_s"], 1),
                "kv_read_bytes": round(kv_bytes),
                "bound_weights_ms": round(1000 * bound_weights_s, 3),
                "bound_ms": round(1000 * bound_s, 3),
                "of_bound": round(bound_s / timing["median_s"], 3),
            }
        )
        print(
            f"  batch {batch:>3}: step {rows[-1]['step_ms']:8.2f} ms; bound "
            f"{rows[-1]['bound_ms']:7.2f} ms (weights alone {rows[-1]['bound_weights_ms']:.2f}); "
            f"{rows[-1]['of_bound']:.0%} of the bound",
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
        "device": str(device),
        "threads": args.threads,
        "weight_bytes": weight_bytes,
        "weight_bytes_read_per_step": read_bytes,
        "kv_bytes_per_token": kv_per_token,
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "copy_mib": copy_mib,
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


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'batch':>5}{'context':>9}{'step ms':>10}{'tok/s':>10}{'bound ms':>10}"
        f"{'weights ms':>12}{'of bound':>10}"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['batch']:>5}{r['context']:>9}{r['step_ms']:>10.2f}{r['tokens_per_s']:>10.1f}"
            f"{r['bound_ms']:>10.2f}{r['bound_weights_ms']:>12.2f}{r['of_bound']:>10.0%}"
        )
    lines.append(
        f"bound = (weights read + KV read) / copy bandwidth "
        f"({result['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s measured)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
