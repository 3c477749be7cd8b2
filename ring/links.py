"""A stage's sockets (`Links`) and how they are opened: bind the receiving ends, connect the
sending ones. The same for a process ring over tcp and a thread ring over inproc. With node keys
(`--curve-dir`) the ring links use CURVE: a stage's PULL admits only the ring's nodes, its PUSH
talks only to the next node's key (protocol/curve.py)."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from protocol.channels import PullChannel, PushChannel
from protocol.curve import NodeKeys, warn_if_exposed
from ring.config import RingConfig
from ring.topology import RingAddresses


@dataclass
class Links:
    """A stage's sockets. `prev` receives from the predecessor, `next` sends to the successor;
    stage 0 also has `intake` (from the frontend) and `deltas` (to the frontend)."""

    prev: PullChannel | None = None
    next: PushChannel | None = None
    intake: PullChannel | None = None
    deltas: PushChannel | None = None

    def close(self) -> None:
        for channel in (self.prev, self.next, self.intake, self.deltas):
            if channel is not None:
                channel.close()


def bind_links(
    cfg: RingConfig,
    addrs: RingAddresses,
    ctx: zmq.Context | None = None,
    keys: NodeKeys | None = None,
) -> Links:
    """This stage's receiving ends: its PULL from the predecessor; stage 0 also the intake."""
    links = Links()
    if cfg.pp_size > 1:
        addr, security = addrs.stage(cfg.rank), keys and keys.ring_server()
        warn_if_exposed(addr, security, f"stage {cfg.rank}'s ring link")
        links.prev = PullChannel(addr, ctx=ctx, security=security)
    if cfg.is_first_stage:
        links.intake = PullChannel(addrs.intake(), ctx=ctx)
    return links


def connect_links(
    links: Links,
    cfg: RingConfig,
    addrs: RingAddresses,
    ctx: zmq.Context | None = None,
    keys: NodeKeys | None = None,
) -> Links:
    """This stage's sending ends: its PUSH to the next stage; stage 0 also the deltas."""
    if cfg.pp_size > 1:
        security = keys and keys.client_of((cfg.rank + 1) % cfg.pp_size)
        links.next = PushChannel(addrs.next_stage(cfg.rank), ctx=ctx, security=security)
    if cfg.is_first_stage:
        links.deltas = PushChannel(addrs.deltas(), ctx=ctx)
    return links


def build_links(
    cfg: RingConfig,
    addrs: RingAddresses,
    ctx: zmq.Context | None = None,
    keys: NodeKeys | None = None,
) -> Links:
    """Both ends at once. Over tcp, connecting before the peer binds is fine: start-up order
    is free."""
    return connect_links(bind_links(cfg, addrs, ctx, keys), cfg, addrs, ctx, keys)
