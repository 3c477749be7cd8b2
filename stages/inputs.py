"""Turn a batch of `SeqChunk`s into the tensors one forward needs, once, shared by all layers.

The batch is packed (varlen): T = the sum of the chunks' token counts, no padding between
sequences. Attention metadata depends on how attention runs:

- `paged` (the CPU kernel in the kernels (`csrc/`)): per chunk its first row, its row count, its
  context length and its block table, [N] and [N, max_blocks] int32. The kernel walks the block
  table and reads K and V where they lie; nothing is copied.
- `gather` (torch: a GPU stage, or a CPU with no C compiler) gathers each context's K and V into
  a dense tensor for SDPA, in two shapes:

- a prefill chunk (more than one token, maybe with earlier context: chunked prefill) gets its own
  attention call; its keys are exactly its context's slots, in position order;
- decode tokens (one token each) are grouped by context length; each group is one batched call
  over keys padded to the group's longest context, with padded slots masked out. Groups bound the
  padding to about 2x, and a batch of similar lengths is one group. On a GPU all decodes are one
  group: there the calls cost more than the padding. This costs
  n * max_len key reads per group, where one call over the packed keys of all decodes with a
  block-diagonal mask would cost n * sum(len): about n times more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.batch import BLOCK_SIZE, SeqChunk

# Decode contexts at most this many keys shorter than a group's longest share the group anyway:
# for short contexts one more call costs more than the padding it saves.
DECODE_GROUP_SLACK = 64


@dataclass
class PrefillAttn:
    row_start: int  # this chunk's rows in the packed batch: [row_start, row_end)
    row_end: int
    key_slots: torch.Tensor  # [ctx] cache slots of positions 0..ctx-1, ctx = start_pos + n
    mask: torch.Tensor | None  # [n, ctx] bool, query i sees keys <= start_pos + i; None: causal


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # [n] rows of the packed batch; None: all rows, in order
    key_slots: torch.Tensor  # [n * key_len] slots, row-major; padding repeats a real slot
    key_len: int  # longest context in the group
    mask: torch.Tensor | None  # [n, 1, 1, key_len] bool, True where a key is real; None: all


@dataclass
class PagedAttn:
    """One row per chunk of the batch: what the paged kernel reads."""

    q_start: torch.Tensor  # [N] int32, the chunk's first row in the packed batch
    q_len: torch.Tensor  # [N] int32, its rows
    ctx_len: torch.Tensor  # [N] int32, its keys: seq_len (earlier context + this chunk)
    block_table: torch.Tensor  # [N, max_blocks] int32; entries past a context are never read
    max_q_len: int  # the most rows of any chunk: 1 for a decode-only batch
    num_splits: int = 1  # GPU decode: parts each context is walked in (triton_attention.py)


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long, where each token's K/V is written
    cu_seqlens: torch.Tensor  # [N + 1] int32, chunk boundaries in the packed batch
    sample_rows: torch.Tensor  # [num_sampled] long, last row of each chunk with sample=True
    prefills: list[PrefillAttn]  # gather: one per prefill chunk
    decode_groups: list[DecodeGroup]  # gather: decodes grouped by context length
    paged: PagedAttn | None = None  # paged: every chunk, prefill or decode
    max_position: int | None = None  # the largest of positions (None: not known on the host)
    # [T] bool: the rows whose chunk is computed at LongRoPE's long factors (SeqChunk.rope_long),
    # where any is; None: a row turns long from the model's switch position on, which is what
    # every decode-only batch's rows do (stages/models/blocks.py Rotary)
    rope_long: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


ATTENTION_BACKENDS = ("paged", "gather")


def build_inputs(
    chunks: list[SeqChunk], device: str | torch.device = "cpu", attention: str = "gather"
) -> ForwardInputs:
    """The forward's tensors; `attention` ("paged" or "gather") picks the metadata built."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    if not chunks:
        raise ValueError("a forward needs at least one chunk")
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens = [0]
    sample_rows: list[int] = []
    prefills: list[PrefillAttn] = []
    decode_rows: list[int] = []
    decode_chunks: list[SeqChunk] = []
    for chunk in chunks:
        check_chunk(chunk)
        row = cu_seqlens[-1]
        n = len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        seq_positions = range(chunk.start_pos, chunk.start_pos + n)
        positions.extend(seq_positions)
        blocks = chunk.block_ids
        slot_mapping.extend(
            blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in seq_positions
        )
        cu_seqlens.append(row + n)
        if chunk.sample:
            sample_rows.append(row + n - 1)
        if attention == "paged":
            continue
        if n == 1:
            decode_rows.append(row)
            decode_chunks.append(chunk)
        else:
            prefills.append(_prefill_attn(chunk, row, device))

    num_tokens = cu_seqlens[-1]
    decode_groups = _decode_groups(decode_rows, decode_chunks, num_tokens, device)
    rope_long = None
    if any(chunk.rope_long for chunk in chunks):
        flags = [chunk.rope_long for chunk in chunks for _ in range(chunk.num_tokens)]
        rope_long = on_device(torch.tensor(flags, dtype=torch.bool), device)
    # Two host tensors, not one per field: the longs ([T] ids, positions, slots, then the
    # [S] sampled rows) and the int32s (cu_seqlens, then the paged metadata), each cut into
    # views. A single stream's decode step made nine tensors here, and between the kernels'
    # weight streams each costs 10-20 us of an interpreter out of cache (2-core Zen 4); on a
    # GPU each was its own copy to the device.
    longs = on_device(
        torch.tensor(input_ids + positions + slot_mapping + sample_rows, dtype=torch.long), device
    )
    ids_t, positions_t, slots_t, sample_t = longs.split(
        (num_tokens, num_tokens, num_tokens, len(sample_rows))
    )
    ints = cu_seqlens + (_paged_ints(chunks) if attention == "paged" else [])
    ints_t = on_device(torch.tensor(ints, dtype=torch.int32), device)
    cu_seqlens_t = ints_t[: len(cu_seqlens)]
    return ForwardInputs(
        input_ids=ids_t,
        positions=positions_t,
        slot_mapping=slots_t,
        cu_seqlens=cu_seqlens_t,
        sample_rows=sample_t,
        prefills=prefills,
        decode_groups=decode_groups,
        paged=_paged_attn(chunks, cu_seqlens_t, ints_t) if attention == "paged" else None,
        max_position=max(chunk.seq_len for chunk in chunks) - 1,
        rope_long=rope_long,
    )


