"""Finding fp32 weights that lie on a GGUF quantization grid, so a CPU stage can hold them as
the integer codes they came from and read 3.6-5.3x fewer bytes a step (fp32; 1.9-3.2x in bf16),
with the same values.

A checkpoint converted from GGUF (the default model is: its layers are Q4_1, its embedding
Q8_0) stores each weight as the fp32 the converter computed from the file's codes:
- Q4_1: w = d * q + m, q in 0..15, one fp16 d and m per 32 weights along a row (the product
  rounded to fp32, then the sum: numpy's two operations, never one FMA);
- Q8_0: w = d * q, q in -127..127, one fp16 d per 32 weights.
A matrix is taken only if every one of its weights is reproduced exactly: d and m are recovered
per block (m is the block's minimum; d one of the few fp16 values next to (max - m) / 15, or to
max |w| / 127), every weight is checked against d * q (+ m), and the stage checks the kernel's
own decoding of the codes against the weight bit for bit before it uses them
(stages/backend/cpu/linear.py). Anything else, random test weights included, stays fp32.

The codes are laid out per panel of 16 output channels, as csrc/ reads them:
`GridCodes` for the fp32 kernel (ppr_linear_grid documents the layout); for a bf16 stage,
`GridQuads` for the kernel that multiplies them by int8-quantized rows (ppr_linear_grid_a8, the
default) and `GridPairs` for the one that decodes them into the fp32 weights rounded to bf16
(ppr_linear_grid_bf16; a stage holds the bf16 panels as well then, and reads them for more than a
few rows: stages/backend/cpu/linear.py). `PPRING_GRID_WEIGHTS=0` turns them all off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.backend.cpu.codes import (
    BLOCK,
    PANEL,
    GridCodes,
    GridPairs,
    GridQuads,
    KQuads,
    k_quant_planes,
)
from stages.backend.cpu.native import NativeKernels
from stages.backend.switches import GRID_WEIGHTS_ENV

DISABLE_ENV = GRID_WEIGHTS_ENV  # "0": keep every weight as panels (read once: switches.py)

# fp16 neighbours of the estimated d that are tried, in ulps (the estimate from the rounded
# weights can land a step or two away from the d the file held)
_ULP_STEPS = (0, -1, 1, -2, 2)
_QUICK_ROWS = 16  # rows checked first, so a matrix off every grid is rejected cheaply


@dataclass(frozen=True)
class Found:
    """What find_codes recovered from a weight [N, K]: w = d * q (+ m), block by block."""

    bits: int  # 4 or 8
    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # fp32 [N, K / 32], each an fp16 number
    m: torch.Tensor | None  # fp32 [N, K / 32] (4 bits), each an fp16 number; None (8 bits)


def find_grid(weight: torch.Tensor, kernels: NativeKernels) -> GridCodes | None:
    """`weight` [N, K] fp32 as Q4_1 codes, else as Q8_0 codes, in the fp32 kernel's layout;
    None if it lies on neither grid."""
    found = find_codes(weight, kernels)
    return None if found is None else pack_codes(found, out_features=weight.shape[0])


def find_codes(weight: torch.Tensor, kernels: NativeKernels) -> Found | None:
    """`weight` [N, K] fp32 as Q4_1 codes, else as Q8_0 codes, else None. The per-block
    search runs in the kernels (ppr_grid_codes); rows are tried a few first, so a matrix off
    every grid costs little."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK:
        return None
    w = weight.detach().contiguous()
    for bits in (4, 8):
        if _codes(w[:_QUICK_ROWS], bits, kernels) is None:
            continue
        found = _codes(w, bits, kernels)
        if found is not None:
            return Found(bits, *found)
    return None


