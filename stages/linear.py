"""How a stage multiplies by a weight matrix: one module per matrix, its kind chosen once per
stage by device, dtype and quantization, so a layer only calls `proj(x)`.

- `DenseLinear`: torch's F.linear (cuBLAS on a GPU; oneDNN on a CPU in bf16, which uses AMX or
  AVX-512 BF16 where the CPU has them).
- `CpuLinear` (CPU, fp32): `cpu_kernels.c` for a few rows, where the kernel streams each
  weight row once (a single row at 27-30 GB/s, where MKL's sgemv read 10.7), and oneDNN with
  the weight reordered once into its blocked layout ("prepacked", as Inductor's CPU freezing
  does) for more. Measured on the 2-core EPYC over every matmul of a SmolLM2 step (fp32, ms):
  1 row: kernel 18, oneDNN 24, MKL 36; 2 rows: 19-21, 24-30, 52-59; 32 rows: 71-83, 64-78,
  80-104; 128 rows: -, 188-210, 216-229; 512 rows: -, 706-792, 806-941. In a whole decode step
  of 32 sequences the prepacked matmuls took 76 ms where the kernel's took 95-103. The price is
  a second copy of every weight (plain for the kernel, blocked for oneDNN), so a stage packs
  only when both fit in a quarter of the machine's memory; otherwise the kernel runs up to
  KERNEL_MAX_ROWS rows and F.linear (MKL) above.
- `Int8Linear` (CPU, `--quantization int8`): weights stored as int8 with one fp32 scale per
  output channel (symmetric, max |w| / 127), multiplied by the kernel in integers: a quarter of
  the bytes of fp32, for the single stream, where reading the weights is the whole step. torch's
  own `_weight_int8pack_mm` ran at 1.4 GB/s on that CPU, slower than fp32.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from stages.errors import ConfigError
from stages.native import NativeKernels

KERNEL_MAX_ROWS = 64  # CpuLinear without a packed copy: the kernel up to here, MKL above
KERNEL_MAX_ROWS_PACKED = 4  # CpuLinear with a packed copy: the kernel up to here, oneDNN above
QUANTIZATIONS = ("none", "int8")


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


class CpuLinear(DenseLinear):
    def __init__(
        self, weight: torch.Tensor | nn.Parameter, kernels: NativeKernels, pack: bool
    ) -> None:
        super().__init__(weight)
        self.kernels = kernels
        # a buffer, so parameter_bytes counts the second copy
        self.register_buffer("packed", pack_for_onednn(self.weight.detach()) if pack else None)
        self.kernel_max_rows = KERNEL_MAX_ROWS_PACKED if pack else KERNEL_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.kernel_max_rows:
            return self.kernels.linear_f32(x, self.weight)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


ONEDNN_BATCH_HINT = 32  # the row count oneDNN picks its blocked layout for; any count runs


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)


@functools.cache
def onednn_packing_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (x86 builds do)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 16)
        y = torch.ops.mkldnn._linear_pointwise(
            torch.randn(3, 16), pack_for_onednn(w), None, "none", [], ""
        )
        return tuple(y.shape) == (3, 8)
    except (AttributeError, RuntimeError):
        return False


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels
        qweight, scale = quantize_int8(weight.detach().float())
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N] fp32

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]  # K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear_int8(x.float(), self.qweight, self.scale)  # [T, N] fp32
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (q [N, K] int8, scale [N]): symmetric, round to nearest, one scale per
    output channel (max |w| / 127). A search over clip ratios (keep the ratio in 0.75-1.0 with
    the least squared error) chose 1.0 for every row of the default model, so it is not done."""
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # [N]
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def make_linear(
    weight: torch.Tensor | nn.Parameter,
    quantization: str,
    kernels: NativeKernels | None,
    pack: bool = False,
) -> nn.Module:
    """The module for one weight matrix [N, K]; `kernels` None means they are not available (or
    not wanted: a GPU stage); `pack`: also keep oneDNN's blocked copy (CpuLinear)."""
    if quantization == "int8":
        assert kernels is not None  # check_quantization ran at start-up
        return Int8Linear(weight, kernels)
    if kernels is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
        return CpuLinear(weight, kernels, pack)
    return DenseLinear(weight)


PACK_ENV = "PPRING_PACK_WEIGHTS"  # "0": never keep oneDNN's copy; "1": always


def should_pack(weight_bytes: int) -> bool:
    """Keep a prepacked copy of fp32 CPU weights when both copies fit in a quarter of this
    machine's memory (or as PPRING_PACK_WEIGHTS says) and oneDNN can run it."""
    setting = os.environ.get(PACK_ENV)
    if setting == "0":
        return False
    if setting != "1":
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return False
        if 2 * weight_bytes > memory // 4:
            return False
    return onednn_packing_available()


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
