"""`ppring bench agreement`: how close a cheaper configuration's greedy text stays to a reference.

    ppring bench agreement [--model DIR] [--reference bfloat16] [--candidates int8,float32]
                           [--prompts 20] [--new-tokens 256] [--prefix 32]

Weight-only int8 changes every weight by up to half a quantization step, so greedy decoding can
take another branch where two tokens were nearly tied. This bench runs the same chat prompts
through the model once per configuration (one stage holding every layer, batched greedy, no
EOS stop, so every continuation has exactly --new-tokens tokens) and reports, for each
candidate, the share of continuations whose first --prefix tokens equal the reference's, the
mean length of the common prefix, and the share of all tokens equal position by position.
A configuration is `float32`, `bfloat16`, or `int8` (int8 weights, activations in the
machine's --dtype auto), or DTYPE+int8; `+exact` holds a bf16 stage's GGUF codes decoded to bf16
(PPRING_GRID_ACTIVATIONS=bf16) rather than multiplied by int8 activations, the default.
Writes bench_agreement.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

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
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be 1 to {len(PROMPTS)}")
    if args.new_tokens < 1 or not 1 <= args.prefix <= args.new_tokens:
        parser.error("--new-tokens must be >= 1 and --prefix between 1 and --new-tokens")
    for config in [args.reference, *args.candidates]:
        try:
            split_config(config)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def split_config(config: str) -> tuple[str, str, str]:
    """ "int8" -> ("auto", "int8", "int8"); "bfloat16+int8" -> ("bfloat16", "int8", "int8");
    "float32" -> ("float32", "none", "int8"); "bfloat16+exact" -> ("bfloat16", "none", "bf16").
    The last is how a bf16 stage multiplies GGUF codes (stages/linear.py grid_activations)."""
    parts = config.split("+")
    flags = [p for p in parts if p in ("int8", "exact")]
    dtypes = [p for p in parts if p not in flags]
    dtype = dtypes[0] if dtypes else "auto"
    quantization = "int8" if "int8" in flags else "none"
    if (
        dtype not in ("auto", "float32", "bfloat16")
        or len(dtypes) > 1
        or len(set(flags)) != len(flags)
    ):
        raise ValueError(
            f"{config} is not a configuration: use float32, bfloat16, int8, D+int8, D+exact"
        )
    return dtype, quantization, "bf16" if "exact" in flags else "int8"


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
    import os

    from transformers import AutoTokenizer

    from launch.prepare_model import resolve_model
    from stages.batch import blocks_needed
    from stages.config import ModelConfig
    from stages.dtype import resolve_dtype
    from stages.kv_cache import bytes_per_block
    from stages.runner import StageRunner

    model_dir = Path(resolve_model(args.model))
    config = ModelConfig.from_folder(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        for text in PROMPTS[: args.prompts]
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    blocks = sum(blocks_needed(len(p) + args.new_tokens) for p in prompts)
    started = time.monotonic()
    outputs: dict[str, list[list[int]]] = {}
    timings: dict[str, float] = {}
    from stages.linear import GRID_ACTIVATIONS_ENV

    for name in [args.reference, *args.candidates]:
        dtype, quantization, activations = split_config(name)
        os.environ[GRID_ACTIVATIONS_ENV] = activations  # read as the stage loads
        resolved = resolve_dtype(dtype, "cpu", config.torch_dtype).name
        runner = StageRunner(
            model_dir,
            0,
            config.num_layers,
            kv_budget_bytes=blocks * bytes_per_block(config, config.num_layers, resolved),
            dtype=resolved,
            num_threads=args.threads or os.cpu_count(),
            quantization=quantization,
        )
        runner.allocate_kv(blocks)
        begin = time.perf_counter()
        outputs[name] = greedy(runner, prompts, args.new_tokens)
        timings[name] = time.perf_counter() - begin
        print(
            f"  {name} ({resolved}, weights {quantization}, grid activations {activations}): "
            f"{timings[name]:.1f} s",
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
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_agreement.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
