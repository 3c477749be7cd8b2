"""The per-stage event loop (DESIGN.md §6): every stage runs one, there is no coordinator.

Iteration `step` handles slot `step % pp_loop_size`:

    1. reqs     stage 0 drains the frontend; others receive from their predecessor. Apply,
                forward to the next stage unless it is stage 0.
    2. decide   the slot's batch, from replicated state only.
    3. proxy    non-first stages receive the seam tensors and check the batch digest.
    4. run      the stage's layers; then send what this step produced without blocking: the
                proxy (non-last), or the sampled output (last stage; sent once it is ready,
                and at the latest `pp_async_batch_depth` steps later).
    5. output   apply the output of step `step + 1 - pp_loop_size` (the slot that comes next),
                received from the predecessor (the last stage keeps its own), and forward it
                unless the next stage is the last (which produced it).

Sending the proxy before waiting for an output (step 4 before 5) is the reordering SGLang's
event_loop_pp docstring allows: the next stage starts as early as possible.

Overlap: the forward is launched, and while it runs the loop does step 5 and then steps 1-2 of
the next step (SGLang's overlap scheduling: the CPU schedules while the device computes). The
scheduler sees its inputs in exactly the order above, so decisions do not change; what leaves
the critical path is everything but receiving and sending the seam. With one slot
(pp_loop_size 1) the next decision needs this step's output, so nothing overlaps.

First/middle/last behaviour is fixed when the loop is built (which links exist, which stage
object runs); the loop body never asks for its rank.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from protocol.channels import ChannelTimeout, PullChannel, PushChannel
from protocol.demux import DemuxReceiver, SequenceError
from protocol.messages import Ctrl, Deltas, NewRequest, Output, Proxy, Reqs, RequestDelta
from ring.config import RingConfig
from ring.scheduler import Batch, DivergenceError, Scheduler, batch_digest
from stages.batch import SampleResult
from stages.runner import Stage, empty_seam

logger = logging.getLogger(__name__)


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


@dataclass
class Links:
    """A stage's sockets. `prev` receives from the predecessor, `next` sends to the successor;
    stage 0 also has `intake` (from the frontend) and `deltas` (to the frontend)."""

    prev: PullChannel | None = None
    next: PushChannel | None = None
    intake: PullChannel | None = None
    deltas: PushChannel | None = None

    def close(self) -> None:
        for channel in (self.prev, self.next, self.intake, self.deltas):
            if channel is not None:
                channel.close()


@dataclass
class LoopStats:
    steps: int = 0
    busy_s: float = 0.0  # time inside stage.run
    wall_s: float = 0.0  # time from the first step to the last
    heartbeats_sent: int = 0
    stalls_s: float = 0.0  # time waiting for an output that was due
    proxy_wait_s: float = 0.0
    reqs_wait_s: float = 0.0


@dataclass
class StageLoop:
    cfg: RingConfig
    stage: Stage
    links: Links
    model: ModelInfo
    stats: LoopStats = field(default_factory=LoopStats)

    def __post_init__(self) -> None:
        self.prefix = f"[pp{self.cfg.rank}]"
        self.is_multi = self.cfg.pp_size > 1
        self.receiver = (
            DemuxReceiver(self.links.prev, self.cfg.pp_loop_size) if self.links.prev else None
        )
        self.scheduler: Scheduler | None = None
        self.pending_results: deque[tuple[Batch, Any]] = deque()  # last stage: not yet sent
        self.own_outputs: dict[int, Output] = {}  # last stage: step -> output to apply later
        self.prepared: Batch | None = None  # the next step's batch, decided during a forward
        self.deltas: list[RequestDelta] = []  # for the frontend, sent once per step
        self.shutting_down = False
        self.aborted_all = False
        self.last_heard = time.monotonic()
        self.next_ctrl_seq = 0

    # -- start-up: agree the KV capacity around the ring --------------------------------------

    def handshake(self) -> int:
        """Agree one KV capacity (the minimum over stages) and check every stage serves the same
        model and ring shape; returns the agreed block count (SGLang PR #10214 crashed on
        stages with different pool sizes)."""
        mine = {
            "num_kv_blocks": self.stage.num_kv_blocks,
            "config_hash": self.model.config_hash,
            "pp_loop_size": self.cfg.pp_loop_size,
            "context_length": self.model.context_length,
        }
        if not self.is_multi:
            agreed = mine["num_kv_blocks"]
        elif self.cfg.is_first_stage:
            self._send_ctrl("hello", mine)
            hello = self._wait_ctrl("hello")
            agreed = hello.info["num_kv_blocks"]
            self._send_ctrl("ready", {"num_kv_blocks": agreed})
            self._wait_ctrl("ready")
        else:
            hello = self._wait_ctrl("hello")
            for key in ("config_hash", "pp_loop_size", "context_length"):
                if hello.info[key] != mine[key]:
                    raise RingDown(
                        f"{self.prefix} {key} differs from stage 0's ({mine[key]!r} vs "
                        f"{hello.info[key]!r}): every stage must serve the same model and flags"
                    )
            info = dict(
                hello.info, num_kv_blocks=min(hello.info["num_kv_blocks"], mine["num_kv_blocks"])
            )
            self.links.next.send(Ctrl(op="hello", rank=hello.rank, seq=hello.seq, info=info))
            ready = self._wait_ctrl("ready")
            agreed = ready.info["num_kv_blocks"]
            self.links.next.send(ready)
        self.stage.allocate_kv(agreed)
        self.scheduler = Scheduler(
            self.cfg, agreed, self.model.context_length, self.model.eos_token_ids
        )
        logger.info(
            "%s ring ready: %d KV blocks agreed, %d slots",
            self.prefix,
            agreed,
            self.cfg.pp_loop_size,
        )
        return agreed

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Run until shutdown (returns 0) or a fatal ring error (returns 1)."""
        try:
            if self.scheduler is None:  # the handshake builds it
                self.handshake()
            if self.cfg.is_first_stage and self.links.deltas is not None:
                self.links.deltas.send(
                    Ctrl(op="ready", rank=0, info={"num_kv_blocks": self.scheduler.num_kv_blocks})
                )
            start = time.monotonic()
            step = 0
            while self._step(step):
                step += 1
            self.stats.wall_s = time.monotonic() - start
            self._log_stats()
            return 0
        except OSError as exc:
            # A neighbour's socket is gone: it stopped first. Report its reason if it sent one.
            cause = self._pending_error(timeout_s=1.0)
            if cause is not None:
                self._fail(str(cause.info.get("message", "")), cause.rank)
            else:
                self._fail(str(exc), None)
            return 1
        except (DivergenceError, SequenceError, RingDown) as exc:
            self._fail(str(exc), getattr(exc, "origin_rank", None))
            return 1
        finally:
            self.links.close()

    def _step(self, step: int) -> bool:
        if self.prepared is None:
            self.prepared = self._prepare(step, may_block=True)
        batch, self.prepared = self.prepared, None
        if batch is None:
            return False  # shutdown went round the ring
        seam = self._take_proxy(batch)
        pending = None
        if batch.entries:
            started = time.monotonic()
            pending = self.stage.launch(batch.chunks, **seam, **self._sampling_args(batch))
        if pending is not None and pending.overlaps and self.cfg.pp_loop_size > 1:
            prepared_early = self._overlap(step, batch, pending)
            result = pending.wait()
            self.stats.busy_s += pending.ended_at - started
            if pending.early_output is None:  # sampled tokens: they exist only now
                self._send_result(batch, result)
            if not prepared_early:  # the due output is late: the proxy goes first, as below
                self._flush()
                self._apply_due_output(step)
        else:
            if pending is not None:
                result = pending.wait()
                self.stats.busy_s += pending.ended_at - started
            else:  # an empty slot: nothing to compute, but the step's messages still go out
                result = SampleResult(token_ids=[]) if self.cfg.is_last_stage else empty_seam()
            self._send_result(batch, result)
            self._flush()  # the next stage can start now, not once the due output is here
            self._apply_due_output(step)
        self._flush()
        self._send_deltas(step)
        self.stats.steps += 1
        return True

    def _overlap(self, step: int, batch: Batch, pending: Any) -> bool:
        """While the forward runs, everything the next step needs, in the same order as without
        overlap: this step's due output, then the next step's reqs and decision. The next slot
        differs from this one (pp_loop_size > 1), so nothing decided here touches a block the
        running batch reads. The proxy is encoded first (its tensors exist, the device is
        filling them; ZeroMQ reads them at the flush, after the wait).

        Returns False if the due output has not arrived when the forward is done: the loop then
        sends the proxy before waiting for it, so a late output never holds the next stage up
        (and a lost message is still caught at the next stage as a step gap)."""
        if pending.early_output is not None:
            self._send_result(batch, pending.early_output)
        due = step + 1 - self.cfg.pp_loop_size
        if due >= 0 and not self.cfg.is_last_stage:  # the last stage keeps its own outputs
            if not self.receiver.prefetch(pending.ready_at, want="output"):
                return False
        self._apply_due_output(step)
        self.prepared = self._prepare(step + 1, may_block=False)
        self._send_deltas(step)
        if self.receiver is not None:  # decode what arrives before the forward ends
            self.receiver.prefetch(pending.ready_at)
        return True

    def _flush(self) -> None:
        """What this step queued for the next stage (reqs, output, proxy) leaves as one message.
        Nothing this stage waited for during the step depends on it: a stage's step k needs
        only its predecessor's step k and the last stage's earlier steps."""
        if self.links.next is not None:
            self.links.next.flush()

    def _send_deltas(self, step: int) -> None:
        """Stage 0: tell the frontend what happened to its requests (tokens, finishes)."""
        if self.deltas and self.links.deltas is not None:
            self.links.deltas.send(Deltas(step=step, deltas=self.deltas))
        self.deltas = []

    def _prepare(self, step: int, may_block: bool) -> Batch | None:
        """Steps 1 and 2 for `step`: take its reqs and decide its batch. None: shutdown."""
        slot = step % self.cfg.pp_loop_size
        reqs = self._take_reqs(slot, step, may_block)
        if reqs is None:
            return None
        self.deltas += self.scheduler.apply_reqs(reqs)
        batch, finished = self.scheduler.decide(slot, step)
        self.deltas += finished
        return self._maybe_diverge(batch)

    def _apply_due_output(self, step: int) -> None:
        """Step 5: apply the output of the slot that comes next (`step + 1 - pp_loop_size`)."""
        due = step + 1 - self.cfg.pp_loop_size
        if due >= 0:
            self.deltas += self.scheduler.apply_output(self._take_output(due))

    # -- step 1: requests ---------------------------------------------------------------------

    def _take_reqs(self, slot: int, step: int, may_block: bool) -> Reqs | None:
        if self.cfg.is_first_stage:
            reqs = self._gather_intake(slot, step, may_block)
        else:
            started = time.monotonic()
            msg = self._recv("reqs")
            self.stats.reqs_wait_s += time.monotonic() - started
            if msg is None:
                return None
            reqs = msg
        if reqs is not None and self.is_multi and not self.cfg.is_last_stage:
            self.links.next.queue(reqs)
        return reqs

    def _gather_intake(self, slot: int, step: int, may_block: bool) -> Reqs | None:
        """Stage 0: drain the frontend without blocking; block (with heartbeats) when idle.
        With a forward running (`may_block` False) the ring is not idle, so it never blocks
        nor shuts the ring down there."""
        new: list[NewRequest] = []
        aborts: list[str] = []
        while True:
            block = (
                may_block
                and not new
                and not aborts
                and self.scheduler.is_idle()
                and not self.shutting_down
            )
            msg = self._next_intake(block)
            if msg is None:
                break
            if isinstance(msg, Ctrl) and msg.op == "shutdown":
                self.shutting_down = True
                continue
            if isinstance(msg, Reqs):
                new += msg.new
                aborts += msg.aborts
        if self.shutting_down:
            # Fail what we hold: abort everything (a running request finishes at its next turn).
            aborts += [r.rid for r in new]
            if not self.aborted_all:
                aborts += list(self.scheduler.requests)
                self.aborted_all = True
            if may_block and self.scheduler.is_idle() and not new:
                self._shutdown_ring(step)
                return None
        return Reqs(slot=slot, step=step, new=new, aborts=aborts)

    def _next_intake(self, block: bool) -> Any | None:
        intake = self.links.intake
        if not block:
            if intake is None or not intake.poll(0):
                return None
            return intake.recv(0)
        # Idle: wait for the frontend, sending a heartbeat around the ring every interval.
        poller = zmq.Poller()
        if intake is not None:
            poller.register(intake.sock, zmq.POLLIN)
        if self.receiver is not None:
            poller.register(self.receiver.channel.sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll(self.cfg.heartbeat_interval_s * 1000))
            if intake is not None and intake.sock in events:
                return intake.recv(0)
            if self.receiver is not None:
                self._handle_ctrl_while_idle()
            if not events and self.is_multi:
                self._send_ctrl("heartbeat", {})
                self.stats.heartbeats_sent += 1
            if self.is_multi and time.monotonic() - self.last_heard > self.cfg.ring_timeout_s:
                raise RingDown(
                    f"{self.prefix} heartbeat did not come back round the ring within "
                    f"{self.cfg.ring_timeout_s:.0f} s"
                )

    def _handle_ctrl_while_idle(self) -> None:
        while (msg := self.receiver.poll("ctrl", 0)) is not None:
            self.last_heard = time.monotonic()
            if msg.op == "error":
                raise RingDown(str(msg.info.get("message", "")), msg.rank)

    # -- steps 3 and 4: the seam and the result -------------------------------------------------

    def _take_proxy(self, batch: Batch) -> dict[str, Any]:
        if self.cfg.is_first_stage:
            return {}
        started = time.monotonic()
        proxy: Proxy = self._recv("proxy")
        self.stats.proxy_wait_s += time.monotonic() - started
        if proxy.step != batch.step or proxy.digest != batch.digest:
            raise DivergenceError(
                f"{self.prefix} slot {batch.slot} step {batch.step}: stage {self.cfg.rank - 1} "
                f"sent a batch with digest {proxy.digest}, this stage decided {batch.digest} "
                f"({len(batch.entries)} requests): the stages' schedulers diverged"
            )
        return {"hidden_states": proxy.hidden_states, "residual": proxy.residual}

    def _sampling_args(self, batch: Batch) -> dict[str, Any]:
        if not self.cfg.is_last_stage:
            return {}
        sampling = [e.req.sampling for e in batch.entries]
        # Only a repetition penalty needs the history; building it costs O(seq_len) per request.
        histories = [
            e.req.all_ids if e.chunk.sample and e.req.sampling.repetition_penalty != 1.0 else None
            for e in batch.entries
        ]
        return {"sampling": sampling, "histories": histories}

    def _send_result(self, batch: Batch, result: Any) -> None:
        if not self.cfg.is_last_stage:
            if self.cfg.debug_fault == ("drop", self.cfg.rank, batch.step):
                return  # fault injection: the proxy is lost
            self.links.next.queue(
                Proxy(
                    batch.slot,
                    batch.step,
                    batch.digest,
                    result["hidden_states"],
                    result["residual"],
                )
            )
            return
        # Last stage: send every output that is ready, and wait for those `depth` steps old.
        self.pending_results.append((batch, result))
        self._flush_outputs(must_send_through=batch.step - self.cfg.pp_async_batch_depth)

    def _flush_outputs(self, must_send_through: int) -> None:
        """Last stage: send outputs in step order: each one that is ready, and each one up to
        step `must_send_through` even if that means waiting for it (the straggler)."""
        while self.pending_results:
            batch, result = self.pending_results[0]
            is_ready = getattr(result, "is_ready", None)
            if is_ready is not None and not is_ready() and batch.step > must_send_through:
                break
            self.pending_results.popleft()
            sample: SampleResult = result.wait() if hasattr(result, "wait") else result
            output = Output(batch.slot, batch.step, batch.digest, sample.token_ids, sample.logprobs)
            self.own_outputs[batch.step] = output
            if self.is_multi:
                self.links.next.queue(output)

    # -- step 5: outputs ------------------------------------------------------------------------

    def _take_output(self, due: int) -> Output:
        if self.cfg.is_last_stage:
            self._flush_outputs(must_send_through=due)
            return self.own_outputs.pop(due)
        started = time.monotonic()
        output: Output = self._recv("output")
        self.stats.stalls_s += time.monotonic() - started
        if output.step != due:
            raise SequenceError(
                f"{self.prefix} expected the output of step {due}, got step {output.step}"
            )
        if self.cfg.rank + 1 < self.cfg.pp_size - 1:  # the last stage made it: don't send back
            self.links.next.queue(output)
        return output

    # -- receiving, control, shutdown -------------------------------------------------------------

    def _recv(self, kind: str) -> Any | None:
        """The next `kind` message from the predecessor; handles control messages meanwhile.
        Returns None when a shutdown arrives instead."""
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
            if msg.op == "error":
                raise RingDown(str(msg.info.get("message", "")), msg.rank)
            if msg.op in ("heartbeat", "shutdown") and msg.rank != self.cfg.rank:
                self.links.next.send(msg)  # round the ring, back to the stage that sent it
            if msg.op == "heartbeat":
                continue
            if msg.op == "shutdown":
                if not self.scheduler.is_idle():
                    logger.warning("%s shut down with requests still held", self.prefix)
                return None
            raise RingDown(f"{self.prefix} unexpected ctrl {msg.op} while running")

    def _wait_ctrl(self, op: str) -> Ctrl:
        deadline = time.monotonic() + self.cfg.ring_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RingDown(
                    f"{self.prefix} no ctrl {op} within {self.cfg.ring_timeout_s:.0f} s: "
                    "is every stage running?"
                )
            try:
                msg = self.receiver.recv("ctrl", timeout_s=remaining)
            except ChannelTimeout:
                continue
            if msg.op == op:
                return msg
            if msg.op == "error":
                raise RingDown(str(msg.info.get("message", "")), msg.rank)

    def _send_ctrl(self, op: str, info: dict[str, Any]) -> None:
        self.links.next.send(Ctrl(op=op, rank=self.cfg.rank, seq=self.next_ctrl_seq, info=info))
        self.next_ctrl_seq += 1

    def _shutdown_ring(self, step: int) -> None:
        """Stage 0, idle and asked to stop: send shutdown round the ring and wait for it."""
        if self.is_multi:
            self._send_ctrl("shutdown", {"step": step})
            self._wait_ctrl("shutdown")
        if self.links.deltas is not None:
            self.links.deltas.send(Ctrl(op="shutdown", rank=0, info={"step": step}))
        logger.info("%s ring shut down after %d steps", self.prefix, step)

    def _log_stats(self) -> None:
        st = self.stats
        wall = max(st.wall_s, 1e-9)
        logger.info(
            "%s %d steps in %.1f s: %.0f%% in forward, %.0f%% waiting for outputs, "
            "%.0f%% waiting for proxies, %.0f%% waiting for reqs",
            self.prefix,
            st.steps,
            wall,
            100 * st.busy_s / wall,
            100 * st.stalls_s / wall,
            100 * st.proxy_wait_s / wall,
            100 * st.reqs_wait_s / wall,
        )

    def _pending_error(self, timeout_s: float) -> Ctrl | None:
        """An error report already on its way to this stage, if any."""
        if self.receiver is None:
            return None
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = self.receiver.recv("ctrl", timeout_s=remaining)
            except (ChannelTimeout, SequenceError):
                return None
            if msg.op == "error":
                return msg
        return None

    def _fail(self, message: str, origin_rank: int | None) -> None:
        """Tell the rest of the ring (and the frontend) and give up. Best effort: the
        neighbour may be gone already."""
        origin = self.cfg.rank if origin_rank is None else origin_rank
        if origin == self.cfg.rank:
            if not message.startswith(self.prefix):
                message = f"{self.prefix} {message}"  # the ring and the user see who found it
            logger.error("%s", message)
        else:
            logger.error("%s stopping: stage %d reported: %s", self.prefix, origin, message)
        msg = Ctrl(op="error", rank=origin, info={"message": message})
        next_rank = (self.cfg.rank + 1) % self.cfg.pp_size
        targets = [self.links.deltas]
        if next_rank != origin:
            targets.append(self.links.next)
        for channel in targets:
            if channel is not None:
                try:
                    channel.send(msg)
                except OSError:
                    pass

    def _maybe_diverge(self, batch: Batch) -> Batch:
        """Fault injection for tests: decide differently at one step on one rank."""
        if self.cfg.debug_fault != ("diverge", self.cfg.rank, batch.step):
            return batch
        entries = batch.entries[:-1]
        return Batch(batch.slot, batch.step, entries, batch_digest(batch.slot, batch.step, entries))
