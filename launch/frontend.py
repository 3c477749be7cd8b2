"""The frontend (on node 0): clients in, token ids to stage 0, text back out.

One asyncio loop (uvloop when available) with two tasks:
- clients: a ROUTER socket. Each `generate` is validated (the schema, then the prompt against
  the context length), tokenized (chat template for `messages`) and sent to stage 0 as a
  `submit` message; an `abort` is passed on. A bad message gets `error` at once and disturbs
  nothing else.
- ring: stage 0's `deltas`. New tokens are detokenized incrementally and streamed as `chunk`;
  stop strings are applied here (the request is then aborted in the ring); a finish sends
  `done` with usage and timings, or `error`.

Every accepted request gets exactly one terminal message (`done` or `error`). If the ring goes
down (a stage reports an error, or the launcher sees a stage die), every request in flight gets
`error` with code `ring_down`, and so does every new one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from launch.detokenize import IncrementalDetokenizer
from protocol.channels import AsyncPullChannel, AsyncRouterChannel, BadClientMessage, PushChannel
from protocol.curve import CurveServer, warn_if_exposed
from protocol.errors import ProtocolError
from protocol.messages import (
    Abort,
    Chunk,
    Deltas,
    Done,
    Error,
    Generate,
    NewRequest,
    Ping,
    Pong,
    RequestDelta,
    RingError,
    RingReady,
    Shutdown,
    StageStats,
    StopServing,
    Submit,
)
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from launch.metrics import FrontendMetrics

logger = logging.getLogger(__name__)


# Where one request's answers go: the ZeroMQ client's socket, or an HTTP handler's queue.
Sink = Callable[[Chunk | Done | Error], Awaitable[None]]
# New requests that may wait while the ring re-forms; beyond them, `overloaded`.
MAX_HELD_REQUESTS = 256


@dataclass
class Inflight:
    sink: Sink
    client_rid: str
    input_ids: list[int]  # the prompt's
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    want_logprobs: bool
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_ids: list[int] = field(default_factory=list)  # sent to the client so far
    stopped_by_string: bool = False
    sent_to_ring: bool = False  # False: held while the ring re-forms
    cached_tokens: int = 0  # of its prompt, found in the prefix cache (told with its first token)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def replay(self, rid: str) -> NewRequest | None:
        """The request as a re-formed ring must see it so that it continues where it stopped:
        its prompt plus the tokens already sent as the prompt (marked as generated, for the
        penalties that count the output), the rest of max_new_tokens, the same sampling (a
        seeded draw depends on (seed, position) only, so it repeats). None: nothing is left to
        generate."""
        remaining = self.sampling.max_new_tokens - self.num_tokens
        if remaining <= 0:
            return None
        sampling = dataclasses.replace(
            self.sampling,
            max_new_tokens=remaining,
            min_tokens=max(0, self.sampling.min_tokens - self.num_tokens),
        )
        return NewRequest(rid, self.input_ids + self.token_ids, sampling, len(self.token_ids))


class Frontend:
    def __init__(
        self,
        tokenizer: Any,
        *,
        client_addr: str,
        intake_addr: str,
        deltas_addr: str,
        context_length: int,
        metrics: FrontendMetrics | None = None,
        security: CurveServer | None = None,
        max_held_requests: int = MAX_HELD_REQUESTS,
    ) -> None:
        """`security`: CURVE for the client socket (protocol/curve.py); None: clear text, with
        a warning when `client_addr` is reachable from other hosts."""
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.context_length = context_length
        self.vocab_size = len(tokenizer)
        warn_if_exposed(client_addr, security, "the frontend's client socket")
        self.clients = AsyncRouterChannel(client_addr, security=security)
        self.deltas = AsyncPullChannel(deltas_addr)
        self.intake = PushChannel(intake_addr)
        self.inflight: dict[str, Inflight] = {}  # ring rid -> request
        self.next_seq = 0
        self.ring_error: str | None = None
        self.ring_ready = asyncio.Event()
        self.num_kv_blocks = 0  # what the ring agreed, once ready
        self.stopped = asyncio.Event()
        self.num_bad_messages = 0
        # Re-forming (launch/local.py restarts the ring after a stage died): the ring's epoch,
        # whether a failure may wait for a re-formed ring instead of failing every request, the
        # failure the launcher is to act on, and since when the ring is down.
        self.epoch: int | None = 0  # None: re-forming, the next epoch not known yet
        self.restartable = False
        self.ring_failure: str | None = None
        self.down_since: float | None = None
        self.max_held_requests = max_held_requests
        # Answers for ZeroMQ clients, by client identity, sent once this turn of the event loop
        # ends (_post): a step's tokens for all of a client's streams leave as one message.
        self.outbox: dict[bytes, list[Chunk | Done | Error]] = {}

    @property
    def addr(self) -> str:
        return self.clients.addr

    # -- lifecycle ------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Until the ring shuts down or fails."""
        tasks = [asyncio.create_task(self._client_loop()), asyncio.create_task(self._ring_loop())]
        try:
            await self.stopped.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def request_shutdown(self) -> None:
        """Ask stage 0 to fail what it holds and take the ring down gracefully."""
        self.intake.send(StopServing())

    def ring_down(self, reason: str, quiet: bool = False) -> None:
        """The ring cannot serve: error everything in flight, and everything that comes."""
        if self.ring_error is None:
            self.ring_error = reason
            if not quiet:
                logger.error("ring down: %s", reason)
        for rid in list(self.inflight):
            self._send_error(rid, "ring_down", f"the ring went down: {reason}")
        self.stopped.set()

    def close(self) -> None:
        self._flush_outbox()
        for channel in (self.clients, self.deltas, self.intake):
            channel.close(linger_ms=500)

    # -- clients --------------------------------------------------------------------------------

    async def _client_loop(self) -> None:
        while True:
            try:
                identity, msg = await self.clients.recv()
            except BadClientMessage as exc:
                self.num_bad_messages += 1
                await self.clients.send(exc.identity, Error("", "bad_request", str(exc)))
                continue
            try:
                if isinstance(msg, Generate):
                    await self.submit(
                        _ring_rid(identity, msg.rid), msg, self._client_sink(identity)
                    )
                elif isinstance(msg, Abort):
                    self.abort(_ring_rid(identity, msg.rid))
                elif isinstance(msg, Ping):
                    await self.clients.send(identity, Pong(msg.rid))
                else:
                    raise ProtocolError(
                        f"a client may send generate, abort or ping, not {msg.kind}"
                    )
            except ProtocolError as exc:
                self.num_bad_messages += 1
                rid = getattr(msg, "rid", "")
                await self.clients.send(identity, Error(rid, "bad_request", str(exc)))
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the frontend
                logger.exception("could not handle a %s", msg.kind)
                rid = getattr(msg, "rid", "")
                await self.clients.send(identity, Error(rid, "internal", f"{type(exc).__name__}"))

    def _client_sink(self, identity: bytes) -> Sink:
        async def send(msg: Chunk | Done | Error) -> None:
            self._post(identity, msg)

        return send

    def _post(self, identity: bytes, msg: Chunk | Done | Error) -> None:
        """Queue `msg` for a client; the queue goes out when this turn of the event loop ends,
        so the answers of one ring step (one Deltas message) reach each client as one ZeroMQ
        message. One message a token and stream cost the frontend and the client a send and a
        receive each, CPU time taken from the stages on a small host: on 2 cores, equal work,
        alternated 4 rounds, medians, PP=1 at 32 in flight 595.6 -> 607.6 tok/s, PP=2 522.6 ->
        572.7; at 64, 621.6 -> 646.6 and 580.5 -> 599.3."""
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._flush_outbox)
        self.outbox.setdefault(identity, []).append(msg)

    def _flush_outbox(self) -> None:
        outbox, self.outbox = self.outbox, {}
        for identity, msgs in outbox.items():
            self.clients.send_many(identity, msgs)

    async def submit(self, rid: str, req: Generate, sink: Sink) -> None:
        """Admit one request under the ring-wide id `rid`; its answers go to `sink`, ending
        with exactly one Done or Error. Raises ProtocolError (nothing sent) for a bad one."""
        if rid in self.inflight:
            raise ProtocolError(f"request id {req.rid!r} is already in flight on this connection")
        if self.ring_error is not None:
            await sink(Error(req.rid, "ring_down", self.ring_error))
            return
        if self.down_since is not None and self._num_held() >= self.max_held_requests:
            await sink(
                Error(
                    req.rid,
                    "overloaded",
                    f"the ring is re-forming and {self.max_held_requests} requests already wait "
                    "for it: try again in a few seconds",
                )
            )
            return
        beyond = [t for t in req.sampling.logit_bias_ids() if t >= self.vocab_size]
        if beyond:
            raise ProtocolError(
                f"logit_bias holds token id {min(beyond)}, beyond the vocabulary "
                f"({self.vocab_size})"
            )
        input_ids = self.tokenize(req)
        total = len(input_ids) + req.sampling.max_new_tokens
        if total > self.context_length:
            raise ProtocolError(
                f"the prompt ({len(input_ids)} tokens) plus max_new_tokens "
                f"({req.sampling.max_new_tokens}) is {total} tokens, beyond the context length "
                f"{self.context_length}"
            )
        request = Inflight(
            sink,
            req.rid,
            input_ids,
            req.sampling,
            IncrementalDetokenizer(
                self.tokenizer, req.stop, input_ids, min_tokens=req.sampling.min_tokens
            ),
            req.sampling.logprobs,
        )
        self.inflight[rid] = request
        if self.metrics is not None:
            self.metrics.request_started(len(input_ids))
        if self.down_since is None:  # else it waits for the re-formed ring
            request.sent_to_ring = True
            self._to_ring(new=[NewRequest(rid, input_ids, req.sampling)])

    def tokenize(self, req: Generate) -> list[int]:
        """The token ids of a request: its ids, its prompt, or its messages in the chat template.
        Raises ProtocolError for one that cannot be served."""
        if req.input_ids is not None:
            if max(req.input_ids) >= self.vocab_size:
                raise ProtocolError(
                    f"input_ids holds a token id beyond the vocabulary ({self.vocab_size})"
                )
            return list(req.input_ids)
        if req.messages is not None:
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise ProtocolError("this model has no chat template: send a prompt instead")
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            # The template already holds any special tokens; don't let encode add a BOS again.
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids = self.tokenizer.encode(req.prompt)
        if not ids:
            raise ProtocolError("the prompt tokenizes to nothing")
        return list(ids)

    def abort(self, rid: str) -> None:
        """Abort request `rid` in the ring (its answer is a Done with finish reason abort)."""
        if rid not in self.inflight:
            return
        if self.down_since is None:
            self._to_ring(aborts=[rid])  # the ring answers with a finish, which sends `done`
        else:  # no ring holds it now: finish it here
            asyncio.ensure_future(self._finish(rid, "abort", time.monotonic()))

    def _to_ring(
        self, new: list[NewRequest] | None = None, aborts: list[str] | None = None
    ) -> None:
        submit = Submit(self.next_seq, new or [], aborts or [], epoch=self.epoch)
        self.intake.send(submit)
        self.next_seq += 1

    # -- the ring -------------------------------------------------------------------------------

    async def _ring_loop(self) -> None:
        while True:
            try:
                msg = await self.deltas.recv()
            except ProtocolError as exc:
                logger.warning("dropped a bad message from stage 0: %s", exc)
                continue
            if hasattr(msg, "epoch") and msg.epoch != self.epoch:
                logger.info("dropped a stale %s of ring epoch %d", msg.kind, msg.epoch)
            elif isinstance(msg, Deltas):
                for delta in msg.deltas:
                    await self._apply(delta)
                # This step's answers leave now. Left to the end of the loop's turn, they
                # would wait for every Deltas already queued behind it (a recv with a message
                # ready does not yield): a frontend behind the ring sent a whole answer as one
                # message, and its streams' TPOT read 0.
                self._flush_outbox()
            elif isinstance(msg, RingReady):
                self.num_kv_blocks = msg.num_kv_blocks
                if self.down_since is not None:
                    self._replay()
                self.ring_ready.set()
            elif isinstance(msg, RingError):
                self._ring_failed(msg.message or "a stage failed")
            elif isinstance(msg, StageStats):
                if self.metrics is not None:
                    self.metrics.stage_report(msg)
            elif isinstance(msg, Shutdown):
                logger.info("the ring shut down")
                self.ring_down("the ring shut down", quiet=True)

    # -- re-forming ---------------------------------------------------------------------------

    def _ring_failed(self, reason: str) -> None:
        """A stage reported the ring cannot go on. Where the launcher may re-form it, requests
        wait for that (the launcher reads `ring_failure`); otherwise every one fails now."""
        if self.restartable:
            self.ring_failure = self.ring_failure or reason
        else:
            self.ring_down(reason)

    def reform(self, reason: str) -> None:
        """The launcher is starting a new ring in place of one that failed (it sets `epoch`
        once it knows it; until then every ring message is stale): hold what comes until the
        new ring is ready, then replay every request in flight (see `Inflight.replay`)."""
        self.epoch = None
        self.ring_failure = None
        self.down_since = self.down_since or time.monotonic()
        self.ring_ready.clear()
        for request in self.inflight.values():
            request.sent_to_ring = False
        logger.warning(
            "the ring is re-forming after: %s; %d requests wait for it", reason, len(self.inflight)
        )

    def _replay(self) -> None:
        new: list[NewRequest] = []
        for rid, request in list(self.inflight.items()):
            replay = request.replay(rid)
            if replay is None:
                asyncio.ensure_future(self._finish(rid, "length", time.monotonic()))
            else:
                new.append(replay)
                request.sent_to_ring = True
        down_s = time.monotonic() - (self.down_since or time.monotonic())
        self.down_since = None
        replayed_tokens = sum(len(r.input_ids) for r in new)
        logger.warning(
            "the ring re-formed (epoch %d) after %.1f s down: replaying %d requests (%d prompt "
            "tokens, of which %d already sent)",
            self.epoch,
            down_s,
            len(new),
            replayed_tokens,
            sum(self.inflight[r.rid].num_tokens for r in new),
        )
        if self.metrics is not None:
            self.metrics.ring_reformed(down_s, len(new), replayed_tokens)
        if new:
            self._to_ring(new=new)

    def _num_held(self) -> int:
        return sum(not request.sent_to_ring for request in self.inflight.values())

    async def _apply(self, delta: RequestDelta) -> None:
        req = self.inflight.get(delta.rid)
        if req is None:
            return  # e.g. finished here by a stop string; the ring's abort answer comes later
        now = time.monotonic()
        if delta.token_id is not None:
            req.token_ids.append(delta.token_id)
            is_first = req.first_token_at is None
            if is_first:
                req.cached_tokens = delta.cached_tokens
            if self.metrics is not None:
                previous = req.last_token_at
                first = None if previous is not None else now - req.arrived
                self.metrics.token(None if previous is None else now - previous, first)
                if is_first:
                    self.metrics.prefix_cache(req.num_prompt_tokens, req.cached_tokens)
            req.first_token_at = req.first_token_at or now
            req.last_token_at = now
            text = req.detok.add(delta.token_id)
            if req.detok.stopped:
                text += req.detok.flush()
                req.stopped_by_string = True
            # Every token is reported, even one with no visible text (an EOS, half a character).
            logprobs = [delta.logprob] if req.want_logprobs and delta.logprob is not None else None
            top_ids = top_logprobs = None
            if logprobs and delta.top_ids is not None and delta.top_logprobs is not None:
                top_ids, top_logprobs = [delta.top_ids], [delta.top_logprobs]
            await req.sink(
                Chunk(req.client_rid, text, [delta.token_id], logprobs, top_ids, top_logprobs)
            )
            if req.stopped_by_string:
                self._to_ring(aborts=[delta.rid])
                await self._finish(delta.rid, "stop", now)
                return
        if delta.finish_reason == "error":
            self._send_error(delta.rid, "rejected", delta.error or "the ring refused the request")
        elif delta.finish_reason:
            tail = req.detok.flush()
            if tail:
                await req.sink(Chunk(req.client_rid, tail, []))
            await self._finish(delta.rid, delta.finish_reason, now)

    async def _finish(self, rid: str, reason: str, now: float) -> None:
        req = self.inflight.pop(rid)
        if self.metrics is not None:
            self.metrics.request_finished(reason, now - req.arrived)
        first = req.first_token_at or now
        tpot = (now - first) / (req.num_tokens - 1) if req.num_tokens > 1 else 0.0
        await req.sink(
            Done(
                rid=req.client_rid,
                finish_reason=reason,
                prompt_tokens=req.num_prompt_tokens,
                completion_tokens=req.num_tokens,
                ttft_s=first - req.arrived,
                tpot_s=tpot,
                e2e_s=now - req.arrived,
                cached_tokens=req.cached_tokens,
            ),
        )

    def _send_error(self, rid: str, code: str, message: str) -> None:
        req = self.inflight.pop(rid, None)
        if req is not None:
            if self.metrics is not None:
                self.metrics.request_failed(code)
            # Sinks never block (a ROUTER send, a queue put); scheduled so sync callers can use it.
            asyncio.ensure_future(req.sink(Error(req.client_rid, code, message)))


def _ring_rid(identity: bytes, client_rid: str) -> str:
    """Clients choose their own ids; the ring needs them unique across clients."""
    return f"{identity.hex()}/{client_rid}"
