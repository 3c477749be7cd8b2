"""Start, watch and stop stage processes by PID; find free ports for a ring on loopback.

Used by the process-ring tests and benches now, and by `ppring local` / `serve`. Every process
started here is stopped by its own PID (terminate, then kill after a grace period), also when
the caller fails: never by name.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launch.stage import PARENT_PID_ENV
from protocol.messages import RingReady
from ring.harness import RingDriver
from ring.topology import RingAddresses

ROOT = Path(__file__).resolve().parent.parent
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
EXPLICIT_PORTS_FROM = 20000  # above the registered services most hosts run


def find_free_base_port(num_ports: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """A base port with `num_ports` consecutive free TCP ports after it (best effort: another
    process may still bind one before we do).

    Drawn at random below the kernel's ephemeral range: a port in that range can be handed to
    any process's outgoing connection between this probe and our bind (with two test workers
    connecting rings at once, a launcher then failed on a taken port); below it only an
    explicit bind takes a port, and the probe sees those."""
    low, high = EXPLICIT_PORTS_FROM, min(_ephemeral_low(), 65536) - num_ports
    if high <= low:  # an unusual ephemeral range: anywhere, then
        low, high = 1024, 65536 - num_ports
    draw = random.SystemRandom()
    for _ in range(tries):
        base = draw.randrange(low, high)
        if all(_port_is_free(host, base + i) for i in range(num_ports)):
            return base
    raise OSError(f"found no {num_ports} consecutive free ports on {host}")


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def wait_for_ready_line(server: subprocess.Popen, timeout_s: float, echo: bool = False) -> str:
    """Read `ppring local`'s stdout (a pipe) until its `ready: ADDR` line and return ADDR;
    `echo` prints each line, indented, as it comes. SystemExit if it exits or is too slow."""
    deadline = time.monotonic() + timeout_s
    buffer = b""
    while True:
        if server.poll() is not None:
            raise SystemExit(f"ppring local exited with code {server.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"ppring local was not ready within {timeout_s:.0f} s")
        readable, _, _ = select.select([server.stdout], [], [], 0.5)
        if not readable:
            continue
        data = os.read(server.stdout.fileno(), 65536)
        if not data:  # it closed its output without a ready line
            server.wait(timeout_s)
            raise SystemExit(f"ppring local exited with code {server.returncode}")
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            text = line.decode(errors="replace")
            if echo:
                print("  " + text, flush=True)
            if text.startswith("ready: "):
                return text.removeprefix("ready: ").strip()


@dataclass
class ProcessGroup:
    """Child processes started together; each stopped by PID."""

    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(
        self, argv: Sequence[str], log_path: Path | None = None, inherit: bool = False
    ) -> subprocess.Popen:
        """Start `argv` with its output in `log_path`, or on our stderr if `inherit` (stdout
        stays ours alone), or discarded."""
        # The stage asks the kernel to kill it when this process dies (launch/stage.py).
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_PID_ENV: str(os.getpid())})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if log_path:
            out = open(log_path, "ab")  # noqa: SIM115 - closed below; the child keeps its copy
        else:
            out = sys.stderr if inherit else subprocess.DEVNULL
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env)
        if log_path:
            out.close()
        self.procs.append(proc)
        return proc

    def poll_dead(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is not None]

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0.01))
        return [p.poll() for p in self.procs]

    def stop(self, grace_s: float = 5.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@dataclass
class ProcessRing:
    """S stage processes over loopback TCP and a driver standing in for the frontend."""

    pp_size: int
    stage_args: list[str] = field(default_factory=list)  # extra flags for every stage
    log_dir: Path | None = None
    transport: str = "tcp"

    def __enter__(self) -> ProcessRing:
        self.base_port = find_free_base_port(self.pp_size + 3)
        self.run_id = f"ppring-{os.getpid()}-{self.base_port}"
        self.addrs = RingAddresses(
            self.pp_size, transport=self.transport, base_port=self.base_port, run_id=self.run_id
        )
        self.driver = RingDriver(self.addrs)
        self.group = ProcessGroup()
        try:
            for rank in range(self.pp_size):
                argv = [
                    sys.executable, "-m", "launch.stage",
                    "--rank", str(rank), "--pp-size", str(self.pp_size),
                    "--port", str(self.base_port), "--transport", self.transport,
                    "--run-id", self.run_id, *self.stage_args,
                ]  # fmt: skip
                log = self.log_dir / f"stage{rank}.log" if self.log_dir else None
                self.group.start(argv, log)
        except BaseException:
            self.group.stop()
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.group.procs]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until stage 0 says the ring agreed its KV capacity."""
        deadline = time.monotonic() + timeout_s
        while not any(isinstance(c, RingReady) for c in self.driver.ctrl):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ring was not ready within {timeout_s:.0f} s")
            dead = self.group.poll_dead()
            if dead:
                raise RuntimeError(f"a stage exited with {dead[0].returncode} during start-up")
            self.driver.poll(0.1)

    def shutdown(self, timeout_s: float = 20.0) -> list[int | None]:
        self.driver.shutdown()
        return self.group.wait(timeout_s)

    def __exit__(self, *exc: object) -> None:
        self.group.stop()
        self.driver.close()
