"""Thin typed wrappers over pyzmq sockets: messages in, messages out.

- `PushChannel` / `PullChannel`: a ring link between neighbouring stages. Sends never block the
  caller (unbounded send queue; the ring bounds what is in flight by its slot count); receives
  block, with an optional timeout.
- `RouterChannel` / `DealerChannel`: clients and the frontend.
- `AsyncRouterChannel` / `AsyncDealerChannel`: the same over `zmq.asyncio`, for the frontend's
  event loop and the async client. The frontend bundles what it has for one client into one
  ZeroMQ message (`send_many`, as a ring link bundles a step); a dealer hands the messages out
  one at a time, in order.

Zero-copy rule (vLLM #24655): a tensor frame is handed to ZeroMQ with `copy=False`, so ZeroMQ
reads the tensor's memory after `send` returns. pyzmq keeps a reference to the buffer, so it is
never freed early; the caller must not *write* that tensor again. Stages always send tensors
freshly produced by a forward pass, never a reused buffer. Frames under `ZMQ_COPY_THRESHOLD`
are copied anyway (below ~64 KiB a copy is as fast as zero-copy, DESIGN.md §7).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from protocol.codec import decode, decode_many, encode, encode_many
from protocol.curve import Security, secure, watch_refusals
from protocol.errors import ProtocolError
from protocol.schema import Limits

logger = logging.getLogger(__name__)

ZMQ_COPY_THRESHOLD = 64 * 1024
# Closing with linger 0 can drop the last message still in flight (DESIGN.md §7).
DEFAULT_LINGER_MS = 2000
# Client sockets carry text and token ids only: much smaller caps than the ring's.
CLIENT_LIMITS = Limits(
    max_header_bytes=16 << 20,
    max_frame_bytes=16 << 20,
    max_message_bytes=32 << 20,
    max_tensors=0,
    max_list_len=1 << 20,
    max_str_len=4 << 20,
)


class ChannelTimeout(TimeoutError):
    """A receive waited longer than its timeout."""


class BadClientMessage(ProtocolError):
    """A client sent something undecodable; `identity` says whom to answer."""

    def __init__(self, identity: bytes, reason: str) -> None:
        super().__init__(reason)
        self.identity = identity


def _send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> Any:
    # The header is small and always copied; tensor frames go zero-copy (pyzmq copies small ones).
    return sock.send_multipart(frames, flags=flags, copy=False)


def _timeout_ms(timeout_s: float | None) -> int | None:
    return None if timeout_s is None else max(0, int(timeout_s * 1000))


class _Channel:
    def __init__(self, sock: zmq.Socket, addr: str, limits: Limits) -> None:
        self.sock = sock
        # A bound "tcp://127.0.0.1:*" resolves to the port the OS picked.
        self.addr = sock.getsockopt_string(zmq.LAST_ENDPOINT) or addr
        self.limits = limits
        sock.setsockopt(zmq.LINGER, DEFAULT_LINGER_MS)
        # Reject an oversized frame in ZeroMQ itself, before it is ever buffered whole.
        sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes + limits.max_header_bytes)

    def close(self, linger_ms: int | None = None) -> None:
        if not self.sock.closed:
            self.sock.close(linger=DEFAULT_LINGER_MS if linger_ms is None else linger_ms)

    def __enter__(self) -> _Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open(
    ctx: zmq.Context,
    kind: int,
    addr: str,
    bind: bool,
    options: dict[int, int] | None = None,
    security: Security = None,
) -> zmq.Socket:
    """A socket of `kind`, bound or connected to `addr`; `security`: CURVE (protocol/curve.py)
    or None for clear text."""
    sock = ctx.socket(kind)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)  # before bind/connect, so the pipes get them
    secure(sock, security)
    if bind:
        watch_refusals(sock, security)
    try:
        if bind:
            sock.bind(addr)
        else:
            sock.connect(addr)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        verb = "bind" if bind else "connect"
        raise OSError(f"cannot {verb} {addr}: {exc}") from None
    return sock


class PushChannel(_Channel):
    """The sending end of a ring link. Connect it to the next stage's bound PullChannel."""

    def __init__(
        self,
        addr: str,
        *,
        bind: bool = False,
        ctx: zmq.Context | None = None,
        security: Security = None,
    ) -> None:
        ctx = ctx or zmq.Context.instance()
        # No high-water mark: a send queues and returns; the ring bounds what is in flight.
        sock = _open(ctx, zmq.PUSH, addr, bind, {zmq.SNDHWM: 0}, security)
        super().__init__(sock, addr, Limits())
        self.queued: list[Any] = []  # frames of queued messages, sent as one by flush()
        self.held = False

    def send(self, msg: Any) -> None:
        """Send `msg` now (after anything queued, which goes first as its own message); while
        held, it joins the queued bundle instead, behind what is there."""
        if self.held:
            self.queue(msg)
            return
        self.flush()
        self._send(encode(msg))

    def hold(self) -> None:
        """Until `release`: nothing leaves, not even by `send`. The ring holds its link while
        a queued frame is still being written by a device (a seam queued before the GPU has
        filled it, ring/loop.py): a control message forwarded meanwhile must not flush it."""
        self.held = True

    def release(self) -> None:
        self.held = False

    def queue(self, msg: Any) -> None:
        """Add `msg` to the bundle `flush` sends. A ring stage queues its step's reqs, output
        and proxy and flushes once per step: one ZeroMQ message, one I/O-thread wake-up and
        one receive per step instead of three, which is most of the ring's CPU per step on a
        busy host. The receiver splits them (PullChannel.recv_many)."""
        self.queued += encode(msg)

    def flush(self) -> None:
        if self.queued and not self.held:
            frames, self.queued = self.queued, []
            self._send(frames)

    def _send(self, frames: list[Any]) -> None:
        try:
            _send_frames(self.sock, frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            # Only possible with a bound PUSH that no peer has connected to yet.
            raise OSError(f"cannot send on {self.addr}: no peer is connected") from None


class PullChannel(_Channel):
    """The receiving end of a ring link; binds by default."""

    def __init__(
        self,
        addr: str,
        *,
        bind: bool = True,
        ctx: zmq.Context | None = None,
        limits: Limits | None = None,
        security: Security = None,
    ) -> None:
        ctx = ctx or zmq.Context.instance()
        sock = _open(ctx, zmq.PULL, addr, bind, security=security)
        super().__init__(sock, addr, limits or Limits())

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next message. Raises ChannelTimeout, or ProtocolError for a bad message (the
        message is consumed either way, so the next call reads the next one)."""
        if timeout_s is not None and not self.sock.poll(_timeout_ms(timeout_s)):
            raise ChannelTimeout(f"no message on {self.addr} within {timeout_s:.3g} s")
        return decode(self.sock.recv_multipart(copy=False), self.limits)

    def recv_many(self, timeout_s: float | None = None) -> list[Any]:
        """The messages of the next ZeroMQ message: one, or a bundle a PushChannel flushed."""
        if timeout_s is not None and not self.sock.poll(_timeout_ms(timeout_s)):
            raise ChannelTimeout(f"no message on {self.addr} within {timeout_s:.3g} s")
        return decode_many(self.sock.recv_multipart(copy=False), self.limits)

    def poll(self, timeout_s: float = 0.0) -> bool:
        return bool(self.sock.poll(_timeout_ms(timeout_s)))


class RouterChannel(_Channel):
    """The frontend's client-facing socket: many clients, each addressed by its identity."""

    def __init__(
        self,
        addr: str,
        *,
        ctx: zmq.Context | None = None,
        limits: Limits = CLIENT_LIMITS,
        security: Security = None,
    ) -> None:
        ctx = ctx or zmq.Context.instance()
        sock = _open(ctx, zmq.ROUTER, addr, bind=True, security=security)
        # A reply to a client that has gone away is dropped, not an error.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        super().__init__(sock, addr, limits)

    def recv(self, timeout_s: float | None = None) -> tuple[bytes, Any]:
        if timeout_s is not None and not self.sock.poll(_timeout_ms(timeout_s)):
            raise ChannelTimeout(f"no message on {self.addr} within {timeout_s:.3g} s")
        return _split_router(self.sock.recv_multipart(copy=False), self.limits)

    def send(self, identity: bytes, msg: Any) -> None:
        _send_frames(self.sock, [identity, *encode(msg)], flags=zmq.NOBLOCK)


class DealerChannel(_Channel):
    """A blocking client's socket."""

    def __init__(
        self,
        addr: str,
        *,
        ctx: zmq.Context | None = None,
        limits: Limits = CLIENT_LIMITS,
        security: Security = None,
    ) -> None:
        ctx = ctx or zmq.Context.instance()
        sock = _open(ctx, zmq.DEALER, addr, bind=False, security=security)
        super().__init__(sock, addr, limits)
        self.pending: deque[Any] = deque()  # the rest of the last bundle received

    def send(self, msg: Any, timeout_s: float | None = None) -> None:
        """Send `msg`; with `timeout_s`, raise ChannelTimeout if no peer takes it by then. (A
        DEALER blocks while it has no connected peer, e.g. a CURVE server refusing it.)

        Tried without blocking, and polled between tries, until the deadline: a pipe can
        appear and go again between a poll and a blocking send (a CURVE server dropping a
        refused peer), and such a send would then wait forever (it did, once in CI)."""
        frames = encode(msg)
        if timeout_s is None:
            _send_frames(self.sock, frames)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                _send_frames(self.sock, frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                pass  # no peer takes it now (or it went since the last poll)
            remaining_ms = _timeout_ms(deadline - time.monotonic())
            if remaining_ms:
                self.sock.poll(remaining_ms, zmq.POLLOUT)
            elif time.monotonic() >= deadline:
                raise ChannelTimeout(f"cannot send to {self.addr} within {timeout_s:.3g} s")

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next message: the frontend bundles what it has for a client at once
        (AsyncRouterChannel.send_many), and they come out one at a time, in order."""
        if not self.pending:
            if timeout_s is not None and not self.sock.poll(_timeout_ms(timeout_s)):
                raise ChannelTimeout(f"no reply from {self.addr} within {timeout_s:.3g} s")
            self.pending.extend(decode_many(self.sock.recv_multipart(copy=False), self.limits))
        return self.pending.popleft()


class AsyncRouterChannel(_Channel):
    """RouterChannel for an asyncio event loop (the frontend)."""

    def __init__(
        self,
        addr: str,
        *,
        ctx: zmq.asyncio.Context | None = None,
        limits: Limits = CLIENT_LIMITS,
        security: Security = None,
    ) -> None:
        ctx = ctx or zmq.asyncio.Context.instance()
        sock = _open(ctx, zmq.ROUTER, addr, bind=True, security=security)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        super().__init__(sock, addr, limits)

    async def recv(self) -> tuple[bytes, Any]:
        return _split_router(await self.sock.recv_multipart(copy=False), self.limits)

    async def send(self, identity: bytes, msg: Any) -> None:
        await self.sock.send_multipart([identity, *encode(msg)], copy=False)

    def send_many(self, identity: bytes, msgs: list[Any]) -> None:
        """`msgs` to one client, in order, as few ZeroMQ messages as the client's bundle cap
        allows (DealerChannel.recv splits them): one a step for all of a client's streams,
        not one a token each, as vLLM's engine core sends one batch of outputs a step.

        Not awaited: a ROUTER send never waits (an unroutable message, or one past the
        high-water mark, is dropped), so the future pyzmq returns is already done. It must
        still go through the asyncio socket, not a plain shadow of it: a send reads the
        socket's pending events, and only the asyncio socket then wakes a waiting recv
        (through a shadow, a client's request that arrived meanwhile was never read)."""
        cap = self.limits.max_bundle
        for start in range(0, len(msgs), cap):
            frames = encode_many(msgs[start : start + cap])
            self.sock.send_multipart([identity, *frames], copy=False)


class AsyncDealerChannel(_Channel):
    """DealerChannel for asyncio (the async client)."""

    def __init__(
        self,
        addr: str,
        *,
        ctx: zmq.asyncio.Context | None = None,
        limits: Limits = CLIENT_LIMITS,
        security: Security = None,
    ) -> None:
        ctx = ctx or zmq.asyncio.Context.instance()
        sock = _open(ctx, zmq.DEALER, addr, bind=False, security=security)
        super().__init__(sock, addr, limits)
        self.pending: deque[Any] = deque()  # the rest of the last bundle received

    async def send(self, msg: Any) -> None:
        await self.sock.send_multipart(encode(msg), copy=False)

    async def recv(self) -> Any:
        """The next message, one at a time out of the frontend's bundles (DealerChannel)."""
        if not self.pending:
            frames = await self.sock.recv_multipart(copy=False)
            self.pending.extend(decode_many(frames, self.limits))
        return self.pending.popleft()


def _split_router(frames: list[Any], limits: Limits) -> tuple[bytes, Any]:
    identity = frames[0].bytes
    try:
        return identity, decode(frames[1:], limits)
    except ProtocolError as exc:
        raise BadClientMessage(identity, str(exc)) from None


class AsyncPullChannel(_Channel):
    """PullChannel for asyncio: the frontend's end of stage 0's deltas."""

    def __init__(
        self,
        addr: str,
        *,
        bind: bool = True,
        ctx: zmq.asyncio.Context | None = None,
        limits: Limits | None = None,
    ) -> None:
        ctx = ctx or zmq.asyncio.Context.instance()
        super().__init__(_open(ctx, zmq.PULL, addr, bind), addr, limits or Limits())

    async def recv(self) -> Any:
        return decode(await self.sock.recv_multipart(copy=False), self.limits)
