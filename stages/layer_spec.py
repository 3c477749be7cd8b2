"""What varies between the decoder layers of the model families ppring serves.

Torch-free data, shared by both halves of stages/ (DESIGN.md §13): a family (stages/models/)
says which of these its layers have; a backend (stages/backend/) receives the spec with the
layer's weights and runs it, or says at start-up that it cannot (the stage then takes the
general path). A flag joins this list with the first family that needs it and the code that
runs it on every path: nothing here is declared ahead of an implementation.

Every family here is a pre-norm decoder with RMSNorm, rotate-half RoPE and a SwiGLU MLP
(Llama's layer); the flags are where they part:

- `qkv_bias`: the q, k and v projections add a bias (Qwen2, Qwen2.5).
- `o_bias`: the o projection adds a bias (Qwen3 with attention_bias=true).
- `qk_norm`: an RMSNorm of every q head and every k head (weights [head_dim], the layer's eps)
  between the projection and the rotary (Qwen3).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    def layer_tensors(self) -> tuple[str, ...]:
        """Checkpoint names inside one decoder layer (relative to `model.layers.{i}.`), in
        Hugging Face's names, which every family here shares."""
        names = [
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
        if self.qkv_bias:
            names += [f"self_attn.{n}_proj.bias" for n in "qkv"]
        if self.o_bias:
            names.append("self_attn.o_proj.bias")
        if self.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        return tuple(names)

    def extra_params(self, hidden: int, head_dim: int, q_heads: int, kv_heads: int) -> int:
        """Parameters the flags add to a Llama layer of this shape, per TP rank of
        `q_heads` and `kv_heads` heads (launch/plan.py counts them; a q/k norm is replicated)."""
        params = (q_heads + 2 * kv_heads) * head_dim if self.qkv_bias else 0
        params += hidden if self.o_bias else 0
        return params + (2 * head_dim if self.qk_norm else 0)

    def extra_flops(self, hidden: int, q_size: int, kv_size: int) -> int:
        """Elementwise work per token the flags add to a layer (stages/partition.py's cost
        model): a bias is an add per output, a head norm ~4 passes over q and k."""
        flops = q_size + 2 * kv_size if self.qkv_bias else 0
        flops += hidden if self.o_bias else 0
        return flops + (4 * (q_size + kv_size) if self.qk_norm else 0)

    def describe(self) -> str:
        """The flags set, for the start-up summary ("plain" where none)."""
        flags = [name for name in ("qkv_bias", "o_bias", "qk_norm") if getattr(self, name)]
        return "+".join(flags) or "plain"
