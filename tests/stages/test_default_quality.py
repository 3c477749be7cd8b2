"""The default path's quality, pinned: the default model in the default dtype (--dtype auto: on a
CPU with AVX-512 BF16 and VNNI, bf16 with the GGUF codes times int8-quantized activations)
against fp32 on the same weights, over the shipped text (bench/texts/quality_en.txt), as
`ppring bench quality` measures it.

A ring's outputs are sampled tokens (with at most 20 top logprobs each, and none for prompt
positions): not a full next-token distribution at every position of a fixed text. So the KL
divergence is measured with the stages chained in this process (tests/stages/conftest.py
`Chain`: the ring's StageRunners, seam and block tables, without its sockets) at PP=1 and PP=2,
the text teacher-forced: its first PREFILL_TOKENS as chunked prefill, the rest one decode step
at a time (at PP=2 the first stage's decodes take its kept decode path). A real ring (threads,
PP=1 and PP=2) is held to fp32's top token at each of its own greedy steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.agreement import window_logits
from bench.quality import DEFAULT_TEXT, compare_rows
from stages.batch import blocks_needed
from stages.config import ModelConfig
from stages.partition import default_partition
from stages.runner import StageRunner
from tests.stages.conftest import Chain, drive_teacher_forced

PREFILL_TOKENS = 256  # in chunks of CHUNK_TOKENS, then decode steps up to TEXT_TOKENS
CHUNK_TOKENS = 64
TEXT_TOKENS = 512
KV_BUDGET = 32 << 20  # fp32: 512 tokens take 23.6 MB
# Bounds over those 511 positions, from `ppring bench quality` (e41ff7e, Zen 4 EPYC, 8 windows
# of 512 tokens): the default path's mean KL divergence from fp32 is 0.0138 nats, p99 0.060,
# top-1 agreement 92.2% (transformers in bf16: 0.0011, 96.5%); over these positions, at PP=1
# and PP=2 alike, 0.0135, p99 0.058, 92.4%. The bounds leave 1.5x the KL divergence and 3
# points of agreement; real regressions of the activations' int8 grid go far past them (a copy
# of cpu_kernels.c built in their place): the scale amax / 128 instead of / 127 measures 0.039
# and 84.9%, truncation instead of rounding to nearest 0.131 and 77.1%, a dropped scale 796 and
# 0%. The default's KL divergence is 13x transformers-bf16's, mostly because the Q4_1 offset
# term of ppr_linear_grid_a8 (a8_micro) multiplies m by sx, the exact sum of x, where llama.cpp's
# q8_1 takes dx * sum(xq): x's rounding errors are then weighted by d * q (all positive, 7.5 d
# on average) instead of the centred w = d * q + m, 2.4x the rms error a matmul. With
# dx * sum(xq) it measures 0.0036, p99 0.012, 95.9% here; these bounds should then follow.
MAX_MEAN_KLD = 0.020
MAX_P99_KLD = 0.09
MIN_TOP1_AGREEMENT = 0.89
# The ring: 16 prompts of 48 tokens from all over the text, 32 greedy tokens each. fp32's top
# token at 90.8% of the 512 steps (PP=1 and PP=2 alike; 95.1% with dx * sum(xq)); truncated
# activations 74.2%, a dropped scale 15%. The scale amax / 128 still gives 90.2% here: the
# teacher-forced KL divergence above is the finer pin, this one the serving path's.
RING_PROMPTS, RING_PROMPT_TOKENS, RING_PROMPT_STRIDE, RING_NEW_TOKENS = 16, 48, 320, 32
MIN_RING_AGREEMENT = 0.86


def test_kl_divergence_and_agreement_of_known_distributions() -> None:
    """compare_rows: KL(P || Q) per row in nats, same-top rows, and Q's summed NLL."""
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])
    ref, got = p.log().repeat(3, 1), torch.stack([p, q, q]).log() + 7.0  # (softmax ignores +7)
    kld, same, nll = compare_rows(ref, got, torch.tensor([0, 1, 2]))
    expected = float((p * (p / q).log()).sum())  # 0.25 ln 2
    assert torch.allclose(kld, torch.tensor([0.0, expected, expected], dtype=kld.dtype))
    assert same == 1  # the last two put token 1 on top, the reference token 0
    assert nll == pytest.approx(-float(p[0].log() + q[1].log() + q[2].log()))


def test_quality_configurations_are_agreements_or_transformers_in_a_dtype() -> None:
    from bench.quality import check_config

    for config in ("auto", "bfloat16+exact", "int8", "float32", "hf-bfloat16", "hf-float32"):
        check_config(config)
    for config in ("hf-float16", "hf-int8", "bf16"):
        with pytest.raises(ValueError):
            check_config(config)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from launch.prepare_model import PrepareModelError, prepare_default_model

    try:
        return prepare_default_model(quiet=True)
    except (PrepareModelError, OSError) as exc:
        pytest.skip(f"the default model cannot be prepared here: {exc}")


