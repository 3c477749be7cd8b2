"""bf16 matmuls on AMX tiles (csrc/matmul_amx.c): over the very panels vdpbf16ps reads, and over
GGUF codes decoded a unit at a time; held to a float64 reference, to the vector kernel within a
bf16 rounding, at every row, channel and K tail; a stage's choice of where the tiles start
(backend/cpu/amx_choice.py): measured once, kept per machine, overridable, and followed alike by
the layer-by-layer path and the fused stack."""

from __future__ import annotations

import json

import pytest
import torch

from stages.backend.cpu import amx_choice, native
from stages.backend.cpu import linear as linear_module
from stages.backend.cpu.linear import CpuBf16Linear, GridA8Linear, make_linear
from stages.backend.switches import AMX_ROWS_ENV, Switches
from stages.errors import ConfigError
from tests.stages.test_fused_layer import grid_dir as grid_dir  # a fixture, for the stack
from tests.stages.test_fused_layer import logits
from tests.stages.test_grid import q4_1_weight, q8_0_weight

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    built = native.kernels()
    assert built is not None, native.unavailable_reason()
    if not built.amx_bf16:
        pytest.skip("this CPU (or kernel) has no AMX-BF16: bf16 matmuls stay on vdpbf16ps")
    return built


def _bf16_bound(expected: torch.Tensor, k: int) -> torch.Tensor:
    """One bf16 rounding of an fp32 sum of k exact products, and the fp32 sum's own error."""
    return expected.abs() * 2**-8 + k * 2**-24 * expected.abs().amax()


@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 64), (33, 96), (1000, 576), (70, 2048)])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 100])
def test_tiles_multiply_the_panels_as_the_vector_kernel_does(
    kernels: native.NativeKernels, n: int, k: int, rows: int
) -> None:
    torch.manual_seed(n * k + rows)
    weight = torch.randn(n, k).to(BF16)
    panels = kernels.pack_bf16(weight)
    x = torch.randn(rows, k).to(BF16)
    tiles = kernels.linear_bf16(x, panels, n, k, amx=True)
    vector = kernels.linear_bf16(x, panels, n, k)
    expected = x.double() @ weight.double().T
    assert tiles.shape == (rows, n)
    assert ((tiles.double() - expected).abs() <= _bf16_bound(expected, k)).all()
    # the same sums in an order of the hardware's: at most one bf16 step apart (or the fp32
    # sums' own error, where they cancel to near zero), and rarely
    step = torch.maximum(tiles.double().abs(), vector.double().abs()) * 2**-7
    step += k * 2**-24 * expected.abs().amax()
    assert ((tiles.double() - vector.double()).abs() <= step).all()
    assert (tiles != vector).float().mean() < 0.01


def test_a_k_the_tiles_do_not_take_falls_back_to_the_vector_kernel(
    kernels: native.NativeKernels,
) -> None:
    weight = torch.randn(48, 40).to(BF16)  # K = 40: not whole 32-wide tiles
    panels = kernels.pack_bf16(weight)
    x = torch.randn(20, 40).to(BF16)
    assert torch.equal(
        kernels.linear_bf16(x, panels, 48, 40, amx=True), kernels.linear_bf16(x, panels, 48, 40)
    )


@pytest.mark.parametrize(("make", "bits"), [(q4_1_weight, 4), (q8_0_weight, 8)])
@pytest.mark.parametrize(("n", "k"), [(70, 64), (960, 576), (33, 1536)])
def test_grid_codes_on_tiles_are_their_bf16_panels_on_tiles(
    kernels: native.NativeKernels, make, bits: int, n: int, k: int, monkeypatch
) -> None:
    monkeypatch.setenv(AMX_ROWS_ENV, "0")  # the module's own calls stay on vpdpbusd
    weight = make(n, k, seed=n + k)  # fp32, as the checkpoint holds it
    linear = make_linear(weight, "none", kernels, BF16)
    assert isinstance(linear, GridA8Linear) and linear.grid.bits == bits
    panels = kernels.pack_bf16(weight.to(BF16))
    for rows in (1, 16, 17, 64):
        x = torch.randn(rows, k).to(BF16)
        # the codes decoded to bf16 exactly, then the same tiles: bit for bit
        assert torch.equal(
            kernels.linear_grid_a8(x, linear.grid, amx=True),
            kernels.linear_bf16(x, panels, n, k, amx=True),
        )


