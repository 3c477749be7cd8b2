"""The small ops of a GPU stage: torch's (stages/backend/torch/ops.py), but attention over the
paged cache in place, by the Triton kernel, for decode-only batches (whose fixed-shape inputs a
CUDA graph replays); other batches gather for SDPA (stages/inputs.py builds the paged metadata
only for a decode-only batch on a stage that takes it)."""

from __future__ import annotations

import torch

from stages.backend.cuda import triton_attention
from stages.backend.torch.ops import TorchOps
from stages.inputs import ForwardInputs


class CudaOps(TorchOps):
    name = "cuda"

    def attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        inputs: ForwardInputs,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        paged = inputs.paged
        if paged is None:
            return super().attention(q, kv_layer, inputs, scale, window, softcap)
        if window or softcap:  # (stages/backend/__init__.py refuses such a model on a GPU)
            raise ValueError("the GPU's paged attention takes no window and no soft cap")
        if paged.max_q_len != 1:
            raise ValueError("the GPU's paged attention takes decode-only batches")
        return triton_attention.paged_decode(
            q, kv_layer, paged.block_table, paged.ctx_len, scale, paged.num_splits
        )
