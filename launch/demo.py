"""`make demo`: start a 2-stage ring of the default model, stream one chat answer, stop.

Everything it starts is stopped by PID when it ends, also on Ctrl-C or an error.
"""

from __future__ import annotations

import os
import subprocess
import sys

from launch.client import Client
from launch.procs import ROOT, ProcessGroup, find_free_base_port, wait_for_ready_line

QUESTION = "What is pipeline parallelism, in two sentences?"
READY_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    port = find_free_base_port(16)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    http_port = port + 15  # the ring takes the first few of the 16 free ports
    cmd = [sys.executable, "-m", "launch", "local", "--pp-size", "2", "--port", str(port)]
    cmd += ["--http-port", str(http_port)]
    print(f"$ ppring local --pp-size 2 --port {port} --http-port {http_port}", flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        addr = wait_for_ready_line(server, READY_TIMEOUT_S, echo=True)
        print(f"\n$ ppring generate --chat {QUESTION!r}", flush=True)
        with Client(addr) as client:
            messages = [{"role": "user", "content": QUESTION}]
            for chunk in client.generate(messages=messages, max_new_tokens=96, temperature=0):
                print(chunk.text, end="", flush=True)
            done = client.last_done
        print(
            f"\n\n[{done.finish_reason}] {done.completion_tokens} tokens; TTFT "
            f"{done.ttft_s * 1000:.0f} ms, TPOT {done.tpot_s * 1000:.0f} ms (2 stages, 1 thread "
            "each, on CPU, in the dtype the summary above names)",
            flush=True,
        )
        return 0
    finally:
        ProcessGroup([server]).stop(grace_s=30)  # SIGTERM: a graceful ring shutdown


if __name__ == "__main__":
    sys.exit(main())