def staged(host: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """`host` ready to be copied to `device` without holding the host up: a copy to a GPU
    from pageable memory would wait for every step queued before it (and the ring prepares the
    next step while the device runs this one, stages/device_step.py), so it goes through
    pinned memory; for any other copy, `host` as it is."""
    if host.device.type != "cpu" or torch.device(device).type != "cuda":
        return host
    return host.pin_memory()


def on_device(host: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied asynchronously (`staged`); on a CPU, `host` itself."""
    source = staged(host, device)
    return host if source is host else source.to(device, non_blocking=True)


def _paged_ints(chunks: list[SeqChunk]) -> list[int]:
    """The paged kernel's int32 metadata after cu_seqlens: every chunk's row count, then its
    context length, then the block tables [N, max_blocks], each cut to what the longest context
    needs and padded with block 0, which is never read."""
    num_blocks = max(-(-chunk.seq_len // BLOCK_SIZE) for chunk in chunks)
    table = [b for chunk in chunks for b in (chunk.block_ids + [0] * num_blocks)[:num_blocks]]
    return [c.num_tokens for c in chunks] + [c.seq_len for c in chunks] + table


def _paged_attn(chunks: list[SeqChunk], cu_seqlens: torch.Tensor, ints: torch.Tensor) -> PagedAttn:
    """Views into `ints` (cu_seqlens [N + 1], then _paged_ints) as the kernel reads them."""
    n = len(chunks)
    q_len, ctx_len, table = ints[n + 1 :].split((n, n, ints.shape[0] - 3 * n - 1))
    return PagedAttn(
        q_start=cu_seqlens[:-1],
        q_len=q_len,
        ctx_len=ctx_len,
        block_table=table.view(n, -1),
        max_q_len=max(c.num_tokens for c in chunks),
    )


def check_chunk(chunk: SeqChunk) -> None:
    """A ValueError for a chunk no forward can run. A violation here is a scheduler bug; fail
    loudly rather than attend to someone else's KV."""
    if not chunk.token_ids:
        raise ValueError("a chunk must carry at least one token")
    if chunk.start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {chunk.start_pos}")
    if len(chunk.block_ids) * BLOCK_SIZE < chunk.seq_len:
        raise ValueError(
            f"block table of {len(chunk.block_ids)} blocks cannot hold {chunk.seq_len} tokens"
        )


def _context_slots(block_ids: list[int], ctx_len: int) -> torch.Tensor:
    """Slots of positions 0..ctx_len-1 of one sequence: [ctx_len] long."""
    num_blocks = -(-ctx_len // BLOCK_SIZE)
    blocks = torch.tensor(block_ids[:num_blocks], dtype=torch.long)
    slots = blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)  # [blocks, 16]
    return slots.reshape(-1)[:ctx_len]


def _prefill_attn(chunk: SeqChunk, row: int, device: str | torch.device) -> PrefillAttn:
    n, ctx = len(chunk.token_ids), chunk.seq_len
    mask = None
    if chunk.start_pos > 0:
        # Causal, aligned bottom-right: query i sits at position start_pos + i.
        query_pos = torch.arange(chunk.start_pos, ctx)[:, None]  # [n, 1]
        mask = on_device(torch.arange(ctx)[None, :] <= query_pos, device)  # [n, ctx]
    return PrefillAttn(
        row_start=row,
        row_end=row + n,
        key_slots=on_device(_context_slots(chunk.block_ids, ctx), device),
        mask=mask,
    )


def _decode_groups(
    rows: list[int], chunks: list[SeqChunk], num_tokens: int, device: str | torch.device
) -> list[DecodeGroup]:
    if not chunks:
        return []
    if group_decodes_by_length(torch.device(device)):
        members = _group_by_length([chunk.seq_len for chunk in chunks])
    else:
        members = [list(range(len(chunks)))]
    if len(members) == 1 and len(rows) == num_tokens:
        # A pure decode batch of similar lengths: keep batch order, so no gather/scatter of rows.
        return [_decode_group(None, chunks, device)]
    return [
        _decode_group(
            on_device(torch.tensor([rows[i] for i in group], dtype=torch.long), device),
            [chunks[i] for i in group],
            device,
        )
        for group in members
    ]


def group_decodes_by_length(device: torch.device) -> bool:
    """On a CPU, yes: padding costs FLOPs there. On a GPU a group costs a dozen small ops per
    layer, each a launch and a Python dispatch, which is what a decode step is bound by, while
    the padded keys cost only bytes: all decodes go in one group."""
    return device.type == "cpu"


def _group_by_length(lengths: list[int]) -> list[list[int]]:
    """Indices grouped longest first; a new group starts when padding a context to the group's
    longest would more than double it and waste more than DECODE_GROUP_SLACK keys."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups = [[order[0]]]
    for i in order[1:]:
        longest = lengths[groups[-1][0]]
        if 2 * lengths[i] < longest and longest - lengths[i] > DECODE_GROUP_SLACK:
            groups.append([i])
        else:
            groups[-1].append(i)
    return [sorted(group) for group in groups]


def _decode_group(
    rows: torch.Tensor | None, chunks: list[SeqChunk], device: str | torch.device
) -> DecodeGroup:
    lengths = torch.tensor([c.seq_len for c in chunks], dtype=torch.long)  # [n]
    key_len = int(lengths.max())
    num_blocks = -(-key_len // BLOCK_SIZE)
    # Block tables cut or padded (with the sequence's first block) to num_blocks: [n, blocks].
    table = torch.tensor(
        [(c.block_ids + c.block_ids[:1] * num_blocks)[:num_blocks] for c in chunks],
        dtype=torch.long,
    )
    slots = (table[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(len(chunks), -1)
    slots = slots[:, :key_len]  # [n, key_len]
    real = torch.arange(key_len)[None, :] < lengths[:, None]  # [n, key_len]
    # Padding points at the sequence's own position-0 slot: real, finite data that the mask
    # hides. A never-written slot could hold anything (NaN), and 0 * NaN is NaN.
    slots = torch.where(real, slots, slots[:, :1])
    uniform = bool((lengths == key_len).all())
    return DecodeGroup(
        rows=rows,
        key_slots=on_device(slots.reshape(-1), device),
        key_len=key_len,
        mask=None if uniform else on_device(real[:, None, None, :], device),
    )
