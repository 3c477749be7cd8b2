"""The blocks every family is built from (DESIGN.md §13): a pipeline stage holds the embedding
(first stage), decoder layers [start, end), the final norm and lm_head (last stage). What a
family's layers add to Llama's comes from its `LayerSpec` (stages/layer_spec.py, read by its
file in stages/models/); what computes each piece is the stage's backend (stages/interface.py
LayerBackend), chosen once when the stage starts: the block code is the same for all of them
and imports none.

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

from stages.config import ModelConfig, RopeScaling
from stages.inputs import ForwardInputs, on_device
from stages.interface import CompiledLayers, GreedyFinish, LayerBackend
from stages.kv_cache import KVCache
from stages.weights import EMBED, FINAL_NORM, LM_HEAD


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


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


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        prefix: str,
        backend: LayerBackend,
    ) -> None:
        super().__init__()

        def take(name: str) -> torch.Tensor:
            # pop: the stage module becomes the only owner of its weights
            return weights.pop(prefix + name)

        self.ops = backend.ops
        self.spec = spec = config.layer_spec
        self.eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.input_norm = _param(take("input_layernorm.weight"))  # [d]
        self.post_attn_norm = _param(take("post_attention_layernorm.weight"))  # [d]
        # What the family adds to Llama's layer (stages/layer_spec.py); None where it does not.
        self.qkv_bias: nn.Parameter | None = None  # [(h + 2 h_kv) d_head]
        self.o_bias: nn.Parameter | None = None  # [d]
        self.q_norm: nn.Parameter | None = None  # [d_head]
        self.k_norm: nn.Parameter | None = None  # [d_head]
        if spec.qkv_bias:
            self.qkv_bias = _param(torch.cat([take(f"self_attn.{n}_proj.bias") for n in "qkv"]))
        if spec.o_bias:
            self.o_bias = _param(take("self_attn.o_proj.bias"))
        if spec.qk_norm:
            self.q_norm = _param(take("self_attn.q_norm.weight"))
            self.k_norm = _param(take("self_attn.k_norm.weight"))
        # One [q+k+v] and one [gate+up] matmul: fewer calls (a GPU launch, or a kernel call on a
        # CPU), and the kernels read q, k, v and gate, up straight out of their outputs.
        qkv = torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"])  # [(h+2h_kv)d, d]
        gate_up = torch.cat((take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")))  # [2I, d]
        self.qkv_proj = backend.linear(qkv)
        self.o_proj = backend.linear(take("self_attn.o_proj.weight"))  # [d, h * d_head]
        self.gate_up_proj = backend.linear(gate_up)
        self.down_proj = backend.linear(take("mlp.down_proj.weight"))  # [d, I]

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
        num_tokens = h.shape[0]
        # A stage's first layer may read hidden_states straight out of a received frame
        # (read-only); every later h is the previous layer's own output, free to overwrite.
        x, residual = self.ops.add_rms_norm(h, residual, self.input_norm, self.eps, layer > 0)
        kv_layer = kv.layer(layer)  # [2, slots, h_kv, d]
        qkv = self.qkv_proj(x)  # [T, (h + 2 h_kv) d]
        if self.qkv_bias is not None:
            qkv = self.ops.add_bias(qkv, self.qkv_bias)
        if self.q_norm is not None and self.k_norm is not None:
            heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
            qkv = self.ops.rms_norm_heads(qkv, 0, heads, head_dim, self.q_norm, self.eps)
            qkv = self.ops.rms_norm_heads(qkv, heads, kv_heads, head_dim, self.k_norm, self.eps)
        q = self.ops.rope_store(
            qkv, cos, sin, inputs.slot_mapping, kv_layer, self.num_heads
        )  # [T, h, d]; this step's K and V are now in the cache
        o = self.ops.attention(q, kv_layer, inputs)  # [T, h, d]
        h = self.o_proj(o.view(num_tokens, -1))  # [T, d]
        if self.o_bias is not None:
            h = self.ops.add_bias(h, self.o_bias)
        x, residual = self.ops.add_rms_norm(h, residual, self.post_attn_norm, self.eps, True)
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x))), residual


class CausalLMStage(nn.Module):
    """Layers [start, end) of a decoder-only model, plus the embedding on the first stage and the
    final norm and lm_head on the last. `weights` is consumed (its tensors move into the module).

    `head_rows` ([lo, hi) of the vocabulary): the lm_head rows this stage multiplies by; None
    means all of them on the last stage and none elsewhere. With the lm_head split the first
    stage holds [0, cut) and the last [cut, V) (stages/partition.py `lm_head_rows`)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        start: int,
        end: int,
        backend: LayerBackend,
        head_rows: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.start_layer, self.end_layer = start, end
        self.is_first_stage = start == 0
        self.is_last_stage = end == config.num_layers
        norm = weights[f"model.layers.{start}.input_layernorm.weight"]
        self.dtype, self.device = norm.dtype, norm.device
        self.ops = backend.ops
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{i}.", backend) for i in range(start, end)
        )
        # On the CPU kernels, every layer in one C call (stages/backend/cpu/fused_layer.py);
        # None: one Python call per op, as DecoderLayer.forward.
        self.fused: CompiledLayers | None = backend.compile_layers(list(self.layers), self.dtype)
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(self.device), persistent=False)  # [d/2]
        # First stage embeds the token ids; later stages start from what the previous sent.
        self._begin: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
        embed = weights.pop(EMBED) if self.is_first_stage else None  # [V, d]
        self._begin = self._embed if self.is_first_stage else self._receive
        if head_rows is None and self.is_last_stage:
            head_rows = (0, config.vocab_size)
        self.head_rows = head_rows
        if self.is_last_stage:
            self.final_norm = _param(weights.pop(FINAL_NORM))  # [d]
        head_serves_lookup = False
        if head_rows is not None:
            head = weights.pop(LM_HEAD)  # [V, d]
            whole = head_rows == (0, head.shape[0])
            tied = embed is not None and head.data_ptr() == embed.data_ptr()
            # Part of the matrix: a copy of its rows, so the whole one can be freed.
            rows = head if whole else head[head_rows[0] : head_rows[1]].clone()
            self.lm_head = backend.linear(rows)  # [hi - lo, d]
            # Tied on one stage: the lm_head (in whatever layout it keeps the matrix) also
            # serves the lookup, so the vocabulary matrix is held once. An int8 lm_head
            # cannot: the embedding stays exact in its own copy.
            head_serves_lookup = tied and whole and hasattr(self.lm_head, "rows")
        # A stage with lm_head rows on the CPU kernels: a greedy decode batch's finish (final
        # norm on the last stage, lm_head, argmax, a split's two maxima) in one call
        # (stages/backend/cpu/fused_layer.py); None: one at a time.
        self.greedy_head: GreedyFinish | None = None
        if head_rows is not None:
            self.greedy_head = backend.greedy_finish(
                self.lm_head,
                self.final_norm if self.is_last_stage else None,
                config.rms_norm_eps,
                self.dtype,
                head_rows[0],
            )
        # The first stage's lookup table, in the stage dtype (the matrices may come in fp32 for
        # a bf16 stage: backend/cpu/linear.py source_dtype); None where the lm_head serves it.
        self.embed_tokens: nn.Parameter | None = (
            None if embed is None or head_serves_lookup else _param(embed.to(self.dtype))
        )

    def forward(
        self,
        inputs: ForwardInputs,
        kv: KVCache,
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this stage's layers; returns (hidden_states, residual), both [T, d]."""
        h, residual = self._begin(inputs, hidden_states, residual)
        cos, sin = self.ops.rope_tables(  # all layers
            inputs.positions, self.inv_freq, self.dtype, inputs.max_position
        )
        # (a stage on the CPU kernels always reads the cache paged; a batch with a long
        # prefill chunk, whose attention is not the paged kernel's, takes the layers' calls)
        if self.fused is not None and not self.ops.long_chunks(inputs):
            return self.fused.forward(h, residual, cos, sin, kv, inputs)
        for layer_index, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, kv, layer_index, inputs)
        assert residual is not None  # every stage has at least one layer
        return h, residual

    def final_hidden(
        self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Last stage: the final norm of h + r, only for `rows` ([N] long, increasing: the
        sampled rows) or for all T rows when None. Returns [N, d] in the stage dtype: what the
        lm_head multiplies."""
        # The norm is per row, so select first: [N, d]. N increasing rows of T = N are every
        # row in order (a decode batch where each samples): nothing to select.
        if rows is not None and rows.shape[0] != h.shape[0]:
            h, residual = h.index_select(0, rows), residual.index_select(0, rows)
        x, _ = self.ops.add_rms_norm(h, residual, self.final_norm, self.config.rms_norm_eps)
        return x

    def compute_logits(
        self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Last stage: final norm, then this stage's lm_head rows. Returns [N, hi - lo]."""
        return self.lm_head(self.final_hidden(h, residual, rows))

    def _embed(
        self,
        inputs: ForwardInputs,
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        if hidden_states is not None or residual is not None:
            raise ValueError("the first stage embeds token ids; it takes no hidden_states")
        return self.embed(inputs.input_ids), None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """First stage: token ids [T] long -> their rows [T, d] in the stage dtype."""
        if self.embed_tokens is None:  # tied: the lm_head holds the matrix
            return self.lm_head.rows(ids)
        return F.embedding(ids, self.embed_tokens)

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
        # The wire delivers CPU tensors; a CUDA stage moves them over here (asynchronously).
        return (
            on_device(hidden_states, self.device).to(self.device, self.dtype),
            on_device(residual, self.device).to(self.device, self.dtype),
        )
