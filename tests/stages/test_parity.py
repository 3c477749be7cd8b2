"""Chained stages give transformers' logits: prefill, chunked prefill and paged decode, for
S = 1..4 and an override split, in batches that mix requests of different lengths, on both
paths a CPU stage can take (`stage_path`: ppring's CPU kernels, or torch alone)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from stages.partition import partition_from_env
from tests.stages.conftest import Chain, drive_teacher_forced, hf_logits, without_native_kernels

TOLERANCE = 1e-4  # max abs logit difference, fp32

SPLITS = {
    "S1": "4",
    "S2": "2,2",
    "S3": "1,2,1",
    "S4": "1,1,1,1",
    "env-3,1": "3,1",  # through PPRING_LAYER_PARTITION
}
MODELS = ["gqa", "tied", "llama3"]


def make_partition(split: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    text = SPLITS[split]
    pp_size = text.count(",") + 1
    if split.startswith("env"):
        monkeypatch.setenv("PPRING_LAYER_PARTITION", text)
        partition = partition_from_env(4, pp_size)
        monkeypatch.delenv("PPRING_LAYER_PARTITION")
        assert partition == [3, 1]
        return partition
    return partition_from_env(4, pp_size)


def random_seqs(lengths: list[int], vocab: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_matches_hf(folder: Path, seqs: list[list[int]], logits: list[torch.Tensor]) -> None:
    for seq, got in zip(seqs, logits):
        expected = hf_logits(folder, seq)
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff < TOLERANCE, f"sequence of {len(seq)} tokens: max abs diff {diff:.2e}"


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", MODELS)
def test_prefill_batch_matches_transformers(
    tiny_dirs: dict[str, Path],
    model: str,
    split: str,
    stage_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = tiny_dirs[model]
    chain = Chain(folder, make_partition(split, monkeypatch))
    seqs = random_seqs([1, 7, 19, 40])
    logits = drive_teacher_forced(chain, seqs, prompt_lens=[len(s) for s in seqs])
    assert_matches_hf(folder, seqs, logits)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", MODELS)
def test_chunked_prefill_mixed_with_decodes_matches_transformers(
    tiny_dirs: dict[str, Path],
    model: str,
    split: str,
    stage_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prompts arrive one step apart and are fed 8 tokens at a time, so most steps mix prefill
    # chunks that have earlier context with other requests' single-token decodes.
    folder = tiny_dirs[model]
    chain = Chain(folder, make_partition(split, monkeypatch))
    prompt_lens = [23, 40, 9, 16]
    seqs = random_seqs([n + 6 for n in prompt_lens], seed=1)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=8, stagger=1)
    assert_matches_hf(folder, seqs, logits)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", MODELS)
def test_32_paged_decode_steps_match_transformers(
    tiny_dirs: dict[str, Path],
    model: str,
    split: str,
    stage_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = tiny_dirs[model]
    chain = Chain(folder, make_partition(split, monkeypatch))
    # Contexts from 1 to 130 tokens: several decode groups in one forward.
    prompt_lens = [1, 5, 17, 40, 98]
    seqs = random_seqs([n + 32 for n in prompt_lens], seed=2)
    logits = drive_teacher_forced(chain, seqs, prompt_lens)
    assert_matches_hf(folder, seqs, logits)


@pytest.mark.parametrize("model", ["linear", "mqa"])
def test_other_variants_match_transformers(
    tiny_dirs: dict[str, Path], model: str, stage_path: str
) -> None:
    folder = tiny_dirs[model]
    chain = Chain(folder, [2, 2])
    prompt_lens = [30, 12, 3]
    seqs = random_seqs([n + 10 for n in prompt_lens], seed=3)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=7, stagger=2)
    assert_matches_hf(folder, seqs, logits)


def test_bfloat16_stays_close_to_transformers(tiny_dirs: dict[str, Path]) -> None:
    folder = tiny_dirs["gqa"]
    chain = Chain(folder, [2, 2], dtype="bfloat16")
    prompt_lens = [20, 9]
    seqs = random_seqs([n + 4 for n in prompt_lens], seed=4)
    logits = drive_teacher_forced(chain, seqs, prompt_lens)
    for seq, got in zip(seqs, logits):
        # bf16 has ~3 significant digits; the tiny model's logits are O(0.1).
        assert (got - hf_logits(folder, seq)).abs().max().item() < 0.02


@pytest.mark.parametrize("model", ["gqa", "tied", "mqa"])
def test_the_gpu_layout_matches_transformers_on_the_cpu(
    tiny_dirs: dict[str, Path], model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a GPU stage runs (torch ops, K/V gathered for SDPA, every decode in one padded
    group), forced on the CPU so CI checks it too."""
    import stages.inputs

    without_native_kernels(monkeypatch)
    monkeypatch.setattr(stages.inputs, "group_decodes_by_length", lambda device: False)
    folder = tiny_dirs[model]
    chain = Chain(folder, [2, 2])
    assert all(stage.attention == "gather" for stage in chain.stages)
    prompt_lens = [60, 5, 31, 12]  # decodes of very different lengths share steps
    seqs = random_seqs([n + 10 for n in prompt_lens], seed=9)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=8, stagger=1)
    assert_matches_hf(folder, seqs, logits)
