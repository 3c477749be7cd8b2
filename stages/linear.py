"""How a stage multiplies by a weight matrix: one module per matrix, its kind chosen once per
stage by device, dtype and quantization, so a layer only calls `proj(x)`.

- `DenseLinear`: torch's F.linear (cuBLAS on a GPU; oneDNN on a CPU in bf16, which uses AMX or
  AVX-512 BF16 where the CPU has them).
- `CpuLinear` (CPU, fp32): `cpu_kernels.c` up to KERNEL_MAX_ROWS rows, F.linear (MKL) above. The
  kernel streams each weight row once for all the batch's rows, prefetching ahead; measured on
  the 2-core EPYC over every matmul of a SmolLM2 step (fp32, ms): 1 row 18 against MKL's 36 and
  oneDNN's (prepacked) 24; 32 rows 71-83 against 80-104 and 64-78; 64 rows 126-144 against
  125-154 and 104-122. oneDNN wins from ~16 rows but needs a second, reordered copy of every
  weight; MKL reads the one copy the kernel reads.
- `Int8Linear` (CPU, `--quantization int8`): weights stored as int8 with one fp32 scale per
  output channel (symmetric, max |w| / 127), multiplied by the kernel in integers: a quarter of
  the bytes of fp32, for the single stream, where reading the weights is the whole step. torch's
  own `_weight_int8pack_mm` ran at 1.4 GB/s on that CPU, slower than fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.errors import ConfigError
from stages.native import NativeKernels

KERNEL_MAX_ROWS = 64  # CpuLinear: rows up to which the kernel beats MKL (measured, above)
QUANTIZATIONS = ("none", "int8")


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor | nn.Parameter) -> None:
        super().__init__()
        self.weight = (
            weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, False)
        )  # [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [T, K] -> [T, N]


class CpuLinear(DenseLinear):
    def __init__(self, weight: torch.Tensor | nn.Parameter, kernels: NativeKernels) -> None:
        super().__init__(weight)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return self.kernels.linear_f32(x, self.weight)
        return F.linear(x, self.weight)


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels
        w = weight.detach().float()  # [N, K]
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # [N]
        qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # [N, K]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear_int8(x.float(), self.qweight, self.scale)  # [T, N] fp32
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def make_linear(
    weight: torch.Tensor | nn.Parameter, quantization: str, kernels: NativeKernels | None
) -> nn.Module:
    """The module for one weight matrix [N, K]; `kernels` None means they are not available (or
    not wanted: a GPU stage)."""
    if quantization == "int8":
        assert kernels is not None  # check_quantization ran at start-up
        return Int8Linear(weight, kernels)
    if kernels is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
        return CpuLinear(weight, kernels)
    return DenseLinear(weight)


def check_quantization(
    quantization: str, device: torch.device, kernels: NativeKernels | None, reason: str | None
) -> None:
    """One clear sentence at start-up for a quantization this stage cannot run."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {quantization} is not supported; use none or int8")
    if quantization != "int8":
        return
    if device.type != "cpu":
        raise ConfigError(
            f"--quantization int8 runs on the CPU only; on {device.type} use --dtype bfloat16"
        )
    if kernels is None:
        raise ConfigError(f"--quantization int8 needs ppring's CPU kernels, but {reason}")
