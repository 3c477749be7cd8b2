"""bf16 stages over weights on a GGUF grid, the default way (stages/backend/cpu/grid.py GridQuads,
csrc/matmul_a8.c ppr_linear_grid_a8): the codes alone, multiplied by each row of x quantized to
int8 per block of 32, as llama.cpp does. The results are held to a reference that does the same
arithmetic in float64 (integer sums exact, one bf16 rounding apart), to the exact product within
the int8 grid's error, and a row's result to its own row, whatever it is batched with."""

from __future__ import annotations

import pytest
import torch

from stages.backend.cpu import grid, native
from stages.backend.cpu import linear as linear_module
from stages.backend.cpu.linear import GridA8Linear, GridBf16Linear, make_linear
from stages.backend.switches import AMX_ROWS_ENV
from stages.errors import ConfigError
from tests.stages.test_grid import q4_1_weight, q8_0_weight

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    built = native.kernels()
    assert built is not None, native.unavailable_reason()
    if not built.a8_dot:
        pytest.skip("this CPU has no AVX512_BF16 and VNNI: grid codes are decoded to bf16")
    return built


@pytest.fixture(autouse=True)
def _default_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(linear_module.GRID_ACTIVATIONS_ENV, raising=False)
    # the vector kernels' own results, at every row count: the tiles a stage may move large
    # calls to are tests/stages/test_amx.py's
    monkeypatch.setenv(AMX_ROWS_ENV, "0")


