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

from stages.config import FREQ_FACTORS, ModelConfig, RopeScaling
from stages.inputs import ForwardInputs, on_device
from stages.interface import CompiledLayers, GreedyFinish, LayerBackend, Ops
from stages.kv_cache import KVCache
from stages.weights import EMBED, FINAL_NORM, LM_HEAD


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    rotary_dim: int | None = None,
    long: bool = False,
) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2], fp32, with linear, Llama-3 or LongRoPE scaling
    applied (LongRoPE's short factors, or its long ones where `long`). A partial rotary turns
    only `rotary_dim` dims: its rotary_dim/2 frequencies come first, then zeros (an angle of
    0: cos 1 and sin 0, the dim passes through: `rotary_order`)."""
    dim = head_dim if rotary_dim is None else rotary_dim
    wavelengths = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim/2]
    inv_freq = 1.0 / wavelengths
    if scaling is not None and scaling.rope_type == "longrope":
        # transformers' order of operations: 1 / (factors * theta ** (2i / dim))
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor)
        inv_freq = 1.0 / (factors * wavelengths)
    elif scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.rope_type == FREQ_FACTORS:  # a GGUF's rope_freqs
        inv_freq = inv_freq / torch.tensor(scaling.factors, dtype=torch.float32)
    elif scaling is not None:
        inv_freq = _llama3(inv_freq, scaling)
    return torch.cat((inv_freq, inv_freq.new_zeros((head_dim - dim) // 2)))


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
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


def norm_weight(weight: torch.Tensor, offset: bool) -> torch.Tensor:
    """An RMSNorm's weight as the kernels multiply by it: Gemma's norms multiply by (1 + w)
    (computed in fp32, as transformers' Gemma RMSNorm does, then in the weight's dtype)."""
    return (weight.float() + 1.0).to(weight.dtype) if offset else weight


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] long: the order a head's dims of q and k are stored in, so that a partial
    rotary is the whole-head one (new dim j holds old dim order[j]).

    transformers turns dims [0, r) as pairs (i, i + r/2) and passes [r, D) through; the kernels
    turn pairs (j, j + D/2) of the whole head. Putting old [0, r/2) at [0, r/2), old [r/2, r)
    at [D/2, D/2 + r/2) and the passed-through dims in the gaps makes every rotary pair a kernel
    pair, and every other pair one whose frequency is 0 (rope_inv_freq), which a rotation
    leaves exactly as it was (x cos 0 + y sin 0 = x). q and k permuted alike keep every score
    q.k; v is not touched, so attention's output is too."""
    half, rotary_half, rest_half = head_dim // 2, rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = [*range(rotary_half), *range(rotary_dim, rotary_dim + rest_half)]
    second = [*range(rotary_half, rotary_dim), *range(rotary_dim + rest_half, head_dim)]
    assert len(first) == len(second) == half
    return torch.tensor(first + second)


class Rotary:
    """A stage's rotary (stages/interface.py RotaryTables): its frequencies, and for LongRoPE
    the long ones, the position a decode turns long from, and cos and sin's factor.

    LongRoPE as transformers runs Phi-3: a sequence longer than original_max_position_embeddings
    is computed at the long factors, all of it (its cache recomputed the first time it gets
    there); a shorter one at the short factors. The scheduler decides which per sequence and
    says so in each chunk (ring/scheduler.py `_rope_long`); a decode-only batch's rows turn long
    exactly from that position on, so its tables need no flags (the kept decode step's and the
    GPU graphs' read by position)."""

    def __init__(self, config: ModelConfig, device: torch.device, sliding: bool = False) -> None:
        """`sliding`: the windowed layers' own rotary (Gemma 3: config.sliding_rope_*)."""
        head_dim, rotary_dim = config.head_dim, config.rotary_dim
        scaling, theta = config.rope_scaling, config.rope_theta
        if sliding:
            assert config.sliding_rope_theta is not None
            scaling, theta = config.sliding_rope_scaling, config.sliding_rope_theta
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling, rotary_dim).to(device)  # [d/2]
        self.scale: torch.Tensor | None = None
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from = 0
        if config.rope_long_from is not None and not sliding:
            assert scaling is not None
            self.long_inv_freq = rope_inv_freq(head_dim, theta, scaling, rotary_dim, long=True).to(
                device
            )
            self.long_from = config.rope_long_from
            if scaling.attention_factor != 1.0:  # the rotary dims only; passed-through ones keep 1
                scale = torch.ones(head_dim // 2)
                scale[: rotary_dim // 2] = scaling.attention_factor
                self.scale = scale.to(device)

    def tables(
        self, ops: Ops, inputs: ForwardInputs, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin of this forward's positions, as `ops.rope_tables` lays them out."""
        positions, max_position = inputs.positions, inputs.max_position
        if self.long_inv_freq is None:
            return ops.rope_tables(positions, self.inv_freq, dtype, max_position, self.scale)
        cos, sin = ops.rope_tables(positions, self.inv_freq, dtype, max_position, self.scale)
        cos_long, sin_long = ops.rope_tables(
            positions, self.long_inv_freq, dtype, max_position, self.scale
        )
        long = inputs.rope_long
        if long is None:
            long = positions >= self.long_from  # [T]
        long = long.view(-1, *([1] * (cos.dim() - 1)))
        return torch.where(long, cos_long, cos), torch.where(long, sin_long, sin)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        layer_index: int,  # in the model
        backend: LayerBackend,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_index}."

        def take(name: str) -> torch.Tensor:
            # pop: the stage module becomes the only owner of its weights
            return weights.pop(prefix + name)

        self.ops = backend.ops
        self.spec = spec = config.layer_spec
        self.eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.attention_scale = config.attention_scale
        self.window = config.window_of(layer_index)  # 0: the layer sees every position
        self.softcap = spec.attn_softcap  # > 0: Gemma 2's attention logit soft-capping
        self.activation = spec.activation
        # the MLP's gate: SwiGLU's silu, or Gemma's GeGLU
        gelu = spec.activation == "gelu_tanh"
        self.act_mul = backend.ops.gelu_tanh_mul if gelu else backend.ops.silu_mul
        # Gemma 3's windowed layers turn at their own rotary (the stage's second tables)
        self.rope_local = bool(self.window) and config.sliding_rope_theta is not None
        # Where the norms sit (stages/layer_spec.py `norms`); None where the layer lacks one.
        self.input_norm: nn.Parameter | None = None  # [d], before attention
        self.post_attn_norm: nn.Parameter | None = None  # [d], before the MLP
        self.attn_out_norm: nn.Parameter | None = None  # [d], on attention's output
        self.mlp_out_norm: nn.Parameter | None = None  # [d], on the MLP's

        def norm(name: str) -> nn.Parameter:
            return _param(norm_weight(take(name), spec.norm_offset))

        if spec.norms == "post":
            self.attn_out_norm = norm("post_attention_layernorm.weight")
            self.mlp_out_norm = norm("post_feedforward_layernorm.weight")
        elif spec.norms == "sandwich":
            self.input_norm = norm("input_layernorm.weight")
            self.attn_out_norm = norm("post_attention_layernorm.weight")
            self.post_attn_norm = norm("pre_feedforward_layernorm.weight")
            self.mlp_out_norm = norm("post_feedforward_layernorm.weight")
        else:
            self.input_norm = norm("input_layernorm.weight")
            self.post_attn_norm = norm("post_attention_layernorm.weight")
        # What the family adds to Llama's layer (stages/layer_spec.py); None where it does not.
        self.qkv_bias: nn.Parameter | None = None  # [(h + 2 h_kv) d_head]
        self.o_bias: nn.Parameter | None = None  # [d]
        self.q_norm: nn.Parameter | None = None  # [d_head], or [h d_head] where whole
        self.k_norm: nn.Parameter | None = None  # [d_head], or [h_kv d_head] where whole
        self.qk_norm_whole = spec.qk_norm_whole
        # One [q+k+v] and one [gate+up] matmul: fewer calls (a GPU launch, or a kernel call on a
        # CPU), and the kernels read q, k, v and gate, up straight out of their outputs.
        if spec.fused_projections:  # the checkpoint's own, in that order
            qkv = take("self_attn.qkv_proj.weight")  # [(h+2h_kv)d, d]
            gate_up = take("mlp.gate_up_proj.weight")  # [2I, d]
        else:
            qkv = torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"])
            gate_up = torch.cat((take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")))
        o = take("self_attn.o_proj.weight")  # [d, h * d_head]
        down = take("mlp.down_proj.weight")  # [d, I]
        qkv_bias = (
            torch.cat([take(f"self_attn.{n}_proj.bias") for n in "qkv"]) if spec.qkv_bias else None
        )
        o_bias = take("self_attn.o_proj.bias") if spec.o_bias else None
        q_norm = k_norm = None
        if spec.qk_norm:
            q_norm = norm_weight(take("self_attn.q_norm.weight"), spec.norm_offset)
            k_norm = norm_weight(take("self_attn.k_norm.weight"), spec.norm_offset)
        if config.rotary_dim != config.head_dim:  # a partial rotary: rotary_order says why
            order = rotary_order(config.head_dim, config.rotary_dim)
            qkv = self._reorder_qk(qkv, order)
            qkv_bias = None if qkv_bias is None else self._reorder_qk(qkv_bias, order)
            if spec.qk_norm:
                assert q_norm is not None and k_norm is not None
                q_norm, k_norm = (
                    w.view(-1, self.head_dim)[:, order].flatten() for w in (q_norm, k_norm)
                )
        if spec.residual_multiplier != 1.0:
            # Granite scales both outputs before the residual add: folded into the matrices
            # that make them (and o's bias), which is the same sum to fp32 rounding.
            m = spec.residual_multiplier
            o, down = o * m, down * m
            o_bias = None if o_bias is None else o_bias * m
        self.qkv_bias = None if qkv_bias is None else _param(qkv_bias)
        self.o_bias = None if o_bias is None else _param(o_bias)
        self.q_norm = None if q_norm is None else _param(q_norm)
        self.k_norm = None if k_norm is None else _param(k_norm)
        self.qkv_proj = backend.linear(qkv)
        self.o_proj = backend.linear(o)
        self.gate_up_proj = backend.linear(gate_up)
        self.down_proj = backend.linear(down)

    def _reorder_qk(self, qkv: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """qkv [(h + 2 h_kv) d_head, ...] with every q and k head's rows in `order` (rows taken
        by index, so a matrix still in its file's blocks stays so)."""
        q_k = (self.num_heads + self.num_kv_heads) * self.head_dim
        heads = torch.arange(q_k).view(-1, self.head_dim)[:, order].flatten()
        return qkv[torch.cat((heads, torch.arange(q_k, qkv.shape[0])))]

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
        ops, eps = self.ops, self.eps
        # A stage's first layer may read hidden_states straight out of a received frame
        # (read-only); every later h is the previous layer's own output, free to overwrite.
        if self.input_norm is not None:
            x, residual = ops.add_rms_norm(h, residual, self.input_norm, eps, layer > 0)
        else:  # attention reads the stream itself
            x = residual = ops.add(h, residual, layer > 0)
        kv_layer = kv.layer(layer)  # [2, slots, h_kv, d]
        qkv = self.qkv_proj(x)  # [T, (h + 2 h_kv) d]
        if self.qkv_bias is not None:
            qkv = ops.add_bias(qkv, self.qkv_bias)
        if self.q_norm is not None and self.k_norm is not None:
            heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
            if self.qk_norm_whole:  # one "head" of h d_head, then one of h_kv d_head
                qkv = ops.rms_norm_heads(qkv, 0, 1, heads * head_dim, self.q_norm, eps)
                qkv = ops.rms_norm_heads(
                    qkv, heads // kv_heads, 1, kv_heads * head_dim, self.k_norm, eps
                )
            else:
                qkv = ops.rms_norm_heads(qkv, 0, heads, head_dim, self.q_norm, eps)
                qkv = ops.rms_norm_heads(qkv, heads, kv_heads, head_dim, self.k_norm, eps)
        q = ops.rope_store(
            qkv, cos, sin, inputs.slot_mapping, kv_layer, self.num_heads
        )  # [T, h, d]; this step's K and V are now in the cache
        o = ops.attention(
            q, kv_layer, inputs, self.attention_scale, self.window, self.softcap
        )  # [T, h, d]
        h = self.o_proj(o.view(num_tokens, -1))  # [T, d]
        if self.o_bias is not None:
            h = ops.add_bias(h, self.o_bias)
        if self.attn_out_norm is not None:
            h, _ = ops.add_rms_norm(h, None, self.attn_out_norm, eps, True)
        if self.post_attn_norm is not None:
            x, residual = ops.add_rms_norm(h, residual, self.post_attn_norm, eps, True)
        else:  # the MLP reads the stream itself
            x = residual = ops.add(h, residual, True)
        h = self.down_proj(self.act_mul(self.gate_up_proj(x)))
        if self.mlp_out_norm is not None:
            h, _ = ops.add_rms_norm(h, None, self.mlp_out_norm, eps, True)
        return h, residual


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
        # a 1-D tensor of the first layer's: what the stage computes in, and where
        norm = weights[f"model.layers.{start}.{config.layer_spec.layer_tensors()[0]}"]
        self.dtype, self.device = norm.dtype, norm.device
        self.ops = backend.ops
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, i, backend) for i in range(start, end)
        )
        # On the CPU kernels, every layer in one C call (stages/backend/cpu/fused_layer.py);
        # None: one Python call per op, as DecoderLayer.forward.
        self.fused: CompiledLayers | None = backend.compile_layers(list(self.layers), self.dtype)
        self.rotary = Rotary(config, self.device)
        # Gemma 3's windowed layers' rotary, where some layer of this stage turns at it
        self.sliding_rotary: Rotary | None = None
        if any(layer.rope_local for layer in self.layers):
            self.sliding_rotary = Rotary(config, self.device, sliding=True)
        # First stage embeds the token ids; later stages start from what the previous sent.
        self._begin: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
        embed = weights.pop(EMBED) if self.is_first_stage else None  # [V, d]
        self._begin = self._embed if self.is_first_stage else self._receive
        if head_rows is None and self.is_last_stage:
            head_rows = (0, config.vocab_size)
        self.head_rows = head_rows
        if self.is_last_stage:
            # Granite divides the logits by logits_scaling: folded into the final norm's weight,
            # which only the lm_head reads (on either end of a split one)
            final_norm = norm_weight(weights.pop(FINAL_NORM), config.layer_spec.norm_offset)
            if config.logits_scaling != 1.0:
                final_norm = final_norm / config.logits_scaling
            self.final_norm = _param(final_norm)
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
        # (not under Gemma 2's final soft cap: transformers' greedy picks among the capped
        # logits, where bf16 can tie two that differ before it)
        if head_rows is not None and not config.final_logit_softcap:
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

    @property
    def inv_freq(self) -> torch.Tensor:
        """[d/2] fp32: the rotary's frequencies (the windowed layers' are sliding_rotary's)."""
        return self.rotary.inv_freq

    def forward(
        self,
        inputs: ForwardInputs,
        kv: KVCache,
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this stage's layers; returns (hidden_states, residual), both [T, d]."""
        h, residual = self._begin(inputs, hidden_states, residual)
        cos, sin = self.rotary.tables(self.ops, inputs, self.dtype)  # all layers
        local = None  # the rope_local layers' (Gemma 3)
        if self.sliding_rotary is not None:
            local = self.sliding_rotary.tables(self.ops, inputs, self.dtype)
        # (a stage on the CPU kernels always reads the cache paged; a batch with a long
        # prefill chunk, whose attention is not the paged kernel's, takes the layers' calls)
        if self.fused is not None and not self.ops.long_chunks(inputs):
            return self.fused.forward(h, residual, cos, sin, kv, inputs, local)
        for layer_index, layer in enumerate(self.layers):
            c, s = (cos, sin) if local is None or not layer.rope_local else local
            h, residual = layer(h, residual, c, s, kv, layer_index, inputs)
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
        return self.cap_logits(self.lm_head(self.final_hidden(h, residual, rows)))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft cap, cap tanh(logits / cap), elementwise (a split lm_head's two
        halves each); the logits as they are elsewhere."""
        cap = self.config.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

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
            rows = self.lm_head.rows(ids)
        else:
            rows = F.embedding(ids, self.embed_tokens)
        multiplier = self.config.embedding_multiplier
        if multiplier == 1.0:
            return rows
        if self.config.embedding_multiplier_in_dtype:  # Gemma's: a tensor of the rows' dtype
            return rows * torch.tensor(multiplier, dtype=rows.dtype)
        return rows * multiplier  # Granite's

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
