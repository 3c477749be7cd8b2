"""bf16 stages over weights on a GGUF grid with PPRING_GRID_ACTIVATIONS=bf16 (backend/cpu/grid.py
GridPairs, matmul_bf16.c ppr_linear_grid_bf16): found from the checkpoint's fp32 values, held as
codes and as bf16 panels, and multiplied to the very same bf16 results either way, at every row
count; a call reads the codes up to `code_rows` rows, the panels above. (The default, codes
times int8 activations, is tests/stages/test_grid_a8.py's.)"""

from __future__ import annotations

import pytest
import torch

from stages.backend.cpu import grid, native
from stages.backend.cpu import linear as linear_module
from stages.backend.cpu.linear import CpuBf16Linear, GridBf16Linear, make_linear, source_dtype
from stages.backend.switches import AMX_ROWS_ENV
from stages.errors import ConfigError
from tests.stages.test_grid import q4_1_weight, q8_0_weight

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    built = native.kernels()
    assert built is not None, native.unavailable_reason()
    if not built.bf16_dot:
        pytest.skip("this CPU has no AVX512_BF16: bf16 stages multiply with torch")
    return built


@pytest.fixture(autouse=True)
def _bf16_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, "bf16")
    # the vector kernels' own results, at every row count: the tiles a stage may move large
    # calls to are tests/stages/test_amx.py's
    monkeypatch.setenv(AMX_ROWS_ENV, "0")


@pytest.mark.parametrize(("make", "bits"), [(q4_1_weight, 4), (q8_0_weight, 8)])
@pytest.mark.parametrize(("n", "k"), [(70, 64), (960, 576), (33, 1536), (16, 32)])
def test_a_grid_weight_multiplies_exactly_as_its_bf16_panels(
    kernels: native.NativeKernels, make, bits: int, n: int, k: int
) -> None:
    weight = make(n, k, seed=n + k)  # fp32, as the checkpoint holds it
    linear = make_linear(weight, "none", kernels, BF16)
    assert isinstance(linear, GridBf16Linear) and linear.grid.bits == bits
    assert torch.equal(linear.dense_weight(), weight.to(BF16))
    dense = CpuBf16Linear(weight.to(BF16), kernels)
    assert torch.equal(linear.panels, dense.panels)
    # 1-12 rows decode into the products; 13 and up decode a unit once into a buffer
    for rows in (1, 2, 5, 11, 12, 13, 24, 25, 64):
        x = torch.randn(rows, k).to(BF16)
        expected = dense(x)
        assert torch.equal(kernels.linear_grid_bf16(x, linear.grid), expected), f"{rows} rows"
        assert torch.equal(linear(x), expected), f"{rows} rows"
    ids = torch.tensor([0, n - 1, 15, 16, 8, 7, 0, n // 2]) % n
    assert torch.equal(linear.rows(ids), weight.to(BF16)[ids])  # a tied embedding's lookup
    assert linear.rows(ids).dtype == BF16
    assert linear.rows(ids[:0]).shape == (0, k)
    assert linear.grid.nbytes < dense.panels.numel() * 2 * 0.6  # far fewer bytes than bf16
    assert linear.bytes_read(linear.code_rows) == linear.grid.nbytes
    assert linear.bytes_read(linear.code_rows + 1) == dense.panels.numel() * 2


def test_a_call_reads_the_codes_up_to_code_rows_and_the_panels_above(
    kernels: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    linear = make_linear(q4_1_weight(48, 64, seed=5), "none", kernels, BF16)
    assert isinstance(linear, GridBf16Linear)
    read: list[str] = []
    for name in ("linear_grid_bf16", "linear_bf16"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _real=real, _name=name: read.append(_name) or _real(*a)
        )
    for rows in (1, linear.code_rows, linear.code_rows + 1, 40):
        linear(torch.randn(rows, 64).to(BF16))
    assert read == ["linear_grid_bf16", "linear_grid_bf16", "linear_bf16", "linear_bf16"]


def test_code_rows_follow_the_threads_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(linear_module.CODE_ROWS_ENV, raising=False)
    one, two = linear_module.code_rows_for(1), linear_module.code_rows_for(2)
    assert one > two >= 1  # one thread streams the panels slower: codes pay off longer
    assert linear_module.code_rows_for(16) == two
    monkeypatch.setenv(linear_module.CODE_ROWS_ENV, "0")  # panels for every call
    assert linear_module.code_rows_for(1) == 0
    for bad in ("many", "-1", "2.5", ""):
        monkeypatch.setenv(linear_module.CODE_ROWS_ENV, bad)
        with pytest.raises(ConfigError, match="not a row count"):
            linear_module.code_rows_for(2)


def test_a_row_does_not_depend_on_its_batch(kernels: native.NativeKernels) -> None:
    linear = make_linear(q4_1_weight(96, 576, seed=9), "none", kernels, BF16)
    x = torch.randn(40, 576).to(BF16)
    whole = linear(x)
    for lo, hi in ((0, 1), (3, 14), (7, 19), (20, 40)):
        assert torch.equal(linear(x[lo:hi]), whole[lo:hi])


def test_no_rows_multiply_to_an_empty_result(kernels: native.NativeKernels) -> None:
    for make in (q4_1_weight, q8_0_weight):
        linear = make_linear(make(40, 64, seed=4), "none", kernels, BF16)
        assert isinstance(linear, GridBf16Linear)
        assert linear(torch.randn(0, 64).to(BF16)).shape == (0, 40)


def test_off_the_grid_or_already_bf16_keeps_the_bf16_panels(
    kernels: native.NativeKernels,
) -> None:
    weight = q4_1_weight(64, 128, seed=1)
    off = weight.clone()
    off[37, 77] = torch.nextafter(off[37, 77], torch.tensor(1.0))  # one ulp off the grid
    linear = make_linear(off, "none", kernels, BF16)
    assert isinstance(linear, CpuBf16Linear)
    assert torch.equal(linear.dense_weight(), off.to(BF16))
    # a bf16 weight has lost what the grid search needs: packed as it is
    assert isinstance(make_linear(weight.to(BF16), "none", kernels, BF16), CpuBf16Linear)
    assert isinstance(make_linear(torch.randn(32, 64), "none", kernels, BF16), CpuBf16Linear)


def test_grid_weights_can_be_turned_off(
    kernels: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert source_dtype(BF16, "none", kernels) == torch.float32
    assert source_dtype(BF16, "int8", kernels) == BF16
    assert source_dtype(torch.float32, "none", kernels) == torch.float32
    assert source_dtype(BF16, "none", None) == BF16
    monkeypatch.setenv(grid.DISABLE_ENV, "0")
    assert source_dtype(BF16, "none", kernels) == BF16
    linear = make_linear(q4_1_weight(32, 64, seed=2), "none", kernels, BF16)
    assert isinstance(linear, CpuBf16Linear)


def test_linear_grid_bf16_refuses_what_it_would_misread(kernels: native.NativeKernels) -> None:
    found = grid.find_codes(q4_1_weight(32, 64, seed=3), kernels)
    assert found is not None
    pairs = grid.pack_pairs(found, 32)
    with pytest.raises(ValueError, match="grid pairs"):
        kernels.linear_grid_bf16(torch.randn(2, 96).to(BF16), pairs)  # K = 96, codes for 64
    with pytest.raises(ValueError, match="bfloat16 x"):
        kernels.linear_grid_bf16(torch.randn(2, 64), pairs)
    with pytest.raises(ValueError, match="grid pairs"):  # a scale of the wrong dtype
        grid.GridPairs(4, pairs.codes, pairs.scale.float(), pairs.offset, 32)
