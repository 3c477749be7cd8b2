from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq.asyncio

from launch.procs import find_free_base_port
from protocol.channels import (
    AsyncDealerChannel,
    AsyncRouterChannel,
    ChannelTimeout,
    DealerChannel,
    PullChannel,
    PushChannel,
    RouterChannel,
)
from protocol.messages import Abort, Done, Proxy, Reqs


def test_push_never_blocks_even_before_the_peer_binds(ctx):
    # Start-up order is free: the next stage may not be listening yet.
    addr = f"tcp://127.0.0.1:{find_free_base_port(1)}"
    push = PushChannel(addr, ctx=ctx)
    start = time.monotonic()
    for step in range(200):
        push.send(Proxy(0, step, "x", torch.randn(64, 64), torch.randn(64, 64)))
    assert time.monotonic() - start < 2.0
    pull = PullChannel(addr, ctx=ctx)
    try:
        assert [pull.recv(timeout_s=5).step for _ in range(200)] == list(range(200))
    finally:
        push.close(0)
        pull.close(0)


def test_inproc_links_work_between_threads_of_one_process(ctx):
    pull = PullChannel("inproc://stage1", ctx=ctx)
    push = PushChannel("inproc://stage1", ctx=ctx)
    push.send(Reqs(slot=0, step=0))
    assert pull.recv(timeout_s=5) == Reqs(slot=0, step=0)
    push.close(0)
    pull.close(0)


def test_a_held_link_sends_nothing_until_released_and_keeps_the_order(link):
    """The ring holds its link while a device still fills a queued seam: a control message
    sent meanwhile joins the bundle behind it instead of flushing it early."""
    push, pull = link
    push.queue(Reqs(slot=0, step=0))
    push.hold()
    push.send(Abort(rid="a"))  # would flush the bundle if the link were not held
    push.flush()
    assert not pull.poll(0.2)
    push.release()
    push.flush()
    assert pull.recv_many(timeout_s=5) == [Reqs(slot=0, step=0), Abort(rid="a")]


def test_a_dealer_send_with_a_zero_timeout_goes_at_once_to_a_live_peer(ctx):
    """A timeout bounds the wait for a peer; it never stops a send a peer can take now (the
    refused-peer case, where the wait is what matters, is in test_curve.py)."""
    router = RouterChannel("tcp://127.0.0.1:*", ctx=ctx)
    dealer = DealerChannel(router.addr, ctx=ctx)
    try:
        dealer.send(Reqs(slot=0, step=0), timeout_s=0)
        assert router.recv(timeout_s=5)[1] == Reqs(slot=0, step=0)
    finally:
        dealer.close(0)
        router.close(0)


def test_receive_timeout_raises_channel_timeout(link):
    _, pull = link
    start = time.monotonic()
    with pytest.raises(ChannelTimeout):
        pull.recv(timeout_s=0.1)
    assert 0.05 < time.monotonic() - start < 2.0


def test_binding_a_busy_address_is_one_clear_error(ctx):
    pull = PullChannel("tcp://127.0.0.1:*", ctx=ctx)
    try:
        with pytest.raises(OSError, match="cannot bind"):
            PullChannel(pull.addr, ctx=ctx)
    finally:
        pull.close(0)


def test_async_router_and_dealer_talk():
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        router = AsyncRouterChannel("tcp://127.0.0.1:*", ctx=ctx)
        dealer = AsyncDealerChannel(router.addr, ctx=ctx)
        try:
            await dealer.send(Abort(rid="a"))
            identity, msg = await asyncio.wait_for(router.recv(), 5)
            assert msg == Abort(rid="a")
            done = Done("a", "stop", 1, 2, 0.1, 0.01, 0.2)
            await router.send(identity, done)
            assert await asyncio.wait_for(dealer.recv(), 5) == done
        finally:
            dealer.close(0)
            router.close(0)
            ctx.term()

    asyncio.run(run())
