"""Clients for a ppring frontend, over ZeroMQ (DEALER to the frontend's ROUTER).

    from launch.client import Client
    with Client("tcp://127.0.0.1:30000") as client:
        for chunk in client.generate("The capital of France is", max_new_tokens=16):
            print(chunk.text, end="", flush=True)
        print(client.complete("2 + 2 =", temperature=0).text)

`Client` is blocking and runs one request at a time; `AsyncClient` multiplexes any number of
concurrent requests over one socket. Leaving a stream early (break, close, timeout) aborts the
request in the ring.

A ring started with `--curve-dir` admits only clients with a key pair it knows:

    from protocol.curve import client_keys
    keys = client_keys("node0.key", "alice.key_secret")  # the frontend node's key, and yours
    client = Client("tcp://198.18.0.1:30000", security=keys)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from protocol.channels import AsyncDealerChannel, ChannelTimeout, DealerChannel
from protocol.curve import CurveClient
from protocol.messages import Abort, ChatMessage, Chunk, Done, Error, Generate, Ping, Pong
from protocol.sampling import SamplingParams
from ring.topology import DEFAULT_PORT

DEFAULT_ADDR = f"tcp://127.0.0.1:{DEFAULT_PORT}"
# How long a client waits for the frontend's first sign of life (its answer to a ping) before
# saying nothing listens; once it has answered, a slow ring gets the full request timeout.
CONNECT_TIMEOUT_S = 3.0


class FrontendUnreachable(ConnectionError):
    """No ppring frontend answered at the address."""

    def __init__(self, addr: str, timeout_s: float, curve: bool) -> None:
        hint = (
            "; is your key in the ring's clients/ folder, and is it node 0's key you passed?"
            if curve
            else "; if the ring runs with --curve-dir, pass its node key and your key pair"
        )
        super().__init__(f"no ppring frontend answers at {addr} (waited {timeout_s:.0f} s){hint}")


class RequestError(RuntimeError):
    """The frontend answered `error`; `code` says which kind (bad_request, ring_down, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    done: Done
    logprobs: list[float] = field(default_factory=list)
    # per token, with top_logprobs: {token id: logprob} of the most likely tokens at its step
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    @classmethod
    def of(cls, chunks: list[Chunk], done: Done) -> Completion:
        return cls(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            done=done,
            logprobs=[lp for c in chunks for lp in (c.logprobs or [])],
            top_logprobs=[
                dict(zip(ids, lps))
                for c in chunks
                for ids, lps in zip(c.top_ids or [], c.top_logprobs or [])
            ],
        )


def _build(
    rid: str,
    prompt: str | None,
    messages: list[dict[str, str]] | None,
    input_ids: list[int] | None,
    stop: list[str] | None,
    sampling: dict[str, Any],
) -> Generate:
    return Generate(
        rid=rid,
        prompt=prompt,
        messages=[ChatMessage(**m) for m in messages] if messages is not None else None,
        input_ids=input_ids,
        sampling=SamplingParams(**sampling),
        stop=list(stop or []),
    )


class _ClientBase:
    """What both clients hold: the address, the timeouts, and request ids unique to this client
    (`{prefix}-{n}`). `timeout_s` bounds the wait for each message of a stream."""

    def __init__(
        self, addr: str, timeout_s: float, connect_timeout_s: float, security: CurveClient | None
    ) -> None:
        self.addr = addr
        self.security = security
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]