@pytest.fixture(scope="module")
def text_ids(model_dir: Path) -> list[int]:
    """The whole shipped text's token ids (~5,800)."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_dir)(DEFAULT_TEXT.read_text())["input_ids"])


@pytest.fixture(scope="module")
def tokens(text_ids: list[int]) -> list[int]:
    assert len(text_ids) >= TEXT_TOKENS
    return text_ids[:TEXT_TOKENS]


@pytest.fixture(scope="module")
def float32_stage(model_dir: Path) -> StageRunner:
    """The reference: one fp32 stage holding every layer (bench/agreement.py window_logits)."""
    layers = ModelConfig.from_folder(model_dir).num_layers
    runner = StageRunner(model_dir, 0, layers, kv_budget_bytes=KV_BUDGET, dtype="float32")
    runner.allocate_kv(blocks_needed(TEXT_TOKENS))
    return runner


@pytest.fixture(scope="module")
def reference(float32_stage: StageRunner, tokens: list[int]) -> torch.Tensor:
    """fp32 logits [TEXT_TOKENS - 1, V] over the text, one prefill."""
    return window_logits(float32_stage, tokens)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_default_dtype_stays_near_float32_over_the_shipped_text(
    model_dir: Path, tokens: list[int], reference: torch.Tensor, pp_size: int
) -> None:
    layers = ModelConfig.from_folder(model_dir).num_layers
    partition = default_partition(layers, pp_size)
    chain = Chain(model_dir, partition, dtype="auto", kv_budget_bytes=KV_BUDGET)
    (logits,) = drive_teacher_forced(chain, [tokens], [PREFILL_TOKENS], chunk_size=CHUNK_TOKENS)
    kld, same, _ = compare_rows(reference, logits[:-1].float(), torch.tensor(tokens[1:]))
    mean, p99 = float(kld.mean()), float(kld.quantile(0.99))
    agreement = same / kld.numel()
    dtype = str(chain.stages[0].dtype).removeprefix("torch.")
    measured = (
        f"PP={pp_size}, {dtype}: mean KLD {mean:.4f} nats, p99 {p99:.4f}, "
        f"top-1 agreement {100 * agreement:.1f}% over {kld.numel()} positions"
    )
    print(measured)
    assert mean <= MAX_MEAN_KLD and p99 <= MAX_P99_KLD, measured
    assert agreement >= MIN_TOP1_AGREEMENT, measured


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp_size", [1, 2])
def test_default_dtype_greedy_through_a_real_ring_picks_float32s_top_token(
    model_dir: Path, text_ids: list[int], float32_stage: StageRunner, pp_size: int
) -> None:
    """The serving path itself: a ring of default-dtype stages (threads, as `ppring local` lays
    them out: the cost partition, the lm_head split at PP=2, plain greedy requests taking the
    kept decode path) continues RING_PROMPTS pieces of the text; fp32, teacher-forced over each
    prompt and the ring's own continuation, puts the same token on top at nearly every step."""
    from protocol.sampling import SamplingParams
    from ring.config import RingConfig
    from ring.harness import ThreadRing
    from ring.loop import ModelInfo

    cfg = RingConfig(pp_size=pp_size, split_lm_head=pp_size > 1, chunked_prefill_size=128)
    # from all over the text: one every RING_PROMPT_STRIDE tokens
    starts = range(0, RING_PROMPTS * RING_PROMPT_STRIDE, RING_PROMPT_STRIDE)
    prompts = [text_ids[at : at + RING_PROMPT_TOKENS] for at in starts]
    greedy = SamplingParams(max_new_tokens=RING_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [(f"q{i}", prompt, greedy) for i, prompt in enumerate(prompts)]

    def make(c: RingConfig) -> StageRunner:
        return StageRunner.for_rank(
            model_dir, pp_size, c.rank, kv_budget_bytes=KV_BUDGET, dtype="auto",
            split_lm_head=c.split_lm_head,
        )  # fmt: skip

    with ThreadRing(cfg, make, ModelInfo(context_length=1024), f"quality{pp_size}") as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([rid for rid, _, _ in requests], timeout_s=90)
        got = dict(ring.driver.tokens)
    same = 0
    for rid, prompt, _ in requests:
        assert len(got[rid]) == RING_NEW_TOKENS, rid
        logits = window_logits(float32_stage, prompt + got[rid])  # row p predicts token p + 1
        top = logits[len(prompt) - 1 :].argmax(dim=-1)
        same += int((top == torch.tensor(got[rid])).sum())
    total = RING_PROMPTS * RING_NEW_TOKENS
    agreement = same / total
    measured = f"ring PP={pp_size}: {100 * agreement:.1f}% of {total} greedy tokens are fp32's top"
    print(measured)
    assert agreement >= MIN_RING_AGREEMENT, measured
