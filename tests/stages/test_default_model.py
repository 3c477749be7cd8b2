"""The default model (SmolLM2-135M-Instruct, DESIGN.md §9) through chained stages equals
transformers on the same converted folder: logits for S = 1..4, and greedy generation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from stages.config import ModelConfig
from tests.stages.conftest import Chain, drive_teacher_forced, greedy_generate

try:
    from launch.prepare_model import prepare_default_model
except ImportError as exc:  # pragma: no cover - only while launch/ is being written
    pytest.skip(f"launch.prepare_model is not importable ({exc})", allow_module_level=True)

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colours:",
    "Water boils at",
]
KV_BUDGET = 64 << 20
LOGIT_TOLERANCE = 2e-3
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return prepare_default_model(quiet=True)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(text)["input_ids"] for text in PROMPTS]


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Iterator[LlamaForCausalLM]:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield model
    del model


@pytest.fixture(scope="module")
def hf_greedy(hf: LlamaForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                top_p=None,
                top_k=None,
                temperature=None,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_config_is_the_default_model(model_dir: Path) -> None:
    config = ModelConfig.from_folder(model_dir)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.tie_word_embeddings and config.vocab_size == 49152


@pytest.mark.parametrize("pp_size", [1, 2, 3, 4])
def test_logits_match_transformers(
    model_dir: Path, hf: LlamaForCausalLM, prompts: list[list[int]], pp_size: int
) -> None:
    from stages.partition import default_partition

    chain = Chain(model_dir, default_partition(30, pp_size), kv_budget_bytes=KV_BUDGET)
    # Prompts plus 4 teacher-forced decode steps, prefilled in chunks of 4 tokens.
    seqs = [p + [260, 1012, 30, 7] for p in prompts]
    got = drive_teacher_forced(chain, seqs, [len(p) for p in prompts], chunk_size=4, stagger=1)
    with torch.inference_mode():
        for seq, logits in zip(seqs, got):
            expected = hf(torch.tensor([seq])).logits[0].float()
            diff = (logits - expected).abs().max().item()
            assert diff < LOGIT_TOLERANCE, f"S={pp_size}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("pp_size", [1, 2, 3, 4])
def test_greedy_generation_matches_transformers(
    model_dir: Path, prompts: list[list[int]], hf_greedy: list[list[int]], pp_size: int
) -> None:
    from stages.partition import default_partition

    chain = Chain(model_dir, default_partition(30, pp_size), kv_budget_bytes=KV_BUDGET)
    eos = ModelConfig.from_folder(model_dir).eos_token_ids
    got = greedy_generate(chain, prompts, NEW_TOKENS, eos)
    assert got == hf_greedy


@pytest.mark.parametrize("path", ["native", "torch"])
def test_bfloat16_answers_like_transformers_in_bfloat16(
    model_dir: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 rounds where transformers rounds (RMSNorm: the normalized row, then the product
    with the weight). Rounding once instead answered this prompt "L'Étoile, la Marseillaise"."""
    from transformers import AutoTokenizer

    from tests.stages.conftest import without_native_kernels

    if path == "torch":
        without_native_kernels(monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    chain = Chain(model_dir, [30], dtype="bfloat16", kv_budget_bytes=KV_BUDGET)
    eos = ModelConfig.from_folder(model_dir).eos_token_ids
    (answer,) = greedy_generate(chain, [prompt], 12, eos)
    assert tokenizer.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."


def test_bfloat16_stages_hold_the_gguf_matrices_as_codes_with_the_same_logits(
    model_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernels multiply bf16 themselves, a bf16 stage holds every matrix of the
    default model (Q4_1 layers, a Q8_0 embedding) as its codes, at PP = 2 (the tied lm_head
    split off). Decoded to bf16 (PPRING_GRID_ACTIVATIONS=bf16), a few rows read under half the
    bytes and the logits equal the bf16 panels' bit for bit; times int8 activations (the
    default, where the CPU has VNNI too), every call reads the codes alone and the logits stay
    near the panels'."""
    from stages.backend.cpu import grid, linear, native
    from stages.backend.cpu.linear import CpuBf16Linear, GridA8Linear, GridBf16Linear
    from stages.backend.switches import AMX_ROWS_ENV

    kernels = native.kernels()
    if kernels is None or not kernels.bf16_dot:
        pytest.skip("no AVX512_BF16 here: a bf16 stage multiplies with torch")
    seqs = [p + [260, 1012, 30, 7] for p in prompts]
    starts = [len(p) for p in prompts]

    def run(kind: type) -> tuple[list[torch.Tensor], int]:
        chain = Chain(model_dir, [15, 15], dtype="bfloat16", kv_budget_bytes=KV_BUDGET)
        matrices = [
            m for s in chain.stages for m in s.model.modules() if hasattr(m, "out_features")
        ]
        assert matrices and all(isinstance(m, kind) for m in matrices)
        one_row = sum(s.weight_bytes_read(1) for s in chain.stages)
        return drive_teacher_forced(chain, seqs, starts, chunk_size=4, stagger=1), one_row

    # the codes up to code_rows rows (the prefill chunks and decodes here), panels above; the
    # panels of both kinds on AMX tiles (where the CPU has them) from the same rows
    monkeypatch.setenv(linear.GRID_ACTIVATIONS_ENV, "bf16")
    monkeypatch.setenv(linear.CODE_ROWS_ENV, "3")
    monkeypatch.setenv(AMX_ROWS_ENV, "3")
    coded, coded_bytes = run(GridBf16Linear)
    # the default where the CPU has VNNI too: the codes alone, times int8 activations
    monkeypatch.delenv(linear.GRID_ACTIVATIONS_ENV)
    a8, a8_bytes = run(GridA8Linear) if kernels.a8_dot else (None, 0)
    monkeypatch.setenv(grid.DISABLE_ENV, "0")
    plain, plain_bytes = run(CpuBf16Linear)
    assert coded_bytes < plain_bytes * 0.5  # (the first stage keeps a bf16 embedding)
    for a, b in zip(coded, plain):
        assert torch.equal(a, b)
    if a8 is None:
        return
    # the same codes in another order, and near the panels' logits: the int8 grid of x moves
    # them by 8% of their norm (median over rows; up to ~50% where the top logits are close),
    # against 2% between the panels and fp32, and keeps the next token on most rows (42 of 48
    # on a Zen 4 EPYC); a wrong kernel moves them by their whole norm
    assert a8_bytes == coded_bytes
    drift = torch.cat([(a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)
                       for a, b in zip(a8, plain)])  # fmt: skip
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(a8, plain))
    assert drift.median() < 0.15 and drift.max() < 0.7, drift
    assert same >= 0.75 * drift.numel(), f"{same} of {drift.numel()} rows kept their argmax"
