"""The 8-bit KV cache (--kv-cache-dtype int8) in plain torch: its layout, its store and its
dequantization. The CPU kernels do the same arithmetic in C (csrc/ppring.h "The 8-bit cache",
csrc/ops.c kv8_store_keys); the torch path stores and gathers through here, and the tests take
it as the reference the kernels must match.

One layer's cache is one byte buffer (stages/kv_cache.py allocates it), each part by page
(16 slots) and KV head, as the kernels read them (csrc/ppring.h "The 8-bit cache"):
  K codes  [pages, h_kv, d / 2, 16, 2] int8  a page's keys as pairs of channels per slot
  V codes  [pages, h_kv, 8, d, 2] int8       its values as pairs of slots per channel
  k_scale  [pages, h_kv, d] uint8            per page, KV head and channel: 2^(e / 8),
                                             e = byte - 128
  v_scale  [pages, h_kv, 16] bf16            per token and KV head
A layer is handed around as its codes, an int8 tensor [2, slots, h_kv, d] at the start of the
buffer (the shape of a 16- or 32-bit cache's layer, in the layout above, so only this module
and the kernels read it); `parts` finds the scales after them and views each part by slot.

Why these granularities (bench/kv_study.py, the default model's fp32 logits, KLD added over 4
windows of 512 tokens): K per token and head 0.00064, per channel of a 16-token page 0.00014
(keys carry outlier channels; a page's channel shares one scale), bf16 0.00002; V per token
and head (a token's values are summed under one weight). One byte a K scale keeps a token and
head at 134 bytes against bf16's 256: the same memory holds 1.91x the blocks (fp16 scales: 138,
1.86x). A page's K scales only grow: a token written into a page that already holds some raises
a channel's scale where it needs more and rounds that channel's earlier codes again at it
(0.00023 when every token arrives alone, as in decode); a prefill writes a page's tokens at once,
so rounds them once.
"""

from __future__ import annotations

import numpy as np
import torch

from stages.batch import BLOCK_SIZE

CODE_MAX = 127
E_MIN, E_MAX = -128, 127
# 2^(i / 8) rounded to fp32, as csrc/ppring.h kv8_scale_of holds them (bit patterns)
_FRAC_BITS = (
    0x3F800000, 0x3F8B95C2, 0x3F9837F0, 0x3FA5FED7, 0x3FB504F3, 0x3FC5672A, 0x3FD744FD, 0x3FEAC0C7,
)  # fmt: skip


def _scale_table() -> torch.Tensor:
    """[256] fp32: the scale of byte b, 2^((b - 128) mod 8 / 8) (rounded) times 2^floor((b - 128)
    / 8), exactly."""
    frac = np.array(_FRAC_BITS, dtype=np.uint32).view(np.float32).astype(np.float64)
    e = np.arange(E_MIN, E_MAX + 1)
    return torch.from_numpy((frac[e & 7] * np.exp2(e >> 3)).astype(np.float32))


SCALES = _scale_table()  # SCALES[e - E_MIN]


