"""`ppring serve`: one process per node, with node 0's rendezvous. On loopback for the start-up
checks; across three network namespaces (real separate hosts, addresses in 198.18.0.0/15) for
the ring itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from launch.procs import ROOT, find_free_base_port
from tests.e2e.conftest import PROMPTS
from tests.tiny_llama import make_tiny_llama

ENV = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))


def serve_argv(rank: int, nnodes: int, rdv: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "launch", "serve", "--node-rank", str(rank),
        "--nnodes", str(nnodes), "--dist-init-addr", rdv, "--port", str(port),
        "--threads-per-stage", "1", "--http-port", "0", *extra,
    ]  # fmt: skip


class Nodes:
    """Processes started by PID and stopped by PID, whatever happens."""

    def __init__(self, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, argv: list[str], name: str, prefix: list[str] | None = None):
        out = open(self.log_dir / f"{name}.out", "wb")  # noqa: SIM115
        err = open(self.log_dir / f"{name}.err", "wb")  # noqa: SIM115
        proc = subprocess.Popen([*(prefix or []), *argv], stdout=out, stderr=err, env=ENV)
        out.close()
        err.close()
        self.procs.append(proc)
        return proc

    def text(self, name: str, stream: str = "err") -> str:
        return (self.log_dir / f"{name}.{stream}").read_text()

    def wait_ready(self, name: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while "ready: " not in self.text(name, "out"):
            assert time.monotonic() < deadline, self.text(name)
            time.sleep(0.5)

    def stop(self) -> None:
        # Node 0 first: its SIGTERM takes the whole ring down gracefully, the others follow.
        for proc in sorted(self.procs, key=lambda p: "--node-rank 0" not in " ".join(p.args)):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def nodes(tmp_path):
    group = Nodes(tmp_path)
    yield group
    group.stop()


@pytest.mark.timeout(300)
def test_a_duplicate_rank_and_a_different_model_are_refused(nodes, default_model, tmp_path):
    port = find_free_base_port(12)
    rdv = f"127.0.0.1:{port + 10}"
    node0 = nodes.start(serve_argv(0, 3, rdv, port, "--rendezvous-timeout", "60"), "n0")
    nodes.start(serve_argv(1, 3, rdv, port), "n1")
    time.sleep(3)
    dup1 = nodes.start(serve_argv(1, 3, rdv, port), "dup1")
    dup0 = nodes.start(serve_argv(0, 3, rdv, port), "dup0")
    other = make_tiny_llama(tmp_path / "tiny", num_layers=6)
    wrong = nodes.start(serve_argv(2, 3, rdv, port, "--model", str(other)), "wrong")
    assert dup1.wait(120) == 2
    assert "rank 1 is already registered" in nodes.text("dup1")
    assert dup0.wait(120) == 2
    assert "another node 0" in nodes.text("dup0")
    assert wrong.wait(120) == 2
    assert "node 2 loaded a different model" in nodes.text("wrong")
    assert node0.poll() is None  # node 0 still waits for a proper rank 2


@pytest.mark.timeout(120)
def test_a_rendezvous_that_waits_too_long_names_the_missing_ranks(nodes):
    port = find_free_base_port(12)
    rdv = f"127.0.0.1:{port + 10}"
    node0 = nodes.start(serve_argv(0, 3, rdv, port, "--rendezvous-timeout", "5"), "n0")
    nodes.start(serve_argv(2, 3, rdv, port, "--rendezvous-timeout", "5"), "n2")
    assert node0.wait(60) == 2
    assert "ranks [1] never registered" in nodes.text("n0")


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def three_hosts():
    """Three network namespaces on one bridge (itself in a fourth namespace, so this machine's
    own network is untouched), addressed 198.18.0.1-3. Skips only if namespaces cannot be made."""
    tag = uuid.uuid4().hex[:6]
    hub, names = f"pph{tag}", [f"ppn{tag}{i}" for i in range(3)]
    try:
        run("ip", "netns", "add", hub)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot create network namespaces here ({exc}); this test needs root")
    made = [hub]
    try:
        run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            run("ip", "netns", "add", name)
            made.append(name)
            run("ip", "-n", name, "link", "set", "lo", "up")
            run("ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name",
                f"v{i}", "netns", hub)  # fmt: skip
            run("ip", "-n", hub, "link", "set", f"v{i}", "master", "br0")
            run("ip", "-n", hub, "link", "set", f"v{i}", "up")
            run("ip", "-n", name, "addr", "add", f"198.18.0.{i + 1}/24", "dev", "eth0")
            run("ip", "-n", name, "link", "set", "eth0", "up")
        yield names
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("node0_first", [False, True])
def test_three_hosts_serve_the_same_greedy_tokens(nodes, three_hosts, hf_greedy, node0_first):
    port = 31000
    rdv = f"198.18.0.1:{port + 20}"
    order = [0, 1, 2] if node0_first else [2, 1, 0]
    for rank in order:
        argv = serve_argv(rank, 3, rdv, port, "--host", f"198.18.0.{rank + 1}")
        nodes.start(argv, f"n{rank}", prefix=["ip", "netns", "exec", three_hosts[rank]])
        time.sleep(1.0)
    nodes.wait_ready("n0")
    script = (
        "import json, sys; from launch.client import Client\n"
        f"c = Client('tcp://198.18.0.1:{port}')\n"
        "out = {p: c.complete(p, max_new_tokens=32, temperature=0).token_ids "
        "for p in json.loads(sys.argv[1])}\n"
        "print(json.dumps(out))\n"
    )
    import json

    client = subprocess.run(
        ["ip", "netns", "exec", three_hosts[0], sys.executable, "-c", script,
         json.dumps(PROMPTS[:3])],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert client.returncode == 0, client.stderr
    got = json.loads(client.stdout)
    for prompt in PROMPTS[:3]:
        assert got[prompt] == hf_greedy[prompt], prompt
