"""The Qwen2, Qwen3, Phi-3 (with and without LongRoPE), OLMo 2 and Granite families
(tests/tiny_families.py) against transformers, in one process:
chained stages give transformers' logits and greedy tokens at PP = 1, 2, 3 on every path a CPU
stage can take (the layers fused into one C call, the layers one kernel call at a time, torch
alone), the kept decode buffers equal the general path bit for bit, bf16 stays close, a split
lm_head and tied embeddings give the same tokens, and the GPU's layout (gathered K/V, decode
graphs, queued steps) forced on the CPU does too. An architecture ppring does not serve is one
sentence naming those it does."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.harness import ThreadRing
from ring.loop import ModelInfo
from stages.backend.cpu import fused_layer, native
from stages.backend.cuda.graphs import EagerRecorder
from stages.config import ModelConfig
from stages.errors import ConfigError
from stages.partition import layer_range
from stages.runner import StageRunner
from tests.stages.conftest import (
    Chain,
    decode_logits,
    drive_teacher_forced,
    greedy_generate,
    without_native_kernels,
)
from tests.stages.test_config import LLAMA_V4_CONFIG, write_config
from tests.stages.test_cpu_decode import drive, kept_calls
from tests.stages.test_fused_layer import needs_bf16_dot
from tests.stages.test_parity import random_seqs
from tests.tiny_families import (
    EOS_TOKEN_ID,
    LONGROPE_ORIGINAL,
    TINY_WINDOW,
    make_tiny_gemma,
    make_tiny_granite,
    make_tiny_mistral,
    make_tiny_olmo2,
    make_tiny_phi3,
    make_tiny_qwen2,
    make_tiny_qwen3,
)

TOLERANCE = 1e-4  # max abs logit difference, fp32 (as test_parity's)
BF16_TOLERANCE = 0.02  # as test_parity's bf16 test: the tiny models' logits are O(0.1)

GREEDY_INIT_STD = 0.2  # tests/tiny_families.py's init_std for the folders of greedy tests
MIN_MARGIN = 1e-3  # transformers' greedy path keeps its best logit this far above the next

FAMILIES = [
    "qwen2", "qwen3", "phi3", "phi3-longrope", "olmo2", "granite", "mistral-window", "gemma2",
    "gemma3",
]  # fmt: skip
TIED = ["qwen2-tied", "qwen3-tied", "granite-tied"]
MAKERS = {
    "qwen2": make_tiny_qwen2, "qwen3": make_tiny_qwen3, "phi3": make_tiny_phi3,
    "phi3-longrope": lambda path, **kw: make_tiny_phi3(path, longrope=True, **kw),
    "olmo2": make_tiny_olmo2,
    "granite": lambda path, **kw: make_tiny_granite(path, tied=False, **kw),
    "mistral-window": make_tiny_mistral,
    "gemma2": make_tiny_gemma,
    "gemma3": lambda path, **kw: make_tiny_gemma(path, version=3, **kw),
}  # fmt: skip
# (seed, the greedy folder's seed): greedy folders whose prompts below meet no near tie
SEEDS = {
    "qwen2": (21, 25), "qwen3": (22, 26), "phi3": (41, 45), "phi3-longrope": (51, 58),
    "olmo2": (61, 65), "granite": (71, 81), "mistral-window": (91, 95), "gemma2": (101, 105),
    "gemma3": (111, 115),
}  # fmt: skip
PARTITIONS = {"PP1": [4], "PP2": [2, 2], "PP3": [1, 2, 1]}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> folder, 4 layers each. "qwen2": GQA with q/k/v biases; "qwen3": GQA, q_norm and
    k_norm, head_dim 32 (4 heads x 32 = 128 != hidden 64). At transformers' init their logits
    are O(0.1), as the Llama tests' are, but Qwen2's greedy text is one token whatever the
    prompt (its v bias outweighs the rest), so the tests of greedy tokens take "-greedy"
    folders, initialised 10x wider, whose text follows the prompt. The tied ones are such too,
    and vary the heads: MHA for Qwen2, MQA with 8 heads of 16 for Qwen3."""
    root = tmp_path_factory.mktemp("tiny-families")
    wide = GREEDY_INIT_STD
    folders = {}
    for name, make in MAKERS.items():
        seed, greedy_seed = SEEDS[name]
        folders[name] = make(root / name, seed=seed)
        folders[f"{name}-greedy"] = make(root / f"{name}-greedy", seed=greedy_seed, init_std=wide)
    return {
        **folders,
        "granite-tied": make_tiny_granite(root / "granite-tied", seed=99, init_std=wide),
        "qwen2-tied": make_tiny_qwen2(
            root / "qwen2-tied", tied=True, kv_heads=4, seed=23, init_std=wide
        ),
        "qwen3-tied": make_tiny_qwen3(
            root / "qwen3-tied",
            tied=True,
            heads=8,
            kv_heads=1,
            head_dim=16,
            seed=24,
            init_std=wide,
        ),
    }


