"""The stage on a CUDA device: the same logits as transformers on the CPU, and seeded sampling
that does not depend on the batch. Skipped where no GPU is present (CI has none); the GPU run
(bench/gpu_run.sh) runs this file first on the device machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protocol.sampling import SamplingParams
from stages.batch import SeqChunk
from tests.stages.conftest import Chain, drive_teacher_forced, hf_logits
from tests.stages.test_parity import random_seqs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# fp32 on the GPU reduces in other orders than on the CPU (and SDPA picks its own kernels).
TOLERANCE = 1e-3


@pytest.mark.parametrize("model", ["gqa", "tied", "llama3", "mqa"])
@pytest.mark.parametrize("partition", [[4], [2, 2], [1, 2, 1]])
def test_cuda_stages_match_transformers_on_the_cpu(
    tiny_dirs: dict[str, Path], model: str, partition: list[int]
) -> None:
    folder = tiny_dirs[model]
    chain = Chain(folder, partition, device="cuda")
    prompt_lens = [23, 40, 9, 16]
    seqs = random_seqs([n + 12 for n in prompt_lens], seed=5)
    # Prefill in chunks of 8 while others decode: every kind of attention metadata on the GPU.
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=8, stagger=1)
    for seq, got in zip(seqs, logits):
        assert got.device.type == "cuda"
        diff = (got.cpu() - hf_logits(folder, seq)).abs().max().item()
        assert diff < TOLERANCE, f"{model} {partition}: max abs diff {diff:.2e}"


def test_cuda_bfloat16_tokens_are_transformers_tokens(tiny_dirs: dict[str, Path]) -> None:
    folder = tiny_dirs["gqa"]
    chain = Chain(folder, [2, 2], dtype="bfloat16", device="cuda")
    seqs = random_seqs([30, 12], seed=6)
    logits = drive_teacher_forced(chain, seqs, prompt_lens=[len(s) for s in seqs])
    for seq, got in zip(seqs, logits):
        expected = hf_logits(folder, seq)
        rel = (got.float().cpu() - expected).norm() / expected.norm()
        assert rel < 2e-2, f"bf16 relative error {rel:.2e}"


def test_cuda_seeded_sampling_is_independent_of_the_batch(tiny_dirs: dict[str, Path]) -> None:
    chain = Chain(tiny_dirs["gqa"], [4], device="cuda")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    prompt = random_seqs([10], seed=7)[0]
    other = random_seqs([14], seed=8)[0]

    def first_token(with_other: bool) -> int:
        table = chain.blocks.grow([], len(prompt))
        chunks = [SeqChunk(prompt, 0, table, sample=True)]
        sampling = [params]
        if with_other:
            chunks.append(SeqChunk(other, 0, chain.blocks.grow([], len(other)), sample=True))
            sampling.append(SamplingParams(temperature=0.7, seed=99))
        return chain.sample(chunks, sampling=sampling).token_ids[0]

    assert first_token(False) == first_token(True)
