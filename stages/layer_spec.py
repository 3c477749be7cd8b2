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
- `qk_norm_whole`: with qk_norm, one RMSNorm over the whole q projection and one over the whole
  k projection instead (weights [h d_head] and [h_kv d_head]; OLMo 2).
- `norms`: where a layer's RMSNorms sit. "pre" (Llama): before attention
  (`input_layernorm`) and before the MLP (`post_attention_layernorm`), the residual stream
  itself never normed. "post" (OLMo 2): on attention's output (`post_attention_layernorm`) and
  on the MLP's (`post_feedforward_layernorm`) before each is added to the residual stream,
  which attention and the MLP read un-normed. "sandwich" (Gemma 2, 3): four, before and after
  each (`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
  `post_feedforward_layernorm`).
- `norm_offset`: every RMSNorm multiplies by (1 + weight) (Gemma's), folded at load.
- `activation`: the MLP's gate, "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU).
- `attn_softcap`: > 0: attention scores become cap tanh(score / cap) (Gemma 2).
- `fused_projections`: the checkpoint holds q, k, v as one `qkv_proj` and gate, up as one
  `gate_up_proj` (Phi-3), in the order the layer concatenates them anyway.
- `residual_multiplier`: attention's and the MLP's outputs are scaled by it before they join the
  residual stream (Granite); 1.0 elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False
    norms: str = "pre"  # "pre", "post" or "sandwich" (above)
    fused_projections: bool = False
    residual_multiplier: float = 1.0
    norm_offset: bool = False
    activation: str = "silu"
    attn_softcap: float = 0.0

    def layer_tensors(self) -> tuple[str, ...]:
        """Checkpoint names inside one decoder layer (relative to `model.layers.{i}.`), in
        Hugging Face's names, which every family here shares."""
        if self.norms == "post":
            names = ["post_attention_layernorm.weight", "post_feedforward_layernorm.weight"]
        elif self.norms == "sandwich":
            names = [
                "input_layernorm.weight", "post_attention_layernorm.weight",
                "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
            ]  # fmt: skip
        else:
            names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        if self.fused_projections:
            names += ["self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"]
        else:
            names += [f"self_attn.{n}_proj.weight" for n in "qkv"]
            names += ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
        names += ["self_attn.o_proj.weight", "mlp.down_proj.weight"]
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
        if self.qk_norm:
            params += (q_heads + kv_heads) * head_dim if self.qk_norm_whole else 2 * head_dim
        return params + (2 * hidden if self.norms == "sandwich" else 0)

    def extra_flops(self, hidden: int, q_size: int, kv_size: int) -> int:
        """Elementwise work per token the flags add to a layer (stages/partition.py's cost
        model): a bias is an add per output, a head norm ~4 passes over q and k."""
        flops = q_size + 2 * kv_size if self.qkv_bias else 0
        flops += hidden if self.o_bias else 0
        return flops + (4 * (q_size + kv_size) if self.qk_norm else 0)

    def describe(self) -> str:
        """The flags set, for the start-up summary ("plain" where none)."""
        flags = [name for name in ("qkv_bias", "o_bias") if getattr(self, name)]
        if self.qk_norm:
            flags.append("qk_norm_whole" if self.qk_norm_whole else "qk_norm")
        if self.norms != "pre":
            flags.append(f"{self.norms}_norms")
        if self.norm_offset:
            flags.append("norm+1")
        if self.activation != "silu":
            flags.append(self.activation)
        if self.attn_softcap:
            flags.append(f"softcap {self.attn_softcap:g}")
        if self.residual_multiplier != 1.0:
            flags.append(f"residual*{self.residual_multiplier:g}")
        return "+".join(flags) or "plain"
