"""Clients fail fast where no frontend listens (launch/client.py), and wait where one does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import deque

import pytest

from launch.client import CONNECT_TIMEOUT_S, AsyncClient, Client, FrontendUnreachable
from launch.procs import ROOT, find_free_base_port
from protocol.channels import RouterChannel
from protocol.messages import Chunk, Done, Generate, Ping, Pong


def nothing_listens() -> str:
    return f"tcp://127.0.0.1:{find_free_base_port(1)}"


def test_ppring_generate_says_nothing_listens_within_the_connect_timeout(capsys):
    """Timed from the command's main, after start-up: the client waits the connect timeout
    (3 s), not the request timeout (120 s), and says why."""
    from launch.generate import main

    addr = nothing_listens()
    started = time.monotonic()
    code = main(["--addr", addr, "hello"])
    waited = time.monotonic() - started
    assert code == 1
    assert f"no ppring frontend answers at {addr}" in capsys.readouterr().err
    assert CONNECT_TIMEOUT_S <= waited < CONNECT_TIMEOUT_S + 2.0


def test_the_ppring_generate_command_exits_non_zero_where_nothing_listens():
    addr = nothing_listens()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "launch", "generate", "--addr", addr, "hello"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    assert f"no ppring frontend answers at {addr}" in done.stderr


def test_both_clients_raise_frontend_unreachable():
    addr = nothing_listens()
    with Client(addr, connect_timeout_s=0.5) as client, pytest.raises(FrontendUnreachable):
        client.complete("hello")

    async def run() -> None:
        async with AsyncClient(addr, connect_timeout_s=0.5) as client:
            await client.complete("hello")

    with pytest.raises(FrontendUnreachable):
        asyncio.run(run())


@pytest.mark.timeout(30)
def test_a_frontend_that_answers_the_ping_gets_the_full_timeout():
    """A frontend that pongs at once but answers the request only after the connect timeout:
    a ring that is up but slow."""
    addr = nothing_listens()
    router = RouterChannel(addr)

    def slow_frontend() -> None:
        for _ in range(2):
            identity, msg = router.recv(timeout_s=10)
            if isinstance(msg, Ping):
                router.send(identity, Pong(msg.rid))
            elif isinstance(msg, Generate):
                time.sleep(1.5)
                done = Done(msg.rid, "stop", 1, 0, 0.0, 0.0, 1.5)
                router.send(identity, done)

    thread = threading.Thread(target=slow_frontend, daemon=True)
    thread.start()
    try:
        with Client(addr, timeout_s=10, connect_timeout_s=0.5) as client:
            answer = client.complete("hello")
        assert answer.done.finish_reason == "stop"
    finally:
        thread.join(10)
        router.close(linger_ms=0)


@pytest.mark.timeout(30)
def test_the_async_client_times_out_a_silent_request_and_aborts_it():
    """A frontend that pongs but never answers the request: TimeoutError after timeout_s, and
    the stream's abort reaches the frontend (the ring would free the request)."""
    addr = nothing_listens()
    router = RouterChannel(addr)
    seen: list[str] = []

    def silent_frontend() -> None:
        for _ in range(3):
            identity, msg = router.recv(timeout_s=10)
            seen.append(msg.kind)
            if isinstance(msg, Ping):
                router.send(identity, Pong(msg.rid))

    async def run() -> float:
        async with AsyncClient(addr, timeout_s=0.5, connect_timeout_s=2.0) as client:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="no answer within"):
                await client.complete("hello")
            return time.monotonic() - started

    thread = threading.Thread(target=silent_frontend, daemon=True)
    thread.start()
    try:
        waited = asyncio.run(run())
    finally:
        thread.join(10)
        router.close(linger_ms=0)
    assert 0.4 < waited < 5.0
    assert seen == ["ping", "generate", "abort"]


class WaitingFrontend:
    """An AsyncDealerChannel whose frontend answers a generate with three messages (a token
    each, the last with the Done), all waiting once the request is sent: recv then returns
    without yielding, as pyzmq's does for a message that is there (a client behind a fast
    ring). `taken` counts the messages read off the socket."""

    def __init__(self) -> None:
        self.pending: deque = deque()  # the rest of the message being handed out
        self.waiting: deque[list] = deque()
        self.arrived = asyncio.Event()
        self.taken = 0

    async def send(self, msg) -> None:
        if isinstance(msg, Ping):
            self.waiting.append([Pong(msg.rid)])
        elif isinstance(msg, Generate):
            done = Done(msg.rid, "length", 1, 3, 0.0, 0.0, 0.0)
            self.waiting += [[Chunk(msg.rid, "a", [1])], [Chunk(msg.rid, "b", [2])]]
            self.waiting.append([Chunk(msg.rid, "c", [3]), done])
        self.arrived.set()

    async def recv(self):
        if not self.pending:
            while not self.waiting:
                self.arrived.clear()
                await self.arrived.wait()
            self.pending.extend(self.waiting.popleft())
            self.taken += 1
        return self.pending.popleft()

    def close(self, linger_ms: int | None = None) -> None:
        pass


def test_the_async_client_hands_each_message_to_its_stream_before_reading_the_next():
    """Otherwise a client behind the frontend hands out several steps' tokens in one turn of
    its event loop: one burst to whoever reads the stream, a TPOT of 0 to whoever times it."""

    async def run() -> list[tuple[list[int], int]]:
        client = AsyncClient(nothing_listens())
        client.channel.close(0)
        client.channel = frontend = WaitingFrontend()
        seen = []
        async with client:
            async for msg in client.generate(input_ids=[5], max_new_tokens=3):
                seen.append((getattr(msg, "token_ids", None), frontend.taken))
        return seen

    # (what the stream got, messages read off the socket by then)
    assert asyncio.run(run()) == [([1], 2), ([2], 3), ([3], 4), (None, 4)]
