"""A long prefill chunk's attention on a CPU with AMX tiles (csrc/attention_amx.c), or torch's SDPA
over its context's K and V, gathered from the paged cache, where that kernel refuses.

ppring's paged kernel (csrc/attention.c) scores a query row at a time against each 16-key page
with vdpbf16ps: right for decodes, which read the cache once and are bound by it, but a chunk of
many rows is bound by arithmetic there. Measured on the 2-core Xeon with AMX, the default model
(9 heads, 3 KV heads, d 64), a 1,500-token prompt in chunks of 512, bf16 (`ppring bench
prefill`, one run each): 1.07 s to the first token with its attention paged (~840 ms of it),
0.78 s with SDPA over the gathered context (torch's CPU flash attention: 4.3 ms a layer for the
last chunk, 476 rows x 1,500 keys), 0.65 s on the tiles (transformers' bf16 forward: 0.86-0.96 s).

A chunk of at least `min_rows` rows goes to the tiles (or SDPA), the rest of the batch
(decodes, short chunks) to the paged kernel, each writing its own rows of one output. For SDPA
a bf16 stage's cache, which holds each page as pairs (ppring.h kv_as_pairs), is gathered with
one index_select and one permute per half; the tiles read the pages in place. An 8-bit cache's
context is converted to bf16 pairs first, once a chunk and layer (csrc/kv8.c).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.backend.cpu.native import NativeKernels
from stages.batch import BLOCK_SIZE
from stages.inputs import PagedAttn
from stages.kv_cache import gather_kv

# Rows from which a chunk's attention goes to the tiles (below, the paged kernel's). One layer
# of the default model (9 heads, 3 KV heads, d 64), 2 threads, medians of 15 alternated calls,
# paged / tiles, us: 16 rows over no earlier context 24 / 30, 32 rows 33 / 28, 64 rows 78 / 43,
# 128 rows 205 / 96; after 512 keys, 16 rows 252 / 81, 32 rows 325 / 118; after 1,000 keys,
# 128 rows 2342 / 712. From 32 rows the tiles win at every context (a batch with such a chunk
# also leaves the fused stack for the layers' calls, ~2 ms a step of the default model).
PREFILL_ROWS = 32


class PrefillAttention:
    """The tiles (or SDPA) for the long chunks of a batch, the paged kernel for the rest."""

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
        eight = kv_layer.dtype is torch.int8
        pairs = eight or self._kernels.kv_as_pairs(kv_layer.dtype, kv_layer.shape[-1])
        for s in long:
            start, rows, context = starts[s], q_len[s], contexts[s]
            if not 0 <= start <= start + rows <= q.shape[0] or not rows <= context:
                raise IndexError(f"sequence {s}: rows {start}+{rows} over {context} keys")
            table = paged.block_table[s]
            cache = kv_layer
            if eight:  # the context's pages as bf16 pairs, once a chunk and layer (csrc/kv8.c)
                pages = -(-context // BLOCK_SIZE)
                cache = self._kernels.kv8_pairs(kv_layer, table[:pages].contiguous())
                table = torch.arange(pages, dtype=torch.int32)
            if (
                pairs
                and cache is not None
                and self._kernels.prefill_attention_amx(
                    q, cache, out, start, rows, context, table, scale
                )
            ):
                continue  # on AMX tiles, in place (csrc/attention_amx.c)
            table = paged.block_table[s]
            k, v = self._context(kv_layer, table, context, q.dtype)  # [h_kv, ctx, d] each
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

    def _context(
        self, kv_layer: torch.Tensor, table: torch.Tensor, context: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first `context` positions, [h_kv, context, d] each, in rows:
        its pages gathered, then out of the cache's layout by the kernels' own conversion
        (NativeKernels.from_cache_layout, which knows the pairs); an 8-bit cache's
        dequantized to `dtype` (the tiles do not read its codes yet)."""
        _, num_slots, h, d = kv_layer.shape
        pages = -(-context // BLOCK_SIZE)
        blocks = table[:pages].long()
        if int(blocks.min()) < 0 or int(blocks.max()) >= num_slots // BLOCK_SIZE:
            raise IndexError(f"a block id outside the cache's {num_slots // BLOCK_SIZE} blocks")
        if kv_layer.dtype is torch.int8:
            slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
            k, v = gather_kv(kv_layer, slots[:context], dtype).transpose(1, 2)
            return k, v
        gathered = kv_layer.view(2, num_slots // BLOCK_SIZE, BLOCK_SIZE * h * d)
        gathered = gathered.index_select(1, blocks).view(2, pages * BLOCK_SIZE, h, d)
        k, v = self._kernels.from_cache_layout(gathered)[:, :context].transpose(1, 2)
        return k, v

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
