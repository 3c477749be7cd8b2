"""The flags a launcher forwards to every stage process, in one table.

`ppring local` and `ppring serve` take these flags and write them out again on each
`python -m launch.stage` command line; the stage turns the ring flags into its `RingConfig`;
`ppring serve` sends the `agreed` ones to node 0's rendezvous, which refuses a node whose values
differ. All of it is derived from `FLAGS`, so a flag added there reaches every one of them.
Flags that place a process (rank, host, port, transport) are not here: each launcher derives
them per stage.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ring.config import RingConfig
from stages.config import KV_CACHE_DTYPES


@dataclass(frozen=True)
class Flag:
    name: str  # "--pp-size"; the namespace attribute is `pp_size`
    type: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    help: str | None = None
    agreed: bool = False  # the rendezvous requires the same value on every node
    field: str | None = None  # the RingConfig field it fills
    switch: bool = False  # takes no value: present means True (`type` and `default` unused)

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


# A CPU ring of two or more stages: one async slot (none for bf16 stages), 128-token prefill
# chunks (pipeline_defaults).
CPU_PIPELINE_DEFAULTS = {"pp_async_batch_depth": 1, "chunked_prefill_size": 128}
CPU_BF16_ASYNC_BATCH_DEPTH = 0

# Scheduling flags, named as in SGLang so a user can move over without a dictionary; then the
# stage's own: which model, how it computes, and the simulated stage's timings.
FLAGS: tuple[Flag, ...] = (
    Flag("--pp-size", int, 1, field="pp_size"),
    Flag(
        "--pp-async-batch-depth",
        int,
        None,
        agreed=True,
        field="pp_async_batch_depth",
        help="micro-batch slots beyond one per stage (default: "
        f"{CPU_PIPELINE_DEFAULTS['pp_async_batch_depth']} for "
        "CPU stages at PP >= 2 computing in float32, else 0)",
    ),
    Flag("--max-running-requests", int, 64, agreed=True, field="max_running_requests"),
    Flag("--pp-max-micro-batch-size", int, None, agreed=True, field="pp_max_micro_batch_size"),
    Flag(
        "--chunked-prefill-size",
        int,
        None,
        agreed=True,
        field="chunked_prefill_size",
        help="prefill tokens per micro-batch (default: "
        f"{CPU_PIPELINE_DEFAULTS['chunked_prefill_size']} for CPU "
        f"stages at PP >= 2, else {RingConfig.chunked_prefill_size})",
    ),
    Flag(
        "--disable-radix-cache",
        switch=True,
        agreed=True,
        field="disable_radix_cache",
        help="no prefix cache: every prompt is computed whole, even where an earlier request "
        "left its first blocks' KV on every stage",
    ),
    Flag(
        "--schedule-policy",
        str,
        "fcfs",
        choices=("fcfs", "lpm"),
        agreed=True,
        field="schedule_policy",
        help="the order waiting requests are admitted in: fcfs (arrival) or lpm (the longest "
        "prefix the cache holds first, none passed over more than 32 times)",
    ),
    Flag("--heartbeat-interval", float, 1.0, field="heartbeat_interval_s"),
    Flag("--ring-timeout", float, 30.0, field="ring_timeout_s"),
    Flag(
        "--trace-steps",
        str,
        None,
        field="trace_steps_dir",
        help="a folder: each stage writes one JSON line per step there (when it started, was "
        "decided, launched, computed and ended; its batch's requests, decodes and tokens), to "
        "see where a step's time goes",
    ),
    Flag("--stage-impl", str, "real", choices=("real", "sim"), agreed=True),
    Flag("--model", str, None, help="a local Hugging Face folder"),
    Flag(
        "--dtype",
        str,
        "auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: bfloat16 on a CPU with native bf16 (AVX-512 BF16 or AMX), else float32; "
        "the checkpoint's dtype on a GPU",
        agreed=True,
    ),
    Flag(
        "--quantization",
        str,
        "none",
        choices=("none", "int8"),
        help="int8: weight-only int8 with per-channel scales (CPU), for a single stream",
        agreed=True,
    ),
    Flag(
        "--kv-cache-dtype",
        str,
        "auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: auto, the stage dtype; int8, 8-bit codes with a scale "
        "per page and channel for K and per token for V (CPU stages): about half the bytes a "
        "token, so twice the sequences in the same --kv-memory-gib and half the cache a decode "
        "step reads (fp8: not built yet)",
        agreed=True,
    ),
    Flag(
        "--partition-rule",
        str,
        "cost",
        choices=("cost", "seed"),
        help="cost: stages of equal cost (the last one's lm_head counted); seed: L // S layers "
        "each, the remainder before the last (PPRING_LAYER_PARTITION overrides both)",
        agreed=True,
    ),
    Flag(
        "--split-lm-head",
        str,
        "auto",
        choices=("auto", "on", "off"),
        help="split the lm_head by vocabulary between the first and the last stage, the first "
        "one sampling, so decode's extra work weighs on two stages (PP >= 2); auto: on for CPU "
        "stages",
        agreed=True,
    ),
    Flag("--device", str, "cpu"),
    # CUDA graphs for decode steps, as SGLang names them (stages/backend/cuda/graphs.py).
    Flag(
        "--cuda-graph-max-bs",
        int,
        None,
        help="CUDA stages: decode batches of up to this many sequences replay as CUDA graphs "
        "(default: the micro-batch cap)",
    ),
    Flag("--disable-cuda-graph", switch=True, help="CUDA stages: run every step eagerly"),
    Flag(
        "--curve-dir",
        str,
        None,
        help="encrypt and authenticate every ZeroMQ socket with CURVE, with the keys in this "
        "folder (nodeR.key_secret, every node's nodeR.key, clients/*.key; `ppring keygen`)",
    ),
    Flag("--threads-per-stage", int, None),
    Flag("--kv-memory-gib", float, 1.0),
    # Simulated stage (--stage-impl sim).
    Flag("--sim-t0-ms", float, 5.0),
    Flag("--sim-t-token-ms", float, 0.0),
    Flag("--sim-sample-delay-ms", float, 0.0),
    Flag("--sim-kv-blocks", int, 4096),
    Flag("--sim-context-length", int, 8192),
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    for flag in FLAGS:
        if flag.switch:
            parser.add_argument(flag.name, action="store_true", help=flag.help)
            continue
        parser.add_argument(
            flag.name, type=flag.type, default=flag.default, choices=flag.choices, help=flag.help
        )


def ring_config(args: argparse.Namespace, rank: int) -> RingConfig:
    fields = {flag.field: getattr(args, flag.dest) for flag in FLAGS if flag.field}
    for field_name, default in pipeline_defaults(args).items():
        if fields[field_name] is None:  # left out: this ring's default
            fields[field_name] = default
    return RingConfig(rank=rank, split_lm_head=splits_lm_head(args), **fields)


def pipeline_defaults(args: argparse.Namespace) -> dict[str, int]:
    """Async depth and prefill chunk when the flags leave them out: SGLang's 0 and our 512,
    except for real CPU stages at PP >= 2 (CPU_PIPELINE_DEFAULTS).

    Why: at depth 0 a slot's tokens must come back round the ring before it runs again, so a
    CPU ring, whose stages have no spare cores to hide anything on, waits for every hop and
    every stage's bookkeeping; and a wave of prompts first fills the pipeline with a whole
    prefill chunk while the later stages idle (512 tokens: about 0.9 s on a one-thread
    stage of the default model). One slot more lets stage 0 run ahead, and 128-token chunks
    fill the pipeline in a quarter of the time. Alternated runs (32 in flight, equal work,
    PP=2 over PP=1, 4 rounds): depth 0 with 512 0.925x, depth 1 with 512 0.909x, depth 1 with
    128 0.977x (every round its own best); that CPU computed in fp32, its weights streaming
    from memory.

    bf16 stages keep depth 0: their matmuls are bound by vdpbf16ps, not memory, and two slots
    of 16 rows beat three of 11 (fewer steps, each weight decoded once for more rows). On a
    Zen 4 EPYC, equal work, PP=2, depth 1 against 0 alternated over 3 rounds: at 32 in flight
    350 382 397 against 485 415 438 tok/s; at 64, 455 465 422 against 457 543 488. (On a Zen 5
    EPYC in bf16 the two had been level.) The choice follows the dtype each node resolves, so
    the rendezvous compares the resolved values (agreed_flags)."""
    if args.pp_size >= 2 and args.device == "cpu" and args.stage_impl == "real":
        if _computes_in_bf16(args):
            return {**CPU_PIPELINE_DEFAULTS, "pp_async_batch_depth": CPU_BF16_ASYNC_BATCH_DEPTH}
        return CPU_PIPELINE_DEFAULTS
    return {"pp_async_batch_depth": 0, "chunked_prefill_size": RingConfig.chunked_prefill_size}


def _computes_in_bf16(args: argparse.Namespace) -> bool:
    """Whether a CPU stage started with these flags computes in bf16 (without int8 weights)."""
    from stages.dtype import resolve_dtype  # torch: only where a ring is configured
    from stages.errors import ConfigError

    if args.quantization != "none":
        return False
    try:
        return resolve_dtype(args.dtype, "cpu").name == "bfloat16"
    except ConfigError:  # the stage says so at start-up, in its own words
        return False


def splits_lm_head(args: argparse.Namespace) -> bool:
    """--split-lm-head resolved: never for one stage; `auto` splits for real stages on a CPU,
    where each stage computes on its own cores and the last one's lm_head would otherwise hold
    every other stage up in decode (a GPU stage's lm_head is a small share of its step)."""
    if args.pp_size < 2 or args.split_lm_head == "off":
        return False
    return args.split_lm_head == "on" or (args.device == "cpu" and args.stage_impl == "real")


def flag_argv(args: argparse.Namespace, **overrides: Any) -> list[str]:
    """Every table flag as command-line words, `overrides` (by attribute) replacing values
    from `args`. A None value is not written: the stage's parser reads a missing flag as its
    default, None."""
    values = {**vars(args), **overrides}
    argv: list[str] = []
    for flag in FLAGS:
        if flag.switch:
            argv += [flag.name] if values[flag.dest] else []
        elif values[flag.dest] is not None:
            argv += [flag.name, str(values[flag.dest])]
    return argv


def cuda_graph_max_bs(args: argparse.Namespace, cfg: RingConfig) -> int:
    """The largest decode batch a CUDA stage captures: 0 when graphs are off, else
    --cuda-graph-max-bs, by default the micro-batch cap (no micro-batch is larger)."""
    if args.disable_cuda_graph:
        return 0
    return cfg.micro_batch_cap if args.cuda_graph_max_bs is None else args.cuda_graph_max_bs


def stage_threads(args: argparse.Namespace) -> int | None:
    """Torch's CPU threads in a stage process: --threads-per-stage where given; on a GPU,
    one (its host work is small ops and copies, and idle OpenMP workers spinning on every
    core only steal time from the other stages' hosts; vLLM's workers do the same); on a CPU,
    None: the launcher splits the cores."""
    if args.threads_per_stage is not None:
        return args.threads_per_stage
    return 1 if args.device.startswith("cuda") else None


def agreed_flags(args: argparse.Namespace) -> dict[str, Any]:
    """What the rendezvous compares across nodes: {flag name: value} of the agreed flags, a
    pipeline default left out resolved as this node resolves it (it follows the node's dtype,
    and two nodes resolving `--dtype auto` on different CPUs must not disagree silently)."""
    resolved = pipeline_defaults(args)
    values = {}
    for flag in FLAGS:
        if not flag.agreed:
            continue
        value = getattr(args, flag.dest)
        values[flag.name] = resolved.get(flag.field, value) if value is None else value
    return values
