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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(180)
def test_a_sigkilled_launcher_leaves_no_stage_of_its_ring(default_model):
    port = find_free_base_port(16)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "launch", "local", "--pp-size", "3", "--stage-impl", "sim",
        "--port", str(port), "--http-port", "0",
    ]  # fmt: skip
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    stages: list[int] = []
    try:
        wait_for_ready_line(launcher, 150)
        stages = children_of(launcher.pid)
        assert len(stages) == 3 and all(alive(pid) for pid in stages)
        launcher.kill()  # SIGKILL: the launcher runs no cleanup at all
        launcher.wait(10)
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in stages) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in stages if alive(pid)] == []
    finally:
        for pid in stages:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(180)
def test_sigterm_stops_a_launcher_whose_stdout_reader_is_gone(default_model):
    """The parent reading the launcher's stdout went away: SIGTERM still shuts the ring down
    (printing "shutting down" to the dead pipe used to raise before the shutdown was asked)."""
    port = find_free_base_port(16)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONUNBUFFERED", None)  # buffered, as under a parent: the exit's flush must pass
    cmd = [
        sys.executable, "-m", "launch", "local", "--pp-size", "2", "--stage-impl", "sim",
        "--port", str(port), "--http-port", "0",
    ]  # fmt: skip
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    stages: list[int] = []
    try:
        wait_for_ready_line(launcher, 150)
        stages = children_of(launcher.pid)
        assert len(stages) == 2 and all(alive(pid) for pid in stages)
        launcher.stdout.close()  # the reader is gone: the launcher's next write gets EPIPE
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(15)
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in stages) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in stages if alive(pid)] == []
        assert launcher.returncode == 0
    finally:
        for pid in stages:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
