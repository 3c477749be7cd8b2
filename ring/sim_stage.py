"""A simulated stage: the real loop and transport, a forward that only takes time.

Its forward takes `t0_s + t_token_s * T` from `launch` (no CPU burned, like GPU kernels: the loop
prepares the next step meanwhile and sleeps only when it must wait for the result), passes seam
tensors of the configured width, and its last stage "samples" a token that depends on (request
seed, position, the token fed at the position before), so a test knows every token each request
must receive (`expected_tokens` chains `expected_token`) and a wrong token fed back round the
ring changes every token after it. The fed token travels like a real model's input does: the
first stage "embeds" each row's token id in column 0 of the seam, the stages between pass it on,
and the last stage reads it there (a one-stage ring reads its own chunk). With `split_lm_head`
the last stage sends its tokens as its share's best tokens and the first stage "samples" them
from it. `sample_delay_s` models the last stage's straggler: the sampled tokens are ready that
long after the forward ends, while the stage itself can already run the next batch (an
asynchronous device-to-host copy); the loop waits for them only when it must send them.

With `kv_model` the stages also keep a KV cache of token ids: each writes the tokens it is fed
into the blocks the chunk's table names, and a sampled token depends on what every stage reads
back there for the whole sequence (`kv_fingerprint`, folded stage by stage through the seam's
column 1), so a block table naming a block whose contents are not that sequence's (a prefix
cache that matched the wrong block, a block reused while still read) changes the tokens.
`expected_tokens_kv` gives what such a ring must send.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from protocol.sampling import SamplingParams
from stages.batch import BLOCK_SIZE, History, SampleResult, SeqChunk
from stages.contract import FinishedStep, LogitsShare, Seam, Stage, StageOutput, StepHandle

SIM_VOCAB = 50_000
SIM_EOS = SIM_VOCAB  # outside the vocabulary: a simulated request stops by length or stop id


def expected_token(seed: int, position: int, previous: int) -> int:
    """The token the simulated last stage samples at `position` (tokens before it) when the
    token fed at `position - 1` was `previous`."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = (x ^ (previous * 0xD6E8FEB86659FD93)) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 29
    return x % SIM_VOCAB


def expected_tokens(
    prompt_ids: Sequence[int],
    seed: int,
    max_new_tokens: int,
    stop_token_ids: Collection[int] = (),
) -> list[int]:
    """Every token a simulated ring sends a request, each chained from the one before it: the
    first from the prompt's last token, then each from the token sampled before it (the one the
    ring fed back), until a stop id (included) or `max_new_tokens`."""
    tokens: list[int] = []
    previous = prompt_ids[-1]
    for n in range(max_new_tokens):
        previous = expected_token(seed, len(prompt_ids) + n, previous)
        tokens.append(previous)
        if previous in stop_token_ids:
            break
    return tokens


FINGERPRINT_MOD = 1 << 20  # a seam column carries it exactly (fp32 holds integers to 2^24)


def kv_fingerprint(tokens: Sequence[int]) -> int:
    """What a stage with a KV model reads back for a sequence's tokens, as one number."""
    return hash(tuple(tokens)) % FINGERPRINT_MOD  # ints hash alike in every process


def fold_fingerprint(carried: int, fingerprint: int) -> int:
    """Stage r's reading folded into what the stages before it read."""
    return (carried * 1_000_003 + fingerprint) % FINGERPRINT_MOD


def expected_tokens_kv(
    prompt_ids: Sequence[int],
    seed: int,
    max_new_tokens: int,
    pp_size: int,
    stop_token_ids: Collection[int] = (),
) -> list[int]:
    """Every token a ring of `pp_size` stages with a KV model sends a request whose KV every
    stage holds right: each drawn from the whole sequence before it."""
    sequence = list(prompt_ids)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        folded = 0
        fingerprint = kv_fingerprint(sequence)
        for _rank in range(pp_size):
            folded = fold_fingerprint(folded, fingerprint)
        token = expected_token(seed, len(sequence), folded)
        tokens.append(token)
        sequence.append(token)
        if token in stop_token_ids:
            break
    return tokens


