"""A decoder layer as one kernel call (backend/cpu/fused_layer.py) computes bit for bit what the
layer's nine kernel calls from Python compute: for every kind of matrix the kernels hold (fp32
and bf16 panels, both on a GGUF grid, bf16 grid codes times int8 activations, int8), for
prefill chunks mixed with decodes, and on a later stage, whose first layer reads a received
frame. A greedy decode batch's finish in one call (GreedyHead) picks the tokens the final norm,
lm_head and argmax called one by one pick."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.backend.cpu import fused_layer, native
from stages.backend.cpu import linear as linear_module
from stages.backend.cpu.linear import GridA8Linear, GridBf16Linear, GridLinear, Int8Linear
from tests.stages.conftest import Chain, drive_teacher_forced, greedy_generate
from tests.stages.test_grid import q4_1_weight, q8_0_weight
from tests.tiny_llama import make_tiny_llama

SEQS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((23, 9, 30))]
PROMPT_LENS = [12, 4, 17]


@pytest.fixture(scope="module")
def grid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose matrices lie on GGUF grids (q, k, v, gate, up Q4_1; o, down Q8_0), with
    head_dim 64, so a bf16 stage holds its cache as pairs, and one KV head (MQA)."""
    folder = make_tiny_llama(
        tmp_path_factory.mktemp("grid") / "m", hidden=128, heads=2, kv_heads=1, seed=7
    )
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for i, (name, weight) in enumerate(sorted(tensors.items())):
        if name.endswith("_proj.weight"):
            make = q8_0_weight if name.split(".")[-2] in ("o_proj", "down_proj") else q4_1_weight
            tensors[name] = make(*weight.shape, seed=i) * 4  # a scale that keeps text varied
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def logits(
    folder: Path, partition: list[int], dtype: str, quantization: str, fused: bool
) -> list[torch.Tensor]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fused_layer.DISABLE_ENV, "1" if fused else "0")
        # forwards of 1-15 rows: the scratch held between steps, grown, and not held (> 6)
        patch.setattr(fused_layer.FusedLayers, "HELD_ROWS", 6)
        chain = Chain(folder, partition, dtype=dtype, quantization=quantization)
        assert all((stage.model.fused is not None) == fused for stage in chain.stages)
        return drive_teacher_forced(chain, SEQS, PROMPT_LENS, chunk_size=5, stagger=2)


def needs_bf16_dot(dtype: str) -> None:
    built = native.kernels()
    assert built is not None, native.unavailable_reason()
    if dtype == "bfloat16" and not built.bf16_dot:
        pytest.skip("a bf16 stage multiplies with the kernels only on AVX512_BF16")


@pytest.fixture(
    params=[
        (partition, dtype, quantization)
        for partition in ([4], [1, 3])
        for dtype in ("float32", "bfloat16")
        for quantization in ("none", "int8")
    ],
    ids=lambda kind: f"{kind[0]}-{kind[1]}-{kind[2]}",
)
def stage_kind(request: pytest.FixtureRequest) -> tuple[list[int], str, str]:
    """(partition, dtype, quantization): one stage or two, each dtype, with and without int8."""
    needs_bf16_dot(request.param[1])
    return request.param


def test_one_call_a_layer_computes_what_the_layer_calls_compute(
    tiny_dirs: dict[str, Path], grid_dir: Path, stage_kind: tuple[list[int], str, str]
) -> None:
    partition, dtype, quantization = stage_kind
    # a bf16 grid stage's three ways: codes times int8 activations in two passes (the default)
    # or one, codes as bf16
    runs = [(tiny_dirs["gqa"], None), (grid_dir, None)]
    if dtype == "bfloat16" and quantization == "none":
        runs += [(grid_dir, "int8"), (grid_dir, "bf16")]
    for folder, activations in runs:
        with pytest.MonkeyPatch.context() as patch:
            if activations:
                patch.setenv(linear_module.GRID_ACTIVATIONS_ENV, activations)
            fused = logits(folder, partition, dtype, quantization, fused=True)
            layered = logits(folder, partition, dtype, quantization, fused=False)
        for got, expected in zip(fused, layered, strict=True):
            assert torch.equal(got, expected)
            assert torch.isfinite(got).all()


