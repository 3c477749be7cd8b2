"""What differs between the first, middle and last stages, chosen once when the loop is built.

A stage plays two roles, picked by its rank:

- its head, where a step's inputs come from: `FrontendHead` (stage 0: requests from the
  frontend, no seam to receive, deltas back to the frontend) or `RingHead` (every other stage:
  requests and the seam from the predecessor);
- its tail, what its forward produces and where its outputs come from: `SamplerTail` (the
  last stage: sampled tokens, sent round the ring and kept to apply itself) or `SeamTail`
  (every other stage: the seam for the next stage; outputs come from the predecessor). With the
  lm_head split (RingConfig.split_lm_head) the last stage is a `ShareTail` (its share of the
  logits goes to stage 0; outputs come from its predecessor) and stage 0 a `ShareSamplerTail`
  (a seam tail that also samples each share and sends the output round the ring).

A one-stage ring is both `FrontendHead` and `SamplerTail`. The loop calls the same methods
whatever the rank, so its body never asks for it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from protocol.demux import SequenceError
from protocol.messages import (
    Deltas,
    NewRequest,
    Output,
    Proxy,
    Reqs,
    RequestDelta,
    RingReady,
    Share,
    StopServing,
    Submit,
)
from ring.config import RingConfig
from ring.control import RingControl
from ring.links import Links
from ring.scheduler import Batch, DivergenceError, Scheduler
from stages.batch import SampleResult
from stages.contract import LogitsShare, Sample, Seam, Stage, StageOutput

logger = logging.getLogger(__name__)


@dataclass
class LoopStats:
    """Where a stage's time went; the roles record their waits, the loop its forwards."""

    steps: int = 0
    busy_s: float = 0.0  # time inside the stage's forward
    wall_s: float = 0.0  # time from the first step to the last
    stalls_s: float = 0.0  # time waiting for an output that was due
    proxy_wait_s: float = 0.0
    reqs_wait_s: float = 0.0  # waiting for the predecessor's reqs while the ring has work
    idle_s: float = 0.0  # waiting for a request while the ring has none: no stage's wait
    tokens: int = 0  # through the forwards
    batches: int = 0  # forwards run
    round_trip_s: float = 0.0  # stage 0 (of a ring): seam sent to its sampled tokens back
    round_trips: int = 0


class FrontendHead:
    """Stage 0: drains the frontend's requests, reports their deltas back to it."""

    def __init__(
        self, cfg: RingConfig, links: Links, control: RingControl, stats: LoopStats
    ) -> None:
        self.cfg, self.links, self.control, self.stats = cfg, links, control, stats
        self.shutting_down = False
        self.aborted_all = False

    def take_reqs(self, sched: Scheduler, step: int, may_block: bool) -> Reqs | None:
        """Drain the frontend without blocking; block (with heartbeats) when idle. With a
        forward running (`may_block` False) the ring is not idle, so it never blocks nor shuts
        the ring down there. None: the ring has shut down."""
        new: list[NewRequest] = []
        aborts: list[str] = []
        while (msg := self._next_intake(may_block and not (new or aborts), sched)) is not None:
            if isinstance(msg, StopServing):
                self.shutting_down = True
            elif isinstance(msg, Submit) and msg.epoch != self.cfg.epoch:
                # Queued for the ring before this one (the frontend replays what it held).
                logger.warning(
                    "[pp0] dropped a stale submit (seq %d) of ring epoch %d: this ring is epoch %d",
                    msg.seq,
                    msg.epoch,
                    self.cfg.epoch,
                )
            elif isinstance(msg, Submit):
                new += msg.new
                aborts += msg.aborts
        if self.shutting_down:
            # Fail what we hold: abort everything (a running request finishes at its next turn).
            aborts += [r.rid for r in new]
            if not self.aborted_all:
                aborts += list(sched.requests)
                self.aborted_all = True
            if may_block and sched.is_idle() and not new:
                self.control.shutdown_ring(step)
                return None
        reqs = Reqs(step % self.cfg.pp_loop_size, step, new, aborts, epoch=self.cfg.epoch)
        if self.cfg.pp_size > 1:  # on to stage 1
            self.links.next.queue(reqs)
        return reqs

    def _next_intake(self, may_block: bool, sched: Scheduler) -> Any | None:
        intake = self.links.intake
        if may_block and sched.is_idle() and not self.shutting_down:
            if self.links.next is not None:  # the last output (StageLoop.outputs_ride_next_proxy)
                self.links.next.flush()
            started = time.monotonic()
            msg = self.control.wait_for_intake(intake)
            self.stats.idle_s += time.monotonic() - started
            return msg
        if intake is None or not intake.poll(0):
            return None
        return intake.recv(0)

    def take_seam(self, batch: Batch) -> Seam | None:
        return None  # the first stage embeds the batch's token ids itself

    def announce_ready(self, num_kv_blocks: int) -> None:
        """Tell the frontend the ring is up, and how many KV blocks it agreed."""
        if self.links.deltas is not None:
            ready = RingReady(rank=0, num_kv_blocks=num_kv_blocks, epoch=self.cfg.epoch)
            self.links.deltas.send(ready)

    def send_deltas(self, step: int, deltas: list[RequestDelta]) -> None:
        if deltas and self.links.deltas is not None:
            self.links.deltas.send(Deltas(step=step, deltas=deltas, epoch=self.cfg.epoch))


