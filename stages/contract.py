"""What the ring's loop asks of a pipeline stage, with no torch: `Stage` and its step handle.

The ring drives any `Stage` the same way:

    stage.num_kv_blocks           # what this stage could hold; the ring agrees the minimum
    stage.allocate_kv(agreed)     # once, before the first run
    out = stage.run(chunks, **previous_out)   # every step, or:
    handle = stage.launch(chunks, **previous_out); ...; out = handle.wait()

A non-last stage returns the seam, {"hidden_states": [T, d], "residual": [T, d]}, which the next
stage's `run` takes as keyword arguments; the last stage returns a `Sample`: a `SampleResult`,
or tokens still on their way from the device (`is_ready()` False until then). With the lm_head
split (`split_lm_head`), the last stage returns its `LogitsShare` instead, and the first stage
finishes the logits and samples (`sample_share`). The real stage
(`stages.runner.StageRunner`) and the ring's simulated one (`ring.sim_stage.SimStage`) both
implement this, and `ring/loop.py` imports only this module of them, so the loop never imports
torch (tensors pass through it, untouched, as opaque objects).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict

from stages.batch import History, SampleResult, SeqChunk

if TYPE_CHECKING:
    import torch

    from protocol.sampling import SamplingParams


class Seam(TypedDict):
    """What a non-last stage hands the next one: its `run` takes these as keyword arguments."""

    hidden_states: torch.Tensor  # [T, d]
    residual: torch.Tensor  # [T, d]; the un-added residual of the fused add+RMSNorm


class LogitsShare(TypedDict):
    """With the lm_head split, what the last stage hands the first for a step's sampled rows:
    the first multiplies `hidden` by its vocabulary rows [0, cut) and samples over both parts.
    For a batch whose every row is plain greedy, only each row's best logit of [cut, V) and its
    token id travel (`best_logit`, `best_token`; `logits` is empty); otherwise all of them."""

    hidden: torch.Tensor  # [N, d]: the final norm's output, what the lm_head multiplies
    logits: torch.Tensor  # [N, V - cut], or [0] when greedy
    best_logit: torch.Tensor  # [N] (greedy), or [0]
    best_token: torch.Tensor  # [N] int64 token ids in [cut, V) (greedy), or [0]


class Sample(Protocol):
    """The last stage's sampled tokens: ready at once (`SampleResult`) or later (a device copy)."""

    def is_ready(self) -> bool: ...

    def wait(self) -> SampleResult: ...


StageOutput = Seam | Sample | LogitsShare


class StepHandle(ABC):
    """A step in progress, from `Stage.launch`.

    `overlaps`: the step is still running when `launch` returns, so the loop prepares the next
    one meanwhile. `ready_at`: the time.monotonic() at which `wait()` should return at once (the
    loop reads its link until then instead of sleeping). `early_output`: a non-last stage's seam,
    whose tensors exist before the device has filled them, so the proxy's header can be encoded
    early (None for sampled tokens). After `wait()`, `ended_at` is when the computation ended:
    the stage's busy time."""

    overlaps: bool = False
    ready_at: float = 0.0
    ended_at: float = 0.0
    early_output: Seam | None = None

    @abstractmethod
    def wait(self) -> StageOutput:
        """The step's output, once its computation has ended."""


class FinishedStep(StepHandle):
    """A step that already ran: the handle of a stage that computes on this process's cores.
    `seam`: the output is a seam (a non-last stage), so it is also the early output."""

    def __init__(self, output: StageOutput, seam: bool) -> None:
        self.output = output
        self.early_output = output if seam else None
        self.ended_at = time.monotonic()

    def wait(self) -> StageOutput:
        return self.output


class Stage(ABC):
    """One pipeline stage: layers [start_layer, end_layer) and their KV cache."""

    is_first_stage: bool
    is_last_stage: bool
    # The lm_head split between the first and the last stage: the last returns a LogitsShare,
    # the first samples it (the ring's RingConfig.split_lm_head must say the same).
    split_lm_head: bool = False

    @property
    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks this stage can hold within its budget (before the ring agrees a minimum)."""

    @abstractmethod
    def allocate_kv(self, num_blocks: int) -> None:
        """Build the KV cache with the agreed block count (<= num_kv_blocks), before the first
        run. Calling it again replaces the cache (and forgets what it held)."""

    @abstractmethod
    def run(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> StageOutput:
        """Run one step on `chunks`.

        hidden_states, residual: [T, d] from the previous stage (None on the first stage).
        sampling, histories: last stage only, one entry per chunk (entries of chunks that do
        not sample are ignored); sampling None means greedy; a history (prompt and output ids so
        far) is needed only by a request with a penalty (`SamplingParams.needs_history`). A
        seeded request's draw depends only on (seed, chunk.seq_len), never on the rest of the
        batch.

        Tensors passed in are only read, so they may be read-only views of received frames;
        tensors returned are fresh each call and never written again by the stage, so they may
        be handed to the transport without a copy.
        """

    def launch(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> StepHandle:
        """Start `run` and return its handle. The ring prepares its next step between the two
        (SGLang's overlap: the CPU schedules while the device computes). A stage whose forward
        runs on this process's own cores, like StageRunner on CPU, gains nothing from that
        overlap (the bookkeeping would only steal cores from the matmuls), so by default the
        step runs here and the handle is already finished."""
        output = self.run(chunks, hidden_states, residual, sampling, histories)
        return FinishedStep(output, seam=not self.is_last_stage)

    def sample_share(
        self,
        chunks: list[SeqChunk],
        share: LogitsShare,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> SampleResult:
        """First stage, lm_head split: finish the logits of the step that ran `chunks` with the
        last stage's share, and sample (arguments as in `run`)."""
        raise NotImplementedError(f"{type(self).__name__} does not split the lm_head")

    def empty_output(self) -> StageOutput:
        """The output of an empty micro-batch: the ring still sends one per step (its steps must
        stay consecutive), but no stage runs a forward for it."""
        if self.is_last_stage and not self.split_lm_head:
            return SampleResult(token_ids=[])
        import torch  # only here: the loop that calls this imports no torch

        if self.is_last_stage:
            empty = torch.empty(0)
            return LogitsShare(
                hidden=torch.empty(0, 0), logits=empty, best_logit=empty, best_token=empty
            )
        return Seam(hidden_states=torch.empty(0, 0), residual=torch.empty(0, 0))
