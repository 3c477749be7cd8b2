"""The GPU's paged decode attention (stages/backend/cuda/triton_attention.py) against plain torch.

On a CUDA machine the kernel runs compiled on the device; elsewhere, where Triton is installed,
in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1), which checks the same kernel's
indexing and online softmax. Skipped where Triton is absent (the CPU build of torch, as in CI):
the GPU run (bench/gpu_run.sh) runs this file on the device machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from stages.backend.cuda import triton_attention
from stages.batch import BLOCK_SIZE

needs_triton = pytest.mark.skipif(not triton_attention.available(), reason="needs Triton")

CUDA = torch.cuda.is_available()
# bf16's tl.dot does not run in the interpreter (numpy has no bf16): fp16 stands in there.
HALF = torch.bfloat16 if CUDA else torch.float16
SHAPES = [(4, 2, 16), (9, 3, 64), (8, 1, 32), (4, 4, 24)]  # GQA, group of 3, MQA, MHA d 24
DTYPES = [torch.float32, HALF]
SPLITS = [1, 3, 16]  # one part; parts of 64 keys, some empty; more parts than any context needs


def max_error(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, num_splits: int = 1
) -> float:
    """The kernel's largest difference from plain torch over contexts across page and loop
    boundaries (16 keys a page, 64 a loop), with scattered block tables."""
    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_blocks, width = 48, 10
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    ctx_len = torch.tensor([1, 16, 17, 64, 65, 130, 160], dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.stack([order[i * 5 : i * 5 + width] for i in range(len(ctx_len))])
    q = torch.randn(len(ctx_len), heads, head_dim, generator=gen)
    q, kv = q.to(device, dtype), kv.to(device, dtype)
    table, ctx_len = table.to(device, torch.int32), ctx_len.to(device)
    scale = head_dim**-0.5
    got = triton_attention.paged_decode(q, kv, table, ctx_len, scale, num_splits)
    expected = triton_attention.reference_decode(q, kv, table, ctx_len, scale)
    return (got.float() - expected.float()).abs().max().item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@needs_triton
@pytest.mark.skipif(not CUDA, reason="the kernel compiled for a GPU")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", SPLITS)
def test_paged_decode_matches_plain_attention_on_the_gpu(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, num_splits: int
) -> None:
    assert max_error(heads, kv_heads, head_dim, dtype, num_splits) < tolerance(dtype)


@needs_triton
@pytest.mark.skipif(CUDA, reason="the GPU test above runs the kernel itself")
def test_paged_decode_matches_plain_attention_in_the_interpreter() -> None:
    """In a process of its own: Triton reads TRITON_INTERPRET when it is imported."""
    script = (
        "import json, torch; from tests.stages import test_triton_attention as t; "
        "print(json.dumps([[str(d), [*s, n], t.max_error(*s, d, n), t.tolerance(d)] "
        "for s in t.SHAPES for d in t.DTYPES for n in t.SPLITS] + "
        "[t.triton_attention.unusable_reason(torch.device('cpu'), 32, 8, 128, torch.float32)]))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    *errors, start_up_check = json.loads(done.stdout.strip().splitlines()[-1])
    for dtype, shape, error, limit in errors:
        assert error < limit, f"{dtype} heads/kv_heads/d/splits {shape}: max error {error:.2e}"
    assert start_up_check is None  # the stage's own check, at Llama-3-8B's heads


def test_paged_decode_refuses_heads_that_do_not_group() -> None:
    q = torch.zeros(1, 5, 16)
    kv = torch.zeros(2, BLOCK_SIZE, 2, 16)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit"):
        triton_attention.paged_decode(q, kv, one.view(1, 1), one, 1.0)


def test_a_gpu_stage_is_told_why_it_cannot_use_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    check = triton_attention.unusable_reason.__wrapped__  # uncached
    device = torch.device("cpu")
    monkeypatch.setenv(triton_attention.DISABLE_ENV, "0")
    assert check(device, 4, 2, 16, torch.float32) == "PPRING_TRITON_ATTENTION=0"
    monkeypatch.delenv(triton_attention.DISABLE_ENV)
    monkeypatch.setattr(triton_attention, "available", lambda: False)
    assert check(device, 4, 2, 16, torch.float32) == "Triton is not installed"
