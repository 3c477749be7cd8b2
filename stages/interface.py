"""The seam between stages/models/ and stages/backend/ (DESIGN.md §13): what a model's blocks
ask of the backend a stage picked, and what a backend's compiled steps read of a model. Both
halves import this module and never each other (tests/stages/test_imports.py checks it).

Protocols only, so a backend can be any object with these members: stages/backend/__init__.py
`Backend` is the one the stage builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from stages.inputs import ForwardInputs
from stages.kv_cache import KVCache


class Ops(Protocol):
    """A layer's work besides its matmuls (stages/backend/torch/ops.py TorchOps documents each;
    the CPU kernels' and the GPU's do the same arithmetic)."""

    name: str

    def rope_tables(
        self,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        dtype: torch.dtype,
        max_position: int | None = None,
        scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def add(
        self, h: torch.Tensor, residual: torch.Tensor | None, h_is_scratch: bool = False
    ) -> torch.Tensor: ...

    def add_rms_norm(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        h_is_scratch: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor: ...

    def rms_norm_heads(
        self,
        qkv: torch.Tensor,
        first_head: int,
        num_heads: int,
        head_dim: int,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor: ...

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_layer: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor: ...

    def attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        inputs: ForwardInputs,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...

    def long_chunks(self, inputs: ForwardInputs) -> bool:
        """Whether this batch's attention leaves a stage's compiled layers (CompiledLayers) for
        the layers' own calls: a long prefill chunk that the ops attend to otherwise."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor: ...


class LayerWeights(Protocol):
    """One decoder layer as a compiled step reads it: the spec's tensors (None where the
    family's layer lacks them) and its four matrix modules (the backend's own linears)."""

    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_scale: float  # what q.k is multiplied by
    window: int  # > 0: attention sees the last `window` positions; 0: all of them
    softcap: float  # > 0: scores become softcap tanh(score / softcap); 0: as they are
    activation: str  # the MLP's gate: "silu" or "gelu_tanh"
    rope_local: bool  # the layer turns at the stage's second rotary (Gemma 3's windowed ones)
    input_norm: torch.Tensor | None  # [d]; None: attention reads the stream un-normed
    post_attn_norm: torch.Tensor | None  # [d], before the MLP; None: the MLP reads it so
    qkv_proj: nn.Module  # [(h + 2 h_kv) d_head, d]
    o_proj: nn.Module  # [d, h d_head]
    gate_up_proj: nn.Module  # [2 I, d]
    down_proj: nn.Module  # [d, I]
    qkv_bias: torch.Tensor | None  # [(h + 2 h_kv) d_head]
    o_bias: torch.Tensor | None  # [d]
    q_norm: torch.Tensor | None  # [d_head], or [h d_head] where qk_norm_whole
    k_norm: torch.Tensor | None  # [d_head], or [h_kv d_head] where qk_norm_whole
    qk_norm_whole: bool
    attn_out_norm: torch.Tensor | None  # [d]: attention's output normed (OLMo 2)
    mlp_out_norm: torch.Tensor | None  # [d]: the MLP's


class CompiledLayers(Protocol):
    """A stage's layers run as one step (the CPU kernels' fused stack)."""

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        inputs: ForwardInputs,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class GreedyFinish(Protocol):
    """A greedy decode batch's finish (final norm, lm_head, argmax) as one call."""

    def tokens(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...


class LayerBackend(Protocol):
    """What a model's blocks build with: the ops, a module per weight matrix, and the
    optional compiled steps (None: the blocks run call by call)."""

    ops: Ops

    def linear(self, weight: torch.Tensor) -> nn.Module: ...

    def compile_layers(
        self, layers: Sequence[LayerWeights], dtype: torch.dtype
    ) -> CompiledLayers | None: ...

    def greedy_finish(
        self,
        lm_head: nn.Module,
        final_norm: torch.Tensor | None,
        eps: float,
        dtype: torch.dtype,
        token_base: int,
    ) -> GreedyFinish | None: ...


class RotaryTables(Protocol):
    """A stage's rotary frequencies as the CPU kernels' kept tables take them
    (stages/backend/cpu/ops.py RopeTable): positions from `long_from` on turn at
    `long_inv_freq` (a decode step's of a LongRoPE sequence that far along), and cos and sin
    are multiplied by `scale` where given."""

    inv_freq: torch.Tensor  # [d_head / 2] fp32
    scale: torch.Tensor | None  # [d_head / 2] fp32
    long_inv_freq: torch.Tensor | None  # [d_head / 2] fp32
    long_from: int


class StageModel(Protocol):
    """What the CPU backend's kept decode step reads of a built stage."""

    is_first_stage: bool
    is_last_stage: bool
    ops: Ops
    rotary: RotaryTables  # what the kept decode step reads its rotary rows from
    sliding_rotary: RotaryTables | None  # the rope_local layers' (Gemma 3), or None
    embed_tokens: torch.Tensor | None
    fused: CompiledLayers | None
    greedy_head: GreedyFinish | None

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...
