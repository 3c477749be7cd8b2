"""The one place that derives every address of a ring from its base port and the stage rank.

Ports from `base_port` on one host per stage (node 0's host for the frontend):

    base_port       frontend ROUTER (clients connect here)
    base_port + 1   frontend PULL   (stage 0 -> frontend: deltas, ring errors), on loopback
    base_port + 2   stage 0 PULL    (frontend -> stage 0: new requests, aborts, shutdown), on
                    loopback: the frontend and stage 0 always share node 0, so these two never
                    face a network
    base_port + 3+r stage r PULL    (stage r-1 -> stage r; stage S-1 -> stage 0 closes the ring)

`inproc://` (threads in one process, for fast tests) and `ipc://` (processes on one host) use
names under `run_id` instead of ports.
"""

from __future__ import annotations

from dataclasses import dataclass

# The frontend's port when none is given; the ring's other ports follow it (see above).
DEFAULT_PORT = 30000
DEFAULT_HTTP_PORT = 8000  # node 0's OpenAI-compatible API, vLLM's and SGLang's default
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RingAddresses:
    pp_size: int
    transport: str = "tcp"  # tcp | ipc | inproc
    hosts: tuple[str, ...] = ("127.0.0.1",)  # one per stage, or one for all
    base_port: int = DEFAULT_PORT
    run_id: str = "ppring"

    def __post_init__(self) -> None:
        if self.transport not in ("tcp", "ipc", "inproc"):
            raise ValueError(f"unknown transport {self.transport!r}: use tcp, ipc or inproc")
        if len(self.hosts) not in (1, self.pp_size):
            raise ValueError(f"give one host, or one per stage ({self.pp_size}), not {self.hosts}")
        if self.transport == "tcp" and not 1024 <= self.base_port <= 65535 - 3 - self.pp_size:
            raise ValueError(f"--port {self.base_port} leaves no room for {self.pp_size} stages")

    def host(self, rank: int) -> str:
        return self.hosts[rank if len(self.hosts) > 1 else 0]

    def _addr(self, rank: int, offset: int, name: str, host: str | None = None) -> str:
        if self.transport == "tcp":
            return f"tcp://{host or self.host(rank)}:{self.base_port + offset}"
        if self.transport == "ipc":
            return f"ipc:///tmp/{self.run_id}-{name}"
        return f"inproc://{self.run_id}-{name}"

    def frontend(self) -> str:
        return self._addr(0, 0, "frontend")

    def deltas(self) -> str:
        return self._addr(0, 1, "deltas", LOOPBACK)

    def intake(self) -> str:
        return self._addr(0, 2, "intake", LOOPBACK)

    def stage(self, rank: int) -> str:
        """Where stage `rank` listens for its ring predecessor."""
        return self._addr(rank, 3 + rank, f"stage{rank}")

    def next_stage(self, rank: int) -> str:
        return self.stage((rank + 1) % self.pp_size)
