"""`ppring bench serve|ring|step|prefill|agreement|quality`: the measurements users pick a
layout from (bench/serve.py, bench/ring.py, bench/step.py, bench/prefill.py, bench/agreement.py,
bench/quality.py). Each writes its JSON (serve and ring a PNG too) into the current folder, or
`--out DIR`."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "serve": ("bench.serve", "local rings of the real model at a sweep of loads, vs HF generate"),
    "ring": ("bench.ring", "simulated stages: pipeline efficiency, async depth, idle fraction"),
    "step": ("bench.step", "one stage's decode step time against the floors it measures"),
    "prefill": ("bench.prefill", "one long prompt's time to first token vs transformers' forward"),
    "agreement": (
        "bench.agreement",
        "greedy text of int8 (or fp32) against bf16's, token by token",
    ),
    "quality": (
        "bench.quality",
        "KL divergence and top-1 agreement against fp32, position by position over a text",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        usage = "usage: ppring bench {serve,ring,step,prefill,agreement,quality} [--help]\n"
        print(usage, file=sys.stderr)
        for name, (_, text) in BENCHES.items():
            print(f"  {name:<11}{text}", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(BENCHES[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
