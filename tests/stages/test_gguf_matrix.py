"""A GGUF file's quantized matrices as their blocks (stages/gguf_matrix.py) and what each backend
holds of them (stages/backend/cpu/linear.py make_linear): the codes of Q4_0, Q4_1, Q5_0 and
Q8_0 read from the blocks as the `gguf` package's dequantization, bit for bit; joined rows
(q, k, v in several formats) kept as blocks; the CPU kernels multiplying the codes (fp32:
exactly the dequantized weight's product; bf16: as llama.cpp does, held to the same reference
as a grid found in a checkpoint); every other format, and the torch backend, from the
dequantized values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from stages.backend.cpu import grid, native
from stages.backend.cpu.linear import (
    CpuBf16Linear,
    CpuLinear,
    GridA8Linear,
    GridBf16Linear,
    GridLinear,
    make_linear,
)
from stages.backend.switches import Switches
from stages.backend.torch.linear import DenseLinear
from stages.gguf_matrix import GgufMatrix
from tests.stages.test_grid_a8 import reference
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


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_k_quant_is_held_as_its_dequantized_values(
    kernels: native.NativeKernels, fmt: str, dtype: torch.dtype
) -> None:
    held = matrix(fmt, 32, 256, 16)
    linear = make_linear(held, "none", kernels, dtype, VECTOR)
    if dtype == BF16 and not kernels.bf16_dot:
        pytest.skip("this CPU has no AVX512_BF16")
    assert isinstance(linear, CpuLinear if dtype == torch.float32 else CpuBf16Linear)
    assert torch.equal(linear.dense_weight(), held.dequantize().to(dtype))


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
