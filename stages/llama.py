"""A Llama pipeline stage in plain torch: embedding (first stage), layers [start, end), final
norm + lm_head (last stage).

The residual add is fused into the next RMSNorm, as in vLLM and SGLang: a layer takes (h, r),
computes r' = h + r and x = rmsnorm(r'), and returns its output with r'. That is why a non-last
stage hands on two [T, d] tensors (DESIGN.md §3). The math follows transformers' Llama exactly
(fp32 norm statistics, rotate-half RoPE), so fp32 results match it to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stages.attention import paged_attention
from stages.config import ModelConfig, RopeScaling
from stages.inputs import ForwardInputs
from stages.kv_cache import KVCache
from stages.weights import EMBED, FINAL_NORM, LM_HEAD


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, d] -> [T, d]; statistics in fp32 whatever the dtype, as transformers does.

    One fused op, not transformers' eight: a decode step is a few thousand small ops, and on a
    GPU each costs a kernel launch and its Python dispatch, which is what bounds a small batch.
    fp32 results are bit-identical to transformers'; bf16 ones round once instead of twice."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotary inverse frequencies [d/2], fp32, with linear or Llama-3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3: wavelengths longer than original_ctx / low_freq_factor are slowed by `factor`,
    # shorter than original_ctx / high_freq_factor are kept, and the band between is blended.
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    blend = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    scaled = torch.where(
        wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor, blended
    )
    return torch.where(wavelen < original / scaling.high_freq_factor, inv_freq, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, signed sin [T, 1, d] (the 1 broadcasts over heads). The sine's
    first half is negated: see apply_rope."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2], fp32
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d]
    sin = angles.sin()
    sin[..., : freqs.shape[-1]].neg_()
    return angles.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; rotate-half convention (the layout Hugging Face checkpoints use).

    rotate_half(x) = [-x2, x1] is roll(x, d/2) = [x2, x1] with its first half negated, and that
    sign lives in `signed_sin` (computed once per forward): four ops per call instead of seven,
    the same arithmetic exactly (a sign flip rounds nothing)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def fuse_projections(device: torch.device) -> bool:
    """One [q+k+v] and one [gate+up] matmul on a GPU, where they save launches (what bounds a
    small batch there). On the CPUs measured the fused matrices ran slower than the separate
    ones (they fall out of cache), so a CPU stage keeps them apart."""
    return device.type != "cpu"


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()

        def take(name: str) -> nn.Parameter:
            # pop: the stage module becomes the only owner of its weights
            return _param(weights.pop(prefix + name))

        self.eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.input_norm = take("input_layernorm.weight")  # [d]
        q, k, v = (take(f"self_attn.{n}_proj.weight") for n in "qkv")  # [h * d_head, d], ...
        gate, up = take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")  # [I, d] each
        self.o_proj = take("self_attn.o_proj.weight")  # [d, h * d_head]
        self.post_attn_norm = take("post_attention_layernorm.weight")  # [d]
        self.down_proj = take("mlp.down_proj.weight")  # [d, intermediate]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.fused = fuse_projections(q.device)
        if self.fused:
            self.qkv_proj = _param(torch.cat((q, k, v)))  # [(h + 2 h_kv) * d_head, d]
            self.gate_up_proj = _param(torch.cat((gate, up)))  # [2 I, d]
        else:
            self.q_proj, self.k_proj, self.v_proj = q, k, v
            self.gate_proj, self.up_proj = gate, up

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        layer: int,
        inputs: ForwardInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h, residual [T, d] -> (h, residual) [T, d]; `layer` is the local index into `kv`."""
        residual = h if residual is None else h + residual
        x = rms_norm(residual, self.input_norm, self.eps)
        h = self._attention(x, cos, sin, kv, layer, inputs)
        residual = h + residual
        x = rms_norm(residual, self.post_attn_norm, self.eps)
        if self.fused:
            gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)  # [T, I] each
        else:
            gate, up = F.linear(x, self.gate_proj), F.linear(x, self.up_proj)
        return F.linear(F.silu(gate) * up, self.down_proj), residual

    def _attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        layer: int,
        inputs: ForwardInputs,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.fused:
            q, k, v = F.linear(x, self.qkv_proj).split(
                (self.q_size, self.kv_size, self.kv_size), dim=-1
            )
        else:
            q, k, v = F.linear(x, self.q_proj), F.linear(x, self.k_proj), F.linear(x, self.v_proj)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)  # [T, h, d]
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, h_kv, d]
        kv.write(layer, inputs.slot_mapping, k, v)
        o = paged_attention(q, kv.layer(layer), inputs)  # [T, h, d]
        return F.linear(o.reshape(num_tokens, -1), self.o_proj)  # [T, d]


