"""A weight matrix multiplied by torch: cuBLAS on a GPU, oneDNN on a CPU (which uses AMX or
AVX-512 BF16 in bf16 where the CPU has them). The CPU kernels' layouts are in
stages/backend/cpu/linear.py, which falls back to this one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor | nn.Parameter) -> None:
        super().__init__()
        self.weight = (
            weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, False)
        )  # [N, K]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]  # K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [T, K] -> [T, N]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, [T, K]: a tied lm_head serves the embedding lookup."""
        return F.embedding(ids, self.weight)
