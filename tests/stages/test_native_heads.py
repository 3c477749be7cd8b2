"""The CPU kernels' two layer features of the Qwen2 and Qwen3 families (stages/backend/cpu/csrc):
a matmul's bias (ppr_add_bias), torch's `y + b` bit for bit, and the RMSNorm of every q and k
head (ppr_rms_norm_heads), transformers' arithmetic and add_rms_norm's bits over those heads;
in fp32 and bf16, odd sizes, at each build level this CPU runs, and refusing what lies outside
the rows given. Then both inside the fused decoder layers (ppr_decoder_layers, and its one-team
path where the stage's matrices are grid codes for vpdpbusd): bit for bit what the layer-by-layer
Python path computes with the same tensors. And the struct mirrors checked field by field."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from stages.backend.cpu import build, fused_layer, native
from tests.stages.conftest import Chain, drive_teacher_forced
from tests.stages.test_grid import q4_1_weight, q8_0_weight
from tests.stages.test_native import AVX2_CFLAGS, _cpu_has, build_kernels
from tests.tiny_llama import make_tiny_llama

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=["native", "portable", "avx2"])
def kernels(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> native.NativeKernels:
    """As a stage builds them (-march=native), the compiler's baseline (the scalar paths) and
    AVX2 alone (the eight-lane bf16 paths), where this CPU runs it."""
    if request.param == "native":
        built = native.kernels()
        assert built is not None, native.unavailable_reason()  # CI has gcc: they must build
        return built
    if request.param == "avx2":
        if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has("avx2", "fma"):
            pytest.skip("this CPU does not run AVX2 + FMA")
        return build_kernels(AVX2_CFLAGS, tmp_path_factory.mktemp("avx2"))
    return build_kernels(build.PORTABLE_CFLAGS, tmp_path_factory.mktemp("portable"))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("rows", "n", "width", "start"),
    [(1, 7, 7, 0), (3, 33, 40, 5), (9, 100, 131, 17), (2, 960, 1000, 24), (12, 1, 3, 2)],
)
def test_add_bias_is_torchs_add(
    kernels: native.NativeKernels, dtype: torch.dtype, rows: int, n: int, width: int, start: int
) -> None:
    torch.manual_seed(rows * n)
    y = (torch.randn(rows, width) * 3).to(dtype)
    bias = torch.randn(n + 4).to(dtype)  # longer than n: only n of it is read
    expected = y.clone()
    expected[:, start : start + n] = (y[:, start : start + n].float() + bias[:n].float()).to(dtype)
    view = y[:, start : start + n]  # a column block: rows `width` apart
    assert kernels.add_bias(view, bias, n) is view
    assert torch.equal(y, expected)  # the block's columns summed, every other one untouched
    whole = torch.randn(rows, n).to(dtype)
    assert torch.equal(kernels.add_bias(whole.clone(), bias[:n]), whole + bias[:n])


def test_add_bias_rounds_denormal_and_tied_sums_as_torch(kernels: native.NativeKernels) -> None:
    # sums a bf16 rounding ties on (to even), sums that land below FLT_MIN, infinities
    y = torch.tensor([[1.0, 1.0, 3e-39, -1e-38, 1e38, float("inf"), 0.5, -2.0] * 5])
    bias = torch.tensor([2**-8, 3 * 2**-8, -1e-39, 5e-39, 3e38, -1.0, 2**-9, 2**-7] * 5)
    y, bias = y.to(torch.bfloat16), bias.to(torch.bfloat16)
    assert torch.equal(kernels.add_bias(y.clone(), bias), y + bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "d"), [(1, 7), (3, 64), (9, 131)])
def test_add_is_torchs_add_in_place_or_not(
    kernels: native.NativeKernels, dtype: torch.dtype, rows: int, d: int
) -> None:
    """The residual stream of a layer that reads it un-normed (OLMo 2): h + residual, written
    into a new tensor or over h, and h itself where there is no residual."""
    torch.manual_seed(rows * d)
    h, residual = (torch.randn(2, rows, d) * 3).to(dtype).unbind(0)
    h, residual = h.contiguous(), residual.contiguous()
    expected = h + residual
    got = kernels.add(h, residual)
    assert got is not h and torch.equal(got, expected) and torch.equal(h + residual, expected)
    scratch = h.clone()
    assert kernels.add(scratch, residual, h_is_scratch=True) is scratch
    assert torch.equal(scratch, expected)
    assert kernels.add(h, None) is h


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "width"), [(1, 14), (3, 256), (9, 262)])
def test_gelu_tanh_mul_is_torchs_geglu(
    kernels: native.NativeKernels, dtype: torch.dtype, rows: int, width: int
) -> None:
    """Gemma's MLP gate: gelu with the tanh approximation times up, as torch computes it (fp32
    to its rounding; bf16 rounded where torch's separate ops round, so at most one bf16 step
    apart where tanh's last fp32 bit differs)."""
    torch.manual_seed(rows + width)
    gate_up = (torch.randn(rows, width) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    got = kernels.gelu_tanh_mul(gate_up)
    assert got.shape == expected.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=5e-6, rtol=1e-5)  # 1 + tanh near -1
    else:
        step = expected.float().abs().clamp(min=2**-10) * 2**-7  # one bf16 step
        assert ((got.float() - expected.float()).abs() <= step).all()
        assert (got == expected).float().mean() > 0.95


