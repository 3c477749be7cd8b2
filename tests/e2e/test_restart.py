"""A stage that dies is restarted and its requests are replayed (launch/local.py `Restarter`,
launch/frontend.py `reform`): clients see a pause, not an error.

Simulated stages first (fast: each token is a known function of (seed, position, the token fed
before it), so an uninterrupted answer is computed, not run, and a token replayed wrong shows),
then the default model at PP=3 against transformers' greedy tokens and against an uninterrupted
ring's seeded samples."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from launch.client import AsyncClient, RequestError
from launch.procs import ROOT
from protocol.channels import PushChannel
from protocol.messages import Proxy
from ring.sim_stage import expected_tokens
from tests.e2e.conftest import PROMPTS
from tests.e2e.test_orphans import alive, children_of

SIM = ["--stage-impl", "sim", "--sim-t0-ms", "20"]


def stage_pids(server) -> list[int]:
    """The launcher's stage processes, by rank (started in rank order)."""
    return sorted(children_of(server.proc.pid))


def kill_stage(server, rank: int) -> int:
    pid = stage_pids(server)[rank]
    os.kill(pid, signal.SIGKILL)
    return pid


async def stream_all(addr: str, requests: list[dict], kill=None, kill_after_tokens: int = 4):
    """Run every request at once; call `kill()` once each has `kill_after_tokens` tokens.
    Returns (token ids per request, the longest gap between two tokens of one stream)."""
    tokens: list[list[int]] = [[] for _ in requests]
    gaps = [0.0]
    killed = asyncio.Event()

    async def one(i: int, client: AsyncClient) -> None:
        last = time.monotonic()
        async for msg in client.generate(**requests[i]):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            tokens[i] += getattr(msg, "token_ids", [])
            if kill and not killed.is_set() and all(len(t) >= kill_after_tokens for t in tokens):
                killed.set()
                kill()

    async with AsyncClient(addr, timeout_s=180) as client:
        await asyncio.gather(*(one(i, client) for i in range(len(requests))))
    return tokens, max(gaps)


def sim_expected(prompt_ids: list[int], seed: int, n: int) -> list[int]:
    return expected_tokens(prompt_ids, seed, n)


@pytest.mark.timeout(300)
def test_a_killed_stage_is_restarted_and_every_stream_completes(start_local, tmp_path):
    server = start_local("--pp-size", "3", *SIM, "--max-stage-restarts", "3")
    requests = [
        {"input_ids": [5 + i] * (3 + i), "max_new_tokens": 24, "temperature": 0.7, "seed": i}
        for i in range(16)
    ]
    got, pause = asyncio.run(stream_all(server.addr, requests, lambda: kill_stage(server, 1)))
    for i, request in enumerate(requests):
        assert got[i] == sim_expected(request["input_ids"], i, 24), i  # none twice, none lost
    log = server.log_text()
    assert "the ring is re-forming after: stage 1 exited with code -9" in log
    assert "the ring re-formed (epoch 1)" in log and "replaying 16 requests" in log
    print(f"pause seen by the clients: {pause:.1f} s")
    assert pause < 60
    metrics = urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10).read().decode()
    assert "ppring:ring_restarts_total{model_name=" in metrics
    assert any(
        line.startswith("ppring:replayed_requests_total") and line.endswith(" 16.0")
        for line in metrics.splitlines()
    )

    # A proxy from the ring before the restart (epoch 0) is dropped, and named in the log.
    stale = PushChannel(f"tcp://127.0.0.1:{server.port + 3 + 1}")
    import torch

    stale.send(Proxy(1, 1, "stale", torch.zeros(1, 8), torch.zeros(1, 8), epoch=0))
    stale.close()
    deadline = time.monotonic() + 10
    while "dropped a stale proxy (step 1) of ring epoch 0" not in server.log_text():
        assert time.monotonic() < deadline, server.log_text()[-2000:]
        time.sleep(0.2)
    got, _ = asyncio.run(stream_all(server.addr, requests[:2]))  # and it serves on
    assert got[0] == sim_expected(requests[0]["input_ids"], 0, 24)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "restarts", [pytest.param(3, marks=pytest.mark.long), 1], ids=["default", "short"]
)
def test_one_death_too_many_fails_every_client_and_the_launcher(start_local, restarts):
    """With the default --max-stage-restarts 3, the fourth death in a row is fatal (make
    test: one restart allowed, the second death)."""
    server = start_local("--pp-size", "2", *SIM, "--max-stage-restarts", str(restarts))
    for restart in range(1, restarts + 1):
        pid = kill_stage(server, 1)
        deadline = time.monotonic() + 60
        marker = f"the ring re-formed (epoch {restart})"
        while marker not in server.log_text():
            assert time.monotonic() < deadline and server.proc.poll() is None
            time.sleep(0.2)
        assert not alive(pid)

    async def fourth() -> None:
        requests = [{"input_ids": [7] * 4, "max_new_tokens": 200, "seed": i} for i in range(4)]
        await stream_all(server.addr, requests, lambda: kill_stage(server, 1), 2)

    with pytest.raises(RequestError, match=f"ring_down.*stage 1 exited.*re-formed {restarts} time"):
        asyncio.run(fourth())
    assert server.proc.wait(30) == 1


