"""A long prefill chunk's attention on a CPU with AMX tiles: torch's SDPA over its context's K and
V, gathered from the paged cache.

ppring's paged kernel (csrc/attention.c) scores a query row at a time against each 16-key page
with vdpbf16ps: right for decodes, which read the cache once and are bound by it, but a chunk of
hundreds of rows is bound by arithmetic there. torch's CPU flash attention multiplies blocks of
queries and keys as matrices (oneDNN's brgemm, on AMX tiles where the CPU has them). Measured on
the 2-core Xeon with AMX, the default model (9 heads, 3 KV heads, d 64), a 1,500-token prompt
in chunks of 512, bf16: the whole prefill spent ~840 ms outside its matmuls in the paged kernel
(1.08 s to the first token), one layer's SDPA over the last chunk (476 rows x 1,500 keys) took
4.3 ms.

A chunk of at least `min_rows` rows goes to SDPA, the rest of the batch (decodes, short chunks)
to the paged kernel, each writing its own rows of one output. A bf16 stage's cache holds each
page as pairs (ppring.h kv_as_pairs): the gather undoes that with one index_select and one
permute per half. The context is at most a few MB a layer (1,500 keys: 1.1 MB), read once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.backend.cpu.native import NativeKernels
from stages.batch import BLOCK_SIZE
from stages.inputs import PagedAttn

# Rows from which a chunk's attention is SDPA's on such a CPU (below, the paged kernel's): a
# chunk of 128 rows over 128-1,500 keys is already several times the work of a decode batch
PREFILL_ROWS = 128


class PrefillAttention:
    """SDPA for the long chunks of a batch, the kernels' paged attention for the rest."""

    def __init__(self, kernels: NativeKernels, min_rows: int | None = None) -> None:
        self._kernels = kernels
        self.min_rows = PREFILL_ROWS if min_rows is None else min_rows
        self._masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def takes(self, paged: PagedAttn) -> bool:
        """Whether a batch has a chunk this sends to SDPA."""
        return paged.max_q_len >= self.min_rows

    def __call__(
        self, q: torch.Tensor, kv_layer: torch.Tensor, paged: PagedAttn, scale: float
    ) -> torch.Tensor:
        """q [T, h, d] (rotary applied), kv_layer [2, slots, h_kv, d] in the cache's layout with
        this step's K and V written -> [T, h, d]."""
        out = torch.empty_like(q)
        q_len = paged.q_len.tolist()
        long = [s for s, n in enumerate(q_len) if n >= self.min_rows]
        short = [s for s, n in enumerate(q_len) if n < self.min_rows]
        if short:
            pick = torch.tensor(short)
            self._kernels.paged_attention(
                q, kv_layer, paged.q_start[pick].contiguous(), paged.q_len[pick].contiguous(),
                paged.ctx_len[pick].contiguous(), paged.block_table[pick].contiguous(), scale,
                out=out,
            )  # fmt: skip
        starts, contexts = paged.q_start.tolist(), paged.ctx_len.tolist()
        pairs = self._kernels.kv_as_pairs(kv_layer.dtype, kv_layer.shape[-1])
        for s in long:
            start, rows, context = starts[s], q_len[s], contexts[s]
            if not 0 <= start <= start + rows <= q.shape[0] or not rows <= context:
                raise IndexError(f"sequence {s}: rows {start}+{rows} over {context} keys")
            table = paged.block_table[s]
            if pairs and self._kernels.prefill_attention_amx(
                q, kv_layer, out, start, rows, context, table, scale
            ):
                continue  # on AMX tiles, in place (csrc/attention_amx.c)
            k, v = self._context(kv_layer, table, context, pairs)  # [h_kv, ctx, d] each
            o = F.scaled_dot_product_attention(
                q[start : start + rows].transpose(0, 1).unsqueeze(0),  # [1, h, rows, d]
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=None if rows == context else self._mask(rows, context, q.dtype),
                is_causal=rows == context,
                scale=scale,
                enable_gqa=True,
            )  # [1, h, rows, d]
            out[start : start + rows] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _context(
        kv_layer: torch.Tensor, table: torch.Tensor, context: int, pairs: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first `context` positions, [h_kv, context, d] each, in rows."""
        _, num_slots, h, d = kv_layer.shape
        pages = -(-context // BLOCK_SIZE)
        blocks = table[:pages].long()
        if int(blocks.min()) < 0 or int(blocks.max()) >= num_slots // BLOCK_SIZE:
            raise IndexError(f"a block id outside the cache's {num_slots // BLOCK_SIZE} blocks")
        k_pages, v_pages = (
            half.reshape(num_slots // BLOCK_SIZE, BLOCK_SIZE * h * d).index_select(0, blocks)
            for half in kv_layer
        )
        if pairs:  # K [h, d / 2, 16, 2] and V [h, 8, d, 2] a page
            k = k_pages.view(pages, h, d // 2, BLOCK_SIZE, 2).permute(1, 0, 3, 2, 4)
            v = v_pages.view(pages, h, BLOCK_SIZE // 2, d, 2).permute(1, 0, 2, 4, 3)
        else:  # rows: [16, h, d] a page
            k = k_pages.view(pages, BLOCK_SIZE, h, d).permute(2, 0, 1, 3)
            v = v_pages.view(pages, BLOCK_SIZE, h, d).permute(2, 0, 1, 3)
        rows = pages * BLOCK_SIZE
        return k.reshape(h, rows, d)[:, :context], v.reshape(h, rows, d)[:, :context]

    def _mask(self, rows: int, context: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, context]: 0 where query i sees key j (j <= context - rows + i), -inf above.
        Kept for the next layers (every layer of a forward asks for the same), a few at most."""
        key = (rows, context, dtype)
        if key not in self._masks:
            if len(self._masks) >= 8:
                self._masks.clear()
            seen = torch.ones(rows, context, dtype=torch.bool).tril(diagonal=context - rows)
            mask = torch.zeros(rows, context, dtype=dtype).masked_fill(~seen, float("-inf"))
            self._masks[key] = mask
        return self._masks[key]