_HF_CACHE: dict[Path, PreTrainedModel] = {}


def hf_model(folder: Path) -> PreTrainedModel:
    """transformers' model of the folder's own architecture (conftest's hf_model is Llama's),
    loaded once per session."""
    if folder not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert type(model).__name__ == model.config.architectures[0]
        _HF_CACHE[folder] = model
    return _HF_CACHE[folder]


@torch.inference_mode()
def hf_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    """[len, V] fp32 logits of one unpadded sequence from transformers."""
    return hf_model(folder)(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(
    folder: Path, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True
) -> list[int]:
    """transformers' greedy continuation, ending at EOS (kept) as greedy_generate's does; or,
    not `stop_at_eos`, all max_new_tokens of it, as a ring's ignore_eos request (EOS is then
    never the best token, so the suppression that min_new_tokens adds changes nothing). Each
    step's best logit is at least MIN_MARGIN above the next, so a token ppring picks otherwise
    is ppring's error, not a near tie that rounding could flip."""
    out = hf_model(folder).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=0 if stop_at_eos else max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    for step, logits in enumerate(out.logits):  # each [1, V], before any processor
        (best, second), (best_token, _) = logits[0].float().topk(2)
        assert best - second > MIN_MARGIN, f"a near tie at step {step}: pick other prompts"
        assert stop_at_eos or best_token != EOS_TOKEN_ID, f"EOS at step {step}"
    return out.sequences[0, len(prompt) :].tolist()


def assert_matches_hf(
    folder: Path, seqs: list[list[int]], logits: list[torch.Tensor], tolerance: float = TOLERANCE
) -> None:
    for seq, got in zip(seqs, logits, strict=True):
        expected = hf_logits(folder, seq)
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff < tolerance, f"sequence of {len(seq)} tokens: max abs diff {diff:.2e}"


@pytest.fixture(params=["fused", "layered", "torch"])
def compute_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The three ways a CPU stage computes its layers: with ppring's CPU kernels all in one C
    call (the default), with them one Python call per kernel (PPRING_FUSED_LAYERS=0), or with
    torch alone (as with no C compiler, or PPRING_NATIVE_KERNELS=0)."""
    if request.param == "torch":
        without_native_kernels(monkeypatch)
    else:
        assert native.kernels() is not None, native.unavailable_reason()
        monkeypatch.setenv(fused_layer.DISABLE_ENV, "1" if request.param == "fused" else "0")
    return request.param


def assert_path_taken(chain: Chain, path: str) -> None:
    """Every stage of `chain` computes as `compute_path` asked, not on some fallback."""
    for stage in chain.stages:
        assert stage.attention == ("gather" if path == "torch" else "paged")
        assert (stage.model.fused is not None) == (path == "fused")


# --- the folders themselves: what makes the parity below mean something ---------------------


def test_the_folders_hold_what_sets_each_family_apart(family_dirs: dict[str, Path]) -> None:
    qwen2, qwen3 = hf_model(family_dirs["qwen2"]), hf_model(family_dirs["qwen3"])
    attn2, attn3 = qwen2.model.layers[0].self_attn, qwen3.model.layers[0].self_attn
    for proj in (attn2.q_proj, attn2.k_proj, attn2.v_proj):
        assert proj.bias is not None and proj.bias.abs().mean() > 0.2
    assert attn2.o_proj.bias is None
    assert all(p.bias is None for p in (attn3.q_proj, attn3.k_proj, attn3.v_proj, attn3.o_proj))
    assert attn3.q_proj.out_features == 4 * 32 != qwen3.config.hidden_size
    for norm in (attn3.q_norm.weight, attn3.k_norm.weight):
        assert norm.shape == (32,) and (norm - 1).abs().max() > 0.05
    config = ModelConfig.from_folder(family_dirs["qwen3"])
    assert (config.head_dim, config.q_size, config.hidden_size) == (32, 128, 64)
    phi3 = hf_model(family_dirs["phi3-longrope"])
    assert phi3.model.layers[0].self_attn.qkv_proj.out_features == (4 + 2 * 2) * 16
    config = ModelConfig.from_folder(family_dirs["phi3-longrope"])
    assert (config.rotary_dim, config.rope_long_from) == (8, LONGROPE_ORIGINAL)
    assert config.rope_scaling is not None and config.rope_scaling.attention_factor > 1.2
    olmo2 = hf_model(family_dirs["olmo2"]).model.layers[0]
    assert olmo2.self_attn.q_norm.weight.shape == (64,)  # the whole projection
    assert olmo2.self_attn.k_norm.weight.shape == (32,)
    assert not hasattr(olmo2, "input_layernorm")
    granite = ModelConfig.from_folder(family_dirs["granite"])
    assert granite.attention_scale == 0.4 and granite.layer_spec.residual_multiplier == 0.22
    assert (granite.embedding_multiplier, granite.logits_scaling) == (12.0, 8.0)


@torch.inference_mode()
@pytest.mark.parametrize(
    ("model", "suffix", "neutral"),
    [
        ("qwen2", "_proj.bias", 0.0),
        ("qwen3", "q_norm.weight", 1.0),
        ("qwen3", "k_norm.weight", 1.0),
        ("olmo2", "q_norm.weight", 1.0),
        ("olmo2", "post_feedforward_layernorm.weight", 1.0),
        ("gemma3", "q_norm.weight", 0.0),  # Gemma's norms multiply by 1 + w
        ("gemma2", "pre_feedforward_layernorm.weight", 0.0),
    ],
)
def test_leaving_out_a_family_feature_moves_the_logits_far_beyond_the_tolerance(
    family_dirs: dict[str, Path], model: str, suffix: str, neutral: float
) -> None:
    """A stage that skipped the biases, or the q/k norms' weights, could not pass the parity
    tests: transformers itself, so changed, moves the logits by over 100x their tolerance."""
    folder = family_dirs[model]
    seq = random_seqs([24], seed=4)[0]
    expected = hf_logits(folder, seq)
    changed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    touched = [p for name, p in changed.named_parameters() if name.endswith(suffix)]
    assert len(touched) >= 4
    for param in touched:
        param.fill_(neutral)
    moved = (changed(torch.tensor([seq])).logits[0] - expected).abs().max().item()
    assert moved > 100 * TOLERANCE


@torch.inference_mode()
@pytest.mark.parametrize(
    ("model", "override"),
    [
        ("granite", {"embedding_multiplier": 1.0}),
        ("granite", {"residual_multiplier": 1.0}),
        ("granite", {"attention_multiplier": 0.25}),  # 1/sqrt(head_dim)
        ("granite", {"logits_scaling": 1.0}),
        ("phi3", {"partial_rotary_factor": 1.0}),
        ("mistral-window", {"sliding_window": None}),
        ("mistral-window", {"sliding_window": TINY_WINDOW + 1}),  # one more key seen
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma2", {"query_pre_attn_scalar": 32}),  # head_dim's scale
        ("gemma2", {"sliding_window": 2 * TINY_WINDOW}),  # no layer windowed at 64 tokens
        ("gemma3", {"sliding_window": 2 * TINY_WINDOW}),
        ("gemma3", {"rope_parameters": "sliding at the full layers' theta"}),
    ],
)
def test_leaving_out_a_family_scalar_moves_the_logits_far_beyond_the_tolerance(
    family_dirs: dict[str, Path], model: str, override: dict[str, float]
) -> None:
    """As above for what a config sets rather than a weight: Granite's multipliers, Phi-3's
    partial rotary (a stage that turned the whole head could not pass); on the folders of the
    greedy tests, whose logits are not O(0.1). Mistral's window too, and its width to the key."""
    folder = family_dirs[f"{model}-greedy"]
    seq = random_seqs([2 * TINY_WINDOW], seed=4)[0]
    expected = hf_logits(folder, seq)
    config = hf_model(folder).config
    if "partial_rotary_factor" in override:
        rope = dict(config.rope_parameters, **override)
        changed = AutoModelForCausalLM.from_pretrained(folder, rope_parameters=rope, **override)
    elif "rope_parameters" in override:  # Gemma 3's windowed layers at the full ones' rotary
        rope = dict(config.rope_parameters)
        rope["sliding_attention"] = rope["full_attention"]
        changed = AutoModelForCausalLM.from_pretrained(folder, rope_parameters=rope)
    else:
        changed = AutoModelForCausalLM.from_pretrained(folder, **override)
    moved = (changed.eval()(torch.tensor([seq])).logits[0] - expected).abs().max().item()
    assert moved > 100 * TOLERANCE


# --- float32 parity on every CPU path ----------------------------------------------------------


@pytest.mark.parametrize("split", list(PARTITIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_batch_then_decodes_match_transformers(
    family_dirs: dict[str, Path], family: str, split: str, compute_path: str
) -> None:
    # Whole prompts in one batch of 156 rows (more than the fused layers' kept scratch), then
    # 8 decode steps of contexts from 2 to 106 tokens (one to seven blocks).
    folder = family_dirs[family]
    chain = Chain(folder, PARTITIONS[split])
    assert_path_taken(chain, compute_path)
    prompt_lens = [98, 40, 17, 1]
    seqs = random_seqs([n + 8 for n in prompt_lens], seed=2)
    logits = drive_teacher_forced(chain, seqs, prompt_lens)
    assert_matches_hf(folder, seqs, logits)


@pytest.mark.parametrize("split", list(PARTITIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_mixed_with_decodes_matches_transformers(
    family_dirs: dict[str, Path], family: str, split: str, compute_path: str
) -> None:
    # Prompts arrive one step apart and are fed 8 tokens at a time, so most steps mix prefill
    # chunks that have earlier context with other requests' single-token decodes.
    folder = family_dirs[family]
    chain = Chain(folder, PARTITIONS[split])
    assert_path_taken(chain, compute_path)
    prompt_lens = [23, 40, 9, 16]
    seqs = random_seqs([n + 6 for n in prompt_lens], seed=1)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=8, stagger=1)
    assert_matches_hf(folder, seqs, logits)


@pytest.mark.parametrize("split", list(PARTITIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(
    family_dirs: dict[str, Path], family: str, split: str, compute_path: str
) -> None:
    """Through the sampling stage (greedy head, and on the kernels the kept decode buffers),
    not only its logits."""
    folder = family_dirs[f"{family}-greedy"]
    chain = Chain(folder, PARTITIONS[split])
    assert_path_taken(chain, compute_path)
    prompts = random_seqs([5, 31, 12], seed=7)
    got = greedy_generate(chain, prompts, max_new_tokens=16, eos_ids=[EOS_TOKEN_ID])
    assert got == [hf_greedy(folder, prompt, 16) for prompt in prompts]


@pytest.mark.parametrize("model", TIED)
def test_tied_embeddings_match_transformers(
    family_dirs: dict[str, Path], model: str, compute_path: str
) -> None:
    """The first stage's embedding and the last stage's lm_head are one matrix in the folder,
    each stage loading it for its own end."""
    folder = family_dirs[model]
    assert ModelConfig.from_folder(folder).tie_word_embeddings
    chain = Chain(folder, [2, 2])
    assert_path_taken(chain, compute_path)
    prompt_lens = [30, 12, 3]
    seqs = random_seqs([n + 10 for n in prompt_lens], seed=3)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=7, stagger=2)
    assert_matches_hf(folder, seqs, logits)


@pytest.mark.parametrize("model", ["qwen2-greedy", "qwen3-greedy", *TIED])
def test_a_split_lm_head_gives_transformers_greedy_tokens(
    family_dirs: dict[str, Path], model: str, stage_path: str
) -> None:
    """Each end multiplies by half the vocabulary and the first stage samples."""
    folder = family_dirs[model]
    chain = Chain(folder, [2, 2], split_lm_head=True)
    assert chain.split_lm_head
    assert all(stage.split_lm_head for stage in chain.stages)
    prompts = random_seqs([9, 26, 4], seed=9)
    got = greedy_generate(chain, prompts, max_new_tokens=16, eos_ids=[EOS_TOKEN_ID])
    assert got == [hf_greedy(folder, prompt, 16) for prompt in prompts]


# --- LongRoPE: the short factors, then the long ones ------------------------------------------


@pytest.mark.parametrize("split", list(PARTITIONS))
def test_longrope_sequences_turn_long_where_transformers_does(
    family_dirs: dict[str, Path], split: str, compute_path: str
) -> None:
    """transformers turns a forward at LongRoPE's long factors where its positions reach past
    original_max_position_embeddings (64 here): a prompt that long from its prefill on, a
    shorter one from the decode that passes 64 (its earlier K stays as the short factors made
    it), one that never gets there never. The three share every step here; each gets its own."""
    folder = family_dirs["phi3-longrope-greedy"]
    chain = Chain(folder, PARTITIONS[split])
    assert_path_taken(chain, compute_path)
    prompts = random_seqs([LONGROPE_ORIGINAL + 6, LONGROPE_ORIGINAL - 14, 20], seed=12)
    got = greedy_generate(chain, prompts, max_new_tokens=24, eos_ids=[EOS_TOKEN_ID])
    assert got == [hf_greedy(folder, prompt, 24) for prompt in prompts]
    # the middle one crossed: it decoded at both factors
    assert len(prompts[1]) < LONGROPE_ORIGINAL < len(prompts[1]) + len(got[1])


def test_longrope_factors_are_what_set_the_tokens(family_dirs: dict[str, Path]) -> None:
    """The parity above would pass without the long factors if they changed nothing: with the
    short ones everywhere transformers' own tokens differ (and so would ppring's)."""
    folder = family_dirs["phi3-longrope-greedy"]
    prompt = random_seqs([LONGROPE_ORIGINAL + 6], seed=12)[0]
    changed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rope = changed.config.rope_parameters
    rope["long_factor"] = list(rope["short_factor"])
    changed = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, rope_parameters=rope
    ).eval()
    with torch.inference_mode():
        expected = hf_logits(folder, prompt)
        moved = (changed(torch.tensor([prompt])).logits[0] - expected).abs().max().item()
    assert moved > 100 * TOLERANCE


# --- the kept decode buffers, and bf16 ----------------------------------------------------------


@pytest.mark.parametrize(
    ("partition", "split"), [([4], False), ([1, 3], False), ([1, 2, 1], False), ([2, 2], True)]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_kept_decode_steps_equal_the_general_path_bit_for_bit(
    family_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    family: str,
    dtype: str,
    partition: list[int],
    split: bool,
) -> None:
    """As tests/stages/test_cpu_decode.py's test for Llama: the same tokens, seams and cache,
    on every stage role, with decodes between steps that mix prefill chunks and decodes."""
    needs_bf16_dot(dtype)
    folder = family_dirs[family]
    chains = [Chain(folder, partition, dtype=dtype, split_lm_head=split) for _ in range(2)]
    assert all(stage.cpu_decode is not None for stage in chains[0].stages)
    calls = kept_calls(monkeypatch)
    kept, ran = drive(chains[0], kept=True)
    # every decode-only step, each stage; but under Gemma 2's final soft cap the last stage's
    # greedy finish is the general path's (blocks.py: transformers picks among capped logits)
    kept_stages = len(partition) - bool(ModelConfig.from_folder(folder).final_logit_softcap)
    assert ran >= 20 and len(calls) == ran * kept_stages
    calls.clear()
    general, _ = drive(chains[1], kept=False)
    assert not calls
    assert len(kept) == len(general)
    for got_step, expected_step in zip(kept, general, strict=True):
        for got, expected in zip(got_step, expected_step, strict=True):
            if isinstance(expected, tuple):  # a seam (hidden_states, residual) or a share
                assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
            else:
                assert got == expected
    for got_stage, expected_stage in zip(chains[0].stages, chains[1].stages, strict=True):
        assert got_stage.kv is not None and expected_stage.kv is not None
        assert torch.equal(got_stage.kv.data, expected_stage.kv.data)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_stays_close_to_transformers(
    family_dirs: dict[str, Path], family: str, stage_path: str
) -> None:
    folder = family_dirs[family]
    chain = Chain(folder, [2, 2], dtype="bfloat16")
    prompt_lens = [20, 9]
    seqs = random_seqs([n + 4 for n in prompt_lens], seed=4)
    logits = drive_teacher_forced(chain, seqs, prompt_lens)
    assert_matches_hf(folder, seqs, logits, tolerance=BF16_TOLERANCE)


# --- the GPU's layout, forced on the CPU --------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gpu_layout_matches_transformers_on_the_cpu(
    family_dirs: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a GPU stage runs (torch ops, K/V gathered for SDPA, every decode in one padded
    group), forced on the CPU."""
    import stages.inputs

    without_native_kernels(monkeypatch)
    monkeypatch.setattr(stages.inputs, "group_decodes_by_length", lambda device: False)
    folder = family_dirs[family]
    chain = Chain(folder, [2, 2])
    assert all(stage.attention == "gather" for stage in chain.stages)
    prompt_lens = [60, 5, 31, 12]  # decodes of very different lengths share steps
    if family == "phi3-longrope":  # within the short factors' positions (see below)
        prompt_lens[0] = LONGROPE_ORIGINAL - 10
    seqs = random_seqs([n + 10 for n in prompt_lens], seed=9)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=8, stagger=1)
    assert_matches_hf(folder, seqs, logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_decode_logits_are_transformers_logits(
    family_dirs: dict[str, Path], family: str
) -> None:
    """Decode steps through the graphs' static buffers (EagerRecorder stands in for CUDA graph
    capture; on a CPU the graph path reads the cache with the kernels), teacher-forced as the
    batch shrinks 7 -> 1, against transformers."""
    assert native.kernels() is not None, native.unavailable_reason()
    folder = family_dirs[family]
    prompt_lens = [5, 23, 9, 40, 17, 12, 30]
    seqs = random_seqs([p + n for p, n in zip(prompt_lens, [6, 20, 3, 12, 9, 1, 16])], seed=11)
    chain = Chain(folder, [2, 2], cuda_graph_max_bs=4, graph_recorder=EagerRecorder())
    got = decode_logits(chain, seqs, prompt_lens, graphs=True)
    assert all(stage.graphs is not None and stage.graphs.replays > 0 for stage in chain.stages)
    for seq, by_pos in zip(seqs, got, strict=True):
        expected = hf_logits(folder, seq)
        for pos, logits in by_pos.items():
            diff = (logits - expected[pos]).abs().max().item()
            assert diff < 1e-5, f"position {pos}: max abs diff {diff:.2e}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_queued_steps_in_a_ring_give_transformers_greedy_tokens(
    family_dirs: dict[str, Path], family: str
) -> None:
    """A PP=3 ring of real stages on the GPU's path: `launch` returns queued steps
    (stages/device_step.py), decodes replay the graphs' static buffers padded to the captured
    sizes, the lm_head split between the ends; as tests/ring/test_real_ring.py's for Llama."""
    folder = family_dirs[f"{family}-greedy"]
    rng = random.Random(4)  # prompts whose greedy text has no EOS and no near tie
    requests = [
        (f"r{i}", [rng.randrange(3, 256) for _ in range(rng.randint(20, 120))],
         SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        for i in range(6)
    ]  # fmt: skip
    cfg = RingConfig(
        pp_size=3, pp_async_batch_depth=1, max_running_requests=4, chunked_prefill_size=64,
        split_lm_head=True,
    )  # fmt: skip
    partition = PARTITIONS["PP3"]

    def make(c: RingConfig) -> StageRunner:
        start, end = layer_range(partition, c.rank)
        return StageRunner(
            folder, start, end, kv_budget_bytes=4 << 20, rank=c.rank, split_lm_head=True,
            overlap=True, cuda_graph_max_bs=4, graph_recorder=EagerRecorder(),
        )  # fmt: skip

    config = ModelConfig.from_folder(folder)
    info = ModelInfo(context_length=512, rope_long_from=config.rope_long_from)
    with ThreadRing(cfg, make, info, f"{family}-queued") as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=90)
        got = dict(ring.driver.tokens)
        replays = [loop.stage.graphs.replays for loop in ring.loops]
    assert all(n > 0 for n in replays)  # decodes ran through the static buffers
    for rid, prompt, _ in requests:
        assert got[rid] == hf_greedy(folder, prompt, 6, stop_at_eos=False), rid


# --- what is not served -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("architecture", "model_type"),
    [("GemmaForCausalLM", "gemma"), ("GPTNeoXForCausalLM", "gpt_neox")],
)
def test_an_architecture_not_served_is_one_sentence_naming_those_served(
    tmp_path: Path, architecture: str, model_type: str
) -> None:
    raw = {**LLAMA_V4_CONFIG, "architectures": [architecture], "model_type": model_type}
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_folder(write_config(tmp_path, raw))
    message = str(error.value)
    for name in (architecture, "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message
    assert "\n" not in message
