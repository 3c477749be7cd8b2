"""A stage's control path, apart from its data steps: the start-up handshake, liveness
(heartbeats while idle, a timeout while waiting), shutdown and failure reports.

Control messages (one `protocol.messages.Control` class per op) travel the same links as the
data, round the ring from the stage that sent them back to it. `RingControl.recv` is how the
loop waits for any data message: it handles the control messages that arrive meanwhile, so an
error or a shutdown wakes a stage from any wait.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

from protocol.channels import ChannelTimeout, PullChannel
from protocol.demux import DemuxReceiver, SequenceError
from protocol.messages import (
    Control,
    Heartbeat,
    RingError,
    RingReady,
    Shutdown,
    StageHello,
    StageStats,
)
from ring.config import RingConfig
from ring.links import Links

logger = logging.getLogger(__name__)

ControlT = TypeVar("ControlT", bound=Control)


class RingDown(RuntimeError):
    """The ring cannot go on: a neighbour died, timed out, or reported a fatal error.
    `origin_rank` is the stage that first reported it (None: this stage)."""

    def __init__(self, message: str, origin_rank: int | None = None) -> None:
        super().__init__(message)
        self.origin_rank = origin_rank


@dataclass
class ModelInfo:
    """What the scheduler must know of the model; the same on every stage."""

    context_length: int
    eos_token_ids: tuple[int, ...] = ()
    config_hash: str = ""
    # LongRoPE: a sequence longer than this turns at the long factors (ring/scheduler.py);
    # None for every other model
    rope_long_from: int | None = None
    # Where every layer has a sliding window, the longest (stages/config.py kv_window): blocks
    # behind it go back to the pool; None: every block a sequence fills stays held
    kv_window: int | None = None
    # What the stage's KV cache stores, as it resolved --kv-cache-dtype (stages/kv_cache.py):
    # "auto" (the stage dtype) or "int8"; every stage must store alike
    kv_cache_dtype: str = "auto"


# At most this long for the stages before this one to allocate their KV cache at start-up (or
# the ring timeout, if longer).
ALLOCATE_TIMEOUT_S = 300.0

# What every stage must agree on with stage 0 at start-up (besides the KV capacity).
AGREED_FIELDS = (
    "config_hash",
    "pp_loop_size",
    "context_length",
    "split_lm_head",
    "max_running_requests",
    "pp_max_micro_batch_size",
    "chunked_prefill_size",
    "disable_radix_cache",
    "schedule_policy",
    "kv_cache_dtype",
)


class RingControl:
    def __init__(self, cfg: RingConfig, links: Links, receiver: DemuxReceiver | None) -> None:
        self.cfg = cfg
        self.links = links
        self.receiver = receiver
        self.prefix = f"[pp{cfg.rank}]"
        self.last_heard = time.monotonic()
        self.next_heartbeat = 0

    # -- start-up ------------------------------------------------------------------------------

    def handshake(self, mine: StageHello, allocate: Callable[[int], None]) -> int:
        """Agree one KV capacity (the minimum over stages) and check every stage serves the same
        model and ring shape (SGLang PR #10214 crashed on stages with different pool sizes);
        have every stage `allocate` it, all at once; return the agreed block count once every
        stage has allocated.

        Two rounds of `RingReady`: the first carries the agreed count and each stage forwards
        it before allocating; the second (`allocated`) each stage forwards only after its own
        allocation, so stage 0 sees it back, and tells the frontend the ring is ready, only when
        the whole ring can serve. Without it a first request waited for a later stage still
        touching its cache's pages (1-6 s for 1 GiB on these VMs) or capturing graphs."""
        if self.cfg.pp_size == 1:
            allocate(mine.num_kv_blocks)
            return mine.num_kv_blocks
        if self.cfg.is_first_stage:
            self.links.next.send(mine)
            agreed = self.wait(StageHello).num_kv_blocks  # the minimum, once round
            self.links.next.send(RingReady(0, agreed, epoch=self.cfg.epoch))
            allocate(agreed)
            self.wait(RingReady)  # the agreed count came round: every stage is allocating
            self.links.next.send(RingReady(0, agreed, epoch=self.cfg.epoch, allocated=True))
            self.wait(RingReady, timeout_s=self._allocate_timeout_s)
            return agreed
        hello = self.wait(StageHello)
        for key in AGREED_FIELDS:
            if getattr(hello, key) != getattr(mine, key):
                raise RingDown(
                    f"{self.prefix} {key} differs from stage 0's ({getattr(mine, key)!r} vs "
                    f"{getattr(hello, key)!r}): every stage must serve the same model and flags"
                )
        blocks = min(hello.num_kv_blocks, mine.num_kv_blocks)
        self.links.next.send(dataclasses.replace(hello, num_kv_blocks=blocks))
        ready = self.wait(RingReady)
        self.links.next.send(ready)
        allocate(ready.num_kv_blocks)
        self.links.next.send(self.wait(RingReady, timeout_s=self._allocate_timeout_s))
        return ready.num_kv_blocks

    @property
    def _allocate_timeout_s(self) -> float:
        """How long a stage waits for the stages before it to allocate: capturing a large
        model's decode graphs takes longer than a ring timeout is meant to be."""
        return max(self.cfg.ring_timeout_s, ALLOCATE_TIMEOUT_S)

    # -- control messages ------------------------------------------------------------------------

    def wait(self, kind: type[ControlT], timeout_s: float | None = None) -> ControlT:
        """The next control message of this type (an error report raises RingDown instead),
        within `timeout_s` (default: the ring timeout)."""
        timeout_s = self.cfg.ring_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = self.receiver.recv("ctrl", timeout_s=remaining)
            except ChannelTimeout:
                continue
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, RingError):
                raise RingDown(msg.message, msg.rank)
        raise RingDown(
            f"{self.prefix} no ctrl {kind.op} within {timeout_s:.0f} s: is every stage running?"
        )

    def recv(self, kind: str) -> Any | None:
        """The next `kind` data message from the predecessor, handling control messages
        meanwhile (heartbeats and a shutdown go on round the ring). None: a shutdown came."""
        while True:
            try:
                msg = self.receiver.recv(kind, timeout_s=self.cfg.ring_timeout_s, also=("ctrl",))
            except ChannelTimeout:
                raise RingDown(
                    f"{self.prefix} heard nothing from stage "
                    f"{(self.cfg.rank - 1) % self.cfg.pp_size} "
                    f"for {self.cfg.ring_timeout_s:.0f} s while waiting for {kind}"
                ) from None
            self.last_heard = time.monotonic()
            if msg.kind == kind:
                return msg
            if isinstance(msg, RingError):
                raise RingDown(msg.message, msg.rank)
            if isinstance(msg, StageStats):
                self.report(msg)
                continue
            if not isinstance(msg, (Heartbeat, Shutdown)):
                raise RingDown(f"{self.prefix} unexpected ctrl {msg.op} while running")
            if msg.rank != self.cfg.rank:
                self.links.next.send(msg)  # round the ring, back to the stage that sent it
            if isinstance(msg, Shutdown):
                return None

    # -- idle: heartbeats ------------------------------------------------------------------------

    def wait_for_intake(self, intake: PullChannel | None) -> Any:
        """Stage 0, idle: the frontend's next message, sending a heartbeat round the ring every
        interval and declaring the ring down if none comes back within the ring timeout."""
        poller = zmq.Poller()
        if intake is not None:
            poller.register(intake.sock, zmq.POLLIN)
        if self.receiver is not None:
            poller.register(self.receiver.channel.sock, zmq.POLLIN)
        multi = self.cfg.pp_size > 1
        while True:
            events = dict(poller.poll(self.cfg.heartbeat_interval_s * 1000))
            if intake is not None and intake.sock in events:
                return intake.recv(0)
            if self.receiver is not None:
                self._drain_idle_ctrl()
            if not events and multi:
                self.links.next.send(Heartbeat(rank=self.cfg.rank, seq=self.next_heartbeat))
                self.next_heartbeat += 1
            if multi and time.monotonic() - self.last_heard > self.cfg.ring_timeout_s:
                raise RingDown(
                    f"{self.prefix} heartbeat did not come back round the ring within "
                    f"{self.cfg.ring_timeout_s:.0f} s"
                )

    def _drain_idle_ctrl(self) -> None:
        while (msg := self.receiver.poll("ctrl", 0)) is not None:
            self.last_heard = time.monotonic()
            if isinstance(msg, RingError):
                raise RingDown(msg.message, msg.rank)
            if isinstance(msg, StageStats):
                self.report(msg)

    def report(self, stats: StageStats) -> None:
        """A stage's statistics (its own or another's) on towards the frontend: stage 0 hands
        them over, every other stage passes them on round the ring."""
        channel = self.links.deltas if self.cfg.is_first_stage else self.links.next
        if channel is not None:
            channel.send(stats)

    # -- the end -----------------------------------------------------------------------------------

    def shutdown_ring(self, step: int) -> None:
        """Stage 0, idle and asked to stop: send shutdown round the ring and wait for it."""
        if self.cfg.pp_size > 1:
            self.links.next.send(Shutdown(rank=0, step=step))
            self.wait(Shutdown)
        if self.links.deltas is not None:
            self.links.deltas.send(Shutdown(rank=0, step=step))
        logger.info("%s ring shut down after %d steps", self.prefix, step)

    def pending_error(self, timeout_s: float) -> RingError | None:
        """An error report already on its way to this stage, if any."""
        if self.receiver is None:
            return None
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = self.receiver.recv("ctrl", timeout_s=remaining)
            except (ChannelTimeout, SequenceError):
                return None
            if isinstance(msg, RingError):
                return msg
        return None

    def fail(self, message: str, origin_rank: int | None) -> None:
        """Tell the rest of the ring (and the frontend) and give up. Best effort: the
        neighbour may be gone already."""
        origin = self.cfg.rank if origin_rank is None else origin_rank
        if origin == self.cfg.rank:
            if not message.startswith(self.prefix):
                message = f"{self.prefix} {message}"  # the ring and the user see who found it
            logger.error("%s", message)
        else:
            logger.error("%s stopping: stage %d reported: %s", self.prefix, origin, message)
        msg = RingError(rank=origin, message=message, epoch=self.cfg.epoch)
        targets = [self.links.deltas]
        if (self.cfg.rank + 1) % self.cfg.pp_size != origin:
            targets.append(self.links.next)
        for channel in targets:
            if channel is not None:
                try:
                    channel.send(msg)
                except OSError:
                    pass
