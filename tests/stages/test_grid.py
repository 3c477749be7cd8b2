"""fp32 weights on a GGUF grid (backend/cpu/grid.py): found only where every weight is exactly
reproduced, held as codes, and multiplied to the very same results as the fp32 panels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.backend.cpu import build, grid, native
from stages.backend.cpu.linear import CpuLinear, GridLinear, make_linear


@pytest.fixture(scope="module", params=["native", "portable"])
def kernels(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> native.NativeKernels:
    if request.param == "native":
        built = native.kernels()
        assert built is not None, native.unavailable_reason()
        return built
    compiler = build.find_compiler()
    assert compiler is not None
    target = tmp_path_factory.mktemp("portable") / "cpu_kernels.so"
    return native.NativeKernels(build.compile_kernels(target, compiler, build.PORTABLE_CFLAGS))


def q4_1_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] as gguf's converter dequantizes Q4_1: fp16 d and m per 32 weights, q in 0..15,
    w = d * q + m in float32 (numpy: the product rounded, then the sum)."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(1e-3, 2e-2, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.2, 0.0, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, k // 32, 32)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, 15  # as a quantizer leaves them: the block's min and max
    return torch.from_numpy((d * q + m).reshape(n, k))


def q8_0_weight(n: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    d = rng.uniform(1e-4, 1e-3, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, (n, k // 32, 32)).astype(np.float32)
    q[..., 0] = 127
    return torch.from_numpy((d * q).reshape(n, k))


@pytest.mark.parametrize(("make", "bits"), [(q4_1_weight, 4), (q8_0_weight, 8)])
@pytest.mark.parametrize(("n", "k"), [(70, 64), (960, 576), (33, 1536)])
def test_a_grid_weight_multiplies_exactly_as_its_fp32_panels(
    kernels: native.NativeKernels, make, bits: int, n: int, k: int
) -> None:
    weight = make(n, k, seed=n + k)
    linear = make_linear(weight, "none", kernels)
    assert isinstance(linear, GridLinear) and linear.grid.bits == bits
    assert torch.equal(linear.dense_weight(), weight)
    dense = CpuLinear(weight, kernels)
    for rows in (1, 2, 5, 6, 7, 13, 64, 130):  # every block split of the rows
        x = torch.randn(rows, k)
        assert torch.equal(linear(x), dense(x)), f"{rows} rows"
    ids = torch.tensor([0, n - 1, 15, 16, 8, 7, 0])
    assert torch.equal(linear.rows(ids), weight[ids])  # a tied embedding's lookup
    assert linear.grid.nbytes < dense.panels.numel() * 4 / 3  # fewer bytes than the panels


def test_no_rows_multiply_to_an_empty_result(kernels: native.NativeKernels) -> None:
    """A split lm_head's share of a step that samples nothing has no rows (this crashed)."""
    for make in (q4_1_weight, q8_0_weight):
        linear = make_linear(make(40, 64, seed=4), "none", kernels)
        assert isinstance(linear, GridLinear)
        assert linear(torch.randn(0, 64)).shape == (0, 40)


def test_one_weight_off_the_grid_keeps_the_fp32_panels(kernels: native.NativeKernels) -> None:
    weight = q4_1_weight(64, 128, seed=1)
    weight[37, 77] = torch.nextafter(weight[37, 77], torch.tensor(1.0))  # one ulp off
    assert grid.find_grid(weight, kernels) is None
    assert isinstance(make_linear(weight, "none", kernels), CpuLinear)


def test_ordinary_weights_are_not_taken_for_a_grid(kernels: native.NativeKernels) -> None:
    assert grid.find_grid(torch.randn(256, 576), kernels) is None
    assert grid.find_grid(torch.randn(16, 30), kernels) is None  # K not a multiple of 32
    all_zero = torch.zeros(20, 64)  # every block constant: d = 0 reproduces it
    assert grid.find_grid(all_zero, kernels) is not None


def test_grid_weights_can_be_turned_off(
    kernels: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(grid.DISABLE_ENV, "0")
    assert isinstance(make_linear(q4_1_weight(32, 64, seed=2), "none", kernels), CpuLinear)


def test_linear_grid_refuses_codes_of_another_shape(kernels: native.NativeKernels) -> None:
    found = grid.find_grid(q4_1_weight(32, 64, seed=3), kernels)
    assert found is not None
    with pytest.raises(ValueError, match="grid codes"):
        kernels.linear_grid(torch.randn(2, 96), found)  # K = 96, codes for 64
