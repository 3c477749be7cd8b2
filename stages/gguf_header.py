"""A GGUF file's header read in one pass: its metadata as Python values and its tensors' names,
types, shapes and places, each tensor's bytes a view of the memory-mapped file.

Why not the `gguf` package's GGUFReader (which ppring uses for everything else: the formats,
their dequantization): it builds a numpy view for every string of every array, and a model's
vocabulary and merges are ~100,000 strings. The default model's header took 2.0 s to read
that way, and a 128k-token vocabulary (Llama 3) more, in every stage's start-up; here those
arrays are walked without decoding (`tokenizer.ggml.tokens` and `merges` keep only their
length: transformers reads the tokenizer itself) in ~0.1 s.

The format (GGUF v2 and v3, little-endian): "GGUF", version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 type and its value (a string: u64 length
and bytes; an array: u32 item type, u64 count, items); each tensor a string name, u32 dims,
u64 per dim (fastest first), u32 type and u64 offset into the data, which starts at the next
multiple of `general.alignment` (32 by default) after the header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

# GGUF value types -> struct format (8: string, 9: array, handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# string arrays kept as their length only (the tokenizer's: transformers reads them itself)
COUNTED = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores")  # fmt: skip


class CountedArray(int):
    """An array field of which only the length was kept (len() works on it)."""

    def __len__(self) -> int:
        return int(self)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` in GGUF's order (fastest dimension first, as the `gguf` package
    gives it), `data` its bytes as uint8 [rows, row bytes] (a view of the mapped file)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray


@dataclass(frozen=True)
class GgufHeader:
    fields: dict[str, Any]
    tensors: list[TensorInfo]


def read_header(path: str | Path) -> GgufHeader:
    """The header of the GGUF file at `path`; ValueError if it is not one."""
    import gguf

    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version, num_tensors, num_fields = struct.unpack("<IQQ", _exact(f, 20))
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}, where ppring reads 2 and 3")
        fields = {}
        for _ in range(num_fields):
            key = _string(f)
            (kind,) = struct.unpack("<I", _exact(f, 4))
            fields[key] = _value(f, kind, key)
        infos = []
        for _ in range(num_tensors):
            name = _string(f)
            (dims,) = struct.unpack("<I", _exact(f, 4))
            shape = struct.unpack(f"<{dims}Q", _exact(f, 8 * dims))
            kind, offset = struct.unpack("<IQ", _exact(f, 12))
            infos.append((name, shape, kind, offset))
        alignment = int(fields.get("general.alignment", 32))
        start = -(-f.tell() // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, shape, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[1:], dtype=np.int64))
        row_bytes = shape[0] // block * block_bytes
        at = start + offset
        if shape[0] % block or at + rows * row_bytes > mapped.shape[0]:
            raise ValueError(f"tensor {name} does not fit the file")
        data = mapped[at : at + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(TensorInfo(name, qtype, tuple(shape), rows * row_bytes, data))
    return GgufHeader(fields, tensors)


def _exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("the header ends early")
    return data


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _exact(f, 8))
    return _exact(f, n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, key: str) -> Any:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack(fmt, _exact(f, struct.calcsize(fmt)))
        return value
    if kind == _STRING:
        return _string(f)
    if kind != _ARRAY:
        raise ValueError(f"metadata {key} has an unknown type {kind}")
    item, count = struct.unpack("<IQ", _exact(f, 12))
    if item in _SCALARS:
        fmt = _SCALARS[item]
        raw = _exact(f, count * struct.calcsize(fmt))
        if key in COUNTED:
            return CountedArray(count)
        return list(struct.unpack(f"<{count}{fmt[1]}", raw))
    if item == _STRING:
        if key in COUNTED:  # walked, not decoded
            for _ in range(count):
                (n,) = struct.unpack("<Q", _exact(f, 8))
                f.seek(n, 1)
            return CountedArray(count)
        return [_string(f) for _ in range(count)]
    return [_value(f, item, key) for _ in range(count)]
