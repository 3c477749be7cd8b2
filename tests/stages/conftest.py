"""Fixtures for stage tests: tiny random Llama folders (session-scoped), their transformers
reference models, and `Chain`, which runs stages 0..S-1 in one process as the ring would."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from protocol.sampling import SamplingParams
from stages.backend.cpu import native
from stages.backend.cuda.graphs import GraphRecorder
from stages.batch import BLOCK_SIZE, History, SampleResult, SeqChunk
from stages.partition import layer_range
from stages.runner import StageRunner
from tests.tiny_llama import make_tiny_llama

KV_BUDGET = 4 << 20  # bytes per stage: hundreds of blocks for the tiny models

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so positions in the tests cross all three frequency bands.
    "original_max_position_embeddings": 32,
}


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    # With two OpenMP threads on two cores, any other busy process stalls every parallel op at
    # its barrier: the suite measured 5x slower under load. One thread is steady.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _offline_hub() -> Iterator[None]:
    # Nothing here may reach a model hub; transformers honours this for every from_pretrained.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def without_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stages built from here on take the torch path, as on a CPU with no C compiler."""
    monkeypatch.setattr(native, "kernels", lambda: None)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "they are turned off by the test")


@pytest.fixture(params=["native", "torch"])
def stage_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a CPU stage computes: with ppring's CPU kernels (which must build here: CI has
    gcc) and without them."""
    if request.param == "native":
        assert native.kernels() is not None, native.unavailable_reason()
    else:
        without_native_kernels(monkeypatch)
    return request.param


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> folder. All have 4 layers; "gqa" is the plain untied GQA model."""
    root = tmp_path_factory.mktemp("tiny-llamas")
    return {
        "gqa": make_tiny_llama(root / "gqa", seed=1),
        "tied": make_tiny_llama(root / "tied", tied=True, kv_heads=4, seed=2),
        "llama3": make_tiny_llama(root / "llama3", rope_scaling=LLAMA3_SCALING, seed=3),
        "linear": make_tiny_llama(
            root / "linear", rope_scaling={"rope_type": "linear", "factor": 4.0}, seed=4
        ),
        "mqa": make_tiny_llama(root / "mqa", heads=8, kv_heads=1, hidden=64, seed=5),
    }


_HF_CACHE: dict[Path, LlamaForCausalLM] = {}


def hf_model(folder: Path) -> LlamaForCausalLM:
    """The transformers reference model for a folder, loaded once per session."""
    if folder not in _HF_CACHE:
        _HF_CACHE[folder] = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _HF_CACHE[folder]


@torch.inference_mode()
def hf_logits(folder: Path, token_ids: Sequence[int]) -> torch.Tensor:
    """[len, V] fp32 logits of one unpadded sequence from transformers."""
    return hf_model(folder)(torch.tensor([list(token_ids)])).logits[0].float()


