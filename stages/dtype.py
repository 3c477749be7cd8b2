"""`--dtype auto|float32|bfloat16|float16`: what a stage computes in, and why.

`auto` (the default, as in vLLM and SGLang) picks:
- on a CPU, bfloat16 where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX: oneDNN then
  runs bf16 matmuls at two to three times fp32's rate), float32 elsewhere: without those
  instructions bf16 is converted to fp32 inside every matmul and runs slower than fp32
  (torchchat #1253; on an AVX2 EPYC, 4x slower at 32 rows);
- on a GPU, the model's own dtype (its config.json `torch_dtype`), or bfloat16 for an fp32
  checkpoint where the GPU supports it.

An explicit dtype a device cannot run is one sentence at start-up; one it runs only slowly
(bfloat16 on a CPU without native bf16) runs, with a warning in the start-up summary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from stages.errors import ConfigError
from stages.weights import TORCH_DTYPES

DTYPE_CHOICES = ("auto", *TORCH_DTYPES)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    name: str  # "float32", "bfloat16", ...
    reason: str  # one clause for the start-up summary
    warning: str | None = None  # said when the choice will run slowly


def resolve_dtype(
    requested: str, device: str | torch.device, model_dtype: str = "float32"
) -> DtypeChoice:
    """The dtype a stage on `device` runs for `--dtype requested`; `model_dtype` is the
    checkpoint's (config.json torch_dtype)."""
    device = torch.device(device)
    if requested not in DTYPE_CHOICES:
        raise ConfigError(f"--dtype {requested} is not supported; use one of {DTYPE_CHOICES}")
    if device.type == "cpu":
        return _cpu(requested)
    if device.type == "cuda":
        return _cuda(requested, device, model_dtype)
    if requested == "auto":
        return DtypeChoice(torch.float32, "float32", f"auto: float32 on {device.type}")
    return DtypeChoice(TORCH_DTYPES[requested], requested, "as asked")


def _cpu(requested: str) -> DtypeChoice:
    native = cpu_native_bf16()
    if requested == "auto":
        if native:
            return DtypeChoice(
                torch.bfloat16, "bfloat16", f"auto: this CPU multiplies bf16 natively ({native})"
            )
        return DtypeChoice(
            torch.float32, "float32", "auto: this CPU has no native bf16 (AVX-512 BF16 or AMX)"
        )
    if requested == "float16":
        raise ConfigError(
            "--dtype float16 is not supported on the CPU; use --dtype bfloat16 or float32"
        )
    if requested == "bfloat16" and not native:
        return DtypeChoice(
            torch.bfloat16,
            "bfloat16",
            "as asked",
            warning="this CPU has no native bf16 (AVX-512 BF16 or AMX): bfloat16 runs "
            "emulated, slower than float32 except for a single stream",
        )
    return DtypeChoice(TORCH_DTYPES[requested], requested, "as asked")


def _cuda(requested: str, device: torch.device, model_dtype: str) -> DtypeChoice:
    bf16_ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if requested == "auto":
        if model_dtype in ("bfloat16", "float16") and (model_dtype != "bfloat16" or bf16_ok):
            return DtypeChoice(
                TORCH_DTYPES[model_dtype], model_dtype, "auto: the checkpoint's own dtype"
            )
        if bf16_ok:
            return DtypeChoice(torch.bfloat16, "bfloat16", "auto: bf16 on a GPU that has it")
        return DtypeChoice(torch.float16, "float16", "auto: this GPU has no bf16")
    if requested == "bfloat16" and not bf16_ok:
        raise ConfigError(
            f"--dtype bfloat16 cannot run on {device}: it has no bf16 support; "
            "use --dtype float16 or float32"
        )
    return DtypeChoice(TORCH_DTYPES[requested], requested, "as asked")


@functools.cache
def cpu_native_bf16() -> str | None:
    """The CPU feature that runs bf16 matmuls natively ("AMX" or "AVX-512 BF16"), or None.
    Read from /proc/cpuinfo's flags, else from torch's own CPU probe."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
            flags = set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    if not flags:  # no /proc/cpuinfo (not Linux): ask torch
        probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        if probe is not None and probe():
            return "AVX-512 BF16"
    return None
