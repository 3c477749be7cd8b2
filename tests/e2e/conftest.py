"""End-to-end: `ppring local` as a real process tree, clients over ZeroMQ."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from launch.prepare_model import prepare_default_model
from launch.procs import ROOT, find_free_base_port

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]

# Every ring a test starts gets this KV budget per stage unless the test names its own (argparse
# keeps the last value given). The default 1 GiB holds 46k tokens at PP=2, far more than any test
# sends, and touching its pages cost 2-7 s of each ring's start on this CI's VMs (0.25 GiB: under
# 1 s); the suite starts a few dozen rings.
TEST_KV_ARGS = ("--kv-memory-gib", "0.25")


class LocalServer:
    """`ppring local ...` started by PID; stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.args = args
        self.port = find_free_base_port(16)
        self.http_port = self.port + 15  # the ring takes the first few of the 16 ports
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        self.log_path = log_dir / f"local-{self.port}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launch",
                "local",
                "--port",
                str(self.port),
                "--http-port",
                str(self.http_port),
                *TEST_KV_ARGS,
                *args,
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
        )
        self.addr = f"tcp://127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.stdout = b""

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while b"ready: " not in self.stdout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ppring local exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("ppring local was not ready in time")
            readable, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if readable:
                self.stdout += os.read(self.proc.stdout.fileno(), 65536)

    def log_text(self) -> str:
        """What the launcher and its stages wrote to stderr so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def default_model() -> Path:
    return prepare_default_model(quiet=True)


@pytest.fixture(scope="session")
def hf_greedy(default_model):
    """transformers' own greedy continuation of each prompt: the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    model.eval()
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
        out[prompt] = gen[0, ids.shape[1] :].tolist()
    return out


@pytest.fixture
def start_local(tmp_path):
    servers: list[LocalServer] = []

    def start(*args: str) -> LocalServer:
        server = LocalServer(list(args), tmp_path)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class Hosts(list):
    """The namespaces of the three hosts, and `hub`, the one holding their bridge."""

    def __init__(self, names: list[str], hub: str) -> None:
        super().__init__(names)
        self.hub = hub


@pytest.fixture
def three_hosts():
    """Three network namespaces on one bridge (itself in a fourth namespace, so this machine's
    own network is untouched), addressed 198.18.0.1-3. Skips only if namespaces cannot be made.
    A test asks for it before the fixture that starts processes in it (`nodes`): fixtures end
    in reverse, so the processes stop while the bridge still joins them (a graceful shutdown
    that goes round the ring needs it)."""
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
        yield Hosts(names, hub)
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
