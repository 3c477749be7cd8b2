"""The ring without the frontend, for tests and benches (not for serving): `RingDriver`, which
stands in for the frontend on stage 0's intake and deltas sockets, and `ThreadRing`, a whole
ring as threads of one process. The thread ring runs the same `StageLoop` and channels as the
process ring; only the transport differs (`inproc://` in one ZeroMQ context instead of
`tcp://`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from protocol.channels import ChannelTimeout, PullChannel, PushChannel
from protocol.messages import (
    Control,
    Deltas,
    NewRequest,
    RequestDelta,
    RingError,
    StopServing,
    Submit,
)
from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.control import ModelInfo
from ring.links import bind_links, connect_links
from ring.loop import StageLoop
from ring.topology import RingAddresses
from stages.contract import Stage


class RingDriver:
    """Stands in for the frontend: sends requests to stage 0 and collects what comes back."""

    def __init__(self, addrs: RingAddresses, ctx: zmq.Context | None = None) -> None:
        self.deltas = PullChannel(addrs.deltas(), ctx=ctx)
        self.intake = PushChannel(addrs.intake(), ctx=ctx)
        self.seq = 0
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float | None]] = {}
        self.finished: dict[str, RequestDelta] = {}
        self.cached_tokens: dict[str, int] = {}  # from each request's first token
        self.num_finishes: dict[str, int] = {}
        self.messages: list[list[str]] = []  # per Deltas message, the requests it told of
        self.ctrl: list[Control] = []

    def submit_many(self, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
        for rid, _, _ in requests:
            self.tokens[rid] = []
        self._send(new=[NewRequest(*r) for r in requests])

    def abort(self, rid: str) -> None:
        self._send(aborts=[rid])

    def shutdown(self) -> None:
        self.intake.send(StopServing())

    def _send(self, new: list | None = None, aborts: list | None = None) -> None:
        self.intake.send(Submit(seq=self.seq, new=new or [], aborts=aborts or []))
        self.seq += 1

    def poll(self, timeout_s: float) -> bool:
        """Read whatever arrives within `timeout_s`; False when nothing did."""
        try:
            msg = self.deltas.recv(timeout_s)
        except ChannelTimeout:
            return False
        if isinstance(msg, Deltas):
            self.messages.append([delta.rid for delta in msg.deltas])
            for delta in msg.deltas:
                if delta.token_id is not None:
                    if not self.tokens.get(delta.rid):
                        self.cached_tokens[delta.rid] = delta.cached_tokens
                    self.tokens.setdefault(delta.rid, []).append(delta.token_id)
                    self.logprobs.setdefault(delta.rid, []).append(delta.logprob)
                if delta.finish_reason:
                    self.finished[delta.rid] = delta
                    self.num_finishes[delta.rid] = self.num_finishes.get(delta.rid, 0) + 1
        else:
            self.ctrl.append(msg)
        return True

    def wait_finished(self, rids: set[str] | list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(rids)
        while pending - set(self.finished):
            if time.monotonic() > deadline:
                missing = sorted(pending - set(self.finished))
                raise TimeoutError(f"{len(missing)} requests unfinished, e.g. {missing[:5]}")
            self.poll(0.1)
            if (error := self.ring_error()) is not None:
                raise RuntimeError(f"ring reported an error: {error.message}")

    def ring_error(self) -> RingError | None:
        """The first error a stage reported, if any."""
        return next((c for c in self.ctrl if isinstance(c, RingError)), None)

    def close(self) -> None:
        self.intake.close(0)
        self.deltas.close(0)


@dataclass
class ThreadRing:
    """S stages as threads over inproc://, plus a driver. Use as a context manager."""

    cfg: RingConfig
    make_stage: Callable[[RingConfig], Stage]
    model: ModelInfo
    run_id: str = "ring"
    # Each stage's view of the model, and its flags, when they should differ (tests of the
    # handshake).
    model_for: Callable[[RingConfig], ModelInfo] | None = None
    cfg_for: Callable[[RingConfig], RingConfig] | None = None
    loops: list[StageLoop] = field(default_factory=list)
    exit_codes: dict[int, int] = field(default_factory=dict)

    def __enter__(self) -> ThreadRing:
        self.ctx = zmq.Context()
        self.addrs = RingAddresses(self.cfg.pp_size, transport="inproc", run_id=self.run_id)
        # inproc needs the binding side first (tcp does not): every stage binds, then the
        # driver (which binds the deltas PULL stage 0 connects to), then every stage connects.
        cfgs = [dataclasses.replace(self.cfg, rank=rank) for rank in range(self.cfg.pp_size)]
        if self.cfg_for is not None:
            cfgs = [self.cfg_for(c) for c in cfgs]
        links = [bind_links(c, self.addrs, self.ctx) for c in cfgs]
        self.driver = RingDriver(self.addrs, self.ctx)
        for c, stage_links in zip(cfgs, links):
            connect_links(stage_links, c, self.addrs, self.ctx)
            model = self.model_for(c) if self.model_for is not None else self.model
            self.loops.append(StageLoop(c, self.make_stage(c), stage_links, model))
        self.threads = [
            threading.Thread(target=self._run, args=(loop,), name=f"pp{loop.cfg.rank}", daemon=True)
            for loop in self.loops
        ]
        for thread in self.threads:
            thread.start()
        return self

    def _run(self, loop: StageLoop) -> None:
        self.exit_codes[loop.cfg.rank] = loop.run()

    def stop(self, timeout_s: float = 10.0) -> dict[int, int]:
        """Shut the ring down gracefully; returns each stage's exit code."""
        self.driver.shutdown()
        return self.join(timeout_s)

    def join(self, timeout_s: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        return dict(self.exit_codes)

    def __exit__(self, *exc: object) -> None:
        if any(t.is_alive() for t in self.threads):
            self.stop()
        self.driver.close()
        alive = [t.name for t in self.threads if t.is_alive()]
        self.ctx.destroy(linger=0)
        if alive:
            raise RuntimeError(f"stage threads did not stop: {alive}")
