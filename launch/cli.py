"""`ppring` command line: one subcommand per job, each implemented in its own module.

Subcommand modules are imported only when chosen, so `ppring --help` is instant and a client
command never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with `main(argv) -> int | None`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "local": ("launch.local", "start every stage of a ring on this machine, plus the frontend"),
    "serve": (
        "launch.serve",
        "one process per node: this node's stage (node 0: also the frontend)",
    ),
    "generate": ("launch.generate", "stream one completion from a running ring to stdout"),
    "keygen": ("launch.keygen", "write a CURVE key pair for a node or a client (--curve-dir)"),
    "prepare-model": (
        "launch.prepare_model",
        "convert the default model (SmolLM2-135M-Instruct) into the cache; print its folder",
    ),
    "plan": ("launch.plan", "KV capacity, wire bytes and bubbles of TP / PP / TPxPP layouts"),
    "bench": (
        "launch.bench",
        "measure: `bench serve` (vs HF generate) or `bench ring` (simulated)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="ppring",
        description="A pipeline-parallel LLM serving engine: one scheduler per stage, "
        "stages in a ZeroMQ ring.",
    )
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), help="what to do")
    parser.epilog = "\n".join(f"  {name:<16}{text}" for name, (_, text) in SUBCOMMANDS.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