def test_a_greedy_decode_batch_finishes_in_one_call_with_the_same_tokens(
    tiny_dirs: dict[str, Path], grid_dir: Path, stage_kind: tuple[list[int], str, str]
) -> None:
    partition, dtype, quantization = stage_kind
    prompts = [seq[:n] for seq, n in zip(SEQS, PROMPT_LENS, strict=True)]
    calls: list[tuple[str, int]] = []  # (finish, rows) of each one-call finish

    def counting(name: str) -> Callable[..., torch.Tensor]:
        original = getattr(fused_layer.GreedyHead, name)

        def counted(head: fused_layer.GreedyHead, h: torch.Tensor, *rest: torch.Tensor) -> Any:
            calls.append((name, h.shape[0]))
            return original(head, h, *rest)

        return counted

    def counting_at(
        name: str,
    ) -> Callable[..., Any]:  # (stages/backend/cpu/kept_decode.py's decode steps)
        original = getattr(fused_layer.GreedyHead, f"{name}_at")

        def counted(head: fused_layer.GreedyHead, h_at: int, res_at: int, rows: int) -> Any:
            calls.append((name, rows))
            return original(head, h_at, res_at, rows)

        return counted

    # with two stages, the lm_head split too: the last stage's share, joined on the first
    for split in (False, True) if len(partition) > 1 else (False,):
        finishes = ["share", "join"] if split else ["tokens"]
        for folder in (tiny_dirs["gqa"], grid_dir):
            outputs = []
            for one_call in (True, False):
                chain = Chain(
                    folder, partition, dtype=dtype, quantization=quantization, split_lm_head=split
                )
                heads = [stage.model for stage in chain.stages if stage.model.head_rows]
                assert len(heads) == len(finishes)
                for model in heads:
                    assert isinstance(model.greedy_head, fused_layer.GreedyHead)
                    if not one_call:
                        model.greedy_head = None  # the norm, lm_head and argmax one at a time
                calls.clear()
                with pytest.MonkeyPatch.context() as patch:
                    for name in ("tokens", "share", "join"):
                        patch.setattr(fused_layer.GreedyHead, name, counting(name))
                    for name in ("tokens", "share"):
                        patch.setattr(fused_layer.GreedyHead, f"{name}_at", counting_at(name))
                    outputs.append(greedy_generate(chain, prompts, max_new_tokens=9))
                # every decode step, not the prefill (3 sampled rows of 33), whose greedy share
                # the first stage still joins in one call
                expected = [(name, 3) for _ in range(8) for name in finishes]
                expected = [("join", 3), *expected] if split else expected
                assert calls == (expected if one_call else [])
            assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    ("dtype", "activations", "kind"),
    [("float32", None, GridLinear), ("bfloat16", None, GridA8Linear),
     ("bfloat16", "bf16", GridBf16Linear)],
)  # fmt: skip
def test_the_grid_model_is_held_as_codes(
    grid_dir: Path,
    dtype: str,
    activations: str | None,
    kind: type,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what the test above relies on to cover the grid kernels
    needs_bf16_dot(dtype)
    built = native.kernels()
    if kind is GridA8Linear and not (built and built.a8_dot):
        pytest.skip("no AVX512_VNNI here: bf16 grid codes are decoded to bf16")
    if activations:
        monkeypatch.setenv(linear_module.GRID_ACTIVATIONS_ENV, activations)
    chain = Chain(grid_dir, [4], dtype=dtype)
    layer = chain.stages[0].model.layers[0]
    assert all(
        isinstance(proj, kind)
        for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    )


def test_a_stage_on_torch_ops_or_with_a_dense_matrix_keeps_the_layer_calls(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    chain = Chain(tiny_dirs["gqa"], [4], quantization="int8")
    model = chain.stages[0].model
    assert model.fused is not None and isinstance(model.layers[0].qkv_proj, Int8Linear)
    built = native.kernels()
    assert built is not None
    # a matrix the kernels do not hold (F.linear): no struct can describe it
    layers = list(model.layers)
    monkeypatch.setattr(layers[2], "o_proj", torch.nn.Linear(64, 64, bias=False))
    assert fused_layer.FusedLayers.build(layers, built, torch.float32) is None
    assert fused_layer.FusedLayers.build(layers[:2], None, torch.float32) is None


def test_the_matmuls_alone_compute_the_layers_matmuls_and_a_wrong_dtype_is_refused(
    tiny_dirs: dict[str, Path],
) -> None:
    # bench step times a stage's matmuls through FusedLayers.matmuls
    model = Chain(tiny_dirs["gqa"], [4]).stages[0].model
    fused = model.fused
    assert fused is not None
    rows = 3
    run = fused.matmuls(rows)
    x_act, y = run.x_act, run.y  # buffers its kernels read and write
    run()
    # Each matmul writes y as [rows, N] from its start, the last layer's down_proj last: what
    # the layer's own down_proj call computes from the same rows, bit for bit, and (other
    # sums, fp32) what the checkpoint's matrix gives.
    got = y.view(-1)[: rows * fused.hidden].view(rows, fused.hidden)
    assert torch.equal(got, model.layers[-1].down_proj(x_act))
    weight = load_file(tiny_dirs["gqa"] / "model.safetensors")
    expected = x_act @ weight[f"model.layers.{len(model.layers) - 1}.mlp.down_proj.weight"].T
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    fused.dtype = torch.bfloat16  # fp32 panels called with bf16 rows: the C dispatch refuses
    with pytest.raises(RuntimeError, match="fused decoder layer failed"):
        fused.matmuls(3)()
