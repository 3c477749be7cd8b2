"""`ppring bench prefill`: one long prompt's time to first token on a stage of every layer,
against transformers' forward over the same tokens, alternated in one process.

ppring's side is what a ring of one stage does with a new request: the prompt in chunks of
`--chunked-prefill-size` tokens (StageRunner.run, each chunk's KV written to the paged cache),
the last chunk sampling the first token. transformers' side is one forward of the model over
the whole prompt in its own dtype (bf16 by default: what a user compares with), logits of every
position as its forward computes them. The two alternate (A, B, A, B, ...) so that a shared
host's drift falls on both; the medians and their ratio are printed and written to
prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ppring bench prefill", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--tokens", type=int, default=1500, help="the prompt's length")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="tokens per prefill chunk (default: the ring's)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="alternated runs of each side")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-baseline", action="store_true", help="ppring's side alone")
    parser.add_argument("--out", type=Path, default=Path("."), help="where the JSON goes")
    args = parser.parse_args(argv)
    if min(args.tokens, args.repeats, args.threads) < 1:
        parser.error("--tokens, --repeats and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from bench.serve import machine_info
    from launch.prepare_model import resolve_model
    from ring.config import RingConfig
    from stages.batch import SeqChunk, blocks_needed
    from stages.config import ModelConfig
    from stages.dtype import resolve_dtype
    from stages.kv_cache import bytes_per_block
    from stages.runner import StageRunner

    model_dir = Path(resolve_model(args.model))
    config = ModelConfig.from_path(model_dir)
    choice = resolve_dtype(args.dtype, torch.device("cpu"), config.torch_dtype)
    chunk = args.chunked_prefill_size or RingConfig.chunked_prefill_size
    blocks = blocks_needed(args.tokens)
    runner = StageRunner(
        model_dir,
        0,
        config.num_layers,
        kv_budget_bytes=blocks * bytes_per_block(config, config.num_layers, choice.name),
        dtype=choice.name,
        num_threads=args.threads,
        cuda_graph_max_bs=0,
    )
    runner.allocate_kv(blocks)
    table = list(range(blocks))
    rng = random.Random(0)
    prompt = [rng.randrange(config.vocab_size) for _ in range(args.tokens)]

    def ppring() -> float:
        start = time.perf_counter()
        for at in range(0, args.tokens, chunk):
            tokens = prompt[at : at + chunk]
            done = at + len(tokens) == args.tokens
            out = runner.run([SeqChunk(tokens, at, table, sample=done)])
        assert len(out.token_ids) == 1  # the first token: a Python int, the step is finished
        return time.perf_counter() - start

    sides: dict[str, Any] = {"ppring": ppring}
    if not args.no_baseline:
        from launch.prepare_model import load_hf_model

        hf = load_hf_model(model_dir, dtype=getattr(torch, args.hf_dtype)).eval()
        ids = torch.tensor([prompt])

        def transformers() -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                hf(ids)
            return time.perf_counter() - start

        sides["transformers"] = transformers
    for side in sides.values():  # one untimed run each: first-call costs off the clock
        side()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, side in sides.items():
            times[name].append(side())
    medians = {name: statistics.median(t) for name, t in times.items()}
    result: dict[str, Any] = {
        "model": model_dir.name,
        "dtype": choice.name,
        "hf_dtype": None if args.no_baseline else args.hf_dtype,
        "tokens": args.tokens,
        "chunked_prefill_size": chunk,
        "threads": args.threads,
        "seconds": times,
        "median_s": medians,
        "machine": machine_info(),
    }
    line = (
        f"ppring bench prefill: {model_dir.name}, {args.tokens} tokens in chunks of {chunk}, "
        f"{args.threads} threads, {args.repeats} alternated runs; ppring {choice.name} "
        f"{medians['ppring']:.3f} s"
    )
    if "transformers" in medians:
        result["ratio"] = medians["ppring"] / medians["transformers"]
        line += (
            f", transformers {args.hf_dtype} forward {medians['transformers']:.3f} s: "
            f"{result['ratio']:.2f}x"
        )
    print(line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
