"""A GGUF file's quantized matrices as their blocks (stages/gguf_matrix.py) and what each backend
holds of them (stages/backend/cpu/linear.py make_linear): the codes of Q4_0, Q4_1, Q5_0 and
Q8_0 read from the blocks as the `gguf` package's dequantization, bit for bit; joined rows
(q, k, v in several formats) kept as blocks; the CPU kernels multiplying the codes (fp32:
exactly the dequantized weight's product; bf16: as llama.cpp does, held to the same reference
as a grid found in a checkpoint); every other format, and the torch backend, from the
dequantized values."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from stages.backend.cpu import grid, native
from stages.backend.cpu.linear import (
    CpuLinear,
    GridA8Linear,
    GridBf16Linear,
    GridLinear,
    make_linear,
)
from stages.backend.switches import Switches
from stages.backend.torch.linear import DenseLinear
from stages.gguf_matrix import GgufMatrix
from tests.stages.test_grid_a8 import quantized_passes, reference
from tests.tiny_gguf import k_quant_blocks

BF16 = torch.bfloat16
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
VECTOR = Switches(amx_rows="0")  # the vector kernels' own results (tiles: test_amx.py)


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    built = native.kernels()
    assert built is not None, native.unavailable_reason()
    return built


def matrix(fmt: str, n: int, k: int, seed: int) -> GgufMatrix:
    """[n, k] in `fmt`: the package's quantizer for a legacy format, random k-quant blocks."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[fmt]
    if fmt in K_QUANTS:
        blocks = k_quant_blocks(n, k, qtype, rng)
    else:
        weight = rng.normal(0, 0.05, size=(n, k)).astype(np.float32)
        weight[0, :32] = 0.0  # a block of zeros: d = 0
        blocks = gguf.quants.quantize(weight, qtype)
    return GgufMatrix.of(fmt, torch.from_numpy(np.ascontiguousarray(blocks)), k)


def values(codes) -> torch.Tensor:  # noqa: ANN001
    """d q (+ m), two fp32 roundings, as the converter and the kernels' decode compute them."""
    n, k = codes.q.shape
    w = torch.mul(codes.q.float(), codes.d.repeat_interleave(32, dim=1))
    return w if codes.m is None else torch.add(w, codes.m.repeat_interleave(32, dim=1))


@pytest.mark.parametrize("fmt", LEGACY)
def test_legacy_codes_are_the_package_s_dequantization(fmt: str) -> None:
    held = matrix(fmt, 48, 96, seed=1)
    codes = held.legacy_codes()
    assert codes is not None and codes.bits == (4 if fmt in ("Q4_0", "Q4_1") else 8)
    assert codes.q.dtype == torch.int8 and codes.q.shape == (48, 96)
    assert torch.equal(values(codes), held.dequantize())
    assert held.dequantize().shape == held.shape == (48, 96)


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_a_k_quant_has_no_legacy_codes(fmt: str) -> None:
    assert matrix(fmt, 16, 256, seed=2).legacy_codes() is None


def test_rows_joined_stay_blocks_a_part_per_format() -> None:
    q, k, v = matrix("Q4_0", 64, 64, 3), matrix("Q4_1", 32, 64, 4), matrix("Q4_1", 32, 64, 5)
    qkv = torch.cat([q, k, v])
    assert isinstance(qkv, GgufMatrix) and qkv.formats == ("Q4_0", "Q4_1")
    assert qkv.shape == (128, 64)
    dense = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(qkv.dequantize(), dense)
    codes = qkv.legacy_codes()
    assert codes is not None and codes.bits == 4 and torch.equal(values(codes), dense)
    eight = torch.cat([matrix("Q5_0", 32, 64, 6), matrix("Q8_0", 16, 64, 7)])
    assert eight.legacy_codes() is not None and eight.legacy_codes().bits == 8
    # 4 and 8 bits, or a k-quant among them: no one grid, so the dequantized values
    assert torch.cat([q, matrix("Q8_0", 16, 64, 8)]).legacy_codes() is None
    assert torch.cat([q, matrix("Q6_K", 16, 256, 9)[:, :64]]).shape == (80, 64)


