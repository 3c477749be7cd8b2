"""--dtype auto and --quantization int8: what each picks, how close it stays to transformers, and
one clear sentence for a choice the device cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from stages import dtype as dtypes
from stages.backend.cpu import native
from stages.backend.cpu.linear import check_quantization
from stages.errors import ConfigError
from tests.stages.conftest import Chain, drive_teacher_forced, hf_logits
from tests.stages.test_parity import random_seqs


def test_auto_is_bf16_only_on_a_cpu_that_multiplies_it_natively(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dtypes, "cpu_native_bf16", lambda: "AMX")
    choice = dtypes.resolve_dtype("auto", "cpu")
    assert choice.dtype == torch.bfloat16 and "AMX" in choice.reason
    monkeypatch.setattr(dtypes, "cpu_native_bf16", lambda: None)
    choice = dtypes.resolve_dtype("auto", "cpu")
    assert choice.dtype == torch.float32 and "no native bf16" in choice.reason
    # Asked for anyway, bf16 runs, with a warning for the summary.
    choice = dtypes.resolve_dtype("bfloat16", "cpu")
    assert choice.dtype == torch.bfloat16 and "emulated" in (choice.warning or "")
    assert dtypes.resolve_dtype("float32", "cpu").warning is None


def test_this_cpu_is_read_from_its_flags() -> None:
    flags = open("/proc/cpuinfo").read()
    expected = "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else None
    assert dtypes.cpu_native_bf16() == expected


def test_auto_on_a_gpu_is_the_checkpoints_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert dtypes.resolve_dtype("auto", "cuda", "bfloat16").dtype == torch.bfloat16
    assert dtypes.resolve_dtype("auto", "cuda", "float16").dtype == torch.float16
    assert dtypes.resolve_dtype("auto", "cuda", "float32").dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("requested", "device", "needle"),
    [
        ("float16", "cpu", "--dtype float16 is not supported on the CPU; use --dtype bfloat16"),
        ("bfloat16", "cuda", "--dtype bfloat16 cannot run on cuda: it has no bf16 support"),
        ("float64", "cpu", "--dtype float64 is not supported"),
    ],
)
def test_a_dtype_the_device_cannot_run_is_one_sentence(
    requested: str, device: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ConfigError) as error:
        dtypes.resolve_dtype(requested, device)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_int8_off_the_cpu_or_without_kernels_is_one_sentence() -> None:
    kernels = native.kernels()
    check_quantization("int8", torch.device("cpu"), kernels, None)  # fine here
    with pytest.raises(ConfigError, match="--quantization int8 runs on the CPU only"):
        check_quantization("int8", torch.device("cuda"), None, None)
    with pytest.raises(ConfigError, match="needs ppring's CPU kernels, but no C compiler"):
        check_quantization("int8", torch.device("cpu"), None, "no C compiler was found")
    with pytest.raises(ConfigError, match="--quantization int4 is not supported"):
        check_quantization("int4", torch.device("cpu"), kernels, None)


def test_the_launcher_refuses_a_bad_dtype_before_starting_a_stage(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from launch import local

    code = local.main(["--model", str(tiny_dirs["gqa"]), "--dtype", "float16", "--port", "1"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --dtype float16 is not supported on the CPU; use --dtype bfloat16 or float32"
    ]


@pytest.mark.parametrize("model", ["gqa", "mqa"])
def test_bfloat16_stays_close_to_transformers_in_bfloat16(
    tiny_dirs: dict[str, Path], model: str, stage_path: str
) -> None:
    folder = tiny_dirs[model]
    chain = Chain(folder, [2, 2], dtype="bfloat16")
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    prompt_lens = [20, 9, 33]
    seqs = random_seqs([n + 6 for n in prompt_lens], seed=5)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=8, stagger=1)
    with torch.inference_mode():
        for seq, got in zip(seqs, logits):
            expected = hf(torch.tensor([seq])).logits[0].float()
            # bf16 keeps ~3 significant digits and the two round in different places; the
            # tiny models' logits are O(0.1-1).
            assert (got - expected).abs().max().item() < 0.03
            assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.parametrize("model", ["gqa", "tied"])
def test_int8_weights_stay_close_to_transformers(tiny_dirs: dict[str, Path], model: str) -> None:
    folder = tiny_dirs[model]
    int8 = Chain(folder, [3, 1], quantization="int8")
    assert all(
        type(layer.qkv_proj).__name__ == "Int8Linear"
        for s in int8.stages
        for layer in s.model.layers
    )
    prompt_lens = [25, 7]
    seqs = random_seqs([n + 5 for n in prompt_lens], seed=6)
    logits = drive_teacher_forced(int8, seqs, prompt_lens, chunk_size=8)
    for seq, got in zip(seqs, logits):
        expected = hf_logits(folder, seq)
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() < 0.05 * scale
        # Greedy picks the float model's token wherever it is not a near-tie: 28 to 30 of 30
        # positions here (the misses: leads of 0.0002 and 0.0045 over the runner-up, under
        # int8's error of ~0.007 on logits of ~0.6).
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.9
