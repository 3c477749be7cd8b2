"""A model given as one GGUF file (stages/gguf_file.py): tiny Llama and Qwen2 models written with
the `gguf` package in mixed formats (tests/tiny_gguf.py), against transformers loading the same
file (`from_pretrained(..., gguf_file=...)`): the config from the metadata, every format's
weights exactly the package's dequantization, logits and greedy tokens at PP = 1, 2, 3 on the
CPU paths; a format or an architecture ppring does not serve is one sentence."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.backend.switches import GRID_WEIGHTS_ENV
from stages.config import ModelConfig
from stages.errors import ConfigError
from stages.gguf_file import SERVED_FORMATS, hf_name, open_gguf, stage_tensors
from stages.gguf_matrix import GgufMatrix
from tests.stages.conftest import Chain, drive_teacher_forced, greedy_generate
from tests.stages.test_families import assert_path_taken, compute_path  # noqa: F401
from tests.stages.test_parity import random_seqs
from tests.tiny_families import TOKENIZER_EOS_ID, TOKENIZER_VOCAB, byte_level_tokenizer
from tests.tiny_gguf import tiny_gguf_pair, write_gguf
from tests.tiny_llama import make_tiny_llama

TOLERANCE = 1e-4  # max abs logit difference, fp32
MIN_MARGIN = 1e-3
PARTITIONS = {"PP1": [4], "PP2": [2, 2], "PP3": [1, 2, 1]}
# Every matrix format in one model (the k-quants where K is a multiple of 256)
LLAMA_FORMATS = {
    "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q8_0",
    "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "F16",
    "output": "BF16",
}  # fmt: skip
# A k-quant in every matrix: q, k and v a join of three (held with d and m per 16, as a
# Q4_K_M file's q, k in Q4_K and v in Q6_K are), gate and up one of two (held as Q5_K)
LLAMA_K_FORMATS = {
    "attn_q": "Q5_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q6_K",
    "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K",
    "output": "Q4_K",
}  # fmt: skip
QWEN2_FORMATS = {
    "attn_q": "Q8_0", "attn_k": "Q6_K", "attn_v": "Q4_K", "attn_output": "Q5_K",
    "ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q4_0", "token_embd": "Q8_0",
}  # fmt: skip


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> a GGUF file in a folder of its own (transformers loads it as folder + name)."""
    formats = {"llama": LLAMA_FORMATS, "qwen2": QWEN2_FORMATS}
    root = tmp_path_factory.mktemp("gguf")
    files = tiny_gguf_pair(root, formats, seeds=(3, 4, 5))
    (root / "llama-k").mkdir()  # the Llama again, every matrix a k-quant
    files["llama-k"] = write_gguf(
        root / "llama-hf", root / "llama-k" / "llama-k.gguf", LLAMA_K_FORMATS, seed=6
    )
    return files


_HF: dict[Path, torch.nn.Module] = {}


def hf_gguf(path: Path) -> torch.nn.Module:
    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    return _HF[path]


def test_the_config_comes_from_the_metadata(gguf_files: dict[str, Path]) -> None:
    llama = ModelConfig.from_path(gguf_files["llama"])
    assert (llama.architecture, llama.hidden_size, llama.num_layers) == ("LlamaForCausalLM", 256, 4)
    assert (llama.num_heads, llama.num_kv_heads, llama.vocab_size) == (4, 2, TOKENIZER_VOCAB)
    assert llama.eos_token_ids == (TOKENIZER_EOS_ID,) and not llama.tie_word_embeddings
    qwen2 = ModelConfig.from_path(gguf_files["qwen2"])
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.layer_spec.qkv_bias
    assert qwen2.rope_theta == 1_000_000.0


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_every_format_loads_as_the_package_dequantizes_it(
    gguf_files: dict[str, Path], model: str
) -> None:
    """Bit for bit the gguf package's dequantization (transformers' too), q and k in Hugging
    Face's row order where the file is a llama's (a quantized matrix's rows of blocks moved
    as whole rows)."""
    path = gguf_files[model]
    reader = open_gguf(path)
    config = ModelConfig.from_path(path)
    seen = set()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        assert name is not None
        (got,) = stage_tensors(path, [name], config).values()
        if isinstance(got, GgufMatrix):  # a quantized matrix stays its blocks
            assert got.formats == (tensor.tensor_type.name,)
            got = got.dequantize().numpy()
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if model == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            expected = expected.reshape(heads, -1, 2, expected.shape[-1]).swapaxes(1, 2)
        assert np.array_equal(got.reshape(-1), np.asarray(expected, np.float32).reshape(-1))
        seen.add(tensor.tensor_type.name)
    wanted = {*(LLAMA_FORMATS if model == "llama" else QWEN2_FORMATS).values(), "F32"}
    assert seen == wanted


