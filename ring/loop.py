"""The per-stage event loop (DESIGN.md §6): every stage runs one, there is no coordinator.

Iteration `step` handles slot `step % pp_loop_size`, in DESIGN.md §6's steps:

    1. reqs     stage 0 drains the frontend; others receive from their predecessor. Apply,
                forward to the next stage unless it is stage 0.
    2. decide   the slot's batch, from replicated state only.
    3. proxy    non-first stages receive the seam tensors and check the batch digest.
    4. run      the stage's layers; the last stage samples.
    6. send     what this step produced, without blocking: the proxy (non-last), or the sampled
                output (last stage; sent once it is ready, and at the latest
                `pp_async_batch_depth` steps later).
    5. output   apply the output of step `step + 1 - pp_loop_size` (the slot that comes next),
                received from the predecessor (the last stage keeps its own), and forward it
                unless the next stage is the last (which produced it). Without overlap, stage
                0 forwards it with the next step's reqs and proxy, and tells the frontend
                once a round of slots (`deltas_due`).

Sending before waiting for an output (6 before 5) is the reordering SGLang's event_loop_pp
docstring allows: the next stage starts as early as possible.

Overlap: when the stage's step handle says its forward is still running (a device computing),
the loop does step 5 and then steps 1-2 of the next step while it runs (SGLang's overlap
scheduling). The scheduler sees its inputs in exactly the order above, so decisions do not
change; what leaves the critical path is everything but receiving and sending the seam. With
one slot (pp_loop_size 1) the next decision needs this step's output, so nothing overlaps.

What differs by rank (where requests and the seam come from, what the forward produces) is the
stage's two roles, chosen once when the loop is built (ring/roles.py); the start-up handshake,
heartbeats, shutdown and failure reports are its control path (ring/control.py). The loop
imports no torch: tensors pass through it untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from protocol.demux import DemuxReceiver, SequenceError
from protocol.messages import RequestDelta, StageHello
from ring.config import RingConfig
from ring.control import ModelInfo, RingControl, RingDown
from ring.links import Links
from ring.report import StatsReporter
from ring.request import Req
from ring.roles import LoopStats, build_roles
from ring.scheduler import Batch, DivergenceError, Scheduler, batch_digest
from ring.trace import StepTracer
from stages.contract import FinishedStep, Seam, Stage, StageOutput, StepHandle

__all__ = ["Links", "LoopStats", "ModelInfo", "RingDown", "StageLoop"]

logger = logging.getLogger(__name__)


@dataclass
class StageLoop:
    cfg: RingConfig
    stage: Stage
    links: Links
    model: ModelInfo
    stats: LoopStats = field(default_factory=LoopStats)

    def __post_init__(self) -> None:
        self.prefix = f"[pp{self.cfg.rank}]"
        prev = self.links.prev
        self.receiver = DemuxReceiver(prev, self.cfg.pp_loop_size, self.cfg.epoch) if prev else None
        self.control = RingControl(self.cfg, self.links, self.receiver)
        if self.stage.split_lm_head != self.cfg.split_lm_head:
            raise ValueError(
                f"{self.prefix} the stage was built with split_lm_head "
                f"{self.stage.split_lm_head}, the ring's config says {self.cfg.split_lm_head}"
            )
        self.head, self.tail = build_roles(
            self.cfg, self.links, self.control, self.stats, self.stage
        )
        self.scheduler: Scheduler | None = None  # built by the handshake
        self.prepared: Batch | None = None  # the next step's batch, decided during a forward
        self.deltas: list[RequestDelta] = []  # for the frontend, sent once a round (deltas_due)
        self.launched_at = 0.0
        self.tracer: StepTracer | None = None  # --trace-steps, opened once the ring is ready
        self.forgot_at: int | None = None  # the step of the "forget" debug fault, once it fired
        # Stage 0 of a ring sends the output it applied at step k (sampled there with the
        # lm_head split, else forwarded from the last stage) with step k + 1's reqs and proxy,
        # not as a message of its own. Stage 1 needs that output only to decide step k + 1,
        # which it cannot start before that proxy anyway; one ZeroMQ message a step fewer is
        # one send, two I/O-thread wake-ups and one receive fewer on a host whose cores the
        # stages share with them. FrontendHead flushes it before it waits idle for requests.
        self.outputs_ride_next_proxy = self.cfg.is_first_stage and self.cfg.pp_size > 1

    def handshake(self) -> int:
        """Agree the KV capacity round the ring, allocate it, build the scheduler."""
        agreed = self.control.handshake(
            StageHello(
                rank=self.cfg.rank,
                num_kv_blocks=self.stage.num_kv_blocks,
                config_hash=self.model.config_hash,
                pp_loop_size=self.cfg.pp_loop_size,
                context_length=self.model.context_length,
                split_lm_head=self.cfg.split_lm_head,
                max_running_requests=self.cfg.max_running_requests,
                pp_max_micro_batch_size=self.cfg.pp_max_micro_batch_size,
                chunked_prefill_size=self.cfg.chunked_prefill_size,
                disable_radix_cache=self.cfg.disable_radix_cache,
                schedule_policy=self.cfg.schedule_policy,
                kv_cache_dtype=self.model.kv_cache_dtype,
            ),
            allocate=self.stage.allocate_kv,  # on a GPU this also captures the decode graphs
        )
        self.control.last_heard = time.monotonic()  # the capture is not the ring's silence
        self.scheduler = Scheduler(
            self.cfg,
            agreed,
            self.model.context_length,
            self.model.eos_token_ids,
            rope_long_from=self.model.rope_long_from,
            kv_window=self.model.kv_window,
        )
        logger.info(
            "%s ring ready: %d KV blocks agreed, %d slots, prefix cache %s",
            self.prefix,
            agreed,
            self.cfg.pp_loop_size,
            "off" if self.cfg.disable_radix_cache else "on",
        )
        return agreed

    def run(self) -> int:
        """Run until shutdown (returns 0) or a fatal ring error (returns 1)."""
        try:
            if self.scheduler is None:
                self.handshake()
            self.head.announce_ready(self.scheduler.num_kv_blocks)
            if self.cfg.trace_steps_dir is not None:
                self.tracer = StepTracer(self.cfg.trace_steps_dir, self.cfg.rank, self.cfg.epoch)
            start = time.monotonic()
            reporter = StatsReporter(self.cfg, self.control, self.stats)
            step = 0
            while self._step(step):
                step += 1
                reporter.after_step(self.scheduler)
            self.stats.wall_s = time.monotonic() - start
            self._log_stats()
            return 0
        except OSError as exc:
            # A neighbour's socket is gone: it stopped first. Report its reason if it sent one.
            cause = self.control.pending_error(timeout_s=1.0)
            if cause is not None:
                self.control.fail(cause.message, cause.rank)
            else:
                self.control.fail(str(exc), None)
            return 1
        except (DivergenceError, SequenceError, RingDown) as exc:
            self.control.fail(str(exc), getattr(exc, "origin_rank", None))
            return 1
        finally:
            if self.tracer is not None:
                self.tracer.close()
            self.links.close()

    # -- one step: DESIGN.md §6 ------------------------------------------------------------------

    def _step(self, step: int) -> bool:
        tracing = self.tracer is not None
        started = time.monotonic() if tracing else 0.0
        batch = self._take_batch(step)  # 1 reqs, 2 decide (or done during the last forward)
        if batch is None:
            return False  # shutdown went round the ring
        decided = time.monotonic() if tracing else 0.0
        seam = self.head.take_seam(batch)  # 3 proxy
        handle = self._launch(batch, seam)  # 4 run
        if handle.overlaps and self.cfg.pp_loop_size > 1:
            self._finish_overlapped(step, batch, handle)  # 6, 5 and the next 1-2 while it runs
            self._end_step(step, overlapped=True)
        else:
            self._send(batch, self._wait(handle))  # 6 send: the proxy or the sampled output
            self._apply_due_output(step)  # 5 output
            self._end_step(step, overlapped=False)
        if tracing:
            computed = max(handle.ended_at, self.launched_at)  # an empty slot ran nothing
            self.tracer.record(
                batch, started, decided, self.launched_at, computed, time.monotonic()
            )
        return True

    def _finish_overlapped(self, step: int, batch: Batch, handle: StepHandle) -> None:
        """While the forward runs, everything the next step needs, in the same order as without
        overlap: this step's due output, then the next step's reqs and decision. The next slot
        differs from this one (pp_loop_size > 1), so nothing decided here touches a block the
        running batch reads. The proxy is encoded first (its tensors exist, the device is
        filling them; ZeroMQ reads them at the flush, after the wait).

        If the due output has not arrived when the forward is done, the proxy goes first, as
        without overlap, so a late output never holds the next stage up (and a lost message is
        still caught at the next stage as a step gap)."""
        held = handle.early_output is not None and self.links.next is not None
        if handle.early_output is not None:
            self.tail.send_result(batch, handle.early_output)
        if held:  # its tensors are still being filled: nothing flushes it before the wait
            self.links.next.hold()
        try:
            prepared_early = self._prepare_during(step, handle)
            result = self._wait(handle)
        finally:
            if held:
                self.links.next.release()
        if handle.early_output is None:  # sampled tokens: they exist only now
            self.tail.send_result(batch, result)
        if not prepared_early:
            self._send_queued()
            self._apply_due_output(step)

    def _prepare_during(self, step: int, handle: StepHandle) -> bool:
        """Step 5, then steps 1-2 of the next step, before the forward ends; False if the due
        output is not here by then (nothing is done)."""
        due = step + 1 - self.cfg.pp_loop_size
        if due >= 0 and not self.tail.prefetch_output(handle.ready_at):
            return False
        self._apply_due_output(step)
        self.prepared = self._prepare(step + 1, may_block=False)
        self.head.send_deltas(step, self._take_deltas())
        if self.receiver is not None:  # decode what arrives before the forward ends
            self.receiver.prefetch(handle.ready_at)
        return True

    # -- the pieces -----------------------------------------------------------------------------

    def _take_batch(self, step: int) -> Batch | None:
        if self.prepared is None:
            self.prepared = self._prepare(step, may_block=True)
        batch, self.prepared = self.prepared, None
        return batch

    def _prepare(self, step: int, may_block: bool) -> Batch | None:
        """Steps 1 and 2 for `step`: take its reqs and decide its batch. None: shutdown."""
        reqs = self.head.take_reqs(self.scheduler, step, may_block)
        if reqs is None:
            return None
        self.deltas += self.scheduler.apply_reqs(reqs)
        self._maybe_forget(step)
        batch, finished = self.scheduler.decide(step % self.cfg.pp_loop_size, step)
        self.deltas += finished
        return self._maybe_diverge(batch)

    def _launch(self, batch: Batch, seam: Seam | None) -> StepHandle:
        """Start the forward; an empty slot runs none, but its step's messages still go out."""
        self.launched_at = time.monotonic()
        if not batch.entries:
            return FinishedStep(self.stage.empty_output(), seam=not self.stage.is_last_stage)
        self.stats.batches += 1
        self.stats.tokens += batch.num_tokens
        return self.stage.launch(batch.chunks, **(seam or {}), **self.tail.sampling_args(batch))

    def _wait(self, handle: StepHandle) -> StageOutput:
        output = handle.wait()
        self.stats.busy_s += max(handle.ended_at - self.launched_at, 0.0)
        return output

    def _send(self, batch: Batch, result: StageOutput) -> None:
        """The proxy or the output leaves now: the next stage can start, not once the due
        output is here."""
        self.tail.send_result(batch, result)
        self._send_queued()

    def _apply_due_output(self, step: int) -> None:
        """Step 5: apply the output of the slot that comes next (`step + 1 - pp_loop_size`)."""
        due = step + 1 - self.cfg.pp_loop_size
        if due >= 0:
            batch = self.scheduler.inflight[due]
            self.deltas += self.scheduler.apply_output(self.tail.take_output(batch))

    def _end_step(self, step: int, overlapped: bool) -> None:
        """What the step queued leaves, and stage 0 tells the frontend what it applied. Without
        overlap, stage 0's applied output waits for the next step's reqs and proxy
        (`outputs_ride_next_proxy`) and its deltas for the round's end (`deltas_due`); with
        overlap both go now. Other stages have no frontend: their deltas are dropped."""
        if overlapped or not self.outputs_ride_next_proxy:
            self._send_queued()
        if overlapped or not self.cfg.is_first_stage or self._deltas_due(step):
            self.head.send_deltas(step, self._take_deltas())
        self.stats.steps += 1

    def _deltas_due(self, step: int) -> bool:
        return deltas_due(
            step, self.cfg.pp_loop_size, self.scheduler.is_idle(), self.deltas,
            self.scheduler.requests,
        )  # fmt: skip

    def _send_queued(self) -> None:
        """What this step queued for the next stage (reqs, output, proxy) leaves as one message.
        Nothing this stage waited for during the step depends on it: a stage's step k needs
        only its predecessor's step k and the last stage's earlier steps."""
        if self.links.next is not None:
            self.links.next.flush()

    def _take_deltas(self) -> list[RequestDelta]:
        deltas, self.deltas = self.deltas, []
        return deltas

    def _log_stats(self) -> None:
        """Shares of the time the ring had work (idle time, with no request anywhere, is no
        stage's wait): a stage's busy and waiting fractions while serving."""
        st = self.stats
        wall = max(st.wall_s - st.idle_s, 1e-9)
        logger.info(
            "%s %d steps in %.1f s (%.1f s idle, no requests): %.0f%% in forward, "
            "%.0f%% waiting for outputs, %.0f%% waiting for proxies, %.0f%% waiting for reqs",
            self.prefix,
            st.steps,
            st.wall_s,
            st.idle_s,
            100 * st.busy_s / wall,
            100 * st.stalls_s / wall,
            100 * st.proxy_wait_s / wall,
            100 * st.reqs_wait_s / wall,
        )

    def _maybe_forget(self, step: int) -> None:
        """Fault injection for tests: from the fault's step on, the first time a request waits,
        this rank's prefix cache forgets its idle blocks, so its next match differs from the
        other stages' (the digest must catch it at the step it decides from it)."""
        fault = self.cfg.debug_fault
        if fault is None or fault[:2] != ("forget", self.cfg.rank) or step < fault[2]:
            return
        if self.forgot_at is None and self.scheduler.waiting:
            forgotten = self.scheduler.pool.forget_idle()
            if forgotten:
                self.forgot_at = step
                logger.warning("%s debug fault: forgot %d cached blocks", self.prefix, forgotten)

    def _maybe_diverge(self, batch: Batch) -> Batch:
        """Fault injection for tests: decide differently at one step on one rank."""
        if self.cfg.debug_fault != ("diverge", self.cfg.rank, batch.step):
            return batch
        entries = batch.entries[:-1]
        return Batch(batch.slot, batch.step, entries, batch_digest(batch.slot, batch.step, entries))


def deltas_due(
    step: int,
    pp_loop_size: int,
    ring_idle: bool,
    deltas: list[RequestDelta],
    running: Mapping[str, Req],
) -> bool:
    """Whether stage 0 sends the frontend the deltas it holds after `step`: once a round of
    pp_loop_size steps. A running request gains one token a round (in its slot's step), so
    each stream keeps its pace, and the frontend and its clients wake once a round instead of
    once a slot: on the 2-core Zen 4 each message costs a send, I/O-thread wake-ups and the
    frontend's and the client's turns, taken from the stages' cores (PP=2, equal work, 32 in
    flight, 10 s of CPU ticks in runs alternated with per-step deltas: the frontend and the
    client 115 and 108 -> 101 and 106 of 2000, the stages 1688 and 1714 -> 1730 and 1737).
    A delta that starts or ends a request goes at once, so neither the time to first token
    nor the end waits for the round, as do deltas after which the ring idles.
    `running`: the scheduler's requests, by id."""
    if pp_loop_size == 1 or (step + 1) % pp_loop_size == 0 or ring_idle:
        return True
    return any(
        delta.finish_reason or delta.rid not in running or len(running[delta.rid].output_ids) == 1
        for delta in deltas
    )
