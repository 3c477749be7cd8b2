"""Decode steps replayed as CUDA graphs: the batch sizes captured, the static buffers they read,
and the padding that makes a batch fit a captured size.

A decode step on a GPU is launch-bound: each of a layer's few dozen small ops costs a Python
dispatch and a kernel launch, far more than its work at small batches (issue 13 measured 50 ms
a step for an 8B model whose weights take 3.6 ms to read). A CUDA graph records a step's
launches once and replays them in one call. What it records are device addresses, so every
input lives in a static buffer that each step overwrites, and every shape is fixed:

- sizes: 1, 2, 4, 8, then every multiple of 16 up to the largest, and the largest itself (as
  nano-vllm and mini-sglang do); a batch of n sequences replays the smallest size >= n, its
  rows n.. padded. A batch larger than the largest size, or one with any prefill chunk, or a
  context longer than the static block table, runs eagerly.
- padding rows write their K/V to a scratch block that no sequence owns (the stage allocates
  one block more than the ring agreed), read one key of it, and their outputs are cut off;
- attention reads K/V through the static block table in place (backend/cuda/triton_attention.py on a
  GPU, the paged kernel on a CPU), looping to each row's own context length: a graph serves
  every step of its size, whatever the lengths. On a GPU, small sizes split each context into
  parts walked by separate programs (flash-decoding), so the device is not left mostly idle.

Graphs of all sizes share one memory pool and are captured largest first, so the smaller ones
reuse its memory. On the last stage the graph ends with the lm_head, so the logits come out of
the replay too; sampling runs after it (greedy is one argmax). Stage-to-stage sends stay
outside the graph (a receive captured in a graph hangs: vllm#51887): a non-last stage's seam is
copied into the static input buffer before the replay, and the output is copied out after.

`GraphRecorder` is what records and replays. On CUDA it is `CudaRecorder`; the CPU tests use
`EagerRecorder`, which "replays" by running the same function on the same static buffers and
writing into the same output tensors, so the bookkeeping here (sizes, padding, slices) is
tested on every CI run without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stages.backend.cuda import triton_attention
from stages.batch import BLOCK_SIZE, SeqChunk
from stages.inputs import ForwardInputs, PagedAttn, staged

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16

# What a captured step returns: (hidden_states, residual) [B, d] each, and on the last stage
# the logits [B, V] (None elsewhere).
StepOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture for batches of up to `max_batch` sequences."""
    if max_batch < 1:
        raise ValueError(f"the largest CUDA graph batch must be >= 1, got {max_batch}")
    sizes = {s for s in SMALL_SIZES if s <= max_batch}
    sizes.update(range(SIZE_STEP, max_batch + 1, SIZE_STEP))
    sizes.add(max_batch)
    return sorted(sizes)