class RingHead:
    """Every stage but the first: requests and the seam come from the predecessor."""

    def __init__(
        self, cfg: RingConfig, links: Links, control: RingControl, stats: LoopStats
    ) -> None:
        self.cfg, self.links, self.control, self.stats = cfg, links, control, stats

    def take_reqs(self, sched: Scheduler, step: int, may_block: bool) -> Reqs | None:
        idle = sched.is_idle()  # then nothing is on its way but the next request
        started = time.monotonic()
        reqs = self.control.recv("reqs")
        waited = time.monotonic() - started
        if idle:
            self.stats.idle_s += waited
        else:
            self.stats.reqs_wait_s += waited
        if reqs is None:  # a shutdown came round instead
            if not idle:
                logger.warning("%s shut down with requests still held", self.control.prefix)
        elif not self.cfg.is_last_stage:  # the last stage's successor is stage 0, their origin
            self.links.next.queue(reqs)
        return reqs

    def take_seam(self, batch: Batch) -> Seam:
        started = time.monotonic()
        proxy: Proxy = self.control.recv("proxy")
        self.stats.proxy_wait_s += time.monotonic() - started
        if proxy.step != batch.step or proxy.digest != batch.digest:
            raise DivergenceError(
                f"{self.control.prefix} slot {batch.slot} step {batch.step}: stage "
                f"{self.cfg.rank - 1} sent a batch with digest {proxy.digest}, this stage "
                f"decided {batch.digest} ({len(batch.entries)} requests): the stages' "
                "schedulers diverged"
            )
        return Seam(hidden_states=proxy.hidden_states, residual=proxy.residual)

    def announce_ready(self, num_kv_blocks: int) -> None:
        pass  # only stage 0 talks to the frontend

    def send_deltas(self, step: int, deltas: list[RequestDelta]) -> None:
        pass


class SeamTail:
    """Every stage but the last: sends the seam on; outputs come from the predecessor."""

    def __init__(
        self, cfg: RingConfig, links: Links, control: RingControl, stats: LoopStats
    ) -> None:
        self.cfg, self.links, self.control, self.stats = cfg, links, control, stats
        # On to the next stage unless it made them (it sampled them).
        self.forward_outputs = (cfg.rank + 1) % cfg.pp_size != cfg.output_origin
        self.sent_at: dict[int, float] = {}  # stage 0: step -> when its seam left

    def sampling_args(self, batch: Batch) -> dict[str, Any]:
        return {}

    def send_result(self, batch: Batch, seam: StageOutput) -> None:
        if self.cfg.debug_fault == ("drop", self.cfg.rank, batch.step):
            return  # fault injection: the proxy is lost
        hidden, residual = seam["hidden_states"], seam["residual"]
        proxy = Proxy(batch.slot, batch.step, batch.digest, hidden, residual, self.cfg.epoch)
        self.links.next.queue(proxy)
        if self.cfg.is_first_stage:
            self.sent_at[batch.step] = time.monotonic()

    def take_output(self, batch: Batch) -> Output:
        output: Output = self._receive("output", batch.step)
        if self.forward_outputs:
            self.links.next.queue(output)
        return output

    def _receive(self, kind: str, due: int) -> Any:
        """The `kind` message of step `due` from the predecessor; the wait is a stall."""
        started = time.monotonic()
        msg = self.control.recv(kind)
        now = time.monotonic()
        self.stats.stalls_s += now - started
        sent = self.sent_at.pop(due, None)
        if sent is not None:
            self.stats.round_trip_s += now - sent
            self.stats.round_trips += 1
        if msg.step != due:
            raise SequenceError(
                f"{self.control.prefix} expected the {kind} of step {due}, got step {msg.step}"
            )
        return msg

    def prefetch_output(self, until: float) -> bool:
        """Read the link until the due output is here or `until`; False: not by then."""
        return self.control.receiver.prefetch(until, want="output")


