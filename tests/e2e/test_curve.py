"""`ppring local --curve-dir`: the client socket and the ring links under CURVE, on loopback,
with simulated stages (the three-host test in test_serve.py runs the real model across
namespaces). A known client is served; a client with no key or an unknown key is refused at
the ZeroMQ level, fails fast, and is logged once with its address; the ring keeps serving.
The same ring's HTTP API runs with --api-key: a request without the key is a 401."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from launch.client import Client, FrontendUnreachable
from launch.procs import ROOT
from protocol.curve import CurveClient, client_keys, keygen, load_pair

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
SIM = ["--stage-impl", "sim", "--sim-t0-ms", "1"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
API_KEY = "sk-ring-key"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    for rank in range(2):
        keygen(root / "ring", f"node{rank}")
    keygen(root / "ring" / "clients", "alice")
    keygen(root / "elsewhere", "mallory")
    return root


def test_a_curve_ring_serves_its_clients_and_refuses_the_others(start_local, keys):
    server = start_local(
        "--pp-size", "2", *SIM, "--curve-dir", str(keys / "ring"), "--api-key", API_KEY
    )  # fmt: skip
    alice = client_keys(keys / "ring" / "node0.key", keys / "ring" / "clients" / "alice.key_secret")
    with Client(server.addr, security=alice) as client:
        first = client.complete("hello", max_new_tokens=4, temperature=0)
    assert len(first.token_ids) == 4

    mallory = CurveClient(load_pair(keys / "elsewhere" / "mallory.key_secret"), alice.server_key)
    for security in (None, mallory):
        started = time.monotonic()
        with (
            pytest.raises(FrontendUnreachable, match="no ppring frontend answers"),
            Client(server.addr, security=security, connect_timeout_s=2.0) as client,
        ):
            client.complete("let me in", max_new_tokens=4)
        assert time.monotonic() - started < 5

    with Client(server.addr, security=alice) as client:  # still serving
        again = client.complete("hello", max_new_tokens=4, temperature=0)
    assert again.token_ids == first.token_ids
    cli = subprocess.run(
        [sys.executable, "-m", "launch", "generate", "--addr", server.addr, "--max-new-tokens",
         "3", "--server-key", str(keys / "ring" / "node0.key"),
         "--curve-key", str(keys / "ring" / "clients" / "alice.key_secret"), "hi"],
        capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr

    log = server.log_text()
    port = server.addr.rsplit(":", 1)[1]
    no_key = [line for line in log.splitlines() if "did not complete a CURVE handshake" in line]
    assert len(no_key) == 1 and f"to tcp://127.0.0.1:{port} from" in no_key[0]
    unknown = [line for line in log.splitlines() if "is not admitted" in line]
    assert len(unknown) == 1
    assert "refused a clients connection from 127.0.0.1" in unknown[0]
    assert mallory.pair.public.decode() in unknown[0]

    body = {"model": "ring", "prompt": "hi", "max_tokens": 2}
    anonymous = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=30)
    assert anonymous.status_code == 401
    assert httpx.get(f"{server.http_url}/health", timeout=30).status_code == 200
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(f"{server.http_url}/v1/models", headers=bearer, timeout=30).json()
    body["model"] = models["data"][0]["id"]
    served = httpx.post(f"{server.http_url}/v1/completions", json=body, headers=bearer, timeout=30)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    assert API_KEY not in server.log_text() and API_KEY.encode() not in server.stdout


def test_missing_keys_are_one_sentence_before_anything_starts(tmp_path):
    keygen(tmp_path, "node0")
    keygen(tmp_path, "node1")
    (tmp_path / "node1.key_secret").unlink()  # ppring local runs node 1 here: it needs it
    run = subprocess.run(
        [sys.executable, "-m", "launch", "local", "--pp-size", "2", *SIM, "--http-port", "0",
         "--curve-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert run.returncode == 2
    assert "node1.key_secret is missing" in run.stderr
    assert "Traceback" not in run.stderr
