"""Decode steps on kept buffers (backend/cpu/kept_decode.py) compute what the general path computes:
the same tokens, the same seams and the same cache, bit for bit, on every stage role (the only
stage, a first, a middle and a last one, and the last of a split lm_head, whose share the first
stage joins), for GQA, MHA and MQA, tied and untied embeddings (the
default model's lookup, a tied lm_head on a GGUF grid, included), with decodes of different
context lengths, and between steps the general path runs (prefill chunks mixed with decodes).
What the kept path does not take (prefill, sampling, a seam it cannot read) goes the general
way, with the general path's errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protocol.sampling import SamplingParams
from stages.backend.cpu.kept_decode import CpuDecodeStep
from stages.backend.cpu.linear import GridA8Linear
from stages.batch import SeqChunk
from tests.stages.conftest import Chain
from tests.stages.test_fused_layer import needs_bf16_dot
from tests.stages.test_grid import q4_1_weight, q8_0_weight
from tests.tiny_llama import make_tiny_llama

# Four sequences of 40 tokens; request i joins at step 2 i, its prompt in chunks of 5 tokens:
# steps mix prefill chunks and decodes until the last prompt is in, then decode-only steps of
# contexts from 14 to 40 tokens (one to three blocks).
SEQS = [[(11 * i + 5 * j) % 250 + 3 for j in range(40)] for i in range(4)]
PROMPT_LENS = [13, 4, 9, 6]
STAGGER = 2
CHUNK = 5


@pytest.fixture(scope="module")
def tied_grid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tied Llama whose embedding lies on the Q8_0 grid and whose projections on GGUF
    grids: in bf16 on AVX512_BF16 and VNNI, the lm_head is GridA8Linear and serves the lookup,
    as the default model's does (the kept path decodes those rows with one kernel call)."""
    folder = make_tiny_llama(
        tmp_path_factory.mktemp("tied-grid") / "m", hidden=128, heads=2, kv_heads=1, tied=True,
        seed=11,
    )  # fmt: skip
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for i, (name, weight) in enumerate(sorted(tensors.items())):
        if name.endswith("_proj.weight"):
            tensors[name] = q4_1_weight(*weight.shape, seed=i) * 4
        elif name == "model.embed_tokens.weight":
            tensors[name] = q8_0_weight(*weight.shape, seed=i) * 32
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def drive(chain: Chain, kept: bool) -> tuple[list[list[object]], int]:
    """Teacher-forced steps of SEQS through the chain, every chunk sampling greedy; with
    `kept` False no stage has the kept path. Returns each step's outputs, stage by stage (a
    seam's two tensors, the last stage's tokens), and how many steps the kept path ran."""
    if not kept:
        for stage in chain.stages:
            stage.cpu_decode = None
    ran = 0
    done = [0] * len(SEQS)
    tables: list[list[int]] = [[] for _ in SEQS]
    outputs: list[list[object]] = []
    for step in range(200):
        chunks = []
        for i, seq in enumerate(SEQS):
            if step < i * STAGGER or done[i] >= len(seq):
                continue
            end = min(done[i] + CHUNK, PROMPT_LENS[i]) if done[i] < PROMPT_LENS[i] else done[i] + 1
            chain.blocks.grow(tables[i], end)
            chunks.append(SeqChunk(seq[done[i] : end], done[i], list(tables[i]), sample=True))
            done[i] = end
        if not chunks:
            break
        decode_only = all(chunk.num_tokens == 1 for chunk in chunks)
        ran += decode_only and kept
        seam: dict[str, torch.Tensor] = {}
        step_outputs: list[object] = []
        for stage in chain.stages:
            out = stage.run(chunks, **seam)
            if stage.is_last_stage and chain.split_lm_head:  # a share, joined on stage 0
                assert isinstance(out, dict)
                step_outputs.append(tuple(out[k].clone() for k in sorted(out)))
                out = chain.stages[0].sample_share(chunks, out)
            if isinstance(out, dict):
                seam = dict(out)
                step_outputs.append((out["hidden_states"].clone(), out["residual"].clone()))
            else:
                step_outputs.append(out.token_ids)
        outputs.append(step_outputs)
    return outputs, ran


def kept_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kept path's entries, appended to as they run."""
    calls: list[str] = []
    for name in ("tokens", "seam", "share"):
        original = getattr(CpuDecodeStep, name)

        def counted(step: CpuDecodeStep, *args: object, _f=original, _name=name) -> object:
            calls.append(_name)
            return _f(step, *args)

        monkeypatch.setattr(CpuDecodeStep, name, counted)
    return calls


