"""Greedy generation through chained stages equals transformers' `generate`, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.config import ModelConfig
from tests.stages.conftest import Chain, greedy_generate, hf_model
from tests.stages.test_parity import random_seqs

NEW_TOKENS = 24


_GENERATED: dict[tuple[Path, tuple[int, ...]], list[int]] = {}


@torch.inference_mode()
def hf_generate(folder: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, computed once per (model, prompt)."""
    key = (folder, tuple(prompt))
    if key not in _GENERATED:
        _GENERATED[key] = _hf_generate(folder, prompt, max_new_tokens)
    return _GENERATED[key]


def _hf_generate(folder: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model(folder).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        top_p=None,
        top_k=None,
        temperature=None,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("partition", [[4], [2, 2], [1, 2, 1], [1, 1, 1, 1], [3, 1]])
@pytest.mark.parametrize("model", ["gqa", "tied", "llama3"])
def test_greedy_equals_transformers_generate(
    tiny_dirs: dict[str, Path], model: str, partition: list[int]
) -> None:
    folder = tiny_dirs[model]
    eos = ModelConfig.from_folder(folder).eos_token_ids
    prompts = random_seqs([6, 1, 23, 50], seed=11)
    got = greedy_generate(Chain(folder, partition), prompts, NEW_TOKENS, eos)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_generate(folder, prompt, NEW_TOKENS)