def test_add_refuses_tensors_of_other_shapes(kernels: native.NativeKernels) -> None:
    with pytest.raises(ValueError, match="alike"):
        kernels.add(torch.randn(4, 8), torch.randn(4, 9))


def heads_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D]: transformers' RMSNorm of each head (Qwen3RMSNorm), in x's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_rms_norm_heads_is_transformers_norm_and_add_rms_norms_bits(
    kernels: native.NativeKernels, dtype: torch.dtype, head_dim: int, rows: int
) -> None:
    heads, kv_heads, eps = 5, 3, 1e-6
    torch.manual_seed(head_dim + rows)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(rows, width) * torch.rand(1, width) * 4).to(dtype)
    q_weight = (1 + 0.3 * torch.randn(head_dim)).to(dtype)
    k_weight = (1 + 0.3 * torch.randn(head_dim)).to(dtype)
    out = qkv.clone()
    assert kernels.rms_norm_heads(out, 0, heads, head_dim, q_weight, eps) is out
    kernels.rms_norm_heads(out, heads, kv_heads, head_dim, k_weight, eps)

    def in_heads(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
        return t[:, first * head_dim : (first + count) * head_dim].reshape(-1, head_dim)

    q_in, k_in = in_heads(qkv, 0, heads), in_heads(qkv, heads, kv_heads)
    q_out, k_out = in_heads(out, 0, heads), in_heads(out, heads, kv_heads)
    # the same bits as add_rms_norm over those heads as rows (what a Python path calls)
    assert torch.equal(q_out, kernels.add_rms_norm(q_in.contiguous(), None, q_weight, eps)[0])
    assert torch.equal(k_out, kernels.add_rms_norm(k_in.contiguous(), None, k_weight, eps)[0])
    # and transformers' norm: in bf16 the same bits here, but only a rounding apart in general
    # (fp32 sums the squares in another order, and takes 1 / sqrt where torch takes rsqrt)
    ulp = 2**-23 if dtype == torch.float32 else 2**-7
    for got, x, w in ((q_out, q_in, q_weight), (k_out, k_in, k_weight)):
        torch.testing.assert_close(got, heads_reference(x, w, eps), atol=1e-6, rtol=4 * ulp)
    v = slice((heads + kv_heads) * head_dim, width)
    assert torch.equal(out[:, v], qkv[:, v])  # v is left alone


def test_the_kernels_refuse_sizes_outside_the_rows(kernels: native.NativeKernels) -> None:
    y = torch.randn(4, 24)
    before = y.clone()
    bias = torch.randn(24)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.add_bias(y, bias, 25)  # past the row
    with pytest.raises(ValueError, match="do not fit"):
        kernels.add_bias(y, bias[:10], 12)  # past the bias
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.add_bias(y, bias.to(torch.bfloat16), 24)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.add_bias(y.t(), bias[:4], 4)  # columns strided
    with pytest.raises(ValueError, match="do not fit"):
        kernels.rms_norm_heads(y, 1, 2, 12, torch.ones(12), 1e-6)  # heads 1-2 of 12: 36 > 24
    with pytest.raises(ValueError, match="do not fit"):
        kernels.rms_norm_heads(y, -1, 1, 12, torch.ones(12), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm_heads(y, 0, 2, 12, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.rms_norm_heads(y[:, :12], 0, 1, 12, torch.ones(12), 1e-6)
    # the entry points themselves check what they are given (PPR_BAD_ROWS, PPR_REFUSED)
    lib, at, w = kernels._lib, y.data_ptr(), bias.data_ptr()
    assert lib.ppr_add_bias(4, at, 24, w, -1, 24) == -4  # negative rows
    assert lib.ppr_add_bias(4, at, 24, w, 4, -3) == -4  # negative columns
    assert lib.ppr_add_bias(4, at, 20, w, 4, 24) == -4  # rows that would overlap
    assert lib.ppr_add_bias(3, at, 24, w, 4, 24) == -1  # no such element size
    assert lib.ppr_rms_norm_heads(4, at, 24, 0, 2, 12, w, 1e-6, -1) == -4
    assert lib.ppr_rms_norm_heads(4, at, 24, 1, 2, 12, w, 1e-6, 4) == -4  # past the row
    assert lib.ppr_rms_norm_heads(4, at, 24, 0, -1, 12, w, 1e-6, 4) == -4
    assert lib.ppr_rms_norm_heads(4, at, 24, 0, 2, 0, w, 1e-6, 4) == -4  # no head_dim
    assert lib.ppr_rms_norm_heads(8, at, 24, 0, 2, 12, w, 1e-6, 4) == -1
    assert torch.equal(y, before)  # nothing was written
    with pytest.raises(ValueError, match="outside the 4 rows given"):
        native.check_status(lib.ppr_add_bias(4, at, 24, w, -1, 24), "add_bias", 4)
    assert lib.ppr_add_bias(4, at, 24, w, 0, 24) == 0  # no rows: nothing to do


def test_struct_offsets_are_read_and_every_field_is_checked() -> None:
    built = native.kernels()
    assert built is not None, native.unavailable_reason()
    mirrors = (fused_layer._Linear, fused_layer._Layer, fused_layer._Step)
    for struct, offsets in zip(mirrors, built.struct_offsets, strict=True):
        assert offsets == tuple(getattr(struct, f[0]).offset for f in struct._fields_)
    assert built._lib.ppr_struct_offset(1, len(fused_layer._Layer._fields_)) == -1
    assert built._lib.ppr_struct_offset(3, 0) == -1
    fused_layer._check_mirrors(built)  # as a stage checks them

    def fake(offsets: tuple[tuple[int, ...], ...]) -> SimpleNamespace:
        return SimpleNamespace(struct_sizes=built.struct_sizes, struct_offsets=offsets)

    layer = list(built.struct_offsets[1])
    swapped = layer[:12] + [layer[13], layer[12]] + layer[14:]  # qkv_bias and o_bias swapped
    linear, _, step = built.struct_offsets
    with pytest.raises(RuntimeError, match=r"_Layer field qkv_bias .* ppr_layer_t field 12"):
        fused_layer._check_mirrors(fake((linear, tuple(swapped), step)))
    longer = (*built.struct_offsets[:2], (*built.struct_offsets[2], 999))
    past = len(fused_layer._Step._fields_)  # one field past the mirror's last
    with pytest.raises(RuntimeError, match=rf"_Step field #{past} \(none here\)"):
        fused_layer._check_mirrors(fake(longer))


# ---- inside the fused layers ----------------------------------------------------------------

SEQS = [[(5 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((21, 9, 26))]
PROMPT_LENS = [11, 4, 15]


@pytest.fixture(scope="module")
def grid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama on GGUF grids (as test_fused_layer's): a bf16 stage multiplies its codes
    by int8-quantized activations, and so runs its layers in one team (layers.c)."""
    folder = make_tiny_llama(
        tmp_path_factory.mktemp("grid") / "m", hidden=128, heads=2, kv_heads=1, seed=11
    )
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for i, (name, weight) in enumerate(sorted(tensors.items())):
        if name.endswith("_proj.weight"):
            make = q8_0_weight if name.split(".")[-2] in ("o_proj", "down_proj") else q4_1_weight
            tensors[name] = make(*weight.shape, seed=i) * 4
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _param(t: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(t.to(dtype).contiguous(), requires_grad=False)


def add_features(chain: Chain, dtype: torch.dtype, features: set[str]) -> None:
    """Every layer gets the same random qkv bias, o bias and q/k norms (those in `features`) in
    both paths: as the Python layer's tensors, and where the stage fuses its layers, their
    addresses in its C structs."""
    for stage in chain.stages:
        model = stage.model
        for i, layer in enumerate(model.layers):
            g = torch.Generator().manual_seed(1000 + model.start_layer + i)
            heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
            hidden = layer.input_norm.shape[0]
            if "qkv_bias" in features:
                width = (heads + 2 * kv_heads) * head_dim
                layer.qkv_bias = _param(torch.randn(width, generator=g), dtype)
            if "o_bias" in features:
                layer.o_bias = _param(0.5 * torch.randn(hidden, generator=g), dtype)
            if "qk_norm" in features:
                layer.q_norm = _param(1 + 0.4 * torch.randn(head_dim, generator=g), dtype)
                layer.k_norm = _param(1 + 0.4 * torch.randn(head_dim, generator=g), dtype)
        if model.fused is not None:
            for struct, layer in zip(model.fused._layers, model.layers, strict=True):
                for name in ("qkv_bias", "o_bias", "q_norm", "k_norm"):
                    tensor = getattr(layer, name)
                    setattr(struct, name, None if tensor is None else tensor.data_ptr())


def feature_logits(folder: Path, dtype: str, features: set[str], fused: bool) -> list[torch.Tensor]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fused_layer.DISABLE_ENV, "1" if fused else "0")
        chain = Chain(folder, [4], dtype=dtype)
        assert all((stage.model.fused is not None) == fused for stage in chain.stages)
        add_features(chain, getattr(torch, dtype), features)
        return drive_teacher_forced(chain, SEQS, PROMPT_LENS, chunk_size=5, stagger=2)


@pytest.mark.parametrize(
    "features", [{"qkv_bias", "o_bias", "qk_norm"}, {"qkv_bias"}, {"qk_norm", "o_bias"}],
    ids=["all", "qkv-bias", "norms-o-bias"],
)  # fmt: skip
@pytest.mark.parametrize(("model", "dtype"), [
    ("gqa", "float32"), ("gqa", "bfloat16"), ("grid", "float32"), ("grid", "bfloat16"),
])  # fmt: skip
def test_fused_layers_add_the_features_as_the_layer_calls_do(
    tiny_dirs: dict[str, Path], grid_dir: Path, model: str, dtype: str, features: set[str]
) -> None:
    built = native.kernels()
    assert built is not None, native.unavailable_reason()
    if dtype == "bfloat16" and not built.bf16_dot:
        pytest.skip("a bf16 stage multiplies with the kernels only on AVX512_BF16")
    folder = grid_dir if model == "grid" else tiny_dirs["gqa"]
    fused = feature_logits(folder, dtype, features, fused=True)
    layered = feature_logits(folder, dtype, features, fused=False)
    plain = feature_logits(folder, dtype, set(), fused=True)
    for got, expected, without in zip(fused, layered, plain, strict=True):
        assert torch.equal(got, expected)
        assert torch.isfinite(got).all()
        assert not torch.equal(got, without)  # the features did reach the C layers


def test_a_build_is_keyed_by_every_c_and_h_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    folder = tmp_path / "csrc"  # a copy to edit, as a test of a modified kernel would
    shutil.copytree(build.SOURCE_DIR, folder)
    monkeypatch.setattr(build, "SOURCE_DIR", folder)
    monkeypatch.setenv("PPRING_CACHE", str(tmp_path / "cache"))
    built: list[Path] = []
    monkeypatch.setattr(build, "compile_kernels", lambda target, *_: built.append(target))
    names = {path.name for path in build.source_files()}
    assert {"ppring.h", "attention.c", "layers.c", "ops.c"} <= names
    first = build.build(compiler)
    header = folder / "ppring.h"
    header.write_text(header.read_text() + "/* an edit */\n")
    second = build.build(compiler)
    (folder / "extra.c").write_text("int ppr_extra(void) { return 1; }\n")
    third = build.build(compiler)
    assert built == [first, second, third] and len({first, second, third}) == 3
