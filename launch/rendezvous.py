"""Multi-node start-up (DESIGN.md §8): every node registers with node 0, node 0 checks them.

Node 0 runs a ROUTER at `--dist-init-addr`; every node (node 0 too) connects a DEALER and sends
a `NodeHello` with its rank, the host its stage listens on, the model's config hash, the layer
partition and the ring's shape. Node 0 answers:
- at once with a `RingError` to a node whose rank is taken, out of range, or whose model,
  partition or flags differ from node 0's (one sentence saying which and how to fix it);
- with `NodeHosts`, every stage's host and the ring's epoch, once all ranks have registered.

Node 0 keeps it open while it serves: a node that registers again opens the next round, which
forms the next ring epoch once every rank has registered in it (launch/serve.py).

Start-up order is free: ZeroMQ connects whenever the other side appears. A rendezvous that
waits longer than its deadline names the ranks still missing (vLLM #26318 and SGLang #18366
hang silently instead).
"""

from __future__ import annotations

import threading
import time

import zmq

from protocol.channels import BadClientMessage, ChannelTimeout, DealerChannel, RouterChannel
from protocol.curve import CurveClient, CurveServer, warn_if_exposed
from protocol.messages import NodeHello, NodeHosts, RingError

# What every node must agree on with node 0, and what to tell a node that does not.
MUST_MATCH = {
    "config_hash": "loaded a different model (config hash)",
    "partition": "uses a different layer partition (set PPRING_LAYER_PARTITION alike everywhere)",
    "nnodes": "was started with a different --nnodes",
    "ring_flags": "was started with different scheduling flags",
    "port": "was started with a different --port",
}


class RendezvousError(RuntimeError):
    """Start-up could not complete; the text says what to fix."""


def serve_rendezvous(
    addr: str,
    nnodes: int,
    deadline_s: float,
    own: NodeHello | None = None,
    security: CurveServer | None = None,
) -> list[str]:
    """Node 0: collect every rank's hello, check it, answer; return the stage hosts by rank.

    `own` is node 0's own hello info, the reference the others are checked against; when None
    the first registration of rank 0 is used. `security`: CURVE, admitting the ring's nodes.
    """
    rendezvous = Rendezvous(addr, nnodes, own, security)
    try:
        return rendezvous.round(deadline_s)
    finally:
        rendezvous.close()


class Rendezvous:
    """Node 0's rendezvous, round after round: round k forms ring epoch k. The first round is
    start-up; a later one opens when a node registers again (a node started again by hand, or
    a survivor whose stage left a failed ring) and completes once every rank has registered in
    it, with the same checks as at start-up. A rank registers once per round."""

    def __init__(
        self,
        addr: str,
        nnodes: int,
        own: NodeHello | None = None,
        security: CurveServer | None = None,
    ) -> None:
        warn_if_exposed(addr, security, "the rendezvous")
        self.addr, self.nnodes, self.reference = addr, nnodes, own
        self.router = RouterChannel(addr, security=security)
        self.epoch = 0

    def round(self, deadline_s: float | None, stop: threading.Event | None = None) -> list[str]:
        """Collect one round; return the stage hosts by rank (all of them were answered with
        NodeHosts of this round's epoch). `deadline_s` None: wait for as long as it takes, or
        until `stop` is set (then RendezvousError)."""
        registered: dict[int, NodeHello] = {}
        identities: dict[int, bytes] = {}
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        while len(registered) < self.nnodes:
            if stop is not None and stop.is_set():
                raise RendezvousError("the rendezvous was stopped")
            remaining = 1.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.nnodes)) - set(registered))
                raise RendezvousError(
                    f"rendezvous at {self.addr} waited {deadline_s:.0f} s; ranks {missing} "
                    f"never registered: start `ppring serve --node-rank R` for each of them"
                )
            try:
                identity, msg = self.router.recv(timeout_s=min(remaining, 1.0))
            except ChannelTimeout:
                continue
            except BadClientMessage as exc:  # e.g. a node of another ppring version
                problem = f"node 0's rendezvous could not read this node's hello: {exc}"
                self.router.send(exc.identity, RingError(rank=0, message=problem))
                continue
            if not isinstance(msg, NodeHello):
                continue
            problem = _check(msg, self.nnodes, registered, self.reference)
            if problem:
                self.router.send(identity, RingError(rank=0, message=problem))
                continue
            if msg.rank == 0 and self.reference is None:
                self.reference = msg
            registered[msg.rank] = msg
            identities[msg.rank] = identity
        hosts = [registered[r].host for r in range(self.nnodes)]
        for identity in identities.values():
            self.router.send(identity, NodeHosts(rank=0, hosts=hosts, epoch=self.epoch))
        self.epoch += 1
        return hosts

    def close(self) -> None:
        time.sleep(0.2)  # let the last answers leave before the socket closes
        self.router.close(linger_ms=1000)


def _check(
    msg: NodeHello, nnodes: int, registered: dict[int, NodeHello], reference: NodeHello | None
) -> str:
    rank = msg.rank
    if not 0 <= rank < nnodes:
        return f"--node-rank {rank} is outside --nnodes {nnodes}: use 0 to {nnodes - 1}"
    if rank in registered:
        other = registered[rank].host
        return f"rank {rank} is already registered (from {other}): give each node its own rank"
    if reference is not None:
        for key, what in MUST_MATCH.items():
            if getattr(msg, key) != getattr(reference, key):
                return (
                    f"node {rank} {what}: {getattr(msg, key)!r} here, "
                    f"{getattr(reference, key)!r} on node 0"
                )
    return ""


def register(
    addr: str, hello: NodeHello, deadline_s: float, security: CurveClient | None = None
) -> list[str]:
    """Every node: say hello to node 0's rendezvous; return the stage hosts by rank.
    `security`: CURVE, with node 0's public key."""
    return register_round(addr, hello, deadline_s, security).hosts


def register_round(
    addr: str, hello: NodeHello, deadline_s: float, security: CurveClient | None = None
) -> NodeHosts:
    """`register`, answering the whole NodeHosts: the hosts and the ring epoch they form."""
    ctx = zmq.Context.instance()
    dealer = DealerChannel(addr, ctx=ctx, security=security)
    try:
        dealer.send(hello)
        try:
            answer = dealer.recv(timeout_s=deadline_s)
        except ChannelTimeout:
            raise RendezvousError(
                f"no answer from the rendezvous at {addr} within {deadline_s:.0f} s: is node 0 "
                "running, are all ranks started, and do all nodes use --curve-dir alike (with "
                "each other's node keys), or none of them?"
            ) from None
        if isinstance(answer, RingError):
            raise RendezvousError(answer.message)
        if not isinstance(answer, NodeHosts):
            raise RendezvousError(f"the rendezvous at {addr} answered {answer.kind}, not hosts")
        return answer
    finally:
        dealer.close(linger_ms=0)