def test_a_module_takes_the_tiles_from_its_amx_rows(
    kernels: native.NativeKernels, monkeypatch
) -> None:
    monkeypatch.setenv(AMX_ROWS_ENV, "8")
    weight = torch.randn(64, 128)
    linear = make_linear(weight.to(BF16), "none", kernels, BF16)
    assert isinstance(linear, CpuBf16Linear) and linear.amx_rows == 8
    panels = linear.panels
    for rows, amx in ((7, False), (8, True), (40, True)):
        x = torch.randn(rows, 128).to(BF16)
        assert torch.equal(linear(x), kernels.linear_bf16(x, panels, 64, 128, amx=amx))
    monkeypatch.setenv(AMX_ROWS_ENV, "0")
    assert make_linear(weight.to(BF16), "none", kernels, BF16).amx_rows == 0


def test_a_bad_amx_rows_setting_is_one_error(monkeypatch) -> None:
    monkeypatch.setenv(AMX_ROWS_ENV, "many")
    with pytest.raises(ConfigError, match=AMX_ROWS_ENV):
        Switches.read()


def test_the_choice_is_measured_once_and_kept_beside_the_build(
    kernels: native.NativeKernels, monkeypatch, tmp_path
) -> None:
    class Built:  # the kernels, their library's path moved to a folder of this test's own
        def __getattr__(self, name):
            return getattr(kernels, name)

    built = Built()
    built.path = tmp_path / "cpu_kernels-test.so"
    measured = []

    def fake_measure(module):
        measured.append(module)
        return 16

    monkeypatch.setattr(amx_choice, "measure", fake_measure)
    module = CpuBf16Linear(torch.randn(32, 64).to(BF16), kernels)
    assert amx_choice.amx_rows_for(module, built) == 16
    assert amx_choice.amx_rows_for(module, built) == 16  # read back, not measured again
    assert len(measured) == 1
    kept = json.loads((tmp_path / "cpu_kernels-test.amx_rows.json").read_text())
    assert list(kept.values()) == [16] and "CpuBf16Linear 32x64" in next(iter(kept))
    assert amx_choice.amx_rows_for(module, built, "3") == 3  # a setting overrides it


def test_measuring_stops_at_a_rung_of_the_ladder(kernels: native.NativeKernels) -> None:
    module = CpuBf16Linear(torch.randn(256, 512).to(BF16), kernels)
    rows = amx_choice.measure(module)
    assert rows == 0 or rows in amx_choice.LADDER
    assert module.amx_rows == 0  # left as it was


@pytest.mark.parametrize("activations", ["int8x2", "bf16"])
def test_the_fused_stack_follows_the_modules_choice(
    kernels: native.NativeKernels, tiny_dirs, grid_dir, activations: str, monkeypatch
) -> None:
    """The stack's C calls take the tiles where the modules' own calls do: prefill chunks of 5
    rows and decode batches of 1-3 (both sides of amx_rows = 3), bit for bit the layer-by-layer
    path's logits, over bf16 panels and over GGUF codes (times int8 rows below amx_rows, or
    decoded to bf16 pairs)."""
    monkeypatch.setenv(AMX_ROWS_ENV, "3")
    monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, activations)
    for folder in (tiny_dirs["gqa"], grid_dir):
        fused = logits(folder, [1, 3], "bfloat16", "none", fused=True)
        layered = logits(folder, [1, 3], "bfloat16", "none", fused=False)
        for got, expected in zip(fused, layered, strict=True):
            assert torch.equal(got, expected)
            assert torch.isfinite(got).all()


def test_the_start_up_summary_names_the_tiles(kernels: native.NativeKernels, monkeypatch) -> None:
    monkeypatch.setenv(AMX_ROWS_ENV, "12")
    modules = [make_linear(torch.randn(32, 64).to(BF16), "none", kernels, BF16)]
    assert "AMX tiles from 12 rows" in linear_module.describe_matrices(modules, BF16)


def test_the_launchers_summary_names_the_tiles(kernels: native.NativeKernels, monkeypatch) -> None:
    from launch.local import amx_tiles_line  # noqa: PLC0415

    monkeypatch.delenv(AMX_ROWS_ENV, raising=False)
    assert "measured per matrix" in amx_tiles_line(BF16, kernels)
    monkeypatch.setenv(AMX_ROWS_ENV, "8")
    assert "from 8 rows" in amx_tiles_line(BF16, kernels)
    monkeypatch.setenv(AMX_ROWS_ENV, "0")
    assert "off" in amx_tiles_line(BF16, kernels)
    assert amx_tiles_line(torch.float32, kernels) is None
    monkeypatch.setenv(AMX_ROWS_ENV, "lots")
    with pytest.raises(ConfigError, match=AMX_ROWS_ENV):
        amx_tiles_line(BF16, kernels)
