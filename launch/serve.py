"""`ppring serve`: one process per node, one pipeline stage per node.

    ppring serve --node-rank R --nnodes N --dist-init-addr HOST0:PORT --host MY_IP [--port P] ...

Every node registers with node 0's rendezvous (launch/rendezvous.py), which checks that all
loaded the same model and partition and were given the same flags, then hands out every
stage's host. Each node then starts its stage; node 0 also runs the frontend, where clients
connect (`tcp://HOST0:P`). Node 0 prints `ready: tcp://HOST0:P` once the ring has agreed its
KV capacity. Any node whose stage dies exits non-zero; node 0's clients get `ring_down`.
SIGINT/SIGTERM on node 0 shut the whole ring down gracefully.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from launch.flags import add_flags, agreed_flags
from launch.local import add_http_args, load_keys, run_frontend, stage_argv, summary
from launch.procs import ProcessGroup
from launch.rendezvous import RendezvousError, register, serve_rendezvous
from protocol.curve import NodeKeys
from protocol.messages import NodeHello
from ring.topology import DEFAULT_PORT, RingAddresses

logger = logging.getLogger("ppring")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ppring serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--dist-init-addr", required=True, help="HOST:PORT of node 0's rendezvous")
    parser.add_argument("--host", default="127.0.0.1", help="the address this node listens on")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="the ring's base port (same on all)"
    )
    parser.add_argument("--rendezvous-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", type=Path, default=None)
    add_flags(parser)
    add_http_args(parser)
    args = parser.parse_args(argv)
    if args.pp_size != 1 and args.pp_size != args.nnodes:
        parser.error(
            f"--pp-size {args.pp_size} must equal --nnodes {args.nnodes}: one stage a node"
        )
    args.pp_size = args.nnodes
    if args.threads_per_stage is None:
        args.threads_per_stage = os.cpu_count() or 1  # one stage per node: all its cores
    return args


def hello_info(args: argparse.Namespace, config_hash: str, partition: list[int]) -> dict:
    return {
        "host": args.host,
        "config_hash": config_hash,
        "partition": partition,
        "nnodes": args.nnodes,
        "ring_flags": agreed_flags(args),
        "port": args.port,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from launch.prepare_model import PrepareModelError, resolve_model

    try:
        model_dir = resolve_model(args.model)
        startup = summary(args, model_dir)
        keys = load_keys(args, range(args.node_rank, args.node_rank + 1))
    except (PrepareModelError, ValueError) as exc:  # CurveError too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.node_rank == 0:
        for line in startup.lines:
            print(line, flush=True)
    hello = NodeHello(
        rank=args.node_rank, **hello_info(args, startup.config.config_hash, startup.partition)
    )
    rendezvous_addr = f"tcp://{args.dist_init_addr}"
    try:
        hosts = _rendezvous(args, rendezvous_addr, hello, keys)
    except (RendezvousError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logger.info("[node%d] ring hosts: %s", args.node_rank, hosts)
    group = ProcessGroup()
    try:
        log = args.log_dir / f"stage{args.node_rank}.log" if args.log_dir else None
        if log:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        group.start(stage_argv(args, args.node_rank, model_dir, hosts), log, inherit=log is None)
        if args.node_rank == 0:
            addrs = RingAddresses(args.nnodes, hosts=tuple(hosts), base_port=args.port)
            return run_frontend(args, addrs, model_dir, startup.context_length, group, keys)
        return _supervise(group)
    finally:
        group.stop()


def _rendezvous(
    args: argparse.Namespace, addr: str, hello: NodeHello, keys: NodeKeys | None
) -> list[str]:
    to_node0 = keys and keys.client_of(0)
    if args.node_rank != 0:
        return register(addr, hello, args.rendezvous_timeout, to_node0)
    result: dict[str, object] = {}
    security = keys and keys.ring_server()

    def run() -> None:
        try:
            result["hosts"] = serve_rendezvous(
                addr, args.nnodes, args.rendezvous_timeout, hello, security
            )
        except RendezvousError as exc:
            result["error"] = exc
        except OSError as exc:
            result["error"] = RendezvousError(
                f"{exc}: is another node 0 already running? give each node its own --node-rank"
            )

    thread = threading.Thread(target=run, name="rendezvous", daemon=True)
    thread.start()
    thread.join(0.5)  # a rendezvous that cannot even bind says so before anything else
    if "error" in result:
        raise result["error"]
    try:
        hosts = register(addr, hello, args.rendezvous_timeout + 5, to_node0)
    except RendezvousError:
        thread.join(5)
        if "error" in result:
            raise result["error"] from None  # the rendezvous' own reason names missing ranks
        raise
    thread.join(10)
    if "error" in result:
        raise result["error"]
    return hosts


def _supervise(group: ProcessGroup) -> int:
    """A node other than 0: run until its stage exits; pass on SIGTERM/SIGINT."""
    stage = group.procs[0]

    def forward(signum: int, _frame: object) -> None:
        if stage.poll() is None:
            stage.terminate()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = stage.wait()
    if code != 0:
        print(f"error: this node's stage exited with code {code}", file=sys.stderr)
    return code
