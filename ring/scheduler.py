"""The scheduler replica every stage runs: same inputs in the same order, same decisions.

Plain Python over `Req` objects; it never touches a tensor and imports no torch. Three inputs
change its state, and every stage feeds them at the same step of its loop:

    apply_reqs(reqs)              new requests and aborts of one step (DESIGN.md §6 step 1)
    decide(slot, step) -> Batch   the micro-batch of one slot (step 2)
    apply_output(output)          the sampled tokens of an earlier step (step 5)

Nothing time- or rank-dependent enters a decision (SGLang #28424 diverged on exactly that), and
each decision is summarised by a digest that travels with the batch, so a replica that differs
is caught at the next stage instead of corrupting output.

The prefix cache (ring/prefix_cache.py) is part of the replica: a block a request has filled is
offered to the pool under its key at the end of the decision that filled it (so no request
admitted in that same batch reads it before the forward has written it; later steps run after
it on every stage), and an admitted request first takes the longest run of cached blocks of its
tokens, prefilling only the rest. Every stage's pool sees the same calls in the same order, so
matches and block ids agree without being sent; the digest covers each admission's cached
length and whole block table, so a pool that drifted is caught at the step it decides from it.

KV exhaustion: we *retract* rather than reserve. Reserving prompt + max_new_tokens for every
request at admission can never deadlock, but it keeps most of the pool idle (requests usually
stop long before max_new_tokens), which caps concurrency exactly where PP is meant to raise it.
So admission only needs room for the first chunk plus one growth block per running request;
when a slot's requests cannot grow, the slot retracts its newest request: its blocks are freed
and it returns to the waiting queue (at its arrival position) to be recomputed from prompt +
tokens so far. Retraction happens only in the slot being decided, whose previous batch is no
longer in flight. A request of that slot may still have a prefill chunk in flight in another
slot's batch (below), and every stage runs steps in order, so that chunk has written its (now
unused) KV before any later step reuses the freed blocks; if that chunk samples, its token is
dropped when it comes back (`Req.sample_step`), and the recompute samples again. Every stage
retracts the same request at the same step because the decision is replicated.

Prefill is spread over the slots (pp_loop_size > 1). A pipeline runs at the pace of its
heaviest micro-batch: when one slot's step carries a new prompt and the next slot's only its
decodes, the stages take turns waiting on each other (measured: both stages of a PP=2 ring idle
18-20% of the time on the serving bench, whatever the layer split). So a step's prefill budget
is the pending prefill split over the slots (at most chunked_prefill_size; unsplit when a share
would be under MIN_PREFILL_CHUNK), and a slot with budget left spends it on prompts that
belong to other slots: it continues their admitted prompts, last chunk included, and when it is
full itself it admits waiting requests into the next slot with room. A request belongs to one slot,
where it decodes (its cap, its retraction); only where its prefill runs moves. Its first token
is not later for it: a last chunk run in the step before its own slot's comes back (L steps
later, L = pp_loop_size) in time for the same decode step its own slot would have given it.
Measured on the equal-work bench (PP=2, 32 in flight, 16 per slot): when the requests of one
slot had finished their prompts, the other slot's new arrivals (up to 137 tokens a step) ran
against 16-token decode steps, and both stages waited 70 ms in each such pair of steps.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field

from protocol.messages import Output, Reqs, RequestDelta
from ring.config import RingConfig
from ring.prefix_cache import ROOT, ROOT_ROPE_LONG, PrefixCache, extend_keys
from ring.request import Req, ReqState
from stages.batch import BLOCK_SIZE, SeqChunk, blocks_needed

# Prefill is spread over the slots only in shares of at least this many tokens: a smaller chunk
# costs more in per-step overhead than it saves in balance.
MIN_PREFILL_CHUNK = 32
# --schedule-policy lpm orders at most this many waiting requests (SGLang's bound too), and
# falls back to arrival order once the oldest has seen this many later ones admitted first.
LPM_MAX_QUEUE = 128
LPM_MAX_PASSES = 32


@dataclass(frozen=True)
class BatchEntry:
    req: Req
    chunk: SeqChunk
    admitted: bool = False  # its request's first chunk since it left the waiting queue


@dataclass(frozen=True)
class Batch:
    """One micro-batch decision: what every stage runs for this slot at this step."""

    slot: int
    step: int
    entries: list[BatchEntry]
    digest: str

    @property
    def num_tokens(self) -> int:
        return sum(e.chunk.num_tokens for e in self.entries)

    @property
    def chunks(self) -> list[SeqChunk]:
        return [e.chunk for e in self.entries]

    @property
    def sampled(self) -> list[Req]:
        return [e.req for e in self.entries if e.chunk.sample]


def batch_digest(slot: int, step: int, entries: list[BatchEntry]) -> str:
    """A short hash of everything that shapes the batch's tensors and its outputs.

    A block table is set whole at admission (the cached blocks it matched, then fresh ones),
    and only grows at the end after that, from pools that replay the same calls: an admission
    is digested with its whole table (and its cached length, its chunk's start), a later chunk
    with the table's length and last block, O(1) per request per step."""
    parts = [f"{slot}:{step}"]
    for e in entries:
        c = e.chunk
        last_block = c.block_ids[-1] if c.block_ids else -1
        parts.append(
            f"{e.req.rid}:{c.start_pos}:{c.num_tokens}:{int(c.sample)}:{len(c.block_ids)}:"
            f"{last_block}:{int(c.rope_long)}"
        )
        if e.admitted:
            parts.append(",".join(map(str, c.block_ids)))
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


@dataclass
class SchedulerStats:
    # The most requests one slot held (what micro_batch_cap bounds; its batch may also carry
    # other slots' prefill chunks).
    max_batch_requests: int = 0
    max_running_requests: int = 0  # the most requests admitted at once
    num_retractions: int = 0
    num_rope_recomputes: int = 0  # LongRoPE sequences computed again at the long factors
    max_held_blocks: int = 0  # the most KV blocks requests held at once, after a decision
    num_continued_chunks: int = 0  # prefill chunks run in another slot's batch
    num_batches: int = 0
    num_empty_batches: int = 0
    # The prefix cache, in tokens: those admissions asked for (a request's whole sequence at
    # each admission, a recompute's too) and those they found cached.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


@dataclass
class Scheduler:
    cfg: RingConfig
    num_kv_blocks: int  # the agreed capacity: the minimum over all stages
    context_length: int
    eos_token_ids: tuple[int, ...] = ()
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    # LongRoPE (ModelInfo.rope_long_from): a sequence longer than this is computed at the long
    # factors, all of it; None for every other model
    rope_long_from: int | None = None
    # ModelInfo.kv_window: where every layer sees only the last this many positions, the blocks
    # behind them go back to the pool as a sequence advances; None: every block stays held
    kv_window: int | None = None

    def __post_init__(self) -> None:
        self.pool = PrefixCache(self.num_kv_blocks)
        self.prefix_caching = not self.cfg.disable_radix_cache
        # (block, key) of the blocks this decision filled: cached at its end (see the module
        # docstring).
        self._filled: list[tuple[int, bytes]] = []
        self.requests: dict[str, Req] = {}
        self.waiting: list[Req] = []  # sorted by arrival
        self.slots: list[list[Req]] = [[] for _ in range(self.cfg.pp_loop_size)]
        self.inflight: dict[int, Batch] = {}  # step -> batch whose output is not applied yet
        self.num_arrivals = 0

    # -- inputs -------------------------------------------------------------------------------

    def apply_reqs(self, reqs: Reqs) -> list[RequestDelta]:
        """Queue new requests and mark aborts. Returns the requests that finished right away
        (rejected, or aborted while waiting)."""
        finished = []
        for new in reqs.new:
            eos = () if new.sampling.ignore_eos else self.eos_token_ids
            req = Req(
                new.rid,
                list(new.input_ids),
                new.sampling,
                arrival=self.num_arrivals,
                num_generated_before=new.num_generated,
                stop_ids=frozenset(new.sampling.stop_token_ids).union(eos),
            )
            self.num_arrivals += 1
            req.rope_long = self._rope_long(req)
            error = self._reject_reason(req)
            if error:
                finished.append(RequestDelta(new.rid, None, None, "error", error))
                continue
            self.requests[req.rid] = req
            self.waiting.append(req)
        for rid in reqs.aborts:
            req = self.requests.get(rid)
            if req is None:
                continue  # already finished, or never known: nothing to do
            if req.state is ReqState.WAITING:
                self.waiting.remove(req)
                finished.append(self._finish(req, "abort"))
            else:
                # Running: it may be in flight. It is finished when its slot comes round again
                # (decide) or when its in-flight output is applied, whichever is first.
                req.abort_requested = True
        return finished

    def decide(self, slot: int, step: int) -> tuple[Batch, list[RequestDelta]]:
        """The batch for `slot` at `step`, and requests finished while deciding (aborts)."""
        aborted = [r for r in self.slots[slot] if r.abort_requested]
        finished = [self._finish(r, "abort") for r in aborted]
        entries, prefill_budget = self._schedule_running(slot, self._prefill_budget())
        continued, prefill_budget = self._continue_other_slots(slot, prefill_budget)
        entries += continued + self._admit(slot, prefill_budget)
        for block, key in self._filled:
            self.pool.commit(block, key)
        self._filled.clear()
        held = self.pool.num_blocks - self.pool.num_available
        self.stats.max_held_blocks = max(self.stats.max_held_blocks, held)
        batch = Batch(slot, step, entries, batch_digest(slot, step, entries))
        for req in batch.sampled:
            req.sample_step = step
        self.inflight[step] = batch
        self.stats.num_batches += 1
        self.stats.num_empty_batches += not entries
        held = len(self.slots[slot])
        self.stats.max_batch_requests = max(self.stats.max_batch_requests, held)
        num_running = sum(len(s) for s in self.slots)
        self.stats.max_running_requests = max(self.stats.max_running_requests, num_running)
        return batch, finished

    def apply_output(self, output: Output) -> list[RequestDelta]:
        """Append sampled tokens of an earlier step's batch; finish what is done."""
        batch = self.inflight.pop(output.step, None)
        if batch is None:
            raise RuntimeError(f"output for step {output.step}, which has no batch in flight")
        if output.digest != batch.digest:
            raise DivergenceError(
                f"output of step {output.step} (slot {output.slot}) has digest {output.digest}, "
                f"this stage decided {batch.digest}: the stages' schedulers diverged"
            )
        sampled = batch.sampled
        if len(output.token_ids) != len(sampled):
            raise DivergenceError(
                f"output of step {output.step} has {len(output.token_ids)} tokens for "
                f"{len(sampled)} sampled requests"
            )
        for name in ("logprobs", "top_ids", "top_logprobs"):
            values = getattr(output, name)
            if values is not None and len(values) != len(sampled):
                raise DivergenceError(
                    f"output of step {output.step} has {len(values)} {name} for "
                    f"{len(sampled)} sampled requests"
                )
        deltas = []
        for i, (req, token_id) in enumerate(zip(sampled, output.token_ids)):
            if req.sample_step != output.step:
                # Retracted while this output was in flight (its recompute samples again), or
                # finished by an abort its slot saw first: not its token any more.
                continue
            req.sample_step = None
            logprob = output.logprobs[i] if output.logprobs is not None else None
            top = output.top_ids[i] if output.top_ids is not None else None
            top_lp = output.top_logprobs[i] if output.top_logprobs is not None else None
            if req.abort_requested:
                deltas.append(self._finish(req, "abort"))
                continue
            req.output_ids.append(token_id)
            reason = self._finish_reason(req, token_id)
            if reason:
                self._finish(req, reason)
            # The first token tells how much of the prompt was cached (the OpenAI usage's
            # cached_tokens, the metrics' hits).
            cached = req.num_cached_tokens if len(req.output_ids) == 1 else 0
            deltas.append(
                RequestDelta(
                    req.rid, token_id, logprob, reason or "", "", top or None, top_lp or None,
                    cached,
                )
            )  # fmt: skip
        return deltas

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(len(s) for s in self.slots)

    @property
    def has_work(self) -> bool:
        """Anything waiting or running: the ring must keep stepping."""
        return bool(self.waiting) or self.num_running > 0

    def is_idle(self) -> bool:
        return not self.has_work

    # -- internals ----------------------------------------------------------------------------

    def _reject_reason(self, req: Req) -> str:
        if req.rid in self.requests:
            return f"request id {req.rid} is already in use"
        num_prompt, max_new = len(req.prompt_ids), req.sampling.max_new_tokens
        total = num_prompt + max_new
        if total > self.context_length:
            return (
                f"the prompt ({num_prompt} tokens) plus max_new_tokens ({max_new}) is {total} "
                f"tokens, beyond the context length {self.context_length}: shorten the prompt "
                f"or lower max_new_tokens"
            )
        most = self._most_blocks(total)
        if most > self.num_kv_blocks:
            return (
                f"the prompt plus max_new_tokens needs {most} KV blocks but the "
                f"whole pool has {self.num_kv_blocks}: lower max_new_tokens or give the KV "
                f"cache more memory"
            )
        return ""

    def _most_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens holds at once: all of them, or with a
        window its last window's and a prefill chunk's (and the block each starts inside)."""
        if self.kv_window is None:
            return blocks_needed(num_tokens)
        held = blocks_needed(self.kv_window + self.cfg.chunked_prefill_size) + 1
        return min(blocks_needed(num_tokens), held)

    def _finish_reason(self, req: Req, token_id: int) -> str | None:
        sampling = req.sampling
        if token_id in req.stop_ids and len(req.output_ids) > sampling.min_tokens:
            return "stop"  # (before min_tokens the sampler never picks one; a peer that did)
        if len(req.output_ids) >= sampling.max_new_tokens:
            return "length"
        if req.seq_len >= self.context_length:
            return "length"
        return None

    def _finish(self, req: Req, reason: str) -> RequestDelta:
        if req.slot is not None:
            self.slots[req.slot].remove(req)
        self._release(req)
        req.slot = None
        req.sample_step = None  # an output still in flight for it is not applied
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        del self.requests[req.rid]
        return RequestDelta(req.rid, None, None, reason)

    @staticmethod
    def _is_decode(req: Req) -> bool:
        return req.num_pending == 1 and bool(req.output_ids)

    def _prefill_budget(self) -> int:
        """Prefill tokens for this step: all of `chunked_prefill_size` with one slot; with
        several, the pending prefill split over them, so that no slot's step is heavier than
        the next (see the module docstring)."""
        cap = self.cfg.chunked_prefill_size
        if self.cfg.pp_loop_size == 1:
            return cap
        pending = sum(r.num_pending for s in self.slots for r in s if not self._is_decode(r))
        if self.num_running < self.cfg.max_running_requests:
            pending += sum(r.num_pending for r in self.waiting)
        share = -(-pending // self.cfg.pp_loop_size)
        return cap if share < MIN_PREFILL_CHUNK else min(cap, share)

    def _continue_other_slots(self, slot: int, budget: int) -> tuple[list[BatchEntry], int]:
        """Prefill chunks of other slots' requests (the one that samples too), oldest first,
        while budget and KV allow; and the budget left. The request stays in its own slot (its
        decodes, its retraction, its cap)."""
        entries: list[BatchEntry] = []
        # Prompts only: a decoding request needs the token its own slot's output brings, and
        # one awaiting its output has nothing pending.
        others = sorted(
            (
                r
                for s, reqs in enumerate(self.slots)
                if s != slot
                for r in reqs
                if r.num_pending > 0 and not self._is_decode(r) and not r.abort_requested
            ),
            key=lambda r: r.arrival,
        )
        for req in others:
            if budget <= 0:
                break
            num_tokens = min(req.num_pending, budget)
            extra = blocks_needed(req.num_computed + num_tokens) - len(req.block_ids)
            # As admission does: keep a growth block per running request.
            if extra + self.num_running > self.pool.num_available:
                break
            entries.append(self._commit(req, num_tokens))
            budget -= num_tokens
        self.stats.num_continued_chunks += len(entries)
        return entries, budget

    def _schedule_running(self, slot: int, prefill_budget: int) -> tuple[list[BatchEntry], int]:
        """Chunks for the slot's admitted requests, retracting the newest until they fit.

        Decodes take one token each; prefill chunks (new, chunked, or recomputing requests)
        share `prefill_budget` tokens. Returns the entries and the prefill budget left.
        """
        reqs = self.slots[slot]
        if self.rope_long_from is not None:  # (LongRoPE models only)
            for req in reqs:
                if not req.rope_long and self._rope_long(req) and self._is_decode(req):
                    self._recompute_long(req)
        while True:
            plan, budget = [], prefill_budget
            for req in reqs:
                if self._is_decode(req):
                    plan.append((req, 1))
                else:
                    num_tokens = min(req.num_pending, budget)
                    budget -= num_tokens
                    plan.append((req, num_tokens))
            need = sum(
                blocks_needed(req.num_computed + n) - len(req.block_ids) - self._behind_window(req)
                for req, n in plan
                if n
            )
            if need <= self.pool.num_available or not reqs:
                break
            self._retract(reqs[-1])  # the newest in this slot
        entries = [self._commit(req, n) for req, n in plan if n]
        return entries, budget

    def _admit(self, slot: int, prefill_budget: int) -> list[BatchEntry]:
        """Admit waiting requests in `_admission_order` (no skipping: the first that does not
        fit ends admission) while caps and KV allow, each into `slot` or, once it is full, into
        the next slot in step order with room (as that slot's own step would have: a cap the
        user set still packs whole micro-batches); their first chunks run in this batch either
        way."""
        entries = []
        cap = self._slot_cap()
        order = [(slot + i) % len(self.slots) for i in range(len(self.slots))]
        candidates = self._admission_order()  # the waiting list itself in arrival order
        while candidates and prefill_budget > 0:
            home = next((s for s in order if len(self.slots[s]) < cap), None)
            if home is None:
                break
            if self.num_running >= self.cfg.max_running_requests:
                break
            req = candidates[0]
            matched = self._match(req)
            num_cached = len(matched) * BLOCK_SIZE
            num_tokens = min(req.seq_len - num_cached, prefill_budget)
            num_new = blocks_needed(num_cached + num_tokens) - len(matched)
            # Keep one growth block per running request so admission does not immediately force
            # a retraction elsewhere.
            if not self.pool.fits(matched, num_new + self.num_running):
                break
            if candidates is not self.waiting:
                candidates.pop(0)
            self.waiting.remove(req)
            for older in self.waiting:  # (sorted by arrival)
                if older.arrival > req.arrival:
                    break
                older.num_passed_over += 1
            self.pool.acquire(matched)
            req.block_ids = matched
            req.num_computed = req.num_cached_tokens = num_cached
            req.num_committed_blocks = len(matched)
            self.stats.prefix_query_tokens += req.seq_len
            self.stats.prefix_hit_tokens += num_cached
            req.state = ReqState.RUNNING
            req.slot = home
            self.slots[home].append(req)
            entries.append(self._commit(req, num_tokens, admitted=True))
            prefill_budget -= num_tokens
        return entries

    def _admission_order(self) -> list[Req]:
        """The waiting requests in the order admission tries them. fcfs: by arrival (the
        waiting list itself: no copy of a long queue every step). lpm
        (SGLang's longest prefix match): the longest cached prefix first, arrival breaking ties,
        so requests that reuse what the cache holds run while it still holds it; by arrival
        again while a queue is longer than LPM_MAX_QUEUE (matching each costs a walk of its
        blocks every step) or once a request has been passed over LPM_MAX_PASSES times (none
        starves)."""
        waiting = self.waiting
        if (
            self.cfg.schedule_policy == "fcfs"
            or not self.prefix_caching
            or len(waiting) < 2
            or len(waiting) > LPM_MAX_QUEUE
            or waiting[0].num_passed_over >= LPM_MAX_PASSES
        ):
            return waiting
        matched = {req.rid: len(self._match(req)) for req in waiting}
        return sorted(waiting, key=lambda r: (-matched[r.rid], r.arrival))

    def _slot_cap(self) -> int:
        """Requests a slot may hold for now. A --pp-max-micro-batch-size the user set is filled
        as set (the bench of the seed's load condition packs M full micro-batches on purpose).
        The default cap comes from --max-running-requests, not from the load, so admission
        also holds a slot to its share of the requests present (running or waiting), rounded
        up: micro-batches stay level, and a pipeline runs at the pace of its heaviest one.
        Measured: 32 requests under a running cap of 64 (3 slots, cap 22) settled at 12, 11
        and 9, and PP=2 served 0.73-0.80x PP=1 in that run."""
        if self.cfg.pp_max_micro_batch_size is not None:
            return self.cfg.pp_max_micro_batch_size
        present = self.num_running + len(self.waiting)
        return min(self.cfg.micro_batch_cap, max(-(-present // self.cfg.pp_loop_size), 1))

    def _match(self, req: Req) -> list[int]:
        """The cached blocks of the longest run of `req`'s full blocks, its last token left out
        (its logits are needed); none with the cache off."""
        if not self.prefix_caching:
            return []
        num_blocks = (req.seq_len - 1) // BLOCK_SIZE
        return self.pool.match(self._keys(req, num_blocks)[:num_blocks])

    @staticmethod
    def _keys(req: Req, num_blocks: int) -> list[bytes]:
        """`req`'s block keys, computed as far as its first `num_blocks` full blocks (for the
        rotary mode it is computed in: a LongRoPE sequence's blocks at the long factors are
        other K and V than the same tokens' at the short ones)."""
        if req.keys_rope_long != req.rope_long:
            req.block_keys, req.keys_rope_long = [], req.rope_long
        keys = req.block_keys
        if len(keys) < num_blocks:
            root = ROOT_ROPE_LONG if req.rope_long else ROOT
            tokens = req.token_slice(len(keys) * BLOCK_SIZE, num_blocks * BLOCK_SIZE)
            extend_keys(keys, tokens, root)
        return keys

    def _rope_long(self, req: Req) -> bool:
        """Whether `req`'s whole sequence is computed at LongRoPE's long factors: where it is
        longer than the model's original context, as transformers' Phi-3 does (a forward whose
        positions reach past it turns every position long, and generation recomputes the cache
        the first time a sequence gets there: Phi3ForCausalLM.prepare_inputs_for_generation).
        The same decision on every stage, from the sequence's length alone."""
        return self.rope_long_from is not None and req.seq_len > self.rope_long_from

    def _recompute_long(self, req: Req) -> None:
        """A decoding LongRoPE request whose next token reaches past the original context: its
        K and V so far were computed at the short factors, so its whole sequence is computed
        again at the long ones (a prefill of it from position 0, in this slot, from this step's
        prefill budget), as transformers recomputes its cache there. Its short blocks stay
        cached for other sequences."""
        self._release(req)
        req.num_computed = 0
        req.rope_long = True
        self.stats.num_rope_recomputes += 1

    def _behind_window(self, req: Req) -> int:
        """How many more of `req`'s blocks lie wholly behind what its next query sees (every
        layer's window): keys before position num_computed - window + 1."""
        if self.kv_window is None:
            return 0
        dead = max(0, req.num_computed - self.kv_window + 1) // BLOCK_SIZE
        return max(0, dead - req.num_window_released)

    def _commit(self, req: Req, num_tokens: int, admitted: bool = False) -> BatchEntry:
        """Allocate the blocks `num_tokens` more tokens need and advance the request; the
        blocks it fills are cached at the end of this decision. Where every layer has a window,
        the blocks no query of it will see again go back to the pool first (full blocks, so
        they stay cached, matchable by another sequence; their ids stay in the request's table,
        where no stage reads them: csrc/attention_window.c). Steps run in order on every stage,
        so a block given back here is rewritten only by a later step than any that reads it."""
        behind = self._behind_window(req)
        if behind:
            released = req.num_window_released
            self.pool.release(req.block_ids[released : released + behind])
            req.num_window_released = released + behind
        start = req.num_computed
        extra = blocks_needed(start + num_tokens) - len(req.block_ids)
        if extra > 0:
            req.block_ids += self.pool.allocate(extra)
        token_ids = req.token_slice(start, start + num_tokens)
        req.num_computed = start + num_tokens
        num_full = req.num_computed // BLOCK_SIZE
        if self.prefix_caching and num_full > req.num_committed_blocks:
            keys = self._keys(req, num_full)
            for i in range(req.num_committed_blocks, num_full):
                self._filled.append((req.block_ids[i], keys[i]))
            req.num_committed_blocks = num_full
        sample = req.num_computed == req.seq_len
        chunk = SeqChunk(token_ids, start, list(req.block_ids), sample, req.rope_long)
        return BatchEntry(req, chunk, admitted)

    def _release(self, req: Req) -> None:
        """Its blocks go back to the pool (those behind its window already have): the full
        ones stay cached until evicted."""
        self.pool.release(req.block_ids[req.num_window_released :])
        req.block_ids = []
        req.num_committed_blocks = 0
        req.num_window_released = 0

    def _retract(self, req: Req) -> None:
        self.slots[req.slot].remove(req)
        self._release(req)
        req.slot = None
        req.num_computed = 0
        req.sample_step = None
        req.state = ReqState.WAITING
        req.num_retractions += 1
        req.rope_long = self._rope_long(req)  # readmitted, it computes its whole sequence
        self.stats.num_retractions += 1
        arrivals = [r.arrival for r in self.waiting]
        self.waiting.insert(bisect.bisect(arrivals, req.arrival), req)


class DivergenceError(RuntimeError):
    """Two stages' scheduler replicas made different decisions."""