class LlamaStage(nn.Module):
    """Layers [start, end) of a Llama model, plus the embedding on the first stage and the final
    norm and lm_head on the last. `weights` is consumed (its tensors move into the module)."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], start: int, end: int
    ) -> None:
        super().__init__()
        self.config = config
        self.start_layer, self.end_layer = start, end
        self.is_first_stage = start == 0
        self.is_last_stage = end == config.num_layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{i}.") for i in range(start, end)
        )
        self.dtype = self.layers[0].o_proj.dtype
        self.device = self.layers[0].o_proj.device
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(self.device), persistent=False)  # [d/2]
        # First stage embeds the token ids; later stages start from what the previous sent.
        self._begin: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
        if self.is_first_stage:
            self.embed_tokens = _param(weights.pop(EMBED))  # [V, d]
            self._begin = self._embed
        else:
            self._begin = self._receive
        if self.is_last_stage:
            self.final_norm = _param(weights.pop(FINAL_NORM))  # [d]
            head = weights.pop(LM_HEAD)
            # Tied on one stage: reuse the embedding Parameter so the bytes are held once.
            tied = self.is_first_stage and head.data_ptr() == self.embed_tokens.data_ptr()
            self.lm_head = self.embed_tokens if tied else _param(head)  # [V, d]

    def forward(
        self,
        inputs: ForwardInputs,
        kv: KVCache,
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this stage's layers; returns (hidden_states, residual), both [T, d]."""
        h, residual = self._begin(inputs, hidden_states, residual)
        cos, sin = rope_cos_sin(inputs.positions, self.inv_freq, self.dtype)  # shared by layers
        for layer_index, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, kv, layer_index, inputs)
        assert residual is not None  # every stage has at least one layer
        return h, residual

    def compute_logits(
        self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Last stage: final norm of h + r, then lm_head, only for `rows` ([N] long) or for all
        T rows when None. Returns [N, V] in the stage dtype."""
        x = h + residual  # [T, d]
        if rows is not None:
            x = x.index_select(0, rows)  # [N, d]; the norm is per row, so select first
        return F.linear(rms_norm(x, self.final_norm, self.config.rms_norm_eps), self.lm_head)

    def _embed(
        self,
        inputs: ForwardInputs,
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        if hidden_states is not None or residual is not None:
            raise ValueError("the first stage embeds token ids; it takes no hidden_states")
        return F.embedding(inputs.input_ids, self.embed_tokens), None  # [T, d]

    def _receive(
        self,
        inputs: ForwardInputs,
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        expected = (inputs.num_tokens, self.config.hidden_size)
        for name, tensor in (("hidden_states", hidden_states), ("residual", residual)):
            if tensor is None or tuple(tensor.shape) != expected:
                got = None if tensor is None else tuple(tensor.shape)
                raise ValueError(
                    f"the stage of layers [{self.start_layer}, {self.end_layer}) needs {name} "
                    f"of shape {expected}, got {got}"
                )
        assert hidden_states is not None and residual is not None
        # The wire delivers CPU tensors; a CUDA stage moves them over here.
        return (
            hidden_states.to(self.device, self.dtype),
            residual.to(self.device, self.dtype),
        )
