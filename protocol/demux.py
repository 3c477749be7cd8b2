"""The demultiplexing receiver: `recv(kind)` over one ring link that carries every kind.

A stage's loop wants its messages in a fixed order (reqs, then proxy, then output of a given
step), but they arrive in whatever order the previous stage sent them. Messages of other kinds
that arrive first are stashed per kind and handed out later in arrival order (SGLang's
`_pp_recv_typed_dict` stashes the same way).

Every `reqs`, `proxy` and `output` is checked on arrival: per kind, steps must be consecutive
from 0 and `slot == step % loop_size`. A gap or a reorder means a message was lost or the stages
disagree about where they are; it raises `SequenceError`, which the ring treats as fatal. An
undecodable message is logged and dropped (a peer that can reach the port must not be able to
stop the ring by sending junk); if it was a real ring message, the next one trips the check.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from protocol.channels import ChannelTimeout, PullChannel
from protocol.errors import ProtocolError
from protocol.messages import ALL_KINDS, SEQUENCED_KINDS

logger = logging.getLogger(__name__)


class SequenceError(ProtocolError):
    """A ring message arrived out of step: lost, duplicated or reordered."""


class DemuxReceiver:
    def __init__(self, channel: PullChannel, loop_size: int | None = None, epoch: int = 0) -> None:
        """`epoch`: this ring's incarnation; a ring message of another is dropped and logged
        (one from before the ring re-formed)."""
        self.channel = channel
        self.loop_size = loop_size
        self.epoch = epoch
        self.stash: dict[str, deque[Any]] = {kind: deque() for kind in ALL_KINDS}
        self.next_step: dict[str, int] = {kind: 0 for kind in SEQUENCED_KINDS}
        self.num_dropped = 0

    def recv(self, kind: str, timeout_s: float | None = None, also: tuple[str, ...] = ()) -> Any:
        """The next message of `kind`, or of one of the `also` kinds if one comes first (the
        ring loop passes `also=("ctrl",)` so an error or shutdown wakes it from any wait).
        Stashes every other kind. Raises ChannelTimeout or SequenceError."""
        if kind not in self.stash:
            raise ValueError(f"unknown message kind {kind!r}")
        for wanted in (*also, kind):
            if self.stash[wanted]:
                return self.stash[wanted].popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            # Never below zero: a zero timeout still reads what is already queued.
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                msgs = self._recv_bundle(remaining)
            except ChannelTimeout:
                raise ChannelTimeout(
                    f"no {kind} message on {self.channel.addr} within {timeout_s:.3g} s"
                ) from None
            found = None
            for msg in msgs:  # in arrival order: the first wanted one is returned
                if found is None and (msg.kind == kind or msg.kind in also):
                    found = msg
                else:
                    self.stash[msg.kind].append(msg)
            if found is not None:
                return found

    def poll(self, kind: str, timeout_s: float = 0.0) -> Any | None:
        """Like recv, but returns None instead of raising on timeout."""
        try:
            return self.recv(kind, timeout_s)
        except ChannelTimeout:
            return None

    def prefetch(self, until: float, want: str | None = None) -> bool:
        """Read and stash what arrives until `until` (time.monotonic()), so that later `recv`s
        find it decoded; with `want`, stop as soon as a message of that kind is stashed and
        return True (False: none by `until`). The ring loop calls this while its forward runs.
        ZeroMQ polls in whole milliseconds, so it stops at the last whole millisecond before
        `until` rather than spin."""
        while not (want is not None and self.stash[want]):
            remaining_ms = int((until - time.monotonic()) * 1000)
            if remaining_ms < 1 or not self.channel.poll(remaining_ms / 1000):
                return False
            for msg in self._recv_bundle(0.0):
                self.stash[msg.kind].append(msg)
        return True

    def pending(self, kind: str) -> int:
        return len(self.stash[kind])

    def _recv_bundle(self, timeout_s: float | None) -> list[Any]:
        """The messages of the next ZeroMQ message (a sender may bundle several), each checked
        for sequence; [] if it was undecodable (then all of it is dropped)."""
        try:
            msgs = self.channel.recv_many(timeout_s)
        except SequenceError:
            raise
        except ProtocolError as exc:
            self.num_dropped += 1
            logger.warning("dropped a bad message on %s: %s", self.channel.addr, exc)
            return []
        fresh = []
        for msg in msgs:
            if getattr(msg, "epoch", self.epoch) != self.epoch:
                self.num_dropped += 1
                logger.warning(
                    "dropped a stale %s (step %s) of ring epoch %d on %s: this ring is epoch %d",
                    msg.kind,
                    getattr(msg, "step", "-"),
                    msg.epoch,
                    self.channel.addr,
                    self.epoch,
                )
                continue
            if msg.kind in self.next_step:
                self._check_sequence(msg)
            fresh.append(msg)
        return fresh

    def _check_sequence(self, msg: Any) -> None:
        expected = self.next_step[msg.kind]
        if msg.step != expected:
            what = "a message was lost" if msg.step > expected else "a message was repeated"
            raise SequenceError(
                f"{msg.kind} step gap on {self.channel.addr}: expected step {expected}, "
                f"got step {msg.step} (slot {msg.slot}); {what} or reordered"
            )
        if self.loop_size is not None and msg.slot != msg.step % self.loop_size:
            raise SequenceError(
                f"{msg.kind} step {msg.step} arrived for slot {msg.slot}, expected slot "
                f"{msg.step % self.loop_size} of {self.loop_size}"
            )
        self.next_step[msg.kind] = expected + 1