def quantized_passes(x: torch.Tensor, passes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """x [M, K] bf16 as the kernels quantize it: per block of 32 of a row, `passes` passes, a
    second over what the first missed (r = x, then r - dx xq): dx = max |r| / 127 and xq =
    round(r / dx) in fp32 (the division correctly rounded, ties to even). Each pass's (xq
    [M, K / 32, 32], dx [M, K / 32]) in float64."""
    m, k = x.shape
    residual = x.float().reshape(m, k // 32, 32)
    out = []
    for _ in range(passes):
        amax = residual.abs().amax(dim=-1)  # [M, B]
        # tensor / tensor: torch divides a scalar by a tensor through its reciprocal (one ulp
        # off)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        xq = torch.round(residual * inv[..., None])
        dx = amax / 127.0
        residual = residual - xq * dx[..., None]
        out.append((xq.double(), dx.double()))
    return out


def reference(x: torch.Tensor, found: grid.Found, passes: int = 2) -> torch.Tensor:
    """What the kernel computes, in float64: x [M, K] bf16 -> [M, N]. x quantized as
    quantized_passes says; then sum(q xq) exact, and over passes and blocks (d dx) sum(q xq)
    + m dx sum(xq)."""
    m, k = x.shape
    q = found.q.double().reshape(found.q.shape[0], k // 32, 32)
    y = torch.zeros(m, q.shape[0], dtype=torch.float64)
    for xq, dx in quantized_passes(x, passes):
        sums = torch.einsum("mbk,nbk->mnb", xq, q)  # [M, N, B], exact integers
        y += (sums * found.d.double()[None] * dx[:, None]).sum(-1)
        if found.m is not None:
            y += (found.m.double()[None] * (dx * xq.sum(-1))[:, None]).sum(-1)
    return y


# the exact product's relative error each way: one int8 pass (llama.cpp's) cost ~0.5% here, and
# a second pass over what the first missed brings it to bf16's own rounding of y
CLOSE_TO_EXACT = {1: 0.02, 2: 0.003}


@pytest.mark.parametrize("passes", [2, 1])
@pytest.mark.parametrize(("make", "bits"), [(q4_1_weight, 4), (q8_0_weight, 8)])
@pytest.mark.parametrize(("n", "k"), [(70, 64), (960, 576), (33, 1536), (16, 32)])
def test_a_grid_weight_multiplies_as_llama_cpp_does(
    kernels: native.NativeKernels, make, bits: int, n: int, k: int, passes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, {1: "int8", 2: "int8x2"}[passes])
    weight = make(n, k, seed=n + k)  # fp32, as the checkpoint holds it
    # x seeded too: drawn from whatever state earlier tests left, one 2-row draw at K 32 (one
    # row all zeros) once landed 2.5% from the exact product
    torch.manual_seed(n * k + bits)
    linear = make_linear(weight, "none", kernels, BF16)
    assert isinstance(linear, GridA8Linear) and linear.grid.bits == bits
    assert linear.passes == passes
    assert torch.equal(linear.dense_weight(), weight.to(BF16))
    found = grid.find_codes(weight, kernels)
    assert found is not None
    # 1-4 rows are one micro-kernel call; more are several, the last one short
    for rows in (1, 2, 3, 4, 5, 9, 64):
        x = torch.randn(rows, k).to(BF16)
        x[0, :32] = 0  # a block of zeros: dx = 0, no division by it
        got = linear(x).double()
        expected = reference(x, found, passes)
        # one bf16 rounding of the fp32 result, plus the fp32 sums' own (far smaller)
        bound = expected.abs() * 2**-8 + 1e-5 * expected.abs().amax()
        assert ((got - expected).abs() <= bound).all(), f"{rows} rows"
        # and close to the exact product
        exact = x.double() @ weight.double().T
        assert (got - exact).norm() <= CLOSE_TO_EXACT[passes] * exact.norm(), f"{rows} rows"
    ids = torch.tensor([0, n - 1, 15, 16, 8, 7, 0, n // 2]) % n
    assert torch.equal(linear.rows(ids), weight.to(BF16)[ids])  # a tied embedding's lookup
    assert linear.rows(ids).dtype == BF16
    assert linear.rows(ids[:0]).shape == (0, k)
    every = torch.arange(n)  # the kernel's decode is quad_rows's, every row, bit for bit
    assert torch.equal(linear.rows(every), grid.quad_rows(linear.grid, every).to(BF16))
    # the codes alone: no bf16 panels held beside them
    assert [name for name, _ in linear.named_buffers()] == [
        "codes",
        "scale",
        *(["offset"] if bits == 4 else []),
    ]
    assert linear.grid.nbytes == grid.pack_pairs(found, n).nbytes


def test_a_row_does_not_depend_on_its_batch(kernels: native.NativeKernels) -> None:
    linear = make_linear(q4_1_weight(96, 576, seed=9), "none", kernels, BF16)
    assert isinstance(linear, GridA8Linear)
    x = torch.randn(40, 576).to(BF16)
    whole = linear(x)
    for lo, hi in ((0, 1), (3, 14), (7, 19), (20, 40), (39, 40)):
        assert torch.equal(linear(x[lo:hi]), whole[lo:hi])


def test_no_rows_multiply_to_an_empty_result(kernels: native.NativeKernels) -> None:
    for make in (q4_1_weight, q8_0_weight):
        linear = make_linear(make(40, 64, seed=4), "none", kernels, BF16)
        assert isinstance(linear, GridA8Linear)
        assert linear(torch.randn(0, 64).to(BF16)).shape == (0, 40)


def test_the_activations_can_stay_bf16_and_a_bad_choice_is_one_error(
    kernels: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = q4_1_weight(32, 64, seed=2)
    monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, "bf16")
    assert isinstance(make_linear(weight, "none", kernels, BF16), GridBf16Linear)
    monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, " INT8 ")
    assert isinstance(make_linear(weight, "none", kernels, BF16), GridA8Linear)
    for bad in ("int4", "", "fp8"):
        monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, bad)
        with pytest.raises(ConfigError, match="PPRING_GRID_ACTIVATIONS"):
            make_linear(weight, "none", kernels, BF16)


def test_linear_grid_a8_refuses_what_it_would_misread(kernels: native.NativeKernels) -> None:
    found = grid.find_codes(q8_0_weight(32, 64, seed=3), kernels)
    assert found is not None
    quads = grid.pack_quads(found, 32)
    assert quads.in_features == 64
    with pytest.raises(ValueError, match="grid quads"):
        kernels.linear_grid_a8(torch.randn(2, 96).to(BF16), quads)  # K = 96, codes for 64
    with pytest.raises(ValueError, match="bfloat16 x"):
        kernels.linear_grid_a8(torch.randn(2, 64), quads)
    for bad in (32, -1):  # a row past the weight's N is refused, not read
        with pytest.raises(ValueError, match="token ids must lie in"):
            kernels.grid_a8_rows(quads, torch.tensor([0, bad]))
    with pytest.raises(ValueError, match="grid quads"):  # a scale of the wrong dtype
        grid.GridQuads(8, quads.codes, quads.scale.float(), None, 32)
    with pytest.raises(ValueError, match="grid quads"):  # codes of another K
        grid.GridQuads(8, quads.codes[:, :8].contiguous(), quads.scale, None, 32)


def test_the_start_up_summary_says_how_grid_weights_multiply(
    kernels: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launch.local import grid_weights_line

    line = grid_weights_line(BF16, "none", kernels)
    assert line is not None and "quantized to int8 per 32 in two passes" in line
    assert "PPRING_GRID_ACTIVATIONS=int8 for one pass" in line
    monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, "int8")
    assert "int8-quantized activations (per 32, one pass" in grid_weights_line(
        BF16, "none", kernels
    )
    monkeypatch.delenv(linear_module.GRID_ACTIVATIONS_ENV)
    # where nothing changes: fp32 stages, int8 weights, no kernels, codes turned off
    assert grid_weights_line(torch.float32, "none", kernels) is None
    assert grid_weights_line(BF16, "int8", kernels) is None
    assert grid_weights_line(BF16, "none", None) is None
    monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, "bf16")
    assert "exactly their bf16 values" in grid_weights_line(BF16, "none", kernels)
    monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, "int4")  # one error, at start-up
    with pytest.raises(ConfigError, match="PPRING_GRID_ACTIVATIONS"):
        grid_weights_line(BF16, "none", kernels)
    monkeypatch.setenv(grid.DISABLE_ENV, "0")
    assert grid_weights_line(BF16, "none", kernels) is None