@pytest.mark.parametrize("split", list(PARTITIONS))
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_logits_and_greedy_tokens_equal_transformers_from_the_file(
    gguf_files: dict[str, Path],
    model: str,
    split: str,
    compute_path: str,  # noqa: F811
) -> None:
    path = gguf_files[model]
    chain = Chain(path, PARTITIONS[split])
    assert_path_taken(chain, compute_path)
    prompt_lens = [40, 9, 1]
    seqs = random_seqs([n + 6 for n in prompt_lens], seed=2)
    logits = drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=16, stagger=1)
    with torch.inference_mode():
        for seq, got in zip(seqs, logits, strict=True):
            expected = hf_gguf(path)(torch.tensor([seq])).logits[0]
            assert (got - expected).abs().max().item() < TOLERANCE
    prompts = random_seqs([7, 23], seed=8)
    got_tokens = greedy_generate(chain, prompts, max_new_tokens=12, eos_ids=[TOKENIZER_EOS_ID])
    for prompt, tokens in zip(prompts, got_tokens, strict=True):
        with torch.inference_mode():
            out = hf_gguf(path).generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        for step in out.logits:
            best, second = step[0].topk(2).values.tolist()
            assert best - second > MIN_MARGIN  # a different token is ppring's error
        assert tokens == out.sequences[0, len(prompt) :].tolist()


def test_the_tokenizer_comes_from_the_file(gguf_files: dict[str, Path]) -> None:
    from launch.prepare_model import load_tokenizer

    path = gguf_files["llama"]
    folder_tokenizer = AutoTokenizer.from_pretrained(path.parent.parent / "llama-hf")
    for text in ("The capital of France is", "日本 <|endoftext|>"):
        assert load_tokenizer(path)(text).input_ids == folder_tokenizer(text).input_ids


def test_a_format_not_served_is_one_sentence_naming_those_served(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "hf", hidden=256, intermediate=512, vocab=TOKENIZER_VOCAB)
    byte_level_tokenizer().save_pretrained(folder)
    path = write_gguf(folder, tmp_path / "m.gguf", {"ffn_down": "Q2_K"}, default_format="F16")
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_path(path)
    message = str(error.value)
    assert "Q2_K" in message and all(name in message for name in SERVED_FORMATS)
    assert "\n" not in message


def test_an_architecture_not_served_is_one_sentence(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="'gpt2' model; ppring serves GGUF files of llama"):
        ModelConfig.from_path(tmp_path / "m.gguf")


def test_the_start_up_line_names_each_groups_format(gguf_files: dict[str, Path]) -> None:
    from stages.gguf_file import formats_line

    line = formats_line(gguf_files["llama"], "float32")
    for group, fmt in LLAMA_FORMATS.items():
        assert f"{group} {fmt}" in line
    assert "MiB of matrices" in line and "as float32 values" in line and "\n" not in line