@dataclass
class DeferredSample:
    """Sampled tokens that become ready at `ready_at` (time.monotonic)."""

    ready_at: float
    result: SampleResult

    def is_ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    def wait(self) -> SampleResult:
        delay = self.ready_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return self.result


class SimStage(Stage):
    def __init__(
        self,
        *,
        is_first_stage: bool,
        is_last_stage: bool,
        num_kv_blocks: int = 4096,
        t0_s: float = 0.0,
        t_token_s: float = 0.0,
        sample_delay_s: float = 0.0,
        hidden_size: int = 64,
        overlap: bool = True,
        split_lm_head: bool = False,
        kv_model: bool = False,
    ) -> None:
        self.is_first_stage = is_first_stage
        self.is_last_stage = is_last_stage
        self.split_lm_head = split_lm_head
        self._num_kv_blocks = num_kv_blocks
        self.t0_s = t0_s
        self.t_token_s = t_token_s
        self.sample_delay_s = sample_delay_s
        self.hidden_size = hidden_size
        # False: the forward runs inside `launch`, like a CPU stage (StageRunner), and the loop
        # takes its path without overlap.
        self.overlap = overlap
        self.allocated_blocks: int | None = None
        self.kv_model = kv_model
        self.kv_tokens: list[int] = []  # [blocks * BLOCK_SIZE] token ids (kv_model); -1: none
        self.busy_s = 0.0  # time spent in forwards: the idle fraction is 1 - busy / wall
        self._overshoot_s = 0.0

    def _wait_until(self, end: float, duration: float) -> float:
        """Block until the simulated forward that ends at `end` is over; returns when it was.

        Like a device, the forward ends at `end` whatever the loop does meanwhile; a loop that
        comes to wait late pays its own lateness. Only the simulation's own error is paid back:
        time.sleep overshoots by 0.1-0.3 ms on a busy 2-core machine, which would count as ring
        overhead, so the next forward ends that much earlier (a steady device on average)."""
        target = end - self._overshoot_s
        now = time.monotonic()
        if now >= target:
            self._overshoot_s = 0.0
            return now
        time.sleep(target - now)
        woke = time.monotonic()
        self._overshoot_s = min(max(woke - target, 0.0), duration)
        return woke

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    def allocate_kv(self, num_blocks: int) -> None:
        if num_blocks > self._num_kv_blocks:
            raise ValueError(
                f"asked for {num_blocks} KV blocks, this stage holds {self._num_kv_blocks}"
            )
        self.allocated_blocks = num_blocks
        if self.kv_model:
            self.kv_tokens = [-1] * (num_blocks * BLOCK_SIZE)

    def run(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> StageOutput | DeferredSample:
        return self.launch(chunks, hidden_states, residual, sampling, histories).wait()

    def launch(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> SimForward | FinishedStep:
        """Check the inputs and start the clock: the forward ends `t0 + t_token * T` from now,
        while the loop prepares its next step (a device computing, the CPU scheduling)."""
        started = time.monotonic()
        num_tokens = sum(c.num_tokens for c in chunks)
        if not self.is_first_stage and (hidden_states is None or len(hidden_states) != num_tokens):
            got = None if hidden_states is None else len(hidden_states)
            raise ValueError(f"seam carries {got} rows for a batch of {num_tokens} tokens")
        for chunk in chunks:
            if chunk.block_ids and max(chunk.block_ids) >= (self.allocated_blocks or 0):
                raise ValueError(f"block table names block {max(chunk.block_ids)} beyond the pool")
        duration = self.t0_s + self.t_token_s * num_tokens if chunks else 0.0
        forward = SimForward(
            self, started, started + duration, self._output(chunks, hidden_states, sampling)
        )
        return forward if self.overlap else FinishedStep(forward.wait(), not self.is_last_stage)

    def _output(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None,
        sampling: Sequence[SamplingParams | None] | None,
    ) -> StageOutput:
        num_tokens = sum(c.num_tokens for c in chunks)
        # The token each row was fed: the first stage embeds its chunks', the others read the
        # seam's column 0, where the first stage put them.
        if self.is_first_stage:
            fed = [t for chunk in chunks for t in chunk.token_ids]
        else:
            fed = hidden_states[:, 0].to(torch.int64).tolist()
        # Column 1: each row's KV reading folded over the stages so far (kv_model).
        carried = [0] * num_tokens if self.is_first_stage else hidden_states[:, 1].to(torch.int64)
        folded = self._read_kv(chunks, fed, carried) if self.kv_model else [0] * num_tokens
        if not self.is_last_stage:
            # Fresh tensors every step: a buffer handed to ZeroMQ is never written again.
            seam = torch.zeros(num_tokens, self.hidden_size)  # [T, d] fp32: ids are exact
            seam[:, 0] = torch.tensor(fed, dtype=seam.dtype)
            seam[:, 1] = torch.tensor(folded, dtype=seam.dtype)
            return Seam(hidden_states=seam, residual=seam.clone())
        tokens = []
        row = 0
        for i, chunk in enumerate(chunks):
            row += chunk.num_tokens
            if chunk.sample:
                params = sampling[i] if sampling is not None else None
                seed = params.seed if params is not None and params.seed is not None else 0
                drawn_from = folded[row - 1] if self.kv_model else fed[row - 1]
                tokens.append(expected_token(seed, chunk.seq_len, drawn_from))
        if self.split_lm_head:
            return LogitsShare(
                hidden=torch.zeros(len(tokens), self.hidden_size),
                logits=torch.empty(0),
                best_logit=torch.zeros(len(tokens)),
                best_token=torch.tensor(tokens, dtype=torch.int64),
            )
        return SampleResult(token_ids=tokens)

    def _read_kv(self, chunks: list[SeqChunk], fed: list[int], carried) -> list[int]:
        """Write each chunk's fed tokens into its blocks, then, for the last row of each chunk
        that samples, fold this stage's reading of the whole sequence into `carried` (other
        rows: 0)."""
        kv, folded, row = self.kv_tokens, [0] * len(fed), 0
        for chunk in chunks:
            table = chunk.block_ids
            if len(table) * BLOCK_SIZE < chunk.seq_len:
                raise ValueError(f"a block table of {len(table)} for {chunk.seq_len} tokens")
            for pos in range(chunk.start_pos, chunk.seq_len):
                kv[table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE] = fed[row]
                row += 1
            if not chunk.sample:
                continue  # nothing is drawn from this chunk's reading
            read = [
                kv[table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE]
                for pos in range(chunk.seq_len)
            ]
            folded[row - 1] = fold_fingerprint(int(carried[row - 1]), kv_fingerprint(read))
        return folded

    def sample_share(
        self,
        chunks: list[SeqChunk],
        share: LogitsShare,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> SampleResult:
        """The first stage "samples" the tokens the last one put in its share."""
        num_sampled = sum(chunk.sample for chunk in chunks)
        if len(share["best_token"]) != num_sampled:
            raise ValueError(f"share has {len(share['best_token'])} rows for {num_sampled}")
        return SampleResult(token_ids=share["best_token"].tolist())


@dataclass
class SimForward(StepHandle):
    """A simulated forward in progress: `wait()` returns its output once it has ended."""

    stage: SimStage
    started: float
    ends_at: float
    output: StageOutput

    overlaps = True

    @property
    def early_output(self) -> StageOutput | None:
        return None if self.stage.is_last_stage else self.output

    @property
    def ready_at(self) -> float:
        return self.ends_at - self.stage._overshoot_s

    def wait(self) -> StageOutput | DeferredSample:
        stage = self.stage
        self.ended_at = self.ends_at
        if self.ends_at > self.started:
            ended = stage._wait_until(self.ends_at, self.ends_at - self.started)
            self.ended_at = min(ended, self.ends_at)  # a late loop does not make it busier
            stage.busy_s += self.ended_at - self.started
        delayed = stage.is_last_stage and not stage.split_lm_head
        if stage.sample_delay_s > 0 and delayed and self.ends_at > self.started:
            return DeferredSample(self.ends_at + stage.sample_delay_s, self.output)
        return self.output
