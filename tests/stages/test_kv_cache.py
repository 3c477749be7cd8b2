from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.batch import BLOCK_SIZE, SeqChunk
from stages.config import ModelConfig
from stages.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget
from stages.runner import StageRunner
from tests.stages.conftest import KV_BUDGET, Chain, drive_teacher_forced
from tests.stages.test_parity import random_seqs


def test_block_count_scales_with_one_over_local_layers(tiny_dirs: dict[str, Path]) -> None:
    config = ModelConfig.from_folder(tiny_dirs["gqa"])
    budget = 1 << 24
    counts = {n: num_blocks_for_budget(config, n, budget, "float32") for n in (1, 2, 4)}
    # 16 tokens * layers * 2 (K, V) * 2 kv heads * 16 dims * 4 bytes
    assert bytes_per_block(config, 1, "float32") == 16 * 2 * 2 * 16 * 4
    assert counts == {1: 4096, 2: 2048, 4: 1024}
    assert num_blocks_for_budget(config, 4, budget, "bfloat16") == 2048


def test_stage_sizes_its_pool_from_its_own_layers(tiny_dirs: dict[str, Path]) -> None:
    whole = StageRunner(tiny_dirs["gqa"], 0, 4, kv_budget_bytes=KV_BUDGET)
    half = StageRunner(tiny_dirs["gqa"], 2, 4, kv_budget_bytes=KV_BUDGET)
    quarter = StageRunner(tiny_dirs["gqa"], 1, 2, kv_budget_bytes=KV_BUDGET)
    assert half.num_kv_blocks == 2 * whole.num_kv_blocks
    assert quarter.num_kv_blocks == 4 * whole.num_kv_blocks


def test_allocate_agreed_smaller_count(tiny_dirs: dict[str, Path]) -> None:
    stage = StageRunner(tiny_dirs["gqa"], 2, 4, kv_budget_bytes=KV_BUDGET)
    stage.allocate_kv(stage.num_kv_blocks // 2)
    assert stage.kv is not None and stage.kv.num_blocks == stage.num_kv_blocks // 2
    assert stage.kv.data.shape == (2, 2, stage.kv.num_blocks * BLOCK_SIZE, 2, 16)
    with pytest.raises(ValueError, match="budget holds"):
        stage.allocate_kv(stage.num_kv_blocks + 1)


def test_run_before_allocate_errors(tiny_dirs: dict[str, Path]) -> None:
    stage = StageRunner(tiny_dirs["gqa"], 0, 4, kv_budget_bytes=KV_BUDGET)
    with pytest.raises(RuntimeError, match="allocate_kv"):
        stage.run([SeqChunk([5], 0, [0], True)])


def test_write_lands_at_slot_mapping() -> None:
    cache = KVCache(num_layers=2, num_blocks=4, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    slots = torch.tensor([17, 3, 40])
    k = torch.arange(18, dtype=torch.float32).view(3, 2, 3)
    cache.write(1, slots, k, -k)
    assert torch.equal(cache.keys(1)[slots], k)
    assert torch.equal(cache.values(1)[slots], -k)
    assert cache.keys(0).abs().sum() == 0  # other layer untouched


def _logits(chain: Chain) -> list[torch.Tensor]:
    prompt_lens = [37, 5, 20]
    seqs = random_seqs([n + 12 for n in prompt_lens], seed=7)
    return drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=9, stagger=1)


def test_scattered_blocks_give_the_same_logits_as_contiguous(tiny_dirs: dict[str, Path]) -> None:
    contiguous = Chain(tiny_dirs["gqa"], [2, 2], scattered=False)
    scattered = Chain(tiny_dirs["gqa"], [2, 2], scattered=True)
    got, expected = _logits(scattered), _logits(contiguous)
    used = sorted(scattered.blocks.used)
    assert used != list(range(len(used)))  # really non-contiguous
    for a, b in zip(got, expected):
        assert (a - b).abs().max().item() < 1e-5


def test_attention_reads_only_named_blocks(tiny_dirs: dict[str, Path]) -> None:
    # Every slot starts as NaN: reading any slot that no sequence wrote would poison the logits.
    clean = _logits(Chain(tiny_dirs["gqa"], [1, 3]))
    poisoned_chain = Chain(tiny_dirs["gqa"], [1, 3], poison=True)
    poisoned = _logits(poisoned_chain)
    for a, b in zip(poisoned, clean):
        assert torch.isfinite(a).all()
        assert (a - b).abs().max().item() < 1e-5
    # And the blocks nobody was given are still NaN: nothing wrote outside the tables either.
    kv = poisoned_chain.stages[0].kv
    assert kv is not None
    unused = sorted(set(range(kv.num_blocks)) - poisoned_chain.blocks.used)
    per_block = kv.data.view(kv.num_layers, 2, kv.num_blocks, BLOCK_SIZE, -1)
    assert torch.isnan(per_block[:, :, unused]).all()
