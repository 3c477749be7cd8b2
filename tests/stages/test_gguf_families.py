"""GGUF files of Gemma 2, Gemma 3, Phi-3 (with and without LongRoPE), OLMo 2 and Granite,
written as llama.cpp's converter writes them (tests/tiny_gguf.py: Gemma's norms as 1 + w,
Phi-3's fused q/k/v and gate/up, its LongRoPE factors as tensors, Granite's q/k rows in
llama.cpp's order, the families' metadata): transformers reads the same weights from each
file it can read (not OLMo 2's or Granite's) as from its folder (the naming is the format's,
not only ours); ppring
reads the same config from the file as from the folder, and its logits and greedy tokens from
the file equal transformers' from the folder, on every CPU path, at PP 1 and 2."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.config import ModelConfig
from stages.gguf_file import stage_tensors
from stages.gguf_matrix import GgufMatrix
from tests.stages.conftest import Chain, drive_teacher_forced, greedy_generate
from tests.stages.test_families import (  # noqa: F401
    assert_matches_hf,
    assert_path_taken,
    compute_path,
    hf_model,
)
from tests.stages.test_parity import random_seqs
from tests.tiny_families import (
    TOKENIZER_EOS_ID,
    TOKENIZER_VOCAB,
    make_tiny_gemma,
    make_tiny_granite,
    make_tiny_olmo2,
    make_tiny_phi3,
)
from tests.tiny_gguf import write_gguf

FAMILIES = ("gemma2", "gemma3", "phi3", "phi3-longrope", "olmo2", "granite")
# a mix of formats where K allows (hidden 64: legacy blocks of 32), F32 norms
FORMATS = {
    "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_qkv": "Q8_0", "ffn_gate": "Q4_0",
    "ffn_up": "Q4_0", "ffn_down": "Q4_0", "token_embd": "F16",
}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (its Hugging Face folder, its GGUF file in F32: the folder's exact values)."""
    root = tmp_path_factory.mktemp("gguf-families")
    shape = {"vocab": TOKENIZER_VOCAB, "tokenizer": True}
    folders = {
        "gemma2": make_tiny_gemma(root / "gemma2", version=2, llama_cpp=True, **shape),
        "gemma3": make_tiny_gemma(
            root / "gemma3", version=3, num_layers=6, llama_cpp=True, **shape
        ),
        "phi3": make_tiny_phi3(root / "phi3", window=40, **shape),
        "phi3-longrope": make_tiny_phi3(root / "phi3-longrope", longrope=True, **shape),
        "olmo2": make_tiny_olmo2(root / "olmo2", **shape),
        "granite": make_tiny_granite(root / "granite", **shape),
    }
    out = {}
    for name, folder in folders.items():
        (root / f"{name}-gguf").mkdir()
        out[name] = (folder, write_gguf(folder, root / f"{name}-gguf" / f"{name}.gguf"))
    return out


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3"])
def test_transformers_reads_the_folder_s_weights_from_the_file(
    files: dict[str, tuple[Path, Path]], family: str
) -> None:
    folder, path = files[family]
    from_file = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    from_folder = hf_model(folder).state_dict()
    for name, weight in from_folder.items():
        if name == "lm_head.weight" and name not in from_file:
            continue  # tied
        if family.startswith("gemma") and name.endswith("norm.weight"):
            # the file holds 1 + w, rounded: w itself is not in it, but 1 + w, what the
            # norm multiplies by, is the folder's exactly
            assert torch.equal(1 + from_file[name], 1 + weight), name
            continue
        assert torch.equal(from_file[name], weight), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_from_the_file_is_the_folder_s(
    files: dict[str, tuple[Path, Path]], family: str
) -> None:
    folder, path = files[family]
    ours, theirs = ModelConfig.from_path(path), ModelConfig.from_folder(folder)
    for field in (
        "architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
        "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_theta", "rope_scaling",
        "partial_rotary_factor", "embedding_multiplier", "attention_multiplier",
        "final_logit_softcap", "layer_windows", "sliding_rope_theta", "rope_long_from",
    ):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.layer_spec == theirs.layer_spec


@pytest.mark.parametrize("split", [[4], [2, 2]], ids=["PP1", "PP2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_from_the_file_equal_transformers_from_the_folder(
    files: dict[str, tuple[Path, Path]],
    family: str,
    split: list[int],
    compute_path: str,  # noqa: F811
) -> None:
    folder, path = files[family]
    layers = ModelConfig.from_path(path).num_layers
    split = [layers] if len(split) == 1 else [layers // 2, layers - layers // 2]
    chain = Chain(path, split)
    assert_path_taken(chain, compute_path)
    prompt_lens = [50, 9]  # past the windows (32, Phi-3's 40)
    seqs = random_seqs([n + 5 for n in prompt_lens], seed=11)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=16)
    assert_matches_hf(folder, seqs, logits)
    prompts = random_seqs([6, 20], seed=12)
    got = greedy_generate(chain, prompts, max_new_tokens=8, eos_ids=[TOKENIZER_EOS_ID])
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.inference_mode():
            out = hf_model(folder).generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
            )
        assert tokens == out[0, len(prompt) :].tolist()[: len(tokens)]


@pytest.mark.parametrize("family", ["gemma2", "phi3", "granite"])
def test_a_quantized_family_file_holds_its_codes(
    files: dict[str, tuple[Path, Path]], family: str, tmp_path: Path
) -> None:
    """The same folder in Q8_0/Q4_0 matrices: the stage holds them as codes, and its logits
    are transformers' on the file's own (dequantized) values (which move them)."""
    folder, _ = files[family]
    (tmp_path / "q").mkdir()
    path = write_gguf(folder, tmp_path / "q" / "m.gguf", FORMATS)
    chain = Chain(path, [2, 2])
    layer = chain.stages[0].model.layers[0]
    assert layer.qkv_proj.grid.name == "Q8_0"
    assert layer.gate_up_proj.grid.name == "Q4_1"  # Q4_0's codes, held as d q + m
    seqs = random_seqs([30], seed=13)
    (logits,) = drive_teacher_forced(chain, seqs, [25])
    # transformers on the folder's config (its GGUF reader leaves Phi-3's partial rotary,
    # Gemma 2's caps at their defaults) with the file's values in place of the folder's
    config = ModelConfig.from_path(path)
    reference = copy.deepcopy(hf_model(folder))
    weights = reference.state_dict()
    names = [n for n in weights if n != "lm_head.weight" or not config.tie_word_embeddings]
    with torch.inference_mode():
        for name, value in stage_tensors(path, names, config).items():
            value = value.dequantize() if isinstance(value, GgufMatrix) else torch.tensor(value)
            weights[name].copy_(value)
        expected = reference(torch.tensor(seqs)).logits[0]
        folder_logits = hf_model(folder)(torch.tensor(seqs)).logits[0]
    error = (logits - expected).abs().max().item()
    moved = (expected - folder_logits).abs().max().item()  # what quantizing did
    assert error < 1e-4 and error < moved / 50