def test_llama3_rope_freqs_turn_as_the_folder_s_rope_scaling(tmp_path: Path) -> None:
    """A Llama 3.x GGUF holds its rotary scaling as rope_freqs, one divisor a frequency
    (llama.cpp's converter): ppring's logits equal transformers' on the Hugging Face folder
    with the same rope_scaling (whose effect is checked to be large here)."""
    rope = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0,
    }  # fmt: skip
    folder = make_tiny_llama(
        tmp_path / "hf", hidden=256, intermediate=512, vocab=TOKENIZER_VOCAB, rope_scaling=rope
    )
    byte_level_tokenizer().save_pretrained(folder)
    path = write_gguf(folder, tmp_path / "llama3.gguf", {"attn_q": "Q8_0"})
    config = ModelConfig.from_path(path)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "freq_factors"
    chain = Chain(path, [2, 2])
    seq = random_seqs([120], seed=6)[0]
    (got,) = drive_teacher_forced(chain, [seq], [100])
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    from_gguf_weights = reference.state_dict()  # the file's Q8_0 q_proj, not the folder's
    q_names = [n for n in from_gguf_weights if n.endswith("q_proj.weight")]
    dequantized = stage_tensors(path, q_names, config)
    with torch.no_grad():
        for name in q_names:
            from_gguf_weights[name].copy_(dequantized[name].dequantize())
        expected = reference(torch.tensor([seq])).logits[0]
        assert (got - expected).abs().max().item() < TOLERANCE
        reference.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        unscaled = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, rope_parameters=reference.config.rope_parameters
        ).eval()
        unscaled.load_state_dict(from_gguf_weights)
        moved = (unscaled(torch.tensor([seq])).logits[0] - expected).abs().max().item()
    assert moved > 100 * TOLERANCE


BF16_TOLERANCE = 0.02  # as test_families': the tiny models' logits are O(0.1)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_bfloat16_multiplies_the_codes_and_stays_close_to_transformers(
    gguf_files: dict[str, Path],
    model: str,
    compute_path: str,  # noqa: F811
) -> None:
    """A bf16 stage holds each matrix whose parts share a layout as codes read from the blocks
    (the k-quants too), on every CPU path; the logits stay within bf16's reach of
    transformers' fp32 ones from the same file."""
    path = gguf_files[model]
    chain = Chain(path, [2, 2], dtype="bfloat16")
    assert_path_taken(chain, compute_path)
    layer = chain.stages[1].model.layers[0]
    held = {
        name: getattr(getattr(layer, f"{name}_proj"), "grid", None)
        for name in ("qkv", "o", "gate_up", "down")
    }
    if compute_path == "torch":
        assert all(grid is None for grid in held.values())
    elif model == "llama":  # q Q4_0, k Q4_1, v Q5_0: no one width; gate Q4_K + up Q5_K
        assert held["qkv"] is None and held["o"].name == "Q8_0"
        assert (held["gate_up"].name, held["down"].name) == ("Q5_K", "Q6_K")
    else:  # q Q8_0, k Q6_K, v Q4_K; gate Q4_1 + up Q5_0: 4 bits and 8
        assert held["qkv"] is None and held["gate_up"] is None
        assert (held["o"].name, held["down"].name) == ("Q5_K", "Q4_1")
    prompt_lens = [30, 9]
    seqs = random_seqs([n + 5 for n in prompt_lens], seed=5)
    logits = drive_teacher_forced(chain, seqs, prompt_lens)
    with torch.inference_mode():
        for seq, got in zip(seqs, logits, strict=True):
            expected = hf_gguf(path)(torch.tensor([seq])).logits[0]
            assert (got.float() - expected).abs().max().item() < BF16_TOLERANCE


