"""`ppring serve`: one process per node, one pipeline stage per node.

    ppring serve --node-rank R --nnodes N --dist-init-addr HOST0:PORT --host MY_IP [--port P] ...

Every node registers with node 0's rendezvous (launch/rendezvous.py), which checks that all
loaded the same model and partition and were given the same flags, then hands out every
stage's host. Each node then starts its stage; node 0 also runs the frontend, where clients
connect (`tcp://HOST0:P`). Node 0 prints `ready: tcp://HOST0:P` once the ring has agreed its
KV capacity. A node whose stage leaves a failed ring registers again, and the rendezvous forms
the next ring epoch once every rank has (a node that died is started again by hand); node 0's
frontend replays the requests in flight. Past --max-stage-restarts a node exits non-zero and
node 0's clients get `ring_down`. SIGINT/SIGTERM on node 0 shut the whole ring down gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from launch.flags import add_flags, agreed_flags
from launch.local import (
    StageRestarter,
    add_http_args,
    add_restart_args,
    load_keys,
    run_frontend,
    say,
    stage_argv,
    summary,
)
from launch.procs import ProcessGroup
from launch.rendezvous import Rendezvous, RendezvousError, register_round
from protocol.curve import CurveClient, NodeKeys
from protocol.messages import NodeHello, NodeHosts
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
    add_restart_args(parser)
    args = parser.parse_args(argv)
    if args.pp_size != 1 and args.pp_size != args.nnodes:
        parser.error(
            f"--pp-size {args.pp_size} must equal --nnodes {args.nnodes}: one stage a node"
        )
    args.pp_size = args.nnodes
    if args.threads_per_stage is None and args.device == "cpu":
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
            say(line)
    hello = NodeHello(
        rank=args.node_rank, **hello_info(args, startup.config.config_hash, startup.partition)
    )
    rendezvous_addr = f"tcp://{args.dist_init_addr}"
    to_node0 = keys and keys.client_of(0)
    service = None
    try:
        if args.node_rank == 0:
            service = RendezvousService(args, rendezvous_addr, hello, keys)
        ring = (
            service.first_round(to_node0)
            if service
            else register_round(rendezvous_addr, hello, args.rendezvous_timeout, to_node0)
        )
    except (RendezvousError, OSError) as exc:
        if service is not None:
            service.stop()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logger.info("[node%d] ring hosts: %s (epoch %d)", args.node_rank, ring.hosts, ring.epoch)
    group = ProcessGroup()
    node = NodeRestarter(args, model_dir, group, rendezvous_addr, hello, to_node0)
    try:
        node.start_stage(ring)
        if args.node_rank == 0:
            addrs = RingAddresses(args.nnodes, hosts=tuple(ring.hosts), base_port=args.port)
            return run_frontend(args, addrs, model_dir, startup.context_length, group, keys, node)
        return _supervise(node)
    finally:
        group.stop()
        if service is not None:
            service.stop()


class RendezvousService:
    """Node 0's rendezvous, in a thread for as long as node 0 serves: the start-up round, then
    one round each time the ring re-forms (launch/rendezvous.py `Rendezvous`)."""

    def __init__(
        self, args: argparse.Namespace, addr: str, hello: NodeHello, keys: NodeKeys | None
    ) -> None:
        self.args, self.addr, self.hello = args, addr, hello
        try:
            self.rendezvous = Rendezvous(addr, args.nnodes, hello, keys and keys.ring_server())
        except OSError as exc:
            raise RendezvousError(
                f"{exc}: is another node 0 already running? give each node its own --node-rank"
            ) from None
        self.stopping = threading.Event()
        self.error: RendezvousError | None = None
        self.thread = threading.Thread(target=self._run, name="rendezvous", daemon=True)
        self.thread.start()

    def first_round(self, security: CurveClient | None) -> NodeHosts:
        """Node 0's own registration in the start-up round."""
        try:
            return register_round(self.addr, self.hello, self.args.rendezvous_timeout + 5, security)
        except RendezvousError:
            self.thread.join(5)
            if self.error is not None:
                raise self.error from None  # its own reason names the missing ranks
            raise

    def _run(self) -> None:
        try:
            self.rendezvous.round(self.args.rendezvous_timeout)
            while not self.stopping.is_set():
                self.rendezvous.round(None, self.stopping)
        except RendezvousError as exc:
            self.error = exc
        finally:
            self.rendezvous.close()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)


class NodeRestarter(StageRestarter):
    """One node's stage in `ppring serve`, started again after it leaves a failed ring: the
    node registers with node 0's rendezvous again, which forms the next ring epoch once every
    node has (a node started again by hand registers the same way), at most
    --max-stage-restarts times within --stage-restart-window. Node 0's frontend replays the
    requests in flight (launch/frontend.py); the same interface as `ppring local`'s
    `Restarter`."""

    def __init__(
        self,
        args: argparse.Namespace,
        model_dir: Path,
        group: ProcessGroup,
        addr: str,
        hello: NodeHello,
        security: CurveClient | None,
    ) -> None:
        super().__init__(args, model_dir, group)
        self.addr, self.hello, self.security = addr, hello, security

    def start_stage(self, ring: NodeHosts) -> None:
        """From the main thread: a stage dies with the thread that started it."""
        self.epoch = ring.epoch
        log = self.args.log_dir / f"stage{self.args.node_rank}.log" if self.args.log_dir else None
        if log:
            self.args.log_dir.mkdir(parents=True, exist_ok=True)
        argv = stage_argv(self.args, self.args.node_rank, self.model_dir, ring.hosts, ring.epoch)
        self.group.start(argv, log, inherit=log is None)

    async def restart(self, now: float) -> int:
        """Stop the stage, rejoin through the rendezvous (waiting in a thread, so node 0's
        frontend keeps answering), start the stage as the new epoch; returns the epoch."""
        self.stop_stages(now)
        ring = await asyncio.to_thread(self.rejoin)
        self.start_stage(ring)
        return self.epoch

    def rejoin(self) -> NodeHosts:
        rank = self.args.node_rank
        logger.warning("[node%d] rejoining the ring through node 0's rendezvous", rank)
        ring = register_round(self.addr, self.hello, self.args.rendezvous_timeout, self.security)
        logger.warning("[node%d] ring epoch %d formed: %s", rank, ring.epoch, ring.hosts)
        return ring


def _supervise(node: NodeRestarter) -> int:
    """A node other than 0: run its stage; when it leaves a failed ring, rejoin (see
    NodeRestarter) while restarts remain. SIGTERM/SIGINT stop the stage and this node."""
    stopping = threading.Event()

    def forward(signum: int, _frame: object) -> None:
        stopping.set()
        for proc in node.group.procs:
            if proc.poll() is None:
                proc.terminate()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        code = node.group.procs[0].wait()
        if code == 0 or stopping.is_set():
            return code
        now = time.monotonic()
        if not node.can_restart(now):
            print(
                f"error: this node's stage exited with code {code}; {node.give_up_reason()}",
                file=sys.stderr,
            )
            return code
        print(f"this node's stage exited with code {code}: rejoining the ring", file=sys.stderr)
        node.budget.used(now)
        node.group.procs.clear()
        try:
            node.start_stage(node.rejoin())
        except RendezvousError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
