"""A weight matrix as a GGUF file holds it: each row a run of its format's blocks, kept as
those bytes until the backend says what it holds (DESIGN.md §13: the loader knows the file, a
backend the kernels). `GgufMatrix` stands wherever a model's blocks expect a weight tensor:
`torch.cat` of matrices joins their rows (a layer's q, k, v and gate, up) and stays blocks,
a part per format; any other torch use first dequantizes it (exactly as the `gguf` package
does), so a backend or family that cannot take blocks still gets the file's values.

What a backend does with one (stages/backend/cpu/linear.py): the CPU kernels hold a Q4_0,
Q4_1, Q5_0 or Q8_0 matrix (`legacy_codes`) and, in bf16, a Q4_K, Q5_K or Q6_K one
(`k_quant_codes`) as its codes straight from these blocks (no fp32 copy, no search for a
grid); a GPU stage dequantizes to its dtype at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 32  # weights per block of the legacy formats (Q4_0, Q4_1, Q5_0, Q8_0)
# bytes per block of 32 weights: fp16 d (and m), then the codes (Q5_0: 4 bytes of fifth bits)
_LEGACY_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}
# bytes per super-block of 256 weights of the k-quants ppring multiplies from their codes
K_QUANT_BLOCKS = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@dataclass(frozen=True)
class LegacyCodes:
    """A legacy-format matrix [N, K] as w = d * q (+ m), block by block (32 weights a block):
    the shape the CPU's grid kernels hold (stages/backend/cpu/grid.py Found)."""

    bits: int  # 4 (q 0..15, with m) or 8 (q -127..127, no m)
    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # fp32 [N, K / 32], each an fp16 number
    m: torch.Tensor | None  # fp32 [N, K / 32] (4 bits), each an fp16 number; None (8 bits)


@dataclass(frozen=True)
class KQuantCodes:
    """A k-quant matrix [N, K] as unsigned codes and fp32 scales: Q4_K and Q5_K w = d q + m
    (d, m per 32 weights), Q6_K w = d (q - 32) (d per 16). d and m are what the `gguf` package
    computes from a super-block's fp16 scales and 6- or 8-bit sub-scales, so d q + m (two
    roundings) and d (q - 32) are its dequantization, bit for bit."""

    format: str  # "Q4_K", "Q5_K", "Q6_K", or a join with Q6_K rows such as "Q4_K+Q6_K"
    q: torch.Tensor  # uint8 [N, K]: 0..15, 0..31 or 0..63
    d: torch.Tensor  # fp32 [N, K / 32] (Q6_K and a join: [N, K / 16])
    m: torch.Tensor | None  # fp32 [N, K / 32] (a join: [N, K / 16]; Q6_K: None)


@dataclass(frozen=True)
class GgufPart:
    """Rows of a matrix in one format: `blocks` uint8 [rows, row bytes], as the file holds them."""

    format: str  # a GGUF type name: "Q4_K", ...
    blocks: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """[rows, K] fp32, as the `gguf` package dequantizes them."""
        import gguf
        import numpy as np

        qtype = gguf.GGMLQuantizationType[self.format]
        values = gguf.quants.dequantize(self.blocks.numpy(), qtype)  # [rows, K]
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