def _codes(
    w: torch.Tensor, bits: int, kernels: NativeKernels
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """w [N, K] -> (q [N, K] int8, d [N, K/32], m [N, K/32] or None for Q8_0), or None."""
    n, k = w.shape
    blocks = w.reshape(-1, BLOCK)  # [B, 32]
    if bits == 4:
        m = blocks.amin(dim=1)
        if not torch.equal(m.to(torch.float16).to(torch.float32), m):
            return None
        estimate, q_range = (blocks.amax(dim=1) - m) / 15, (0, 15)
    else:
        m, estimate, q_range = None, blocks.abs().amax(dim=1) / 127, (-127, 127)
    found = kernels.grid_codes(w, _fp16_candidates(estimate), m, *q_range)
    if found is None:
        return None
    q, d = found
    return q, d.reshape(n, k // BLOCK), None if m is None else m.reshape(n, k // BLOCK)


def _fp16_candidates(estimate: torch.Tensor) -> torch.Tensor:
    """estimate [B] (>= 0) -> [B, 5] fp32: the fp16 numbers next to it, nearest first."""
    bits = estimate.to(torch.float16).view(torch.int16).to(torch.int32)  # [B]
    steps = torch.tensor(_ULP_STEPS, dtype=torch.int32)
    near = (bits[:, None] + steps).clamp(0, 0x7BFF)  # positive, finite fp16
    return near.to(torch.int16).view(torch.float16).to(torch.float32).contiguous()


def _panels(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [N, C] -> [P, C, 16]: panel p holds rows 16p..16p+15 as its last axis (zero past N)."""
    padded = torch.zeros((rows, t.shape[1]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded.reshape(rows // PANEL, PANEL, t.shape[1]).transpose(1, 2).contiguous()


def pack_codes(found: Found, out_features: int) -> GridCodes:
    """The codes in the fp32 kernel's layout (GridCodes; csrc/ documents it)."""
    bits, q, d, m = found.bits, found.q, found.d, found.m
    rows = -(-out_features // PANEL) * PANEL
    scale = _panels(d, rows)  # [P, K/32, 16]
    offset = _panels(m, rows) if m is not None else None
    if bits == 4:
        q_panels = _panels(q.view(torch.uint8), rows)  # [P, K, 16], 0..15
        codes = q_panels[..., :8] | (q_panels[..., 8:] << 4)  # [P, K, 8]
    else:
        codes = _panels(q, rows)  # [P, K, 16] int8
    return GridCodes(bits, codes.contiguous(), scale, offset, out_features)


def rows_of(grid: GridCodes, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of the weight, [T, K] fp32, exactly as the kernel decodes them (a tied
    lm_head serves the embedding lookup)."""
    p, j = ids // PANEL, ids % PANEL
    if grid.bits == 4:
        byte = grid.codes[p, :, j % 8].to(torch.int32)  # [T, K]
        q = torch.where((j >= 8)[:, None], byte >> 4, byte & 15).to(torch.float32)
    else:
        q = grid.codes[p, :, j].to(torch.float32)
    d = grid.scale[p, :, j].repeat_interleave(BLOCK, dim=1)  # [T, K]
    rows = torch.mul(q, d)
    if grid.offset is not None:
        rows = torch.add(rows, grid.offset[p, :, j].repeat_interleave(BLOCK, dim=1))
    return rows


def pack_quads(found: Found, out_features: int) -> GridQuads:
    """The codes in the int8-activation kernel's layout (GridQuads; csrc/ documents
    it)."""
    q, (n, k) = found.q, found.q.shape
    rows = -(-out_features // PANEL) * PANEL
    padded = torch.zeros((rows, k), dtype=torch.int16)  # zero codes (and d = 0) past N
    padded[:n] = q
    if found.bits == 4:
        # [P, 16 channels, K / 8 groups, 2 halves, 4] -> [P, K / 8, 16, 4]: low | high << 4
        groups = padded.reshape(rows // PANEL, PANEL, k // 8, 2, 4).permute(0, 2, 1, 3, 4)
        codes = groups[:, :, :, 0] | (groups[:, :, :, 1] << 4)
    else:
        # [P, 16 channels, K / 4 groups, 4] -> [P, K / 4, 16, 4], stored as q + 128 (unsigned)
        codes = padded.reshape(rows // PANEL, PANEL, k // 4, 4).permute(0, 2, 1, 3) + 128
    codes = codes.reshape(rows // PANEL, codes.shape[1], 4 * PANEL).to(torch.uint8)
    scale = _panels(found.d, rows).to(torch.float16)  # exact: each d is an fp16 number
    offset = None if found.m is None else _panels(found.m, rows).to(torch.float16)
    return GridQuads(found.bits, codes.contiguous(), scale, offset, out_features)


def quad_rows(quads: GridQuads, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of the weight, [T, K] fp32, decoded from the codes as the checkpoint's
    converter computed them (d * q, then + m: two roundings, never one FMA), so exactly the
    checkpoint's values. Serves a tied embedding lookup, and the check at load."""
    p, c = ids // PANEL, ids % PANEL
    k = quads.in_features
    group = quads.codes.reshape(quads.codes.shape[0], quads.codes.shape[1], PANEL, 4)
    byte = group[p, :, c].to(torch.int32)  # [T, groups, 4]
    if quads.bits == 4:
        q = torch.stack((byte & 15, byte >> 4), dim=2)  # [T, K / 8, 2, 4]: k 0-3, then 4-7
    else:
        q = byte - 128
    q = q.reshape(ids.shape[0], k).to(torch.float32)
    rows = torch.mul(q, quads.scale[p, :, c].float().repeat_interleave(BLOCK, dim=1))
    if quads.offset is not None:
        rows = torch.add(rows, quads.offset[p, :, c].float().repeat_interleave(BLOCK, dim=1))
    return rows


def pack_pairs(found: Found, out_features: int) -> GridPairs:
    """The codes in the bf16 kernel's layout (GridPairs; csrc/ documents it)."""
    q, (n, k) = found.q, found.q.shape
    rows = -(-out_features // PANEL) * PANEL
    padded = torch.zeros((rows, k), dtype=torch.int8)
    padded[:n] = q
    # [P, 2 halves, 8 channels, K / 2 pairs, 2] -> [P, K / 2, 2 halves, 8 channels x 2]
    lanes = padded.reshape(rows // PANEL, 2, 8, k // 2, 2).permute(0, 3, 1, 2, 4)
    lanes = lanes.reshape(rows // PANEL, k // 2, 2, PANEL)
    if found.bits == 4:
        nibbles = lanes.view(torch.uint8)  # 0..15
        codes = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)  # [P, K / 2, 16]
    else:
        codes = lanes.reshape(rows // PANEL, k // 2, 2 * PANEL)  # [P, K / 2, 32]
    scale = _panels(found.d, rows).to(torch.float16)  # exact: each d is an fp16 number
    offset = None if found.m is None else _panels(found.m, rows).to(torch.float16)
    return GridPairs(found.bits, codes.contiguous(), scale, offset, out_features)


def pack_k_quads(
    name: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, out_features: int
) -> KQuads:
    """A k-quant's codes q uint8 [N, K] (0..63), d [N, K / 32 or K / 16] and m [N, K / 32 or
    K / 16] (or None) fp32 in the k-quant kernel's layout (KQuads; csrc/ documents it)."""
    import numpy as np

    n, k = q.shape
    rows = -(-out_features // PANEL) * PANEL
    padded = torch.zeros((rows, k), dtype=torch.uint8)  # zero codes (and d = 0) past N
    padded[:n] = q
    # [P, 16 channels, K / 8 groups, 2 halves, 4] -> [P, K / 8, 2, 16, 4]
    groups = padded.reshape(rows // PANEL, PANEL, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
    low = groups & 15
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(rows // PANEL, -1)  # [P, K * 8]
    planes = k_quant_planes(name)
    # per group, plane and half: 64 bits (channel c's k 8 g + 4 half + j at bit 4 c + j)
    codes = nibbles
    if planes:
        bits = torch.stack([(groups >> (4 + p)) & 1 for p in range(planes)], dim=2)
        masks = np.packbits(bits.reshape(*bits.shape[:4], 64).numpy(), axis=-1, bitorder="little")
        codes = torch.cat((nibbles, torch.from_numpy(masks).reshape(rows // PANEL, -1)), dim=1)
    offset = None if m is None else _panels(m, rows)
    return KQuads(name, codes.contiguous(), _panels(d, rows), offset, out_features, k)
