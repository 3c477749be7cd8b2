"""A decode-only step on the CPU kernels, over what it keeps from step to step.

At one row, the default model's step on the 2-core Zen 4 spends ~3.8 ms in its three kernel
calls (the embedding rows, the layers, the greedy lm_head) and, on the general path, ~0.45 ms
more in the Python around them: `build_inputs`' lists, views and two tensors, ~25 torch ops in
all, a ctypes struct built per call. That Python runs out of cache (the weights' 96 MB went
through both cores' caches since the last step), so an op that costs 2-5 us timed alone costs
10-20 us there (backend/cpu/ops.py RopeTable). A decode batch needs little of it: per sequence one
token id, one position, one cache slot, one context length and a block table. Here:

- those go into two `array`s, int64 and int32, C memory the kernels read by address: no tensor;
- the step struct, the layers' scratch and a last stage's outputs are made once and kept;
- the rotary rows are read from the stage's table at each position inside the kernel
  (csrc/ops.c rope_store_rows), not gathered per step;
- the last stage's greedy finish writes its scratch and tokens into buffers kept too.

The kernels are the general path's, called on the same values in the same order, so tokens,
cache and seams are those of `StageRunner`'s general path bit for bit
(tests/stages/test_cpu_decode.py). Whole steps (`StageRunner.run`), one process, blocks of
10 alternated with the general path, medians (default model, bf16, context 512, 2 threads,
Zen 4): 1 row 4.43 -> 4.09 ms (faster in 94 of 100 blocks), 4 rows 5.60 -> 5.23 (53 of 60),
32 rows 32.2 -> 31.6 (21 of 30). Replaying the step's three kernel calls alone, with nothing
between them, took 3.81 ms against the general path's 4.28 in another such run.

Used for a decode-only batch (one token a chunk, at most MAX_ROWS of them) on a stage whose
layers run fused (backend/cpu/fused_layer.py), where the stage hands a seam on or, as the last
stage, every row samples plain greedy (its tokens, or with the lm_head split its share of
them). Anything else takes the general path.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import TYPE_CHECKING

import torch

from stages.backend.cpu.fused_layer import FusedLayers, GreedyHead, kv_address
from stages.backend.cpu.linear import GridA8Linear
from stages.backend.cpu.ops import NativeOps
from stages.batch import BLOCK_SIZE, SeqChunk
from stages.inputs import check_chunk

if TYPE_CHECKING:
    from stages.interface import StageModel
    from stages.kv_cache import KVCache


class CpuDecodeStep:
    """One stage's decode steps on kept buffers. Build with `build`; `takes` says whether a
    step can run here, then `seam` (a stage that hands on), `tokens` (the last stage) or
    `share` (the last stage of a split lm_head) runs it."""

    MAX_ROWS = FusedLayers.HELD_ROWS  # the layers' scratch is laid out for this many rows

    def __init__(self, model: StageModel, fused: FusedLayers, kv: KVCache) -> None:
        self.model = model
        self.fused = fused
        self.kv = kv  # (held: the kernels get its address)
        self.dtype = fused.dtype
        self.hidden = fused.hidden
        self.is_first_stage = model.is_first_stage
        self._scratch, addresses = fused.scratch_for(self.MAX_ROWS)  # (held, as kv)
        self._step = fused.step_struct(kv.num_slots, addresses, self.MAX_ROWS, kv.kv_bytes)
        self._step_at = ctypes.addressof(self._step)
        self._kv_at, self._kv_stride = kv_address(kv)
        rotary = model.rotary
        self._rope = model.ops.rope_table(
            rotary.inv_freq, rotary.scale, rotary.long_inv_freq, rotary.long_from
        )
        sliding = model.sliding_rotary  # Gemma 3's windowed layers' own rotary, or None
        self._rope_local = None if sliding is None else model.ops.rope_table(sliding.inv_freq)
        # Kept rows [MAX_ROWS, d] each: the first stage's embedded tokens (where the kernels
        # look them up), then the last stage's layer outputs h and residual, which its greedy
        # finish reads within the step (a seam leaves in fresh tensors).
        self._rows = torch.empty(3, self.MAX_ROWS, self.hidden, dtype=self.dtype)
        rows_bytes = self.MAX_ROWS * self.hidden * self._rows.element_size()
        self._h_in_at = self._rows.data_ptr()
        self._h_out_at = self._h_in_at + rows_bytes
        self._residual_out_at = self._h_out_at + rows_bytes
        # The default model's lookup: its tied lm_head's grid codes, decoded by one kernel call
        # into the kept rows; None: the general path's (the model's embed).
        head = getattr(model, "lm_head", None)
        tied = model.is_first_stage and model.embed_tokens is None
        self._lookup_into = head.rows_into if tied and isinstance(head, GridA8Linear) else None

    @property
    def head(self) -> GreedyHead | None:
        """The last stage's one-call greedy finish, which `tokens` and `share` use; None: not
        the last stage, or its finish runs call by call."""
        return self.model.greedy_head if self.model.is_last_stage else None

    @classmethod
    def build(cls, model: StageModel, kv: KVCache) -> CpuDecodeStep | None:
        """One for a stage whose layers run fused (a last stage's one-call greedy finish is
        looked up per step: `head`); None where the general path is the only one."""
        if not isinstance(model.fused, FusedLayers) or not isinstance(model.ops, NativeOps):
            return None
        return cls(model, model.fused, kv)

    def takes(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> bool:
        """Whether this step is a decode-only batch of at most MAX_ROWS chunks with the seam
        as the kernels read it (none on the first stage; [n, d] contiguous in the stage dtype
        elsewhere). Anything else, bad input included, takes the general path, which says what
        is wrong."""
        n = len(chunks)
        if not 0 < n <= self.MAX_ROWS or any(len(chunk.token_ids) != 1 for chunk in chunks):
            return False
        # its rotary table turns long by position (blocks.py Rotary): as every decode does
        long_from = self.model.rotary.long_from
        if self.model.rotary.long_inv_freq is not None and any(
            chunk.rope_long != (chunk.start_pos >= long_from) for chunk in chunks
        ):
            return False
        if self.is_first_stage:
            return hidden_states is None and residual is None
        shape = (n, self.hidden)
        return all(
            isinstance(t, torch.Tensor)
            and t.dtype == self.dtype
            and t.device.type == "cpu"
            and tuple(t.shape) == shape
            and t.is_contiguous()
            for t in (hidden_states, residual)
        )

    def tokens(
        self, chunks: list[SeqChunk], hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> list[int]:  # fmt: skip
        """Last stage (unsplit lm_head), every chunk sampling plain greedy: each chunk's greedy
        token."""
        head = self._kept_layers(chunks, hidden_states, residual)
        return head.tokens_at(self._h_out_at, self._residual_out_at, len(chunks))

    def share(
        self, chunks: list[SeqChunk], hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Last stage of a split lm_head, every chunk sampling plain greedy: the final norm's
        output x [n, d], and over this stage's vocabulary rows each row's maximal logit [n]
        and its token [n] int64 (fresh tensors: they leave for the first stage)."""
        head = self._kept_layers(chunks, hidden_states, residual)
        return head.share_at(self._h_out_at, self._residual_out_at, len(chunks))

    def _kept_layers(
        self, chunks: list[SeqChunk], hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> GreedyHead:  # fmt: skip
        """The last stage's layers into its kept rows, for the greedy finish it returns."""
        head = self.head
        assert head is not None
        self._layers(chunks, hidden_states, residual, self._h_out_at, self._residual_out_at)
        return head

    def seam(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A stage that hands on: the layers' (hidden_states, residual) [n, d] each, fresh
        tensors (the transport may hold them past the next step)."""
        h_out, residual_out = torch.empty(2, len(chunks), self.hidden, dtype=self.dtype)
        self._layers(chunks, hidden_states, residual, h_out.data_ptr(), residual_out.data_ptr())
        return h_out, residual_out

    def _layers(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
        h_out_at: int,
        residual_out_at: int,
    ) -> None:
        """The step's metadata into the kept struct, then every layer: outputs at h_out_at and
        residual_out_at, [n, d] each."""
        n = len(chunks)
        positions = []
        for chunk in chunks:
            check_chunk(chunk)  # the general path's ValueError for a chunk no forward can run
            positions.append(chunk.start_pos)
        width = max(positions) // BLOCK_SIZE + 1  # blocks of the longest context
        # int64: ids [n], positions [n], cache slots [n]; int32: q_start [n], q_len [n],
        # ctx_len [n], block tables [n, width] (padded with block 0, which is never read)
        longs = array("q", [chunk.token_ids[0] for chunk in chunks])
        longs.extend(positions)
        ints = array("i", range(n))
        ints.extend([1] * n)
        ints.extend([position + 1 for position in positions])
        for chunk, position in zip(chunks, positions, strict=True):
            blocks = chunk.block_ids
            longs.append(blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            row = blocks[:width]
            ints.extend(row if len(row) == width else row + [0] * (width - len(row)))
        longs_at, ints_at = longs.buffer_info()[0], ints.buffer_info()[0]
        if self._lookup_into is not None:
            self._lookup_into(longs_at, self._h_in_at, n)
            h_at, residual_at = self._h_in_at, None
        elif self.is_first_stage:
            ids = torch.frombuffer(longs, dtype=torch.int64, count=n)  # a view: no copy
            h = self.model.embed(ids)  # [n, d]
            h_at, residual_at = h.data_ptr(), None
        else:
            assert hidden_states is not None and residual is not None  # (`takes`)
            h_at, residual_at = hidden_states.data_ptr(), residual.data_ptr()
        cos, sin = self._rope.covering(max(positions))  # [P, head_dim] fp32 each
        step = self._step
        if self._rope_local is not None:  # the kernels check positions against both's rows
            cos_local, sin_local = self._rope_local.covering(max(positions))
            step.cos_local, step.sin_local = cos_local.data_ptr(), sin_local.data_ptr()
            rows = min(cos.shape[0], cos_local.shape[0])
        else:
            rows = cos.shape[0]
        step.num_tokens = step.num_seqs = n
        step.table_stride = width
        step.cos, step.sin, step.rope_rows = cos.data_ptr(), sin.data_ptr(), rows
        step.positions = longs_at + 8 * n
        step.slot_mapping = longs_at + 16 * n
        step.q_start, step.q_len = ints_at, ints_at + 4 * n
        step.ctx_len, step.block_table = ints_at + 8 * n, ints_at + 12 * n
        # (`longs`, `ints` and `h` live until this returns: the kernels read them by address)
        self.fused.run_at(
            self._step_at, h_at, residual_at, residual_out_at, self._kv_at, self._kv_stride,
            h_out_at,
        )  # fmt: skip
