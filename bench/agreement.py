"""`ppring bench agreement`: how close a cheaper configuration's greedy text stays to a reference.

    ppring bench agreement [--model DIR] [--reference bfloat16] [--candidates int8,float32]
                           [--prompts 20] [--new-tokens 256] [--prefix 32]
                           [--text FILE [--windows 4] [--window-tokens 512]]

Weight-only int8 changes every weight by up to half a quantization step, so greedy decoding can
take another branch where two tokens were nearly tied. This bench runs the same chat prompts
through the model once per configuration (one stage holding every layer, batched greedy, no
EOS stop, so every continuation has exactly --new-tokens tokens) and reports, for each
candidate, the share of continuations whose first --prefix tokens equal the reference's, the
mean length of the common prefix, and the share of all tokens equal position by position.
A configuration is `float32`, `bfloat16`, or `int8` (int8 weights, activations in the
machine's --dtype auto), or DTYPE+int8; `+exact` holds a bf16 stage's GGUF codes decoded to bf16
(PPRING_GRID_ACTIVATIONS=bf16) rather than multiplied by int8 activations, the default.
With --text, each configuration's perplexity over the file's first --windows windows of
--window-tokens tokens is measured too (teacher-forced, each window from position 0, one
prefill each): a measure less fragile than greedy text. Writes bench_agreement.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

# Twenty everyday chat prompts: questions, instructions, small tasks.
PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "Name three colours of the rainbow.",
    "What is 17 times 23?",
    "Give me a tip for learning a new language.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What does a CPU do?",
    "Suggest a name for a pet goldfish.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water?",
    "Write a short poem about autumn leaves.",
    "List three benefits of regular exercise.",
    "Who wrote Pride and Prejudice?",
    "What is the difference between weather and climate?",
    "Describe a cat to someone who has never seen one.",
    "How does a rainbow form?",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ppring bench agreement", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--reference", default="bfloat16")
    parser.add_argument("--candidates", default="int8,float32")
    parser.add_argument("--prompts", type=int, default=20, help=f"at most {len(PROMPTS)}")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=32, help="tokens that must agree")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--text", type=Path, default=None, help="a text file: perplexity too")
    parser.add_argument("--windows", type=int, default=4, help="perplexity windows (--text)")
    parser.add_argument("--window-tokens", type=int, default=512, help="tokens a window")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be 1 to {len(PROMPTS)}")
    if args.new_tokens < 1 or not 1 <= args.prefix <= args.new_tokens:
        parser.error("--new-tokens must be >= 1 and --prefix between 1 and --new-tokens")
    if args.windows < 1 or args.window_tokens < 2:
        parser.error("--windows must be >= 1 and --window-tokens >= 2")
    if args.text is not None and not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    for config in [args.reference, *args.candidates]:
        try:
            split_config(config)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def split_config(config: str) -> tuple[str, str, str]:
    """ "int8" -> ("auto", "int8", "int8x2"); "bfloat16+int8" -> ("bfloat16", "int8", "int8x2");
    "float32" -> ("float32", "none", "int8x2"); "bfloat16+exact" -> ("bfloat16", "none", "bf16");
    "auto+a8" -> ("auto", "none", "int8"). The last is how a bf16 stage multiplies GGUF codes
    (stages/backend/switches.py grid_activations): `exact` decoded to bf16, `a8` times int8
    activations in one pass (llama.cpp's), else in two. `kv8` (the KV cache in 8 bits:
    kv_cache_of) may join any of them."""
    parts = config.split("+")
    flags = [p for p in parts if p in ("int8", "exact", "a8", "kv8")]
    dtypes = [p for p in parts if p not in flags]
    dtype = dtypes[0] if dtypes else "auto"
    quantization = "int8" if "int8" in flags else "none"
    if (
        dtype not in ("auto", "float32", "bfloat16")
        or len(dtypes) > 1
        or len(set(flags)) != len(flags)
        or ("exact" in flags and "a8" in flags)
    ):
        raise ValueError(
            f"{config} is not a configuration: use float32, bfloat16, int8, D+int8, D+exact, "
            "D+a8, each with +kv8 or not"
        )
    activations = "bf16" if "exact" in flags else "int8" if "a8" in flags else "int8x2"
    return dtype, quantization, activations


def kv_cache_of(config: str) -> str:
    """--kv-cache-dtype of a configuration: int8 where it names `kv8`, else auto."""
    return "int8" if "kv8" in config.split("+") else "auto"


def greedy(runner: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Batched greedy continuations of exactly `new_tokens` tokens (no EOS stop)."""
    from stages.batch import BLOCK_SIZE, SeqChunk, blocks_needed

    tables, next_block = [], 0
    for prompt in prompts:
        count = blocks_needed(len(prompt) + new_tokens)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    assert next_block * BLOCK_SIZE <= runner.kv.num_slots
    chunks = [SeqChunk(list(p), 0, tables[i], sample=True) for i, p in enumerate(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(new_tokens):
        tokens = runner.run(chunks).token_ids
        for out, token in zip(outputs, tokens):
            out.append(token)
        chunks = [
            SeqChunk([t], c.seq_len, tables[i], sample=True)
            for i, (c, t) in enumerate(zip(chunks, tokens))
        ]
    return outputs


def text_windows(token_ids: list[int], windows: int, window_tokens: int) -> list[list[int]]:
    """The first `windows` whole windows of `window_tokens` tokens (fewer if the text is short;
    at least one, maybe shorter, if it has two tokens)."""
    found = [
        token_ids[i : i + window_tokens]
        for i in range(0, len(token_ids) - window_tokens + 1, window_tokens)
    ][:windows]
    if not found and len(token_ids) >= 2:
        found = [token_ids]
    if not found:
        raise ValueError("--text holds fewer than two tokens: no perplexity to measure")
    return found


def window_logits(runner: Any, window: list[int]) -> Any:
    """fp32 logits [W - 1, V] of a one-stage `runner` over `window` (one prefill from position
    0, KV blocks 0..): row p predicts token p + 1."""
    from stages.batch import SeqChunk, blocks_needed

    table = list(range(blocks_needed(len(window))))
    logits = runner.forward_logits([SeqChunk(window, 0, table, sample=True)], all_rows=True)
    return logits[:-1].float()


def load_runner(
    model_dir: Path, name: str, blocks: int, threads: int | None = None
) -> tuple[Any, str]:
    """A one-stage StageRunner holding every layer in configuration `name` (split_config), its
    KV cache of `blocks` blocks allocated, and a clause saying what it runs."""
    from stages.backend.cpu.linear import GRID_ACTIVATIONS_ENV
    from stages.config import ModelConfig
    from stages.dtype import resolve_dtype
    from stages.kv_cache import bytes_per_block
    from stages.runner import StageRunner

    config = ModelConfig.from_path(model_dir)
    dtype, quantization, activations = split_config(name)
    kv_cache = kv_cache_of(name)
    resolved = resolve_dtype(dtype, "cpu", config.torch_dtype).name
    # read as the stage loads its matrices; the caller's setting is back after the load
    with mock.patch.dict(os.environ, {GRID_ACTIVATIONS_ENV: activations}):
        runner = StageRunner(
            model_dir,
            0,
            config.num_layers,
            kv_budget_bytes=blocks * bytes_per_block(config, config.num_layers, resolved, kv_cache),
            dtype=resolved,
            num_threads=threads or os.cpu_count(),
            quantization=quantization,
            kv_cache_dtype=kv_cache,
        )
    runner.allocate_kv(blocks)
    what = f"{resolved}, weights {quantization}"
    if resolved == "bfloat16" and quantization == "none":
        what += f", grid activations {activations}"
    if kv_cache != "auto":
        what += f", KV {runner.kv_cache_description}"
    return runner, what


def perplexity(runner: Any, windows: list[list[int]]) -> dict:
    """exp(mean negative log-likelihood) of each window's tokens after its first, each window
    one prefill from position 0 (its logits for every row), and the share of positions whose
    top token is the next one."""
    import math

    import torch

    nll, hits, count = 0.0, 0, 0
    for window in windows:
        logits = window_logits(runner, window)  # [W - 1, V]: row p predicts token p + 1
        target = torch.tensor(window[1:])
        logprobs = torch.log_softmax(logits, dim=-1)
        nll -= float(logprobs[torch.arange(len(target)), target].sum())
        hits += int((logits.argmax(dim=-1) == target).sum())
        count += len(target)
    return {"perplexity": math.exp(nll / count), "top1": hits / count, "tokens": count}


def compare(reference: list[list[int]], candidate: list[list[int]], prefix: int) -> dict:
    common = []
    for ref, got in zip(reference, candidate):
        n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        common.append(n)
    same = sum(a == b for ref, got in zip(reference, candidate) for a, b in zip(ref, got))
    total = sum(len(ref) for ref in reference)
    return {
        "prefix_agreement": sum(n >= prefix for n in common) / len(common),
        "mean_common_prefix_tokens": sum(common) / len(common),
        "token_agreement": same / total,
        "common_prefix_tokens": common,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    from launch.prepare_model import load_tokenizer, resolve_model
    from stages.batch import blocks_needed

    model_dir = Path(resolve_model(args.model))
    tokenizer = load_tokenizer(model_dir)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        for text in PROMPTS[: args.prompts]
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    blocks = sum(blocks_needed(len(p) + args.new_tokens) for p in prompts)
    windows = None
    if args.text is not None:
        ids = tokenizer(args.text.read_text(errors="replace"))["input_ids"]
        windows = text_windows(list(ids), args.windows, args.window_tokens)
        blocks = max(blocks, blocks_needed(max(len(w) for w in windows)))
    started = time.monotonic()
    outputs: dict[str, list[list[int]]] = {}
    timings: dict[str, float] = {}
    scores: dict[str, dict] = {}
    for name in [args.reference, *args.candidates]:
        runner, what = load_runner(model_dir, name, blocks, args.threads)
        begin = time.perf_counter()
        outputs[name] = greedy(runner, prompts, args.new_tokens)
        timings[name] = time.perf_counter() - begin
        if windows is not None:  # the greedy runs are done with the cache: reuse its blocks
            scores[name] = perplexity(runner, windows)
        print(
            f"  {name} ({what}): {timings[name]:.1f} s",
            flush=True,
        )
        del runner
    reference = outputs[args.reference]
    result: dict[str, Any] = {
        "bench": "agreement",
        "command": "ppring bench agreement " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": str(model_dir),
        "reference": args.reference,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "prefix": args.prefix,
        "candidates": {
            name: {**compare(reference, outputs[name], args.prefix), "seconds": timings[name]}
            for name in args.candidates
        },
        "perplexity": {
            "text": str(args.text),
            "windows": len(windows),
            "window_tokens": args.window_tokens,
            **scores,
        }
        if windows is not None
        else None,
        "sample_text": {
            name: tokenizer.decode(outputs[name][0][:48])
            for name in [args.reference, *args.candidates]
        },
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(
        f"\nagreement with {args.reference} over {len(prompts)} prompts, {args.new_tokens} tokens:"
    )
    for name, c in result["candidates"].items():
        print(
            f"  {name:>14}: {100 * c['prefix_agreement']:.0f}% share the first {args.prefix} "
            f"tokens; mean common prefix {c['mean_common_prefix_tokens']:.1f} tokens; "
            f"{100 * c['token_agreement']:.0f}% of tokens equal position by position"
        )
    if windows is not None:
        print(f"\nperplexity over {len(windows)} windows of {args.text}:")
        for name, score in scores.items():
            print(
                f"  {name:>14}: {score['perplexity']:.3f}; top token right at "
                f"{100 * score['top1']:.1f}% of {score['tokens']} positions"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_agreement.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