def size_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows; None: none does (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class StaticDecodeInputs:
    """The buffers a captured decode step reads, for up to `max_batch` rows, on `device`.

    Row i of a step holds sequence i of the batch; rows past the batch are padding: token 0 at
    position 0, writing its K/V to slot 0 of `pad_block` and reading that one key."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        pad_block: int,
        hidden_size: int | None,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int = 1,
    ) -> None:
        self.max_batch, self.max_blocks, self.pad_block = max_batch, max_blocks, pad_block
        self.num_kv_heads = num_kv_heads  # for the attention's split of contexts
        self.device = device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)  # [B]
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)  # [B]
        self.slot_mapping = torch.full(
            (max_batch,), pad_block * BLOCK_SIZE, dtype=torch.long, device=device
        )  # [B]
        self.ctx_len = torch.ones(max_batch, dtype=torch.int32, device=device)  # [B]
        self.block_table = torch.full(
            (max_batch, max_blocks), pad_block, dtype=torch.int32, device=device
        )  # [B, max_blocks]
        rows = torch.arange(max_batch, device=device)
        self.q_start = rows.to(torch.int32)  # [B]: one row per sequence
        self.q_len = torch.ones(max_batch, dtype=torch.int32, device=device)  # [B]
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.sample_rows = rows  # [B] long: every decode samples
        # A non-first stage's incoming seam, [B, d] each; None on the first stage.
        self.hidden_states = self.residual = None
        if hidden_size is not None:
            self.hidden_states = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
            self.residual = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)

    def fits(self, chunks: Sequence[SeqChunk]) -> bool:
        """Every chunk a sampling decode (the last stage's graph computes every row's logits)
        whose context the static block table can hold."""
        return all(
            c.num_tokens == 1 and c.sample and -(-c.seq_len // BLOCK_SIZE) <= self.max_blocks
            for c in chunks
        )

    def inputs(self, batch: int) -> ForwardInputs:
        """The forward's inputs for a step of `batch` rows: views of the static buffers."""
        return ForwardInputs(
            input_ids=self.input_ids[:batch],
            positions=self.positions[:batch],
            slot_mapping=self.slot_mapping[:batch],
            cu_seqlens=self.cu_seqlens[: batch + 1],
            sample_rows=self.sample_rows[:batch],
            prefills=[],
            decode_groups=[],
            paged=PagedAttn(
                q_start=self.q_start[:batch],
                q_len=self.q_len[:batch],
                ctx_len=self.ctx_len[:batch],
                block_table=self.block_table[:batch],
                max_q_len=1,
                # A graph pays one launch for the join: at small batches the split is worth it.
                num_splits=triton_attention.splits_for(batch, self.num_kv_heads, self.device),
            ),
        )

    def fill(
        self,
        chunks: Sequence[SeqChunk],
        batch: int,
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> None:
        """Write a decode batch of n = len(chunks) <= `batch` rows, and padding up to `batch`.

        The block table is written only as wide as this batch's longest context: columns past
        it keep older steps' values, which no row reads (each reads ctx_len keys)."""
        n = len(chunks)
        pad_slot = self.pad_block * BLOCK_SIZE
        positions = [c.start_pos for c in chunks] + [0] * (batch - n)
        slots = [
            c.block_ids[c.start_pos // BLOCK_SIZE] * BLOCK_SIZE + c.start_pos % BLOCK_SIZE
            for c in chunks
        ] + [pad_slot] * (batch - n)
        width = max(-(-c.seq_len // BLOCK_SIZE) for c in chunks)
        table = [(c.block_ids + [self.pad_block] * width)[:width] for c in chunks]
        table += [[self.pad_block] * width] * (batch - n)
        ids = [c.token_ids[0] for c in chunks] + [0] * (batch - n)
        ctx = [c.seq_len for c in chunks] + [1] * (batch - n)
        self._copy(self.input_ids[:batch], torch.tensor(ids, dtype=torch.long))
        self._copy(self.positions[:batch], torch.tensor(positions, dtype=torch.long))
        self._copy(self.slot_mapping[:batch], torch.tensor(slots, dtype=torch.long))
        self._copy(self.ctx_len[:batch], torch.tensor(ctx, dtype=torch.int32))
        self._copy(self.block_table[:batch, :width], torch.tensor(table, dtype=torch.int32))
        if self.hidden_states is not None:
            if hidden_states is None or residual is None:
                raise ValueError("a non-first stage's graph step needs the incoming seam")
            # Padding rows keep whatever they held: finite values that no real row reads.
            self._copy(self.hidden_states[:n], hidden_states)
            self._copy(self.residual[:n], residual)

    def _copy(self, static: torch.Tensor, host: torch.Tensor) -> None:
        """Into a static buffer without holding the host up (inputs.staged)."""
        static.copy_(staged(host, self.device), non_blocking=True)


class GraphRecorder(ABC):
    """Records `step()` once for a batch size and returns (replay, the outputs it fills)."""

    name: str

    @abstractmethod
    def record(self, step: Callable[[], StepOutputs]) -> tuple[Callable[[], None], StepOutputs]:
        """Capture `step` (it may run it to warm up); returns its replay and static outputs."""

    def reset(self) -> None:
        """Forget earlier captures (the KV cache they read is being replaced). Only a recorder
        that keeps state across captures has anything to forget."""
        return None


class EagerRecorder(GraphRecorder):
    """No graph: a replay runs `step` again and copies its results into the first call's
    tensors, so callers see the outputs of a real graph (fixed tensors, overwritten by each
    replay). For testing the bookkeeping on a CPU."""

    name = "eager"

    def record(self, step: Callable[[], StepOutputs]) -> tuple[Callable[[], None], StepOutputs]:
        outputs = step()

        def replay() -> None:
            for static, fresh in zip(outputs, step()):
                if static is not None:
                    static.copy_(fresh)

        return replay, outputs


class CudaRecorder(GraphRecorder):
    """torch.cuda.CUDAGraph, all sizes in one memory pool. Each step runs twice on a side
    stream before capture: the first run allocates and the kernels compile (Triton), so the
    capture records only launches."""

    name = "cuda"

    def __init__(self) -> None:
        self.pool = None
        # One side stream for every warm-up: cuBLAS keeps a workspace per stream it runs on.
        self.side: torch.cuda.Stream | None = None

    def reset(self) -> None:
        self.pool = None

    def record(self, step: Callable[[], StepOutputs]) -> tuple[Callable[[], None], StepOutputs]:
        if self.side is None:
            self.side = torch.cuda.Stream()
        side = self.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, outputs


@dataclass
class GraphStep:
    """One captured batch size: its replay and the static outputs it fills."""

    size: int
    replay: Callable[[], None]
    outputs: StepOutputs


class DecodeGraphs:
    """The captured decode steps of one stage. `forward(inputs, hidden, residual)` is the
    stage's step (layers, and the logits on the last stage) over `ForwardInputs` that it must
    read only through the tensors given (the static buffers)."""

    def __init__(
        self,
        forward: Callable[[ForwardInputs, torch.Tensor | None, torch.Tensor | None], StepOutputs],
        buffers: StaticDecodeInputs,
        sizes: Sequence[int],
        recorder: GraphRecorder,
    ) -> None:
        self.forward, self.buffers, self.recorder = forward, buffers, recorder
        self.sizes = sorted(sizes)
        if self.sizes[-1] > buffers.max_batch:
            raise ValueError(f"sizes up to {self.sizes[-1]}, buffers for {buffers.max_batch}")
        self.steps: dict[int, GraphStep] = {}
        self.capture_s = 0.0
        self.replays = 0

    def capture(self) -> None:
        """Record every size, largest first (the smaller ones reuse the pool's memory)."""
        started = time.monotonic()
        for size in reversed(self.sizes):
            inputs = self.buffers.inputs(size)
            seam = self.buffers.hidden_states, self.buffers.residual
            h, r = (None, None) if seam[0] is None else (seam[0][:size], seam[1][:size])

            def step(inputs: ForwardInputs = inputs, h=h, r=r) -> StepOutputs:
                return self.forward(inputs, h, r)

            replay, outputs = self.recorder.record(step)
            self.steps[size] = GraphStep(size, replay, outputs)
        self.capture_s = time.monotonic() - started

    def size_for(self, chunks: Sequence[SeqChunk]) -> int | None:
        """The captured size this batch replays at; None: it runs eagerly."""
        if not self.buffers.fits(chunks):
            return None
        return size_for(len(chunks), self.sizes)

    def run(
        self,
        chunks: Sequence[SeqChunk],
        size: int,
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> tuple[ForwardInputs, StepOutputs]:
        """Replay the step of `size` for this decode batch. Returns the inputs and outputs cut
        to the batch's n rows: views of static tensors that the next replay overwrites."""
        n = len(chunks)
        self.buffers.fill(chunks, size, hidden_states, residual)
        step = self.steps[size]
        step.replay()
        self.replays += 1
        h, r, logits = step.outputs
        cut = self.buffers.inputs(n)
        return cut, (h[:n], r[:n], None if logits is None else logits[:n])
