"""`python -m bench.requant SRC.gguf OUT.gguf --format Q6_K --tensors ffn_down`: a copy of a GGUF
file with some tensor groups quantized again, to Q4_K or Q6_K, for measuring ppring's k-quant
kernels on a real model (`ppring bench quality --model OUT.gguf`): the default model's file
holds none (its matrices are Q4_1 and Q8_0, and only its ffn_down's K, 1536, is a multiple of
the k-quants' 256).

The `gguf` package quantizes no k-quant, so these are plain round-to-nearest quantizers (each
sub-block's scale from its range, the super-block's fp16 d from the largest; not llama.cpp's
search for the scales that err least): a file of the right format and shape, of about
llama.cpp's accuracy for the format, not of its exact bits. Each block is checked against the
package's dequantization before it is written. Everything else (metadata, tokenizer, the other
tensors) is copied as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

QK = 256  # weights per super-block


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w [N, K] fp32 (K % 256 = 0) -> Q6_K blocks uint8 [N, K / 256 * 210]: per 16 weights a
    scale sc d (sc int8, d fp16 per 256), q in -32..31 stored + 32 as 4 low bits (ql) and 2
    high (qh)."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [B, sub-blocks, 16]
    sub = np.abs(x).max(axis=-1) / 31.0  # [B, 16]
    d = (sub.max(axis=-1) / 127.0).astype(np.float16)  # [B]
    d32 = d.astype(np.float32)
    sc = np.where(d32[:, None] > 0, np.round(sub / np.where(d32 > 0, d32, 1)[:, None]), 0)
    sc = np.clip(sc, -127, 127).astype(np.int8)
    eff = d32[:, None] * sc.astype(np.float32)  # [B, 16]
    q = np.where(eff[..., None] > 0, np.round(x / np.where(eff > 0, eff, 1)[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, QK)  # [B, 256], 0..63
    # weight h 128 + s 64 + b: ql[h 64 + b] >> 4 s; weight h 128 + t 32 + c: qh[h 32 + c] >> 2 t
    halves = q.reshape(-1, 2, 128)
    ql = (halves[:, :, :64] & 15) | ((halves[:, :, 64:] & 15) << 4)  # [B, 2, 64]
    quarters = halves.reshape(-1, 2, 4, 32) >> 4  # [B, 2, t, c]
    qh = sum(quarters[:, :, t] << (2 * t) for t in range(4)).astype(np.uint8)  # [B, 2, 32]
    blocks = np.concatenate(
        [
            ql.reshape(-1, 128),
            qh.reshape(-1, 64),
            sc.view(np.uint8),
            d.reshape(-1, 1).view(np.uint8),
        ],
        axis=1,
    )
    return blocks.reshape(n, -1)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w [N, K] fp32 (K % 256 = 0) -> Q4_K blocks uint8 [N, K / 256 * 144]: per 32 weights
    w = d sc q - dmin m (sc, m 6-bit, d and dmin fp16 per 256), q in 0..15."""
    n, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [B, sub-blocks, 32]
    low = np.minimum(x.min(axis=-1), 0.0)  # [B, 8]
    scale = (x.max(axis=-1) - low) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (-low.min(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d32 > 0, d32, 1)[:, None]), 0, 63).astype(np.uint8)
    mins = np.clip(np.round(-low / np.where(dmin32 > 0, dmin32, 1)[:, None]), 0, 63)
    mins = mins.astype(np.uint8)
    eff = d32[:, None] * sc.astype(np.float32)
    offset = dmin32[:, None] * mins.astype(np.float32)
    q = np.where(
        eff[..., None] > 0,
        np.round((x + offset[..., None]) / np.where(eff > 0, eff, 1)[..., None]),
        0,
    )
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # weight c 64 + s 32 + l
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # qs[c 32 + l] >> 4 s
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mins[:, :4] | ((mins[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    head = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8)], 1)
    return np.concatenate([head, scales, qs], axis=1).reshape(n, -1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def requantize(src: Path, out: Path, fmt: str, groups: list[str]) -> list[str]:
    """Write `out`: `src` with the tensors of `groups` (`ffn_down`, ...) in `fmt`; the names
    quantized again."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    changed = []
    qtype = gguf.GGMLQuantizationType[fmt]
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        group = parts[2] if parts[0] == "blk" else parts[0]
        shape = [int(n) for n in reversed(tensor.shape)]  # [N, K]
        if group in groups and len(shape) == 2 and shape[1] % QK == 0:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            blocks = QUANTIZERS[fmt](np.asarray(values, dtype=np.float32))
            check = gguf.quants.dequantize(blocks, qtype)
            if not np.isfinite(check).all() or check.shape != tuple(shape):
                raise RuntimeError(f"{tensor.name}: the {fmt} blocks do not read back")
            writer.add_tensor(tensor.name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
            changed.append(tensor.name)
        else:
            data = np.asarray(tensor.data)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.requant", description=__doc__)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", choices=sorted(QUANTIZERS), required=True)
    parser.add_argument("--tensors", default="ffn_down", help="groups, comma-separated")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    changed = requantize(args.src, args.out, args.format, args.tensors.split(","))
    print(f"{args.out}: {len(changed)} tensors in {args.format} ({', '.join(changed[:3])}, ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