@dataclass(frozen=True, eq=False)
class GgufMatrix:
    """A weight [N, K] as its file's rows of blocks, for a stage on `device`: one part, or
    several where rows of different formats were joined (a Q4_K_M file's q, k in Q4_K and v
    in Q6_K)."""

    parts: tuple[GgufPart, ...]
    in_features: int  # K
    device: torch.device = torch.device("cpu")

    ndim = 2

    @classmethod
    def of(cls, fmt: str, blocks: torch.Tensor, in_features: int) -> GgufMatrix:
        return cls((GgufPart(fmt, blocks),), in_features)

    def on(self, device: torch.device) -> GgufMatrix:
        return GgufMatrix(self.parts, self.in_features, device)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(part.format for part in self.parts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))  # [N, K]

    @property
    def out_features(self) -> int:
        return sum(part.blocks.shape[0] for part in self.parts)  # N

    @property
    def nbytes(self) -> int:
        return sum(part.blocks.numel() for part in self.parts)

    def dim(self) -> int:
        return 2

    def data_ptr(self) -> int:  # (a tied lm_head is told from its embedding by this)
        return self.parts[0].blocks.data_ptr()

    def clone(self) -> GgufMatrix:
        parts = tuple(GgufPart(p.format, p.blocks.clone()) for p in self.parts)
        return GgufMatrix(parts, self.in_features, self.device)

    def detach(self) -> GgufMatrix:
        return self

    def __getitem__(self, rows: Any) -> GgufMatrix | torch.Tensor:
        """Rows `rows` (a slice or index tensor over N) of a one-part matrix as blocks; anything
        else dense."""
        if len(self.parts) == 1 and isinstance(rows, (slice, torch.Tensor, list)):
            part = GgufPart(self.parts[0].format, self.parts[0].blocks[rows])
            return GgufMatrix((part,), self.in_features, self.device)
        return self.dequantize()[rows]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] as the `gguf` package dequantizes it (fp32), in `dtype`, on the
        stage's device."""
        weight = torch.cat([part.dequantize() for part in self.parts])
        return weight.reshape(self.shape).to(device=self.device, dtype=dtype)

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.dequantize().to(*args, **kwargs)

    def __mul__(self, other: Any) -> torch.Tensor:
        return self.dequantize() * other

    __rmul__ = __mul__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        """torch.cat of matrices joins their rows as blocks (parts of one format merged);
        anything else runs on the dequantized values."""
        kwargs = kwargs or {}
        if func is torch.cat and _joinable(args[0]) and kwargs.get("dim", 0) == 0:
            return _join(args[0])
        return func(*_dense(args), **_dense(kwargs))

    def k_quant_codes(self) -> KQuantCodes | None:
        """The codes of a matrix all of whose parts are k-quants, read from the blocks (else
        None): all Q6_K, or all Q4_K or Q5_K (Q4_K rows held as Q5_K's, their fifth bits
        zero), or Q6_K rows joined with Q4_K or Q5_K rows ("Q4_K+Q6_K", a Q4_K_M file's q, k
        and v): every row as d q + m per 16 weights, Q6_K's m = -32 d (exact: d is an fp16
        number times an int8, q and 32 fit 6 bits, so d q, 32 d and their sum are exact in
        fp32), Q4_K's and Q5_K's d and m repeated for both halves of each 32."""
        formats = set(self.formats)
        if not formats or not formats <= set(K_QUANT_BLOCKS):
            return None
        codes = [_k_quant_codes(part, self.in_features) for part in self.parts]
        if len(codes) == 1:
            return codes[0]
        q = torch.cat([c.q for c in codes])
        if formats == {"Q6_K"}:
            return KQuantCodes("Q6_K", q, torch.cat([c.d for c in codes]), None)
        if "Q6_K" not in formats:
            fmt = "Q5_K" if "Q5_K" in formats else "Q4_K"
            m = torch.cat([c.m for c in codes])  # type: ignore[misc]
            return KQuantCodes(fmt, q, torch.cat([c.d for c in codes]), m)
        d16, m16 = [], []
        for c in codes:
            if c.m is None:  # Q6_K: d per 16, codes q + 32
                d16.append(c.d)
                m16.append(-32.0 * c.d)
            else:
                d16.append(c.d.repeat_interleave(2, dim=1))
                m16.append(c.m.repeat_interleave(2, dim=1))
        return KQuantCodes("+".join(sorted(formats)), q, torch.cat(d16), torch.cat(m16))

    def legacy_codes(self) -> LegacyCodes | None:
        """The codes of a matrix all of whose parts are Q4_0, Q4_1 (4 bits) or all Q5_0, Q8_0
        (8 bits), as the grid kernels hold them, read from the blocks; else None."""
        codes = [_legacy_codes(part, self.in_features) for part in self.parts]
        if any(c is None for c in codes) or len({c.bits for c in codes}) != 1:  # type: ignore
            return None
        first = codes[0]
        assert first is not None
        if len(codes) == 1:
            return first
        return LegacyCodes(
            first.bits,
            torch.cat([c.q for c in codes]),  # type: ignore[union-attr]
            torch.cat([c.d for c in codes]),  # type: ignore[union-attr]
            None if first.m is None else torch.cat([c.m for c in codes]),  # type: ignore
        )