class BlockPool:
    """Hands out KV blocks like the ring's bookkeeping would; scattered = shuffled free list."""

    def __init__(self, num_blocks: int, scattered: bool = True, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        if scattered:
            random.Random(seed).shuffle(self.free)
        else:
            self.free.reverse()  # pop() then yields 0, 1, 2, ...
        self.used: set[int] = set()

    def grow(self, table: list[int], num_tokens: int) -> list[int]:
        while len(table) * BLOCK_SIZE < num_tokens:
            block = self.free.pop()
            self.used.add(block)
            table.append(block)
        return table


class Chain:
    """Stages 0..S-1 of one model chained in this process, sharing block tables."""

    def __init__(
        self,
        folder: Path,
        partition: list[int],
        *,
        dtype: str = "float32",
        device: str = "cpu",
        kv_budget_bytes: int = KV_BUDGET,
        scattered: bool = True,
        poison: bool = False,
        quantization: str = "none",
        cuda_graph_max_bs: int | None = None,
        graph_recorder: GraphRecorder | None = None,
        split_lm_head: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.split_lm_head = split_lm_head and len(partition) > 1
        self.stages = [
            StageRunner(
                folder,
                *layer_range(partition, rank),
                kv_budget_bytes=kv_budget_bytes,
                dtype=dtype,
                device=device,
                rank=rank,
                quantization=quantization,
                cuda_graph_max_bs=cuda_graph_max_bs,
                graph_recorder=graph_recorder,
                split_lm_head=self.split_lm_head,
                kv_cache_dtype=kv_cache_dtype,
            )
            for rank in range(len(partition))
        ]
        # LongRoPE: a sequence longer than this is computed at the long factors, all of it (as
        # the ring's scheduler decides: ring/scheduler.py `_rope_long`); None elsewhere
        self.rope_long_from = self.stages[0].config.rope_long_from
        agreed = min(stage.num_kv_blocks for stage in self.stages)
        for stage in self.stages:
            stage.allocate_kv(agreed)
            if poison:
                # Any read of a slot no sequence wrote now turns the logits into NaN.
                assert stage.kv is not None
                stage.kv.data.fill_(float("nan"))
        self.blocks = BlockPool(agreed, scattered=scattered)

    def rope_long(self, seq_len: int) -> bool:
        """Whether a sequence of seq_len tokens is computed at LongRoPE's long factors."""
        return self.rope_long_from is not None and seq_len > self.rope_long_from

    def _through(self, chunks: list[SeqChunk]) -> dict[str, torch.Tensor]:
        seam: dict[str, torch.Tensor] = {}
        for stage in self.stages[:-1]:
            out = stage.run(chunks, **seam)
            assert isinstance(out, dict)
            seam = out
        return seam

    def logits(self, chunks: list[SeqChunk], graphs: bool = False) -> torch.Tensor:
        """[T, V] logits of every row of the batch; `graphs`: the last stage too replays a
        decode graph where the batch fits one (earlier stages always do, where they have
        graphs)."""
        seam = self._through(chunks)
        return self.stages[-1].forward_logits(chunks, **seam, all_rows=True, graphs=graphs)

    def sample(
        self,
        chunks: list[SeqChunk],
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> SampleResult:
        seam = self._through(chunks)
        out = self.stages[-1].run(chunks, **seam, sampling=sampling, histories=histories)
        if self.split_lm_head:  # the last stage's share, sampled on the first stage
            out = self.stages[0].sample_share(chunks, out, sampling, histories)
        assert isinstance(out, SampleResult)
        return out


def drive_teacher_forced(
    chain: Chain,
    seqs: list[list[int]],
    prompt_lens: list[int],
    chunk_size: int | None = None,
    stagger: int = 0,
) -> list[torch.Tensor]:
    """Feed each sequence through `chain`: its prompt in prefill chunks of `chunk_size` (whole if
    None), then one token per step (decode) until the sequence ends; request i joins at step
    i * stagger. Every step is one batch mixing whatever each request needs. Returns each
    sequence's [len, V] logits, row p for position p. (A LongRoPE sequence is computed at the
    factors of its whole length, as a reference's one forward over it is.)"""
    done = [0] * len(seqs)
    tables: list[list[int]] = [[] for _ in seqs]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    step = 0
    while any(done[i] < len(seq) for i, seq in enumerate(seqs)):
        chunks, owners = [], []
        for i, seq in enumerate(seqs):
            if step < i * stagger or done[i] >= len(seq):
                continue
            if done[i] < prompt_lens[i]:
                size = chunk_size or prompt_lens[i]
                end = min(done[i] + size, prompt_lens[i])
            else:
                end = done[i] + 1
            chain.blocks.grow(tables[i], end)
            long = chain.rope_long(len(seq))
            chunks.append(SeqChunk(seq[done[i] : end], done[i], list(tables[i]), True, long))
            owners.append(i)
        step += 1
        if not chunks:
            continue
        logits = chain.logits(chunks)
        row = 0
        for chunk, i in zip(chunks, owners):
            rows[i].append(logits[row : row + chunk.num_tokens])
            row += chunk.num_tokens
            done[i] += chunk.num_tokens
    return [torch.cat(r) for r in rows]


def decode_logits(
    chain: Chain, seqs: list[list[int]], prompt_lens: list[int], graphs: bool
) -> list[dict[int, torch.Tensor]]:
    """Teacher-forced: each prompt prefilled in one batch, then one batch per step of every
    sequence not yet at its end (so the batch shrinks). Returns, per sequence, {position: its
    [V] logits} for the decoded positions."""
    tables = [chain.blocks.grow([], len(seq)) for seq in seqs]
    long = [chain.rope_long(len(seq)) for seq in seqs]  # (as drive_teacher_forced's)
    chain.logits(
        [SeqChunk(s[:p], 0, t, True, g) for s, p, t, g in zip(seqs, prompt_lens, tables, long)]
    )
    rows: list[dict[int, torch.Tensor]] = [{} for _ in seqs]
    for step in range(max(len(s) - p for s, p in zip(seqs, prompt_lens))):
        live = [i for i, (s, p) in enumerate(zip(seqs, prompt_lens)) if p + step < len(s)]
        positions = [prompt_lens[i] + step for i in live]
        chunks = [
            SeqChunk([seqs[i][pos]], pos, tables[i], True, long[i])
            for i, pos in zip(live, positions)
        ]
        logits = chain.logits(chunks, graphs=graphs)  # [n, V]
        for row, (i, pos) in enumerate(zip(live, positions)):
            rows[i][pos] = logits[row].cpu()
    return rows


def greedy_generate(
    chain: Chain, prompts: list[list[int]], max_new_tokens: int, eos_ids: Sequence[int] = ()
) -> list[list[int]]:
    """Batched greedy generation through the chain (prefill together, then decode together);
    a request stops at an eos id (kept in its output) or after max_new_tokens. A LongRoPE
    sequence whose next token takes it past the switch is computed again whole at the long
    factors, as the ring's scheduler does (ring/scheduler.py `_recompute_long`)."""
    tables = [chain.blocks.grow([], len(p) + max_new_tokens) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = [
        SeqChunk(list(p), 0, tables[i], True, chain.rope_long(len(p)))
        for i, p in enumerate(prompts)
    ]
    owners = list(range(len(prompts)))
    while chunks:
        tokens = chain.sample(chunks).token_ids
        next_chunks, next_owners = [], []
        for chunk, i, token in zip(chunks, owners, tokens):
            outputs[i].append(token)
            if token in eos_ids or len(outputs[i]) >= max_new_tokens:
                continue
            if not chunk.rope_long and chain.rope_long(chunk.seq_len + 1):
                whole = list(prompts[i]) + outputs[i]
                next_chunks.append(SeqChunk(whole, 0, tables[i], True, rope_long=True))
            else:
                next_chunks.append(
                    SeqChunk([token], chunk.seq_len, tables[i], True, chunk.rope_long)
                )
            next_owners.append(i)
        chunks, owners = next_chunks, next_owners
    return outputs


@pytest.fixture(scope="session")
def chain_factory() -> Callable[..., Chain]:
    return Chain


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (the default model)")
