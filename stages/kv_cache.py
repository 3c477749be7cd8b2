"""Paged KV storage for this stage's layers only.

One tensor holds K and V of every local layer: [num_local_layers, 2, num_blocks * BLOCK_SIZE,
h_kv, d_head]. A token's KV lives at one slot, `block_id * BLOCK_SIZE + pos % BLOCK_SIZE`, in
every layer. Which request holds which block is bookkeeping in `ring/`; this module only stores.
An 8-bit cache (--kv-cache-dtype int8) holds each layer as one byte buffer instead, its codes
then its scales (stages/kv_quant.py); its layer is still the codes [2, slots, h_kv, d].
"""

from __future__ import annotations

import torch

from stages import kv_quant
from stages.batch import BLOCK_SIZE
from stages.config import KV_CACHE_DTYPES, ModelConfig
from stages.errors import ConfigError


def resolve_kv_cache_dtype(
    requested: str, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> str:
    """What a stage computing in `dtype` on `device` stores for `--kv-cache-dtype requested`:
    "auto" (K and V in the stage dtype) or "int8" (stages/kv_quant.py); one sentence for a
    choice it cannot store."""
    if requested not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"--kv-cache-dtype {requested} is not one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if requested == "auto":
        return "auto"
    if requested == "bf16":
        if dtype != torch.bfloat16:
            raise ConfigError(
                f"--kv-cache-dtype bf16 needs a bf16 stage (this one computes in "
                f"{str(dtype).removeprefix('torch.')}); use --dtype bfloat16, or auto or int8"
            )
        return "auto"
    if requested.startswith("fp8"):
        raise ConfigError(
            f"--kv-cache-dtype {requested} is not built yet; int8 is the 8-bit cache this "
            "build stores (on the default model fp8 e4m3 adds about 28x int8's KL divergence: "
            "python -m bench.kv_study)"
        )
    if torch.device(device).type != "cpu":
        raise ConfigError(
            "--kv-cache-dtype int8 runs on CPU stages only for now: the GPU's Triton decode "
            "kernel and graphs do not read an 8-bit cache yet"
        )
    return "int8"


def bytes_per_block(
    config: ModelConfig,
    num_local_layers: int,
    dtype: str | torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    """KV bytes one block costs on a stage holding `num_local_layers` layers (kv_cache_dtype
    as resolve_kv_cache_dtype returns it)."""
    if kv_cache_dtype == "int8":
        return num_local_layers * kv_quant.block_bytes(config.num_kv_heads, config.head_dim)
    return BLOCK_SIZE * num_local_layers * config.kv_bytes_per_token_per_layer(dtype)


def kv_bytes_per_token(
    config: ModelConfig, num_layers: int, dtype: str | torch.dtype, kv_cache_dtype: str = "auto"
) -> float:
    """KV bytes a token costs over `num_layers` layers (what a decode step reads per token of
    context): a block's bytes over its slots."""
    return bytes_per_block(config, num_layers, dtype, kv_cache_dtype) / BLOCK_SIZE


def num_blocks_for_budget(
    config: ModelConfig,
    num_local_layers: int,
    budget_bytes: int,
    dtype: str | torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    """Blocks that fit in `budget_bytes`. Sized from this stage's layers only
    (num_effective_layers = end - start), so at a fixed budget it scales with 1/layers."""
    return budget_bytes // bytes_per_block(config, num_local_layers, dtype, kv_cache_dtype)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.kv_cache_dtype = kv_cache_dtype
        self._shape = (2, num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
        if kv_cache_dtype == "int8":
            # [layers, bytes of a layer]: codes, then K's and V's scales (kv_quant.py); zeroed,
            # so a slot never written holds code 0 at scale 2^-16
            per_layer = kv_quant.layer_bytes(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
            self.data = torch.zeros(num_layers, per_layer, dtype=torch.uint8, device=device)
            self.kv_bytes = 1  # the kernels' name for it (csrc/ppring.h kv_kind_ok)
            return
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
        self.kv_bytes = self.data.element_size()

    @property
    def num_slots(self) -> int:
        return self.num_blocks * BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, layer: int) -> torch.Tensor:
        """[2, slots, h_kv, d]: K then V (an 8-bit cache: the codes, its scales after them)."""
        if self.kv_cache_dtype == "int8":
            codes = self.data[layer, : 2 * self._shape[1] * self._shape[2] * self._shape[3]]
            return codes.view(torch.int8).view(self._shape)
        return self.data[layer]

    def keys(self, layer: int) -> torch.Tensor:
        return self.layer(layer)[0]  # [slots, h_kv, d]

    def values(self, layer: int) -> torch.Tensor:
        return self.layer(layer)[1]  # [slots, h_kv, d]

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store this forward's K and V ([T, h_kv, d]) of local `layer` at `slot_mapping` [T]."""
        store_kv(self.layer(layer), slot_mapping, k, v)


def store_kv(
    kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k, v [T, h_kv, d] into one layer's cache [2, slots, h_kv, d] at slot_mapping [T]: one copy
    for both (ops, not bytes, are what a small GPU batch pays for); an 8-bit layer quantizes
    them (kv_quant.store)."""
    if kv_layer.dtype is torch.int8:
        kv_quant.store(kv_layer, slot_mapping, k, v)
        return
    kv_layer.index_copy_(1, slot_mapping, torch.stack((k, v)))  # [2, T, h_kv, d]


def gather_kv(kv_layer: torch.Tensor, key_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K and V at key_slots [L]: [2, L, h_kv, d] of `dtype` (an 8-bit layer dequantized)."""
    if kv_layer.dtype is torch.int8:
        return kv_quant.gather(kv_layer, key_slots, dtype)
    return kv_layer.index_select(1, key_slots)
