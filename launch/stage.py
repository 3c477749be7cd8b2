"""One stage as its own process: `python -m launch.stage --rank R --pp-size S ...`.

The launcher (`ppring local` / `ppring serve`) and the process-ring tests start one of these per
stage. It builds the stage (real or simulated), binds and connects its ring links from the one
address scheme (ring/topology.py), runs the stage's event loop, and exits with its code: 0 after
a shutdown went round the ring, 1 when the ring failed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from ring.config import RingConfig
from ring.topology import RingAddresses

logger = logging.getLogger(__name__)

DEFAULT_KV_MEMORY_GIB = 1.0


def add_ring_args(parser: argparse.ArgumentParser) -> None:
    """Scheduling flags, named as in SGLang so a user can move over without a dictionary."""
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--pp-async-batch-depth", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--pp-max-micro-batch-size", type=int, default=None)
    parser.add_argument("--chunked-prefill-size", type=int, default=512)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--ring-timeout", type=float, default=30.0)


def add_stage_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage-impl", choices=("real", "sim"), default="real")
    parser.add_argument("--model", default=None, help="a local Hugging Face folder")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="auto: bfloat16 on a CPU with native bf16 (AVX-512 BF16 or AMX), else float32; "
        "the checkpoint's dtype on a GPU",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "int8"),
        default="none",
        help="int8: weight-only int8 with per-channel scales (CPU), for a single stream",
    )
    parser.add_argument(
        "--partition-rule",
        choices=("cost", "seed"),
        default="cost",
        help="cost: stages of equal cost (the last one's lm_head counted); seed: L // S layers "
        "each, the remainder before the last (PPRING_LAYER_PARTITION overrides both)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads-per-stage", type=int, default=None)
    parser.add_argument("--kv-memory-gib", type=float, default=DEFAULT_KV_MEMORY_GIB)
    # Simulated stage (--stage-impl sim).
    parser.add_argument("--sim-t0-ms", type=float, default=5.0)
    parser.add_argument("--sim-t-token-ms", type=float, default=0.0)
    parser.add_argument("--sim-sample-delay-ms", type=float, default=0.0)
    parser.add_argument("--sim-kv-blocks", type=int, default=4096)
    parser.add_argument("--sim-context-length", type=int, default=8192)


def ring_config(args: argparse.Namespace, rank: int) -> RingConfig:
    return RingConfig(
        pp_size=args.pp_size,
        rank=rank,
        pp_async_batch_depth=args.pp_async_batch_depth,
        max_running_requests=args.max_running_requests,
        pp_max_micro_batch_size=args.pp_max_micro_batch_size,
        chunked_prefill_size=args.chunked_prefill_size,
        heartbeat_interval_s=args.heartbeat_interval,
        ring_timeout_s=args.ring_timeout,
    )


def build_stage(args: argparse.Namespace, cfg: RingConfig):  # -> (Stage, ModelInfo)
    from ring.loop import ModelInfo

    if args.stage_impl == "sim":
        from ring.sim_stage import SimStage

        stage = SimStage(
            is_first_stage=cfg.is_first_stage,
            is_last_stage=cfg.is_last_stage,
            num_kv_blocks=args.sim_kv_blocks,
            t0_s=args.sim_t0_ms / 1000,
            t_token_s=args.sim_t_token_ms / 1000,
            sample_delay_s=args.sim_sample_delay_ms / 1000 if cfg.is_last_stage else 0.0,
        )
        return stage, ModelInfo(context_length=args.sim_context_length, config_hash="sim")

    from launch.prepare_model import resolve_model
    from stages.runner import StageRunner

    model_dir = resolve_model(args.model)
    stage = StageRunner.for_rank(
        model_dir,
        cfg.pp_size,
        cfg.rank,
        kv_budget_bytes=int(args.kv_memory_gib * 2**30),
        dtype=args.dtype,
        device=args.device,
        num_threads=args.threads_per_stage,
        quantization=args.quantization,
        partition_rule=args.partition_rule,
    )
    model = stage.config
    info = ModelInfo(
        context_length=model.max_position_embeddings,
        eos_token_ids=tuple(model.eos_token_ids),
        config_hash=model.config_hash,
    )
    return stage, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.stage", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="the ring's base port")
    parser.add_argument(
        "--transport", choices=("tcp", "ipc"), default="tcp", help="ipc: stages on one host"
    )
    parser.add_argument("--run-id", default="ppring", help="names ipc sockets apart")
    parser.add_argument(
        "--ring-hosts", default=None, help="comma-separated host of every stage (multi-node)"
    )
    add_ring_args(parser)
    add_stage_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    cfg = ring_config(args, args.rank)
    addrs = RingAddresses(
        cfg.pp_size,
        transport=args.transport,
        hosts=tuple(args.ring_hosts.split(",")) if args.ring_hosts else (args.host,),
        base_port=args.port,
        run_id=args.run_id,
    )

    from ring.links import build_links
    from ring.loop import StageLoop

    stage, model = build_stage(args, cfg)
    links = build_links(cfg, addrs)
    loop = StageLoop(cfg, stage, links, model)
    # SIGTERM/SIGINT: the launcher asks stage 0's frontend link for a graceful shutdown; a
    # signal straight to a stage process means "stop now", which the ring reports as an error.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    # Ctrl-C in a terminal reaches the whole process group; the launcher turns it into a
    # graceful shutdown that goes round the ring, so a stage must not die of it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return loop.run()


if __name__ == "__main__":
    sys.exit(main())