def test_any_other_use_is_the_dequantized_tensor() -> None:
    held = matrix("Q8_0", 16, 64, 10)
    dense = held.dequantize()
    assert torch.equal(held * 2.0, dense * 2.0) and torch.equal(3 * held, 3 * dense)
    assert torch.equal(held.to(BF16), dense.to(BF16))
    assert torch.equal(torch.cat([held, dense]), torch.cat([dense, dense]))
    assert torch.equal(held[2:5].dequantize(), dense[2:5])  # rows stay blocks
    assert torch.equal(held[:, :32], dense[:, :32])


@pytest.mark.parametrize("fmt", LEGACY)
def test_fp32_codes_from_the_blocks_multiply_exactly_as_the_dequantized_weight(
    kernels: native.NativeKernels, fmt: str
) -> None:
    held = torch.cat([matrix(fmt, 40, 96, 11), matrix(fmt, 30, 96, 12)])
    linear = make_linear(held, "none", kernels, torch.float32, VECTOR)
    assert isinstance(linear, GridLinear)
    off_grid = Switches(grid_weights=False)
    panels = make_linear(held.dequantize(), "none", kernels, torch.float32, off_grid)
    assert isinstance(panels, CpuLinear)
    for rows in (1, 5, 37):
        x = torch.randn(rows, 96)
        assert torch.equal(linear(x), panels(x))


