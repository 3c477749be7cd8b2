"""A request as every stage's scheduler replica tracks it: plain Python, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.sampling import SamplingParams
from stages.batch import History


class ReqState(enum.Enum):
    WAITING = "waiting"  # in the queue, holds no KV
    RUNNING = "running"  # admitted to a slot: prefilling (possibly chunked) or decoding
    FINISHED = "finished"


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: int  # order of arrival; ties in the waiting queue never happen
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    # the first this many of block_ids are behind every layer's window: given back to the pool
    # (ring/scheduler.py `_commit`), named in the table still but never read
    num_window_released: int = 0
    num_computed: int = 0  # tokens whose KV is in the cache
    # The step whose batch samples its next token, while that output is in flight: the output
    # of any other step (it was retracted, or finished by an abort, meanwhile) is not its own.
    sample_step: int | None = None
    abort_requested: bool = False
    finish_reason: str | None = None
    num_retractions: int = 0
    # A replay (NewRequest.num_generated): the last this many prompt_ids were its output.
    num_generated_before: int = 0
    # The ids that end it: its stop_token_ids, and EOS unless ignore_eos.
    stop_ids: frozenset[int] = frozenset()
    # The prefix cache (ring/prefix_cache.py): the keys of its sequence's first full blocks,
    # computed once (they depend on its tokens alone); how many blocks of its table are full and
    # offered to the cache; the tokens its last admission found cached.
    block_keys: list[bytes] = field(default_factory=list)
    keys_rope_long: bool = False  # the mode block_keys were computed for (below)
    num_committed_blocks: int = 0
    num_cached_tokens: int = 0
    # Later arrivals admitted before it while it waited (--schedule-policy lpm's bound).
    num_passed_over: int = 0
    # LongRoPE: its K and V are computed at the long factors (ring/scheduler.py `_rope_long`)
    rope_long: bool = False

    def penalty_history(self) -> History:
        """Its tokens as the penalties see them: what it generated before a replay counts as
        output, not prompt. The output is copied: the request takes this step's token before
        a device step that is still running reads it."""
        cut = len(self.prompt_ids) - self.num_generated_before
        # A replay's min_tokens is already what is left of it (the frontend takes off the
        # tokens sent), so this ring's output is what counts.
        early = len(self.output_ids) < self.sampling.min_tokens
        return History(
            self.prompt_ids[:cut],
            self.prompt_ids[cut:] + self.output_ids,
            sorted(self.stop_ids) if early else (),
        )

    def token_slice(self, start: int, end: int) -> list[int]:
        """(prompt_ids + output_ids)[start:end] without building the sum (a decode step reads
        one token)."""
        num_prompt = len(self.prompt_ids)
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - num_prompt]

    @property
    def seq_len(self) -> int:
        """Tokens the sequence has: prompt plus output so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not in the KV cache yet: 1 when decoding; more while prefilling (a new
        request, the rest of a chunked prompt, or a retracted request recomputing)."""
        return self.seq_len - self.num_computed