def test_a_k_quant_model_runs_its_codes_fused_as_call_by_call(
    gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every matrix a k-quant held as its codes: the layers in one C call (one team, the
    quantized rows shared) give the call-by-call results bit for bit; their distance from
    transformers' fp32 logits is about bf16's own (the dequantized weights in bf16 panels)."""
    from stages.backend.cpu import fused_layer

    path = gguf_files["llama-k"]
    prompt_lens = [24, 7]
    seqs = random_seqs([n + 4 for n in prompt_lens], seed=9)
    results = []
    for fused in ("1", "0"):
        monkeypatch.setenv(fused_layer.DISABLE_ENV, fused)
        chain = Chain(path, [2, 2], dtype="bfloat16")
        assert (chain.stages[0].model.fused is not None) == (fused == "1")
        names = {
            proj.grid.name
            for stage in chain.stages
            for layer in stage.model.layers
            for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        }
        assert names == {"Q4_K+Q5_K+Q6_K", "Q6_K", "Q4_K"}
        assert chain.stages[1].model.lm_head.grid.name == "Q4_K"
        results.append(drive_teacher_forced(chain, seqs, prompt_lens))
    for got, layered in zip(*results, strict=True):
        assert torch.equal(got, layered)
    monkeypatch.setenv(GRID_WEIGHTS_ENV, "0")  # the same weights as bf16 panels
    panels = drive_teacher_forced(Chain(path, [2, 2], dtype="bfloat16"), seqs, prompt_lens)
    with torch.inference_mode():
        for seq, got, bf16 in zip(seqs, results[0], panels, strict=True):
            expected = hf_gguf(path)(torch.tensor([seq])).logits[0]
            error, own = ((t.float() - expected).abs().mean().item() for t in (got, bf16))
            assert error < 1.25 * own


@pytest.mark.parametrize("model", ["llama", "qwen2", "llama-k"])
def test_the_header_reads_as_the_gguf_package_reads_it(
    gguf_files: dict[str, Path], model: str
) -> None:
    """stages/gguf_header.py against the package's GGUFReader: every field (the tokenizer's
    string arrays by length), every tensor's type, shape and bytes."""
    from stages.gguf_header import COUNTED, read_header

    path = gguf_files[model]
    ours, theirs = read_header(path), gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own pseudo-fields (version, counts)
            continue
        value = field.contents()
        if key in COUNTED:
            assert len(ours.fields[key]) == len(value) > 0
        else:
            assert ours.fields[key] == value, key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, their in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (their.name, their.tensor_type)
        assert list(mine.shape) == [int(n) for n in their.shape]
        assert mine.n_bytes == int(their.n_bytes)
        raw = np.asarray(their.data).view(np.uint8).reshape(-1)
        assert np.array_equal(mine.data.reshape(-1), raw)


def test_a_cut_file_is_one_sentence(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    whole = gguf_files["llama"].read_bytes()
    for size in (3, 100, len(whole) // 2):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        with pytest.raises(ConfigError, match="is not a readable GGUF file") as error:
            ModelConfig.from_path(cut)
        assert "\n" not in str(error.value)


def test_the_file_s_tokenizer_is_rebuilt_once_then_read_from_the_cache(
    gguf_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launch import prepare_model

    monkeypatch.setenv("PPRING_CACHE", str(tmp_path))
    path = gguf_files["qwen2"]
    first = prepare_model.load_tokenizer(path)
    (saved,) = (tmp_path / "tokenizers").iterdir()
    assert saved.name.startswith("qwen2-") and (saved / prepare_model.MARKER_NAME).is_file()
    built = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: built.append(k) or first)
    prepare_model.load_tokenizer(path)
    assert built == [{}]  # from the saved folder, not the file (no gguf_file=)
    monkeypatch.undo()
    monkeypatch.setenv("PPRING_CACHE", str(tmp_path))
    again = prepare_model.load_tokenizer(path)
    text = "pipeline parallelism, in two sentences \u00fc 42"
    assert again(text)["input_ids"] == first(text)["input_ids"]
    assert (again.eos_token_id, len(again)) == (first.eos_token_id, len(first))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_split_lm_head_takes_rows_of_the_file_s_blocks(
    gguf_files: dict[str, Path], dtype: str
) -> None:
    """The lm_head split over both ends: each holds its rows of the file's blocks (Q4_K codes
    in bf16), and the greedy tokens are the unsplit chain's."""
    path = gguf_files["llama-k"]
    split = Chain(path, [2, 2], dtype=dtype, split_lm_head=True)
    assert split.split_lm_head
    if dtype == "bfloat16":
        heads = [stage.model.lm_head for stage in split.stages]
        assert all(head.grid.name == "Q4_K" for head in heads)
        assert sum(head.out_features for head in heads) == TOKENIZER_VOCAB
    prompts = random_seqs([9, 26], seed=14)
    got = greedy_generate(split, prompts, max_new_tokens=10, eos_ids=[TOKENIZER_EOS_ID])
    whole = Chain(path, [2, 2], dtype=dtype)
    assert got == greedy_generate(whole, prompts, max_new_tokens=10, eos_ids=[TOKENIZER_EOS_ID])
