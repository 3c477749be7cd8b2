"""Paged KV storage for this stage's layers only.

One tensor holds K and V of every local layer: [num_local_layers, 2, num_blocks * BLOCK_SIZE,
h_kv, d_head]. A token's KV lives at one slot, `block_id * BLOCK_SIZE + pos % BLOCK_SIZE`, in
every layer. Which request holds which block is bookkeeping in `ring/`; this module only stores.
"""

from __future__ import annotations

import torch

from stages.batch import BLOCK_SIZE
from stages.config import ModelConfig


def bytes_per_block(config: ModelConfig, num_local_layers: int, dtype: str | torch.dtype) -> int:
    """KV bytes one block costs on a stage holding `num_local_layers` layers."""
    return BLOCK_SIZE * num_local_layers * config.kv_bytes_per_token_per_layer(dtype)


def num_blocks_for_budget(
    config: ModelConfig, num_local_layers: int, budget_bytes: int, dtype: str | torch.dtype
) -> int:
    """Blocks that fit in `budget_bytes`. Sized from this stage's layers only
    (num_effective_layers = end - start), so at a fixed budget it scales with 1/layers."""
    return budget_bytes // bytes_per_block(config, num_local_layers, dtype)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        # Zeroed, not empty: a slot no sequence has written yet must never hold NaN garbage.
        # [layers, 2, slots, h_kv, d]; a bf16 stage on AVX512_BF16 kernels holds each 16-slot
        # page's K and V as pairs inside that shape (native.py kv_as_pairs), and only the
        # kernels read or write it then.
        self.data = torch.zeros(
            num_layers,
            2,
            num_blocks * BLOCK_SIZE,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def num_slots(self) -> int:
        return self.num_blocks * BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, layer: int) -> torch.Tensor:
        return self.data[layer]  # [2, slots, h_kv, d]: K then V

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]  # [slots, h_kv, d]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]  # [slots, h_kv, d]

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store this forward's K and V ([T, h_kv, d]) of local `layer` at `slot_mapping` [T]."""
        store_kv(self.data[layer], slot_mapping, k, v)


def store_kv(
    kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k, v [T, h_kv, d] into one layer's cache [2, slots, h_kv, d] at slot_mapping [T]: one copy
    for both (ops, not bytes, are what a small GPU batch pays for)."""
    kv_layer.index_copy_(1, slot_mapping, torch.stack((k, v)))  # [2, T, h_kv, d]