@pytest.mark.parametrize(
    ("partition", "split"), [([4], False), ([1, 3], False), ([1, 2, 1], False), ([2, 2], True)]
)
@pytest.mark.parametrize(
    ("model", "dtype"),
    [("gqa", "float32"), ("tied", "float32"), ("mqa", "bfloat16"), ("tied_grid", "bfloat16")],
)
def test_kept_decode_steps_equal_the_general_path_bit_for_bit(
    tiny_dirs: dict[str, Path],
    tied_grid_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    partition: list[int],
    split: bool,
    model: str,
    dtype: str,
) -> None:
    needs_bf16_dot(dtype)
    folder = tied_grid_dir if model == "tied_grid" else tiny_dirs[model]
    chains = [Chain(folder, partition, dtype=dtype, split_lm_head=split) for _ in range(2)]
    assert all(stage.cpu_decode is not None for stage in chains[0].stages)
    if model == "tied_grid" and len(partition) == 1:  # the lm_head serves the lookup, as the
        first = chains[0].stages[0].model  # default model's: the kernels decode its rows
        assert first.embed_tokens is None and isinstance(first.lm_head, GridA8Linear)
    calls = kept_calls(monkeypatch)
    kept, ran = drive(chains[0], kept=True)
    assert ran >= 20 and len(calls) == ran * len(partition)  # every decode-only step, each stage
    calls.clear()
    general, _ = drive(chains[1], kept=False)
    assert not calls
    assert len(kept) == len(general)
    for got_step, expected_step in zip(kept, general, strict=True):
        for got, expected in zip(got_step, expected_step, strict=True):
            if isinstance(expected, tuple):  # a seam: hidden_states, residual
                assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
            else:
                assert got == expected
    for got_stage, expected_stage in zip(chains[0].stages, chains[1].stages, strict=True):
        assert got_stage.kv is not None and expected_stage.kv is not None
        assert torch.equal(got_stage.kv.data, expected_stage.kv.data)


def test_what_the_kept_path_does_not_take_runs_the_general_way(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    chain = Chain(tiny_dirs["gqa"], [2, 2])
    first, last = chain.stages
    calls = kept_calls(monkeypatch)
    table = chain.blocks.grow([], 40)
    prompt = SEQS[0][:20]
    chain.sample([SeqChunk(prompt, 0, table, sample=True)])  # a prefill: general
    assert calls == []
    decode = [SeqChunk([SEQS[0][20]], 20, table, sample=True)]
    seam = first.run(decode)
    assert isinstance(seam, dict) and calls == ["seam"]
    # a sampled (not plain greedy) request: the last stage's general finish
    sampled = SamplingParams(temperature=0.8, seed=3)
    out = last.run(decode, **seam, sampling=[sampled])
    assert len(out.token_ids) == 1 and calls == ["seam"]
    # a seam the kernels cannot read as it is: the general path's clear error
    wide = torch.zeros(1, first.config.hidden_size + 1)
    with pytest.raises(ValueError, match="needs hidden_states of shape"):
        last.run(decode, hidden_states=wide, residual=wide)
    assert calls == ["seam"]


def test_a_decode_the_cache_cannot_hold_fails_before_touching_anything(
    tiny_dirs: dict[str, Path],
) -> None:
    chains = [Chain(tiny_dirs["gqa"], [4]) for _ in range(2)]
    tokens = []
    for chain in chains:
        table = chain.blocks.grow([], 17)  # two blocks: positions 0-31
        chain.sample([SeqChunk(SEQS[1][:16], 0, table, sample=True)])
        if chain is chains[0]:
            (stage,) = chain.stages
            kv_before = stage.kv.data.clone()
            # position 40 lies in a third block the table does not have
            with pytest.raises(ValueError, match="cannot hold 41 tokens"):
                stage.run([SeqChunk([5], 40, table, sample=True)])
            with pytest.raises(ValueError, match="start_pos must be >= 0"):
                stage.run([SeqChunk([5], -1, table, sample=True)])
            assert torch.equal(stage.kv.data, kv_before)
        tokens.append([chain.sample([SeqChunk([SEQS[1][p]], p, table, True)]) for p in (16, 17)])
    assert tokens[0] == tokens[1]
