from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq.asyncio

from launch.procs import find_free_base_port
from protocol.channels import (
    CLIENT_LIMITS,
    AsyncDealerChannel,
    AsyncRouterChannel,
    ChannelTimeout,
    DealerChannel,
    PullChannel,
    PushChannel,
    RouterChannel,
)
from protocol.codec import encode
from protocol.messages import Abort, Chunk, Done, Ping, Pong, Proxy, Reqs


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


def test_a_client_gets_the_frontends_bundles_one_message_at_a_time_in_order():
    """send_many: what the frontend has for one client leaves as few ZeroMQ messages as the
    client's bundle cap allows; both dealers hand the messages out one by one, in order, and a
    timeout applies only when nothing is left of the last bundle."""
    chunks = [Chunk("a", f"t{i}", [i]) for i in range(40)]  # more than one bundle (cap 32)
    done = Done("a", "length", 3, 40, 0.1, 0.01, 0.5)

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        router = AsyncRouterChannel("tcp://127.0.0.1:*", ctx=ctx)
        dealer = AsyncDealerChannel(router.addr, ctx=ctx)
        sync_dealer = DealerChannel(router.addr, ctx=zmq.Context.instance())
        try:
            await dealer.send(Ping(rid="p"))
            sync_dealer.send(Ping(rid="p"))
            identities = [(await asyncio.wait_for(router.recv(), 5))[0] for _ in range(2)]
            for identity in identities:
                router.send_many(identity, [*chunks, done])
            got = [await asyncio.wait_for(dealer.recv(), 5) for _ in range(41)]
            got_sync = [sync_dealer.recv(timeout_s=5) for _ in range(41)]
            assert got == got_sync == [*chunks, done]
            # nothing is left over to hand out (the split itself: the next test)
            assert not dealer.pending and not sync_dealer.pending
            with pytest.raises(ChannelTimeout):
                sync_dealer.recv(timeout_s=0.1)
        finally:
            dealer.close(0)
            sync_dealer.close(0)
            router.close(0)
            ctx.term()

    asyncio.run(run())


def test_send_many_splits_at_the_clients_bundle_cap(ctx):
    """A raw DEALER sees the ZeroMQ messages themselves: ceil(n / cap) of them."""
    from protocol.codec import decode_many

    async def run() -> list[int]:
        actx = zmq.asyncio.Context()
        router = AsyncRouterChannel("tcp://127.0.0.1:*", ctx=actx)
        raw = ctx.socket(zmq.DEALER)
        raw.connect(router.addr)
        try:
            raw.send_multipart(encode(Ping(rid="p")))
            identity, _ = await asyncio.wait_for(router.recv(), 5)
            cap = router.limits.max_bundle
            router.send_many(identity, [Pong(rid=str(i)) for i in range(2 * cap + 1)])
            sizes = []
            while raw.poll(1000):
                sizes.append(len(decode_many(raw.recv_multipart(), router.limits)))
            return sizes
        finally:
            raw.close(0)
            router.close(0)
            actx.term()

    cap = CLIENT_LIMITS.max_bundle
    assert asyncio.run(run()) == [cap, cap, 1]


def test_send_many_does_not_swallow_a_request_that_arrived_meanwhile():
    """A send reads the socket's pending events; a request that arrived while the event loop
    was busy must still wake the frontend's waiting recv after send_many (it did not when the
    sends went through a plain shadow of the asyncio socket: clients timed out)."""

    async def run() -> None:
        actx = zmq.asyncio.Context()
        ctx = zmq.Context()
        router = AsyncRouterChannel("tcp://127.0.0.1:*", ctx=actx)
        dealer = DealerChannel(router.addr, ctx=ctx)
        try:
            dealer.send(Ping(rid="first"))
            identity, _ = await asyncio.wait_for(router.recv(), 5)
            waiting = asyncio.ensure_future(router.recv())
            await asyncio.sleep(0)  # one turn: the recv starts, finds nothing, waits on the socket
            assert not waiting.done()
            dealer.send(Ping(rid="second"))
            # The loop is busy (this coroutine does not yield) while the request arrives: wait
            # for it on a plain handle of the same socket. Reading its events there takes the
            # wake-up the loop would have seen, as a send does: only the send can wake the recv.
            unseen = zmq.Socket.shadow(router.sock.underlying)
            assert unseen.poll(5000, zmq.POLLIN), "the second request never arrived"
            router.send_many(identity, [Pong(rid="first")])
            _, msg = await asyncio.wait_for(waiting, 5)
            assert msg == Ping(rid="second")
            assert dealer.recv(timeout_s=5) == Pong(rid="first")
        finally:
            dealer.close(0)
            router.close(0)
            ctx.term()
            actx.term()

    asyncio.run(run())
