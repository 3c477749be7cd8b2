"""The stage on a CUDA device: the same logits as transformers on the CPU, and seeded sampling
that does not depend on the batch. Skipped where no GPU is present (CI has none); the GPU run
(bench/gpu_run.sh) runs this file first on the device machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protocol.sampling import SamplingParams
from stages.batch import SeqChunk
from tests.stages.conftest import Chain, decode_logits, drive_teacher_forced, hf_logits
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


@pytest.mark.parametrize(("model", "partition"), [("gqa", [4]), ("tied", [2, 2]), ("mqa", [2, 2])])
def test_cuda_graph_decode_logits_are_transformers_logits(
    tiny_dirs: dict[str, Path], model: str, partition: list[int]
) -> None:
    """Decode batches of 7, 6 and 5 exceed the largest graph (4) and run eagerly; 4, 2 and 1
    replay their own size, 3 replays 4 with a padding row; each context is split into parts
    (splits_for). Logits, not tokens, are compared: a near-tie of a random model's top two
    logits may fall either way under another order of summation."""
    folder = tiny_dirs[model]
    prompt_lens = [5, 23, 9, 40, 17, 12, 30]
    seqs = random_seqs([p + n for p, n in zip(prompt_lens, [6, 20, 3, 12, 9, 1, 16])], seed=11)
    graphs = Chain(folder, partition, device="cuda", cuda_graph_max_bs=4)
    for stage in graphs.stages:
        assert stage.graphs is not None and stage.graphs.recorder.name == "cuda"
    got = decode_logits(graphs, seqs, prompt_lens, graphs=True)
    assert all(stage.graphs.replays > 0 for stage in graphs.stages)
    eager = decode_logits(Chain(folder, partition, device="cuda"), seqs, prompt_lens, False)
    for seq, by_pos, eager_by_pos in zip(seqs, got, eager):
        expected = hf_logits(folder, seq)
        for pos, logits in by_pos.items():
            diff = (logits - expected[pos]).abs().max().item()
            assert diff < TOLERANCE, f"{model} {partition} position {pos}: {diff:.2e}"
            assert (logits - eager_by_pos[pos]).abs().max().item() < TOLERANCE


def test_cuda_launch_returns_before_the_device_is_done_and_gives_the_run_output(
    tiny_dirs: dict[str, Path],
) -> None:
    """StageRunner.launch on a GPU: an overlapped handle whose seam lands in pinned host
    memory and whose greedy tokens come back through a device event."""
    chain = Chain(tiny_dirs["gqa"], [2, 2], device="cuda", cuda_graph_max_bs=4)
    reference = Chain(tiny_dirs["gqa"], [2, 2], device="cuda")
    prompts = random_seqs([9, 14, 6], seed=12)

    def prefill(c: Chain) -> list[SeqChunk]:
        return [SeqChunk(p, 0, c.blocks.grow([], len(p)), sample=True) for p in prompts]

    chunks = prefill(chain)
    first = chain.stages[0].launch(chunks)
    assert first.overlaps and first.early_output is not None
    seam = first.wait()
    assert seam["hidden_states"].is_pinned() and seam["residual"].is_pinned()
    last = chain.stages[1].launch(chunks, **seam)
    tokens = last.wait().wait().token_ids  # the handle's output is a Sample
    assert tokens == reference.sample(prefill(reference)).token_ids


def test_the_launcher_on_this_gpu_runs_the_checkpoints_dtype_and_refuses_int8_in_one_sentence(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """On the real device (test_dtype.py checks the same rules with a mocked torch.cuda):
    `--dtype auto` names the checkpoint's bf16 in the start-up summary, an fp32 checkpoint runs
    bf16 (this GPU has it), and `--quantization int8`, a CPU path, stops the launcher with one
    sentence before any stage starts."""
    from dataclasses import replace

    from launch import local
    from stages.config import ModelConfig

    args = local.parse_args(["--model", str(tiny_dirs["gqa"]), "--device", "cuda"])
    config = ModelConfig.from_folder(tiny_dirs["gqa"])
    lines = local.compute_lines(args, replace(config, torch_dtype="bfloat16"))
    assert lines[0] == "dtype: bfloat16 (auto: the checkpoint's own dtype)"
    lines = local.compute_lines(args, replace(config, torch_dtype="float32"))
    assert lines[0] == "dtype: bfloat16 (auto: bf16 on a GPU that has it)"
    argv = ["--model", str(tiny_dirs["gqa"]), "--device", "cuda", "--quantization", "int8"]
    assert local.main([*argv, "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --quantization int8 runs on the CPU only; on cuda use --dtype bfloat16"]
