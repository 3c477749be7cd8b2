"""Clients fail fast where no frontend listens (launch/client.py), and wait where one does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from launch.client import AsyncClient, Client, FrontendUnreachable
from launch.procs import ROOT, find_free_base_port
from protocol.channels import RouterChannel
from protocol.messages import Done, Generate, Ping, Pong


def nothing_listens() -> str:
    return f"tcp://127.0.0.1:{find_free_base_port(1)}"


def test_ppring_generate_says_nothing_listens_within_5_s():
    addr = nothing_listens()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.monotonic()
    cmd = [sys.executable, "-m", "launch", "generate", "--addr", addr, "hello"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30)
    assert time.monotonic() - started < 5.0
    assert done.returncode != 0
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