def layer_bytes(num_slots: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's 8-bit cache of num_slots slots (whole pages)."""
    cells = num_slots * num_kv_heads * head_dim
    return 2 * cells + cells // BLOCK_SIZE + 2 * num_slots * num_kv_heads


def block_bytes(num_kv_heads: int, head_dim: int) -> int:
    """Bytes one block (16 slots) of one layer costs: codes, K's scales, V's scales."""
    return layer_bytes(BLOCK_SIZE, num_kv_heads, head_dim)


def check_layer(kv_layer: torch.Tensor) -> None:
    """ValueError unless kv_layer is an 8-bit layer's codes [2, slots, h_kv, d] (whole pages)
    with its scales inside the same buffer after them. Builds no view: the kernels' wrappers
    check every call (backend/cpu/calls.py kv_kind)."""
    if kv_layer.dtype is not torch.int8 or kv_layer.dim() != 4 or not kv_layer.is_contiguous():
        raise ValueError("an 8-bit cache layer is its int8 codes [2, slots, h_kv, d]")
    _, num_slots, h, d = kv_layer.shape
    if num_slots % BLOCK_SIZE:
        raise ValueError(f"an 8-bit cache holds whole pages of {BLOCK_SIZE} slots")
    # int8: the storage offset is in bytes
    if kv_layer.untyped_storage().nbytes() - kv_layer.storage_offset() < layer_bytes(
        num_slots, h, d
    ):
        raise ValueError("this int8 tensor is not an 8-bit cache layer: no scales follow it")


def parts(
    kv_layer: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_codes [pages, 16, h_kv, d / 2, 2] int8, v_codes [pages, 8, 2, h_kv, d] int8, k_scale
    [pages, h_kv, d] uint8, v_scale [pages, 16, h_kv] bf16) of a layer: strided views of its
    page layout, indexed by page and slot of the page (V's slot j at [page, j // 2, j % 2]; K's
    channel c at [..., c // 2, c % 2]). kv_layer: its codes [2, slots, h_kv, d], the start of
    the layer's buffer, which must hold the scales after them."""
    check_layer(kv_layer)
    _, num_slots, h, d = kv_layer.shape
    need = layer_bytes(num_slots, h, d)
    whole = torch.empty(0, dtype=torch.uint8, device=kv_layer.device)
    whole.set_(kv_layer.untyped_storage(), kv_layer.storage_offset(), (need,))
    cells = num_slots * h * d
    pages, pair = num_slots // BLOCK_SIZE, BLOCK_SIZE // 2
    k_scale = whole[2 * cells : 2 * cells + cells // BLOCK_SIZE].view(pages, h, d)
    v_scale = whole[2 * cells + cells // BLOCK_SIZE :].view(torch.bfloat16)
    v_scale = v_scale.view(pages, h, BLOCK_SIZE).permute(0, 2, 1)
    # K [pages, h, d / 2, 16, 2] -> [pages, 16, h, d / 2, 2]
    k_codes = kv_layer[0].view(pages, h, d // 2, BLOCK_SIZE, 2).permute(0, 3, 1, 2, 4)
    # V [pages, h, 8, d, 2] -> [pages, 8, 2, h, d] -> by slot, the channel pairs as K's
    v_codes = kv_layer[1].view(pages, h, pair, d, 2).permute(0, 2, 4, 1, 3)
    return k_codes, v_codes, k_scale, v_scale


def exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest e in [E_MIN, E_MAX] whose scale takes amax (fp32) into CODE_MAX, as int64
    (E_MAX for amax past them all, infinite or NaN): csrc/ppring.h kv8_exponent."""
    limit = CODE_MAX * SCALES.to(amax.device)  # [256], fp32 products as the C computes them
    guess = torch.ceil(8.0 * torch.log2(amax / CODE_MAX))
    e = torch.nan_to_num(guess, nan=E_MAX, posinf=E_MAX, neginf=E_MIN).clamp(E_MIN, E_MAX).long()
    for _ in range(3):  # the guess is off by at most one; made exact as the C does
        lower = (e - 1).clamp(min=E_MIN)
        e = torch.where((e > E_MIN) & (limit[lower - E_MIN] >= amax), lower, e)
    for _ in range(3):
        e = torch.where((e < E_MAX) & (limit[e - E_MIN] < amax), (e + 1).clamp(max=E_MAX), e)
    e = torch.where(amax <= limit[0], torch.full_like(e, E_MIN), e)
    return torch.where(amax <= limit[-1], e, torch.full_like(e, E_MAX))


def code(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (fp32) to the nearest code, ties to even, in [-127, 127] (NaN: 0), int8."""
    c = torch.round(x / scale).clamp(-CODE_MAX, CODE_MAX)
    return torch.nan_to_num(c, nan=0.0).to(torch.int8)


def store(
    kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k (rotated) and v [T, h_kv, d] of the stage dtype into an 8-bit layer at slot_mapping
    [T]: each token's values with their own scale, and each run of consecutive slots in one
    page (a decode's token, a prefill's page) into its page's keys at once."""
    k_codes, v_codes, k_scale, v_scale = parts(kv_layer)
    slots = slot_mapping.to(torch.int64)
    page, j = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    vf = v.float()
    v_s = (vf.abs().amax(-1) / CODE_MAX).to(torch.bfloat16)  # [T, h_kv]
    v_sf = v_s.float()[..., None]
    zero = torch.zeros((), dtype=torch.int8)
    v_codes[page, j // 2, j % 2] = torch.where(v_sf > 0, code(vf, v_sf), zero)
    v_scale[page, j] = v_s
    kf = k.float()
    slot_list = slots.tolist()
    t = 0
    while t < len(slot_list):
        t1 = t + 1
        while (
            t1 < len(slot_list)
            and slot_list[t1] == slot_list[t1 - 1] + 1
            and slot_list[t1] % BLOCK_SIZE
        ):
            t1 += 1
        _store_keys(k_codes, k_scale, slot_list[t], kf[t:t1])
        t = t1


def _store_keys(
    k_codes: torch.Tensor, k_scale: torch.Tensor, slot: int, keys: torch.Tensor
) -> None:
    """keys [n, h_kv, d] fp32 into slots [slot, slot + n) of one page (csrc/ops.c
    kv8_store_keys)."""
    o0, page = slot % BLOCK_SIZE, slot // BLOCK_SIZE
    e = exponent(keys.abs().amax(0))  # [h_kv, d]
    if o0 > 0:
        e_old = k_scale[page].long() - 128
        e = torch.maximum(e, e_old)
        grown = e > e_old  # [h_kv, d]
        if bool(grown.any()):
            old = k_codes[page, :o0].reshape(o0, *e.shape)  # [o0, h_kv, d]
            s_old, s_new = _scales(e_old), _scales(e)
            again = code(old.float() * s_old, s_new)
            k_codes[page, :o0] = torch.where(grown, again, old).view(k_codes[page, :o0].shape)
    k_scale[page] = (e + 128).to(torch.uint8)
    n = keys.shape[0]
    k_codes[page, o0 : o0 + n] = code(keys, _scales(e)).view(k_codes[page, o0 : o0 + n].shape)


def _scales(e: torch.Tensor) -> torch.Tensor:
    """2^(e / 8) as the C holds it, for exponents e (int64)."""
    return SCALES.to(e.device)[e - E_MIN]


def gather(kv_layer: torch.Tensor, key_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K and V of an 8-bit layer at key_slots [L], dequantized: [2, L, h_kv, d] of `dtype`
    (code times its scale in fp32, then rounded to dtype)."""
    k_codes, v_codes, k_scale, v_scale = parts(kv_layer)
    pages, j = key_slots // BLOCK_SIZE, key_slots % BLOCK_SIZE
    k_bytes = k_scale.index_select(0, pages).long()  # [L, h_kv, d]
    k_at = k_codes[pages, j].reshape(k_bytes.shape)  # [L, h_kv, d]
    k = k_at.float() * SCALES.to(k_bytes.device)[k_bytes]
    v = v_codes[pages, j // 2, j % 2].float() * v_scale[pages, j].float()[..., None]
    return torch.stack((k, v)).to(dtype)


def dequantize(kv_layer: torch.Tensor) -> torch.Tensor:
    """A whole 8-bit layer as fp32 [2, slots, h_kv, d] (tests, inspection)."""
    slots = torch.arange(kv_layer.shape[1], device=kv_layer.device)
    return gather(kv_layer, slots, torch.float32)