def _legacy_codes(part: GgufPart, k: int) -> LegacyCodes | None:
    """The codes of one part in Q4_0, Q4_1, Q5_0 or Q8_0 (None for another format). Each is
    exact: Q4_0's w = d (q - 8) is d q + m with m = -8 d (an fp16 number, and d q - 8 d is
    exact in fp32), Q5_0's d (q - 16) is an 8-bit code q - 16 in -16..15 times d."""
    size = _LEGACY_BYTES.get(part.format)
    if size is None:
        return None
    n = part.blocks.shape[0]
    raw = part.blocks.reshape(n, k // BLOCK, size)  # [N, K / 32, bytes]
    d = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # [N, K / 32]
    if part.format == "Q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return LegacyCodes(8, q, d, None)
    if part.format == "Q4_1":
        m = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        return LegacyCodes(4, _nibbles(raw[..., 4:]).reshape(n, k), d, m)
    if part.format == "Q4_0":
        m = (-8.0 * d.half()).float()  # -8 d, exact in fp16 unless it overflows
        if not torch.isfinite(m).all():
            return None
        return LegacyCodes(4, _nibbles(raw[..., 2:]).reshape(n, k), d, m)
    # Q5_0: 4 bytes of fifth bits (bit j of the little-endian word: weight j), 16 of nibbles
    high = raw[..., 2:6].to(torch.int32)
    word = high[..., 0] | high[..., 1] << 8 | high[..., 2] << 16 | high[..., 3] << 24
    fifth = (word[..., None] >> torch.arange(BLOCK, dtype=torch.int32)) & 1  # [N, K / 32, 32]
    q = _nibbles(raw[..., 6:]).to(torch.int32) | fifth << 4
    return LegacyCodes(8, (q - 16).to(torch.int8).reshape(n, k), d, None)


def _k_quant_codes(part: GgufPart, k: int) -> KQuantCodes:
    """One Q4_K, Q5_K or Q6_K part's codes, as the `gguf` package's dequantize_blocks reads
    them (the same steps, stopped before the codes become floats)."""
    import gguf
    import numpy as np

    n = part.blocks.shape[0]
    blocks = part.blocks.numpy().reshape(-1, K_QUANT_BLOCKS[part.format])  # [N K / 256, bytes]
    count = blocks.shape[0]
    if part.format == "Q6_K":  # ql[128] qh[64] scales[16] (int8) d (fp16)
        ql, qh, scales, d = np.split(blocks, [128, 192, 208], axis=1)
        sub = scales.view(np.int8).astype(np.float32)
        d_sub = d.view(np.float16).astype(np.float32) * sub  # [count, 16]
        low = (ql.reshape(count, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        high = (
            qh.reshape(count, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        ) & 3
        q = low.reshape(count, -1, 32) | (high.reshape(count, -1, 32) << 4)  # [count, 8, 32]
        return KQuantCodes(
            "Q6_K",
            torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
            torch.from_numpy(np.ascontiguousarray(d_sub).reshape(n, k // 16)),
            None,
        )
    d, dmin, scales = blocks[:, 0:2], blocks[:, 2:4], blocks[:, 4:16]
    sc, mins = gguf.quants.Q4_K.get_scale_min(scales)  # [count, 8] each
    d_sub = d.view(np.float16).astype(np.float32) * sc.astype(np.float32)  # [count, 8]
    m_sub = -(dmin.view(np.float16).astype(np.float32) * mins.astype(np.float32))
    qs = blocks[:, -128:]
    q = (qs.reshape(count, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    q = q.reshape(count, 8, 32)
    if part.format == "Q5_K":  # d dmin scales[12] qh[32] qs[128]
        qh = blocks[:, 16:48].reshape(count, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(
            1, 1, 8, 1
        )
        q = q | ((qh & 1).reshape(count, 8, 32) << 4)
    return KQuantCodes(
        part.format,
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(n, k)),
        torch.from_numpy(np.ascontiguousarray(d_sub).reshape(n, k // 32)),
        torch.from_numpy(np.ascontiguousarray(m_sub).reshape(n, k // 32)),
    )


def _join(matrices: list[GgufMatrix]) -> GgufMatrix:
    """The rows of `matrices` in order; neighbouring parts of one format merged into one."""
    parts: list[GgufPart] = []
    for part in (p for m in matrices for p in m.parts):
        if parts and parts[-1].format == part.format:
            parts[-1] = GgufPart(part.format, torch.cat((parts[-1].blocks, part.blocks)))
        else:
            parts.append(part)
    return GgufMatrix(tuple(parts), matrices[0].in_features, matrices[0].device)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] int8: weight j is byte j's low nibble, j + 16 its high."""
    return torch.cat((qs & 15, qs >> 4), dim=-1).to(torch.int8)


def _joinable(matrices: Any) -> bool:
    return (
        isinstance(matrices, (list, tuple))
        and len(matrices) > 0
        and all(isinstance(m, GgufMatrix) for m in matrices)
        and len({(m.in_features, m.device) for m in matrices}) == 1
    )


def _dense(value: Any) -> Any:
    """`value` with every GgufMatrix in it (through lists, tuples and dicts) dequantized."""
    if isinstance(value, GgufMatrix):
        return value.dequantize()
    if isinstance(value, (list, tuple)):
        return type(value)(_dense(v) for v in value)
    if isinstance(value, dict):
        return {key: _dense(v) for key, v in value.items()}
    return value