class Client(_ClientBase):
    """Blocking client, one request at a time."""

    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        timeout_s: float = 120.0,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        security: CurveClient | None = None,
    ) -> None:
        super().__init__(addr, timeout_s, connect_timeout_s, security)
        self.channel = DealerChannel(addr, security=security)
        self._answered = False  # the frontend has answered something on this socket
        self.last_done: Done | None = None

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        input_ids: list[int] | None = None,
        stop: list[str] | None = None,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Stream the answer as chunks; `last_done` holds usage and timings afterwards."""
        rid = f"{self._prefix}-{next(self._ids)}"
        if not self._answered:
            self._send(Ping(rid=rid))
        self._send(_build(rid, prompt, messages, input_ids, stop, sampling))
        finished = False
        try:
            while True:
                msg = self._recv()
                if getattr(msg, "rid", None) != rid or isinstance(msg, Pong):
                    continue  # a late answer to an earlier, abandoned request
                if isinstance(msg, Chunk):
                    yield msg
                elif isinstance(msg, Done):
                    finished = True
                    self.last_done = msg
                    return
                elif isinstance(msg, Error):
                    finished = True
                    raise RequestError(msg.code, msg.message)
        finally:
            if not finished:
                with contextlib.suppress(ChannelTimeout):  # no frontend: nothing to abort
                    self.channel.send(Abort(rid=rid), timeout_s=0)

    def _send(self, msg: Any) -> None:
        timeout_s = self.timeout_s if self._answered else self.connect_timeout_s
        try:
            self.channel.send(msg, timeout_s)
        except ChannelTimeout:
            if not self._answered:
                raise FrontendUnreachable(self.addr, timeout_s, bool(self.security)) from None
            raise TimeoutError(f"could not send within {self.timeout_s:.0f} s") from None

    def _recv(self) -> Any:
        timeout_s = self.timeout_s if self._answered else self.connect_timeout_s
        try:
            msg = self.channel.recv(timeout_s)
        except ChannelTimeout:
            if not self._answered:
                raise FrontendUnreachable(self.addr, timeout_s, bool(self.security)) from None
            raise TimeoutError(f"no answer within {self.timeout_s:.0f} s") from None
        self._answered = True
        return msg

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        chunks = list(self.generate(prompt, **kwargs))
        return Completion.of(chunks, self.last_done)

    def chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Completion:
        return self.complete(messages=messages, **kwargs)

    def close(self) -> None:
        self.channel.close(linger_ms=200)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# asyncio.timeout (Python 3.11+) arms one timer handle per wait; wait_for wraps the wait in a
# task of its own. Per streamed token that was ~45 us of a client's CPU against ~28 (32 streams
# of 64 tokens from a stand-in frontend, 2-core Zen 4), and on a small host the client's CPU is
# taken from the stages it is measuring.
_timeout = getattr(asyncio, "timeout", None)


async def _next(queue: asyncio.Queue, timeout_s: float) -> Any:
    """The next message for one request, or TimeoutError after `timeout_s` without one."""
    if not queue.empty():
        return queue.get_nowait()
    try:
        if _timeout is None:  # Python 3.10
            return await asyncio.wait_for(queue.get(), timeout_s)
        async with _timeout(timeout_s):
            return await queue.get()
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:.0f} s") from None


class AsyncClient(_ClientBase):
    """asyncio client: many concurrent requests over one socket."""

    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        timeout_s: float = 120.0,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        security: CurveClient | None = None,
    ) -> None:
        super().__init__(addr, timeout_s, connect_timeout_s, security)
        self.channel = AsyncDealerChannel(addr, security=security)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._answered = asyncio.Event()  # the frontend has answered something
        self._pinged = False

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        input_ids: list[int] | None = None,
        stop: list[str] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Chunk | Done]:
        """Yields chunks, then the final Done."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        await self._check_frontend()
        rid = f"{self._prefix}-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            await self.channel.send(_build(rid, prompt, messages, input_ids, stop, sampling))
            while True:
                msg = await _next(queue, self.timeout_s)
                if isinstance(msg, Error):
                    finished = True
                    raise RequestError(msg.code, msg.message)
                yield msg
                if isinstance(msg, Done):
                    finished = True
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                await self.channel.send(Abort(rid=rid))

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        chunks, done = [], None
        async for msg in self.generate(prompt, **kwargs):
            if isinstance(msg, Done):
                done = msg
            else:
                chunks.append(msg)
        return Completion.of(chunks, done)

    async def chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Completion:
        return await self.complete(messages=messages, **kwargs)

    async def _check_frontend(self) -> None:
        """Before the first request: a ping, answered within the connect timeout, or
        FrontendUnreachable (every request waiting on it fails alike)."""
        try:
            if not self._pinged:
                self._pinged = True
                # A DEALER's send waits while no peer is connected (a CURVE server refusing
                # this client's key, say): bounded by the connect timeout too.
                ping = self.channel.send(Ping(rid=f"{self._prefix}-ping"))
                await asyncio.wait_for(ping, self.connect_timeout_s)
            await asyncio.wait_for(self._answered.wait(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise FrontendUnreachable(
                self.addr, self.connect_timeout_s, bool(self.security)
            ) from None

    async def _read(self) -> None:
        while True:
            msg = await self.channel.recv()
            self._answered.set()
            queue = self._queues.get(getattr(msg, "rid", ""))
            if queue is not None:
                queue.put_nowait(msg)
            if not self.channel.pending:
                # The frontend's message is handed out: its streams take it before the next
                # is read. A recv with a message ready does not yield, so a client behind the
                # frontend would hand out several steps' tokens in one turn (a burst, and a
                # TPOT of 0 for whoever times them).
                await asyncio.sleep(0)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.channel.close(linger_ms=200)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