@pytest.mark.long
@pytest.mark.timeout(600)
def test_the_default_model_at_pp3_loses_no_token_to_a_killed_stage(start_local, hf_greedy):
    """SIGKILL the middle stage mid-generation: 16 greedy streams finish equal to
    transformers'. Then the last stage, under seeded temperature sampling: equal to the same
    requests on the uninterrupted ring."""
    server = start_local("--pp-size", "3", "--dtype", "float32", "--max-stage-restarts", "3")
    greedy = [
        {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": 32, "temperature": 0}
        for i in range(16)
    ]
    started = time.monotonic()
    got, pause = asyncio.run(stream_all(server.addr, greedy, lambda: kill_stage(server, 1)))
    took = time.monotonic() - started
    print(f"greedy, middle stage killed: pause {pause:.1f} s, all in {took:.1f} s")
    for request, tokens in zip(greedy, got, strict=True):
        assert tokens == hf_greedy[request["prompt"]], request["prompt"]
    assert pause < 90  # model load plus a few seconds, on a shared 2-core host

    sampled = [
        {"prompt": PROMPTS[i], "max_new_tokens": 24, "temperature": 0.8, "seed": 100 + i}
        for i in range(len(PROMPTS))
    ]
    reference, _ = asyncio.run(stream_all(server.addr, sampled))
    got, pause = asyncio.run(stream_all(server.addr, sampled, lambda: kill_stage(server, 2)))
    print(f"sampled, last stage killed: pause {pause:.1f} s")
    assert got == reference
    assert "the ring re-formed (epoch 2)" in server.log_text()


@pytest.fixture
def nodes(tmp_path):
    from tests.e2e.test_serve import Nodes

    group = Nodes(tmp_path)
    yield group
    group.stop()


def _serve_ring(nodes, prefix=None, hosts=None, extra=(), ring_timeout_s=4):
    """Three `ppring serve` nodes; `hosts`/`prefix`: per rank (namespaces), else loopback.
    The ring timeout must exceed the stages' start-up skew (the handshake waits that long)."""
    from launch.procs import find_free_base_port
    from tests.e2e.test_serve import serve_argv

    port = 31100 if hosts else find_free_base_port(12)
    rdv = f"{hosts[0] if hosts else '127.0.0.1'}:{port + 20}"
    argv = {}
    for rank in range(3):
        host = ["--host", hosts[rank]] if hosts else []
        timeout = ["--ring-timeout", str(ring_timeout_s)]
        argv[rank] = serve_argv(rank, 3, rdv, port, *timeout, *host, *extra)
        nodes.start(argv[rank], f"n{rank}", prefix=prefix and prefix[rank])
    nodes.wait_ready("n0")
    return port, argv


@pytest.mark.timeout(300)
def test_a_serve_node_started_again_by_hand_rejoins_and_requests_finish(nodes):
    """Loopback, simulated stages: SIGKILL node 1 (its stage dies with it), start it again
    with the same --node-rank: the survivors leave the failed ring within the ring timeout and
    rejoin through node 0's rendezvous, and every stream finishes with its own tokens."""
    port, argv = _serve_ring(nodes, extra=SIM)
    requests = [
        {"input_ids": [3 + i] * 4, "max_new_tokens": 60, "seed": i, "temperature": 1.0}
        for i in range(8)
    ]

    def kill_node1() -> None:
        nodes.procs[1].kill()
        nodes.start(argv[1], "n1-again")

    got, pause = asyncio.run(
        stream_all(f"tcp://127.0.0.1:{port}", requests, kill_node1, kill_after_tokens=3)
    )
    for i, request in enumerate(requests):
        assert got[i] == sim_expected(request["input_ids"], i, 60), i
    print(f"pause seen by the clients: {pause:.1f} s")
    assert "ring epoch 1 formed" in nodes.text("n2")
    assert "the ring re-formed (epoch 1)" in nodes.text("n0")


NETNS_CLIENT = """
import asyncio, json, pathlib, sys
sys.path.insert(0, sys.argv[4])
from tests.e2e.test_restart import stream_all
marker = pathlib.Path(sys.argv[3])
requests = [{"prompt": p, "max_new_tokens": 32, "temperature": 0} for p in json.loads(sys.argv[2])]
got, pause = asyncio.run(stream_all(sys.argv[1], requests, marker.touch, kill_after_tokens=4))
print(json.dumps({"tokens": got, "pause": pause}))
"""


@pytest.mark.long
@pytest.mark.timeout(900)
def test_three_hosts_node1_killed_and_started_again_by_hand(
    three_hosts, nodes, hf_greedy, tmp_path
):
    """The default model across three namespaces: node 1's launcher SIGKILLed mid-generation
    (its stage dies with it) and started again by hand; the ring re-forms and every stream in
    flight finishes equal to transformers'."""
    import json

    hosts = [f"198.18.0.{r + 1}" for r in range(3)]
    prefix = [["ip", "netns", "exec", name] for name in three_hosts]
    # The default model loads in seconds per stage, and three at once on two cores take
    # longer: a ring timeout of 20 s, so start-up is never taken for a failure.
    port, argv = _serve_ring(nodes, prefix, hosts, ("--dtype", "float32"), ring_timeout_s=20)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    marker = tmp_path / "streaming"
    client = subprocess.Popen(
        [*prefix[2], sys.executable, "-c", NETNS_CLIENT, f"tcp://{hosts[0]}:{port}",
         json.dumps(prompts), str(marker), str(ROOT)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert time.monotonic() < deadline and client.poll() is None, client.stderr.read()
            time.sleep(0.1)
        nodes.procs[1].kill()
        nodes.procs[1].wait(10)
        nodes.start(argv[1], "n1-again", prefix=prefix[1])
        out, err = client.communicate(timeout=600)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, err
    result = json.loads(out)
    for prompt, tokens in zip(prompts, result["tokens"], strict=True):
        assert tokens == hf_greedy[prompt], prompt
    print(f"pause seen by the clients: {result['pause']:.1f} s")
    assert "the ring re-formed (epoch 1)" in nodes.text("n0")
