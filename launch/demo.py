"""`make demo`: start a 2-stage ring of the default model, stream one chat answer, stop.

Everything it starts is stopped by PID when it ends, also on Ctrl-C or an error.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from launch.client import Client
from launch.procs import ROOT, find_free_base_port

QUESTION = "What is pipeline parallelism, in two sentences?"
READY_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    port = find_free_base_port(16)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "launch", "local", "--pp-size", "2", "--port", str(port)]
    print("$ ppring local --pp-size 2 --port", port, flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        addr = wait_ready(server)
        print(f"\n$ ppring generate --chat {QUESTION!r}", flush=True)
        with Client(addr) as client:
            messages = [{"role": "user", "content": QUESTION}]
            for chunk in client.generate(messages=messages, max_new_tokens=96, temperature=0):
                print(chunk.text, end="", flush=True)
            done = client.last_done
        print(
            f"\n\n[{done.finish_reason}] {done.completion_tokens} tokens; TTFT "
            f"{done.ttft_s * 1000:.0f} ms, TPOT {done.tpot_s * 1000:.0f} ms (2 stages, 1 thread "
            "each, fp32 on CPU)",
            flush=True,
        )
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def wait_ready(server: subprocess.Popen) -> str:
    """Echo the server's start-up summary until its `ready:` line; return the address."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    buffer = b""
    while True:
        if server.poll() is not None:
            raise SystemExit(f"ppring local exited with code {server.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit("ppring local was not ready in time")
        readable, _, _ = select.select([server.stdout], [], [], 0.5)
        if not readable:
            continue
        buffer += os.read(server.stdout.fileno(), 65536)
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            text = line.decode()
            print("  " + text, flush=True)
            if text.startswith("ready: "):
                return text.removeprefix("ready: ")


if __name__ == "__main__":
    sys.exit(main())
