"""End-to-end: `ppring local` as a real process tree, clients over ZeroMQ."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
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
