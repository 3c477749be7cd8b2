"""How a stage computes: one backend, picked once at start-up (DESIGN.md §13).

- `cpu`: ppring's C kernels (stages/backend/cpu/): matrices packed in their layouts or held as
  GGUF codes, the small ops and paged attention one call each, and the compiled steps: a
  stage's layers in one call (fused_layer.py), decode steps over kept buffers (kept_decode.py),
  a greedy finish in one call.
- `torch`: torch's ops throughout (stages/backend/torch/): a CPU without a C compiler, or with
  PPRING_NATIVE_KERNELS=0.
- `cuda`: torch's ops, the Triton paged decode attention and CUDA graphs
  (stages/backend/cuda/).

A backend gets a layer's weights and its family's `LayerSpec` (through the model's blocks,
stages/interface.py); it never imports a model. The environment's switches are read here,
once (switches.py), and the stage's start-up summary prints `Backend.describe()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stages.backend.cpu import native
from stages.backend.cpu.fused_layer import FusedLayers, GreedyHead
from stages.backend.cpu.linear import check_quantization, make_linear, source_dtype
from stages.backend.cpu.native import NativeKernels
from stages.backend.cpu.ops import NativeOps
from stages.backend.cuda.ops import CudaOps
from stages.backend.switches import FUSED_LAYERS_ENV, Switches
from stages.backend.torch.ops import TorchOps
from stages.errors import ConfigError
from stages.interface import LayerWeights, Ops


@dataclass(frozen=True)
class Backend:
    """What a stage computes with, chosen once (`pick`): its ops, what multiplies by a
    weight, and its compiled steps. Implements stages/interface.py LayerBackend."""

    name: str  # "cpu", "torch" or "cuda"
    reason: str  # why this one, for the start-up summary
    ops: Ops
    kernels: NativeKernels | None  # the CPU kernels, where this stage uses them
    quantization: str = "none"
    dtype: torch.dtype | None = None  # what the stage computes in (None: its weights' dtype)
    switches: Switches = Switches()

    @classmethod
    def pick(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str = "none",
        switches: Switches | None = None,
    ) -> Backend:
        """The backend for a stage on `device` computing in `dtype`; one ConfigError for a
        quantization it cannot run or a bad switch."""
        switches = switches or Switches.read()
        kernels, reason = native.kernels_for(device, dtype)
        check_quantization(quantization, device, kernels, reason)
        if kernels is not None:
            tiles = switches.amx_rows != "0"
            name, ops = "cpu", NativeOps.for_stage(kernels, dtype, tiles)
            reason = "ppring's CPU kernels: paged attention, matmuls and small ops"
        elif device.type == "cuda":
            name, ops = "cuda", CudaOps()
            reason = "torch's ops, the Triton paged decode attention and CUDA graphs"
        else:
            name, ops = "torch", TorchOps()
            reason = f"torch's ops (the CPU kernels: {reason})"
        return cls(name, reason, ops, kernels, quantization, dtype, switches)

    def matrix_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a stage computing in `dtype` loads its weight matrices in
        (stages/backend/cpu/linear.py source_dtype)."""
        return source_dtype(dtype, self.quantization, self.kernels, self.switches)

    def linear(self, weight: torch.Tensor) -> nn.Module:
        """The module multiplying by `weight` [N, K] (which may still be in the checkpoint's
        fp32 on a bf16 stage: stages/backend/cpu/linear.py make_linear)."""
        return make_linear(weight, self.quantization, self.kernels, self.dtype, self.switches)

    def compile_layers(
        self, layers: Sequence[LayerWeights], dtype: torch.dtype
    ) -> FusedLayers | None:
        """The stage's layers as one kernel call, or None (the blocks run call by call;
        `compile_refusal` says why). One ConfigError for layers this backend cannot run."""
        if self.name == "cuda" and any(layer.window or layer.softcap for layer in layers):
            raise ConfigError(
                "this model's attention has a sliding window or a soft cap, which ppring's GPU "
                "backend does not run yet (its Triton decode kernel takes neither); serve it on "
                "the CPU (--device cpu)"
            )
        if self.compile_refusal(layers, dtype) is not None:
            return None
        return FusedLayers.build(list(layers), self.kernels, dtype)

    def compile_refusal(self, layers: Sequence[LayerWeights], dtype: torch.dtype) -> str | None:
        """Why these layers do not run as one call, for the start-up line (a family the fused
        stack cannot run yet takes the general path, and says so); None where they do."""
        if not self.switches.fused_layers:
            return f"{FUSED_LAYERS_ENV}=0"
        return FusedLayers.refusal(list(layers), self.kernels, dtype)

    def greedy_finish(
        self,
        lm_head: nn.Module,
        final_norm: torch.Tensor | None,
        eps: float,
        dtype: torch.dtype,
        token_base: int,
    ) -> GreedyHead | None:
        """A greedy decode batch's finish in one kernel call, or None (call by call)."""
        if not self.switches.fused_layers:
            return None
        return GreedyHead.build(lm_head, final_norm, eps, dtype, token_base, self.kernels)

    def describe(self) -> str:
        """One line for the start-up summary: which backend, why, and the switches set."""
        changed = self.switches.changed()
        return f"{self.name} ({self.reason})" + (f"; {changed}" if changed else "")
