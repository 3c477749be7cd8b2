"""One stage as its own process: `python -m launch.stage --rank R --pp-size S ...`.

The launcher (`ppring local` / `ppring serve`) and the process-ring tests start one of these per
stage. It builds the stage (real or simulated), binds and connects its ring links from the one
address scheme (ring/topology.py), runs the stage's event loop, and exits with its code: 0 after
a shutdown went round the ring, 1 when the ring failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys

from launch.flags import add_flags, cuda_graph_max_bs, ring_config, stage_threads
from ring.config import RingConfig
from ring.topology import DEFAULT_PORT, RingAddresses

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "PPRING_LAUNCHER_PID"  # set by launch/procs.py for the stages it starts
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
            split_lm_head=cfg.split_lm_head,
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
        num_threads=stage_threads(args),
        quantization=args.quantization,
        partition_rule=args.partition_rule,
        split_lm_head=cfg.split_lm_head,
        cuda_graph_max_bs=cuda_graph_max_bs(args, cfg),
        kv_cache_dtype=args.kv_cache_dtype,
    )
    model = stage.config
    info = ModelInfo(
        context_length=model.max_position_embeddings,
        eos_token_ids=tuple(model.eos_token_ids),
        config_hash=model.config_hash,
        rope_long_from=model.rope_long_from,
        kv_window=model.kv_window,
        kv_cache_dtype=stage.kv_cache_dtype,
    )
    return stage, info


def build_parser() -> argparse.ArgumentParser:
    """Where this process sits in the ring, then the flags every stage gets (launch/flags.py)."""
    parser = argparse.ArgumentParser(prog="python -m launch.stage", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the ring's base port")
    parser.add_argument(
        "--transport", choices=("tcp", "ipc"), default="tcp", help="ipc: stages on one host"
    )
    parser.add_argument("--run-id", default="ppring", help="names ipc sockets apart")
    parser.add_argument(
        "--ring-hosts", default=None, help="comma-separated host of every stage (multi-node)"
    )
    parser.add_argument(
        "--ring-epoch", type=int, default=0, help="the ring's incarnation (set by the launcher)"
    )
    add_flags(parser)
    return parser


def die_with_launcher() -> None:
    """Have the kernel kill this stage when its launcher dies, however it dies (a SIGKILL runs
    no cleanup): Linux's PR_SET_PDEATHSIG, asked for first thing. The launcher names itself in
    PARENT_PID_ENV; if it is already gone (it died before we asked), exit now. The signal comes
    when the launcher's thread that started us ends, so launchers start stages from their main
    thread."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: this stage may outlive its launcher")
    elif os.getppid() != int(parent):
        logger.error("the launcher (pid %s) is gone: not starting", parent)
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    die_with_launcher()
    args = build_parser().parse_args(argv)
    cfg = dataclasses.replace(ring_config(args, args.rank), epoch=args.ring_epoch)
    addrs = RingAddresses(
        cfg.pp_size,
        transport=args.transport,
        hosts=tuple(args.ring_hosts.split(",")) if args.ring_hosts else (args.host,),
        base_port=args.port,
        run_id=args.run_id,
    )

    from protocol.curve import CurveError, NodeKeys
    from ring.links import build_links
    from ring.loop import StageLoop

    try:
        keys = NodeKeys.load(args.curve_dir, cfg.rank, cfg.pp_size) if args.curve_dir else None
    except CurveError as exc:
        logger.error("[pp%d] %s", cfg.rank, exc)
        return 2
    stage, model = build_stage(args, cfg)
    links = build_links(cfg, addrs, keys=keys)
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
