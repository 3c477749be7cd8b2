"""A ring's stages never outlive their launcher, however it dies (launch/stage.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.procs import ROOT, find_free_base_port, wait_for_ready_line


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:  # fields: state, ppid, ...
                found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def sim_launcher(pp_size: int, env: dict[str, str]):
    """`ppring local` with simulated stages, its stdout a pipe, read up to its ready line; yields
    (launcher, its stage PIDs). Every process is stopped by PID afterwards, also on failure."""
    port = find_free_base_port(16)
    cmd = [
        sys.executable, "-m", "launch", "local", "--pp-size", str(pp_size),
        "--stage-impl", "sim", "--port", str(port), "--http-port", "0",
    ]  # fmt: skip
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    stages: list[int] = []
    try:
        wait_for_ready_line(launcher, 150)
        stages += children_of(launcher.pid)
        assert len(stages) == pp_size and all(alive(pid) for pid in stages)
        yield launcher, stages
    finally:
        for pid in stages:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


def survivors(stages: list[int], within_s: float = 5.0) -> list[int]:
    """The stages still alive after up to `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in stages) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in stages if alive(pid)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(180)
def test_a_sigkilled_launcher_leaves_no_stage_of_its_ring(default_model):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    with sim_launcher(3, env) as (launcher, stages):
        launcher.kill()  # SIGKILL: the launcher runs no cleanup at all
        launcher.wait(10)
        assert survivors(stages) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(180)
def test_sigterm_stops_a_launcher_whose_stdout_reader_is_gone(default_model):
    """The parent reading the launcher's stdout went away: SIGTERM still shuts the ring down
    (printing "shutting down" to the dead pipe used to raise before the shutdown was asked)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONUNBUFFERED", None)  # buffered, as under a parent: the exit's flush must pass
    with sim_launcher(2, env) as (launcher, stages):
        launcher.stdout.close()  # the reader is gone: the launcher's next write gets EPIPE
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(15)
        assert survivors(stages) == []
        assert launcher.returncode == 0