class ShareSamplerTail(SeamTail):
    """Stage 0 with the lm_head split: its forward hands on the seam like any non-last stage,
    and each due output is sampled here from the last stage's share of the logits, then sent
    round the ring (every other stage applies it too)."""

    def __init__(
        self, cfg: RingConfig, links: Links, control: RingControl, stats: LoopStats, stage: Stage
    ) -> None:
        super().__init__(cfg, links, control, stats)
        self.stage = stage

    def take_output(self, batch: Batch) -> Output:
        share: Share = self._receive("share", batch.step)
        if share.digest != batch.digest:
            raise DivergenceError(
                f"{self.control.prefix} step {batch.step}: the last stage sent logits of a batch "
                f"with digest {share.digest}, this stage decided {batch.digest}: the stages' "
                "schedulers diverged"
            )
        started = time.monotonic()
        result = self.stage.sample_share(
            batch.chunks,
            LogitsShare(
                hidden=share.hidden,
                logits=share.logits,
                best_logit=share.best_logit,
                best_token=share.best_token,
            ),
            **sampling_args(batch),
        )
        self.stats.busy_s += time.monotonic() - started  # compute, like a forward's
        output = output_of(batch, result, self.cfg.epoch)
        self.links.next.queue(output)
        return output

    def prefetch_output(self, until: float) -> bool:
        return self.control.receiver.prefetch(until, want="share")


class ShareTail:
    """The last stage with the lm_head split: sends its share of each step's logits to stage 0,
    which samples; the outputs come back from its predecessor like any stage's."""

    def __init__(
        self, cfg: RingConfig, links: Links, control: RingControl, stats: LoopStats
    ) -> None:
        self.cfg, self.links = cfg, links
        self.outputs = SeamTail(cfg, links, control, stats)  # receives; never forwards

    def sampling_args(self, batch: Batch) -> dict[str, Any]:
        # Which rows are plain greedy decides what the share holds; no history is needed here.
        return {"sampling": [e.req.sampling for e in batch.entries]}

    def send_result(self, batch: Batch, share: StageOutput) -> None:
        self.links.next.queue(
            Share(batch.slot, batch.step, batch.digest, **share, epoch=self.cfg.epoch)
        )

    def take_output(self, batch: Batch) -> Output:
        return self.outputs.take_output(batch)

    def prefetch_output(self, until: float) -> bool:
        return self.outputs.prefetch_output(until)


def output_of(batch: Batch, result: SampleResult, epoch: int) -> Output:
    """The `output` message of a step's sampled tokens, wherever they were sampled."""
    return Output(
        batch.slot, batch.step, batch.digest, result.token_ids, result.logprobs, epoch,
        result.top_ids, result.top_logprobs,
    )  # fmt: skip


def sampling_args(batch: Batch) -> dict[str, Any]:
    """What the sampling stage's `run` (or `sample_share`) takes besides the tensors: each
    entry's sampling parameters, and its history where a penalty needs it."""
    sampling = [e.req.sampling for e in batch.entries]
    histories = [  # only a penalty needs one
        e.req.penalty_history() if e.chunk.sample and e.req.sampling.needs_history else None
        for e in batch.entries
    ]
    return {"sampling": sampling, "histories": histories}


class SamplerTail:
    """The last stage: samples, sends each step's tokens round the ring, keeps them to apply."""

    def __init__(self, cfg: RingConfig, links: Links) -> None:
        self.cfg, self.links = cfg, links
        self.pending: deque[tuple[Batch, Sample]] = deque()  # sampled, not yet sent
        self.own_outputs: dict[int, Output] = {}  # step -> output to apply later

    def sampling_args(self, batch: Batch) -> dict[str, Any]:
        return sampling_args(batch)

    def send_result(self, batch: Batch, sample: StageOutput) -> None:
        """Send every output that is ready, and wait for those `depth` steps old."""
        self.pending.append((batch, sample))
        self._send_outputs(through=batch.step - self.cfg.pp_async_batch_depth)

    def take_output(self, batch: Batch) -> Output:
        self._send_outputs(through=batch.step)
        return self.own_outputs.pop(batch.step)

    def prefetch_output(self, until: float) -> bool:
        return True  # its own: nothing to receive

    def _send_outputs(self, through: int) -> None:
        """Outputs leave in step order: each one that is ready, and each one up to step
        `through` even if that means waiting for it (the straggler)."""
        while self.pending:
            batch, sample = self.pending[0]
            if batch.step > through and not sample.is_ready():
                break
            self.pending.popleft()
            output = output_of(batch, sample.wait(), self.cfg.epoch)
            self.own_outputs[batch.step] = output
            if self.cfg.pp_size > 1:
                self.links.next.queue(output)


Tail = SeamTail | ShareSamplerTail | ShareTail | SamplerTail


def build_roles(
    cfg: RingConfig, links: Links, control: RingControl, stats: LoopStats, stage: Stage
) -> tuple[FrontendHead | RingHead, Tail]:
    head = (
        FrontendHead(cfg, links, control, stats)
        if cfg.is_first_stage
        else RingHead(cfg, links, control, stats)
    )
    tail: Tail
    if cfg.is_last_stage:
        tail = (
            ShareTail(cfg, links, control, stats) if cfg.split_lm_head else SamplerTail(cfg, links)
        )
    elif cfg.is_first_stage and cfg.split_lm_head:
        tail = ShareSamplerTail(cfg, links, control, stats, stage)
    else:
        tail = SeamTail(cfg, links, control, stats)
    return head, tail
