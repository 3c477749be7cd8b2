"""Tiny random Llama folders for tests: transformers builds and saves them, so parity tests
compare ppring against the reference implementation on exactly the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from bench.random_model import Shape, llama_config


def make_tiny_llama(
    path: str | Path,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    tied: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_positions: int = 512,
    seed: int = 0,
    shards: int = 1,
    keep_index: bool = True,
    eos_token_id: int | list[int] = 2,
    architecture: str = "LlamaForCausalLM",
) -> Path:
    """Save a random-init fp32 Llama to `path` (safetensors) and return the folder.

    `shards > 1` splits the weights over about that many files; `keep_index=False` then deletes
    `model.safetensors.index.json` to exercise the index-less loader path.
    """
    path = Path(path)
    config = llama_config(
        Shape(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            max_positions=max_positions,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            bos_token_id=1,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tied,
        )
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Random init leaves norms at 1.0; perturb them so a missing or misplaced norm shows up.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    max_shard_size: int | str = "10GB"
    if shards > 1:
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        max_shard_size = max(total_bytes // shards, 1)
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    if shards > 1 and not keep_index:
        (path / "model.safetensors.index.json").unlink()
    if architecture != "LlamaForCausalLM":
        config_path = path / "config.json"
        data = json.loads(config_path.read_text())
        data["architectures"] = [architecture]
        config_path.write_text(json.dumps(data, indent=2))
    return path
