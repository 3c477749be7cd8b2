"""The plain-Python contract between the ring's scheduler and a stage.

No torch here: the scheduler in `ring/` imports this module, and it must stay fast to import and
testable without tensors. A batch is a list of `SeqChunk`s, one per sequence in it; the last stage
answers with a `SampleResult` holding one token per chunk whose `sample` flag is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Tokens per KV block. Fixed for the whole ring: every stage's block tables index the same blocks.
BLOCK_SIZE = 16


@dataclass(frozen=True)
class SeqChunk:
    """The tokens one sequence feeds through the stage in one step.

    A prefill chunk carries many tokens; a decode step carries one. Several chunks of different
    kinds and lengths run together in one forward.
    """

    token_ids: list[int]  # tokens fed this step (a prefill chunk, or 1 decode token)
    start_pos: int  # tokens of this sequence already in this stage's KV cache
    block_ids: list[int]  # block table covering start_pos + len(token_ids) tokens
    sample: bool  # last stage: produce a token from this chunk's last position
    # LongRoPE (a Phi-3 whose rotary switches factors): this sequence's K and V are computed at
    # the long factors (ring/scheduler.py says when); False for every other model
    rope_long: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens of this sequence in the KV cache once this chunk has run."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class History:
    """One request's tokens so far, for the penalties that read them: the repetition penalty
    reads both parts, the presence and frequency penalties only the output (as vLLM's)."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    # Ids the sampler must not choose at this step: its stop ids and EOS while fewer than
    # min_tokens are out.
    suppressed_ids: Sequence[int] = ()


@dataclass(frozen=True)
class SampleResult:
    """What the last stage produces: one token (and optionally its logprob) per sampled chunk,
    in the order the chunks with `sample=True` appear in the batch."""

    token_ids: list[int]
    # Log-probability of each chosen token under the raw model distribution (before penalties,
    # temperature and filters, as vLLM and SGLang report by default); None when no chunk asked.
    logprobs: list[float] | None = None
    # The top_logprobs most likely tokens of each sampled row and their raw logprobs, best
    # first ([] for a row that asked for none); None when no row asked.
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    # A `stages.contract.Sample` that is ready at once: the loop treats these and tokens still
    # on their way from a device alike.
    def is_ready(self) -> bool:
        return True

    def wait(self) -> SampleResult:
        return self


def blocks_needed(num_tokens: int) -> int:
    """KV blocks that hold `num_tokens` tokens of one sequence."""
    return -(-num_tokens // BLOCK_SIZE)