@pytest.mark.parametrize("fmt", LEGACY)
def test_bf16_codes_from_the_blocks_multiply_as_llama_cpp_does(
    kernels: native.NativeKernels, fmt: str
) -> None:
    if not kernels.a8_dot:
        pytest.skip("this CPU has no AVX512_BF16 and VNNI")
    held = matrix(fmt, 70, 128, 13)
    linear = make_linear(held, "none", kernels, BF16, VECTOR)
    assert isinstance(linear, GridA8Linear)
    codes = held.legacy_codes()
    found = grid.Found(codes.bits, codes.q, codes.d, codes.m)
    dense = held.dequantize()
    torch.manual_seed(14)
    for rows in (1, 4, 9):
        x = torch.randn(rows, 128).to(BF16)
        expected = reference(x, found)
        bound = expected.abs() * 2**-8 + 1e-5 * expected.abs().amax()
        assert ((linear(x).double() - expected).abs() <= bound).all()
    ids = torch.tensor([0, 69, 16, 33])
    assert torch.equal(linear.rows(ids), dense.to(BF16)[ids])  # a tied embedding's lookup
    # the codes and fp16 scales alone, no fp32 or bf16 copy: per 32 weights 16 bytes of
    # nibbles, d and m (4 bits), or 32 bytes and d (8 bits), over whole panels of 16 rows
    per_block = 20 if codes.bits == 4 else 34
    assert [name for name, _ in linear.named_buffers()][:2] == ["codes", "scale"]
    assert linear.grid.nbytes == 80 * (128 // 32) * per_block


def test_bf16_panels_way_holds_the_dequantized_values(kernels: native.NativeKernels) -> None:
    if not kernels.bf16_dot:
        pytest.skip("this CPU has no AVX512_BF16")
    held = matrix("Q4_0", 48, 64, 15)
    switches = Switches(grid_activations="bf16", amx_rows="0")
    linear = make_linear(held, "none", kernels, BF16, switches)
    assert isinstance(linear, GridBf16Linear)
    assert torch.equal(linear.dense_weight(), held.dequantize().to(BF16))


def k_reference(x: torch.Tensor, codes, passes: int = 2) -> torch.Tensor:  # noqa: ANN001
    """What the k-quant kernel computes, in float64: x [M, K] bf16 -> [M, N]. x quantized per
    32 as test_grid_a8.reference does; then per 32 (Q6_K: per 16) sum(q xq) exactly, times d
    dx, plus Q4_K/Q5_K's m dx sum(xq) (Q6_K's codes less 32)."""
    m, k = x.shape
    n = codes.q.shape[0]
    q = codes.q.double()
    y = torch.zeros(m, n, dtype=torch.float64)
    for xq, dx in quantized_passes(x, passes):
        if codes.m is None:  # Q6_K: d per 16, w = d (q - 32)
            sums = torch.einsum("mgk,ngk->mng", xq.reshape(m, -1, 16), (q - 32).reshape(n, -1, 16))
            y += (sums * codes.d.double()[None] * dx.repeat_interleave(2, 1)[:, None]).sum(-1)
        elif codes.d.shape[1] == k // 16:  # a join: d and m per 16
            xq16, dx16 = xq.reshape(m, -1, 16), dx.repeat_interleave(2, 1)
            sums = torch.einsum("mgk,ngk->mng", xq16, q.reshape(n, -1, 16))
            y += (sums * codes.d.double()[None] * dx16[:, None]).sum(-1)
            y += (codes.m.double()[None] * (dx16 * xq16.sum(-1))[:, None]).sum(-1)
        else:
            sums = torch.einsum("mbk,nbk->mnb", xq, q.reshape(n, -1, 32))
            y += (sums * codes.d.double()[None] * dx[:, None]).sum(-1)
            y += (codes.m.double()[None] * (dx * xq.sum(-1))[:, None]).sum(-1)
    return y


# bytes held per 256 weights: nibbles 128, masks 32 a plane, fp32 d and m per 32 (Q6_K: d per 16)
K_QUANT_HELD = {"Q4_K": 128 + 64, "Q5_K": 128 + 32 + 64, "Q6_K": 128 + 64 + 64,
                "Q4_K+Q6_K": 128 + 64 + 128}  # fmt: skip


def k_matrix(fmt: str, n: int, k: int, seed: int) -> GgufMatrix:
    """`matrix`, or for "Q4_K+Q6_K" a join: Q4_K rows, Q6_K rows, Q4_K rows (a Q4_K_M qkv)."""
    if "+" not in fmt:
        return matrix(fmt, n, k, seed)
    return torch.cat(
        [
            matrix("Q4_K", 32, k, seed),
            matrix("Q6_K", n - 48, k, seed + 1),
            matrix("Q4_K", 16, k, seed + 2),
        ]
    )


@pytest.mark.parametrize("fmt", [*K_QUANTS, "Q4_K+Q6_K"])
def test_a_k_quant_multiplies_from_its_codes_as_llama_cpp_does(
    kernels: native.NativeKernels, fmt: str
) -> None:
    if not kernels.a8_dot:
        pytest.skip("this CPU has no AVX512_BF16 and VNNI")
    held = k_matrix(fmt, 70, 512, 20)
    linear = make_linear(held, "none", kernels, BF16, VECTOR)
    assert isinstance(linear, GridA8Linear) and linear.grid.name == fmt
    dense = held.dequantize()
    # the codes decode to the package's dequantization, rounded to bf16, every row
    assert torch.equal(linear.dense_weight(), dense.to(BF16))
    assert torch.equal(linear.rows(torch.tensor([69, 0, 17])), dense.to(BF16)[[69, 0, 17]])
    codes = held.k_quant_codes()
    torch.manual_seed(21)
    for passes in (2, 1):
        linear.passes = passes
        for rows in (1, 2, 3, 4, 5, 9, 33):
            x = torch.randn(rows, 512).to(BF16)
            x[0, :32] = 0  # a block of zeros: dx = 0
            got = linear(x).double()
            expected = k_reference(x, codes, passes)
            bound = expected.abs() * 2**-8 + 1e-5 * expected.abs().amax()
            assert ((got - expected).abs() <= bound).all(), f"{rows} rows, {passes} passes"
            exact = x.double() @ dense.double().T
            tolerance = {1: 0.02, 2: 0.003}[passes]
            assert (got - exact).norm() <= tolerance * exact.norm()
    linear.passes = 2
    x = torch.randn(40, 512).to(BF16)
    whole = linear(x)
    for lo, hi in ((0, 1), (3, 14), (39, 40)):  # a row's result is its own
        assert torch.equal(linear(x[lo:hi]), whole[lo:hi])
    assert linear(x[:0]).shape == (0, 70)
    with pytest.raises(ValueError, match="token ids must lie in"):  # checked before any read
        linear.rows(torch.tensor([3, 70]))
    assert linear.grid.nbytes == 80 * 2 * K_QUANT_HELD[fmt]  # 5 panels, 2 super-blocks a row


@pytest.mark.parametrize("fmt", [*K_QUANTS, "Q4_K+Q6_K"])
def test_a_k_quant_on_amx_tiles_multiplies_its_bf16_weights(
    kernels: native.NativeKernels, fmt: str
) -> None:
    if not kernels.amx_bf16:
        pytest.skip("this CPU or build has no AMX-BF16")
    held = k_matrix(fmt, 64, 256, 22)
    linear = make_linear(held, "none", kernels, BF16, Switches(amx_rows="1"))
    assert isinstance(linear, GridA8Linear) and linear.amx_rows == 1
    x = torch.randn(37, 256).to(BF16)
    expected = x.double() @ held.dequantize().to(BF16).double().T  # the decoded bf16 weights
    got = linear(x).double()
    assert ((got - expected).abs() <= expected.abs() * 2**-7 + 1e-4 * expected.abs().amax()).all()


def test_k_quant_joins_share_a_format_where_one_holds_both() -> None:
    four, five, six = (
        matrix("Q4_K", 16, 256, 23),
        matrix("Q5_K", 32, 256, 24),
        matrix("Q6_K", 16, 256, 25),
    )
    both = torch.cat([four, five])
    codes = both.k_quant_codes()
    assert codes is not None and codes.format == "Q5_K"  # Q4_K's rows, fifth bits zero
    w = torch.add(torch.mul(codes.q.float(), codes.d.repeat_interleave(32, 1)),
                  codes.m.repeat_interleave(32, 1))  # fmt: skip
    assert torch.equal(w, both.dequantize())
    assert torch.cat([six, six]).k_quant_codes().format == "Q6_K"
    # Q6_K with Q4_K or Q5_K rows: d and m per 16 (Q6_K's m = -32 d), still exactly the values
    for rows in ([four, six], [six, five, four]):
        joined = torch.cat(rows).k_quant_codes()
        rows_held = sum(r.out_features for r in rows)
        assert joined is not None and joined.d.shape == joined.m.shape == (rows_held, 16)
        w = torch.add(torch.mul(joined.q.float(), joined.d.repeat_interleave(16, 1)),
                      joined.m.repeat_interleave(16, 1))  # fmt: skip
        assert torch.equal(w, torch.cat(rows).dequantize())
    assert torch.cat([four, six]).k_quant_codes().format == "Q4_K+Q6_K"
    assert torch.cat([matrix("Q8_0", 16, 256, 26), four]).k_quant_codes() is None


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_an_fp32_stage_holds_a_k_quant_as_its_dequantized_values(
    kernels: native.NativeKernels, fmt: str
) -> None:
    held = matrix(fmt, 32, 256, 16)
    linear = make_linear(held, "none", kernels, torch.float32, VECTOR)
    assert isinstance(linear, CpuLinear)
    assert torch.equal(linear.dense_weight(), held.dequantize())


def test_k_quant_codes_of_another_shape_are_refused() -> None:
    held = matrix("Q5_K", 16, 256, 27).k_quant_codes()
    quads = grid.pack_k_quads("Q5_K", held.q, held.d, held.m, 16)
    for bad in (
        dict(codes=quads.codes[:, :-8].contiguous()),
        dict(scale=quads.scale[:, :4].contiguous()),
        dict(offset=None),
        dict(in_features=512),
        dict(name="Q6_K"),
    ):
        with pytest.raises(ValueError, match="k-quant codes do not fit"):
            replace(quads, **bad)


def test_the_torch_backend_and_int8_take_the_dequantized_values(
    kernels: native.NativeKernels,
) -> None:
    held = matrix("Q4_1", 32, 64, 17)
    dense = make_linear(held, "none", None, torch.float32)
    assert isinstance(dense, DenseLinear)
    x = torch.randn(3, 64)
    assert torch.equal(dense(x), torch.nn.functional.linear(x, held.dequantize()))
    int8 = make_linear(held, "int8", kernels, torch.float32)
    assert int8.in_features == 64


@pytest.mark.parametrize(("fmt", "error"), [("Q6_K", 0.03), ("Q4_K", 0.1)])
def test_bench_s_k_quantizers_write_blocks_the_package_reads_back(fmt: str, error: float) -> None:
    """bench/requant.py's round-to-nearest quantizers (for measuring the kernels on a real
    model): blocks the `gguf` package reads back near the weights, codes ppring reads alike."""
    from bench.requant import QUANTIZERS

    rng = np.random.default_rng(28)
    weight = rng.normal(0, 0.05, size=(16, 512)).astype(np.float32)
    weight[0, :64] = 0.0  # zero sub-blocks: scale 0
    blocks = QUANTIZERS[fmt](weight)
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[fmt]).reshape(weight.shape)
    assert np.abs(back[0, :64]).max() == 0
    assert np.sqrt(((back - weight) ** 2).mean() / (weight**2).mean()) < error
    held = GgufMatrix.of(fmt, torch.from_numpy(blocks), 512)
    assert torch.equal(held.dequantize(), torch.from_numpy(back))
