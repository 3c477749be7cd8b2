from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch

from protocol.sampling import SamplingParams
from stages.batch import History, SampleResult, SeqChunk
from stages.runner import Stage, StageRunner
from tests.stages.conftest import KV_BUDGET, Chain


def test_stage_interface_is_small() -> None:
    abstract = set(Stage.__abstractmethods__)
    assert abstract == {"num_kv_blocks", "allocate_kv", "run"}
    params = list(inspect.signature(Stage.run).parameters)
    assert params == ["self", "chunks", "hidden_states", "residual", "sampling", "histories"]


def test_roles_follow_the_layer_range(tiny_dirs: dict[str, Path]) -> None:
    folder = tiny_dirs["gqa"]
    first = StageRunner(folder, 0, 1, kv_budget_bytes=KV_BUDGET)
    middle = StageRunner(folder, 1, 3, kv_budget_bytes=KV_BUDGET)
    last = StageRunner(folder, 3, 4, kv_budget_bytes=KV_BUDGET)
    assert (first.is_first_stage, first.is_last_stage) == (True, False)
    assert (middle.is_first_stage, middle.is_last_stage) == (False, False)
    assert (last.is_first_stage, last.is_last_stage) == (False, True)


def test_for_rank_reads_the_env_partition(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPRING_LAYER_PARTITION", "3,1")
    stage = StageRunner.for_rank(tiny_dirs["gqa"], 2, 1, kv_budget_bytes=KV_BUDGET)
    assert (stage.start_layer, stage.end_layer) == (3, 4)
    stage = StageRunner.for_rank(
        tiny_dirs["gqa"], 2, 0, kv_budget_bytes=KV_BUDGET, partition=[1, 3]
    )
    assert (stage.start_layer, stage.end_layer) == (0, 1)


def test_seam_is_hidden_states_and_residual(tiny_dirs: dict[str, Path]) -> None:
    chain = Chain(tiny_dirs["gqa"], [2, 2])
    chunks = [SeqChunk([5, 6, 7], 0, [0], True), SeqChunk([9], 0, [1], True)]
    out = chain.stages[0].run(chunks)
    assert isinstance(out, dict) and set(out) == {"hidden_states", "residual"}
    assert out["hidden_states"].shape == out["residual"].shape == (4, 64)
    assert out["hidden_states"].dtype == torch.float32


def test_last_stage_samples_only_chunks_that_ask(tiny_dirs: dict[str, Path]) -> None:
    chain = Chain(tiny_dirs["gqa"], [2, 2])
    chunks = [
        SeqChunk([5, 6, 7], 0, [0], sample=False),  # a prefill chunk with more to come
        SeqChunk([9, 10], 0, [1], sample=True),
        SeqChunk([11], 0, [2], sample=True),
    ]
    logits = chain.logits(chunks)
    for stage in chain.stages:
        stage.allocate_kv(stage.num_kv_blocks)  # fresh caches, same blocks
    out = chain.sample(chunks)
    assert isinstance(out, SampleResult)
    assert out.token_ids == [logits[4].argmax().item(), logits[5].argmax().item()]
    none = chain.sample([SeqChunk([1, 2], 3, [3], sample=False)])
    assert none.token_ids == []


def test_sampling_params_and_logprobs_reach_the_sampler(tiny_dirs: dict[str, Path]) -> None:
    chain = Chain(tiny_dirs["gqa"], [4])
    chunks = [SeqChunk([5, 6, 7], 0, [0], True), SeqChunk([9], 0, [1], True)]
    sampled_rows = chain.logits(chunks)[[2, 3]]  # [2, V]: each chunk's last position
    for stage in chain.stages:
        stage.allocate_kv(stage.num_kv_blocks)  # fresh caches, same blocks
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(top_k=1)]
    out = chain.sample(
        chunks, sampling=params, histories=[History([5, 6, 7], []), History([9], [])]
    )
    # Greedy, and top_k 1 at temperature 1: the best token of each row (a draw over all 256
    # tokens of the tiny model would rarely be it).
    best = sampled_rows.argmax(-1)
    assert out.token_ids == best.tolist()
    # Each chosen token's logprob under the raw model distribution.
    expected = sampled_rows.log_softmax(-1).gather(1, best[:, None]).squeeze(1)
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_seeded_request_same_tokens_alone_or_batched(tiny_dirs: dict[str, Path]) -> None:
    folder = tiny_dirs["gqa"]
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(batch: bool) -> list[int]:
        chain = Chain(folder, [2, 2])
        table = chain.blocks.grow([], 40)
        other_tables = [chain.blocks.grow([], 40) for _ in range(2)]
        tokens, prompt = [], [5, 6, 7, 8]
        chunk = SeqChunk(prompt, 0, table, True)
        others = [SeqChunk([20 + i] * (3 + i), 0, t, True) for i, t in enumerate(other_tables)]
        for _ in range(10):
            chunks = [others[0], chunk, others[1]] if batch else [chunk]
            params = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.0)]
            out = chain.sample(chunks, sampling=params if batch else [seeded])
            token = out.token_ids[1 if batch else 0]
            tokens.append(token)
            chunk = SeqChunk([token], chunk.seq_len, table, True)
            if batch:
                others = [
                    SeqChunk([t], o.seq_len, o.block_ids, True)
                    for o, t in zip(others, (out.token_ids[0], out.token_ids[2]))
                ]
        return tokens

    assert run(batch=False) == run(batch=True)


def test_first_stage_refuses_hidden_states(tiny_dirs: dict[str, Path]) -> None:
    chain = Chain(tiny_dirs["gqa"], [2, 2])
    chunks = [SeqChunk([5], 0, [0], True)]
    with pytest.raises(ValueError, match="first stage"):
        chain.stages[0].run(chunks, hidden_states=torch.zeros(1, 64), residual=torch.zeros(1, 64))


def test_later_stage_checks_the_seam_shape(tiny_dirs: dict[str, Path]) -> None:
    chain = Chain(tiny_dirs["gqa"], [2, 2])
    chunks = [SeqChunk([5, 6], 0, [0], True)]
    with pytest.raises(ValueError, match="needs hidden_states of shape"):
        chain.stages[1].run(chunks)
    with pytest.raises(ValueError, match="needs residual of shape"):
        chain.stages[1].run(chunks, hidden_states=torch.zeros(2, 64), residual=torch.zeros(3, 64))


def test_forward_logits_only_on_the_last_stage(tiny_dirs: dict[str, Path]) -> None:
    chain = Chain(tiny_dirs["gqa"], [2, 2])
    with pytest.raises(ValueError, match="not the last stage"):
        chain.stages[0].forward_logits([SeqChunk([5], 0, [0], True)])


def test_bad_layer_range(tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="not inside"):
        StageRunner(tiny_dirs["gqa"], 2, 5, kv_budget_bytes=KV_BUDGET)


def test_later_stage_reads_seam_tensors_without_writing(tiny_dirs: dict[str, Path]) -> None:
    # As the transport delivers them: tensors over immutable bytes frames.
    chain = Chain(tiny_dirs["gqa"], [2, 2])
    chunks = [SeqChunk([5, 6, 7], 0, [0], True)]
    seam = chain.stages[0].run(chunks)
    assert isinstance(seam, dict)
    frames = {name: bytes(t.numpy().tobytes()) for name, t in seam.items()}
    with warnings.catch_warnings():
        # torch warns (once per process) that such a buffer is read-only: expected here.
        warnings.simplefilter("ignore", UserWarning)
        received = {
            name: torch.frombuffer(frame, dtype=torch.float32).view(3, 64)
            for name, frame in frames.items()
        }
    logits = chain.stages[1].forward_logits(chunks, **received)
    assert torch.isfinite(logits).all()
    assert all(bytes(t.numpy().tobytes()) == frames[n] for n, t in received.items())


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_a_split_lm_head_gives_the_unsplit_logits_and_tokens(
    tiny_dirs: dict[str, Path], name: str
) -> None:
    """The first stage's rows [0, cut) joined with the last stage's share are the unsplit
    logits bit for bit, so greedy (best logits only) and seeded draws (all logits) agree."""
    folder = tiny_dirs[name]
    whole = [StageRunner(folder, *r, kv_budget_bytes=KV_BUDGET) for r in ((0, 2), (2, 4))]
    split = [
        StageRunner(folder, *r, kv_budget_bytes=KV_BUDGET, split_lm_head=True)
        for r in ((0, 2), (2, 4))
    ]
    for stage in whole + split:
        stage.allocate_kv(stage.num_kv_blocks)
    chunks = [
        SeqChunk([5, 6, 7], 0, [0], sample=True),
        SeqChunk([9], 0, [1], sample=False),
        SeqChunk([11, 12], 0, [2], sample=True),
    ]
    logits = whole[1].forward_logits(chunks, **whole[0].run(chunks))  # [2, V]
    cut = split[1].vocab_cut
    assert split[0].model.head_rows == (0, cut) and split[1].model.head_rows == (cut, 256)
    seam = split[0].run(chunks)
    greedy = split[1].run(chunks, **seam)  # plain greedy: the best logit of [cut, V) only
    assert greedy["logits"].numel() == 0 and greedy["best_token"].min() >= cut
    assert split[0].sample_share(chunks, greedy).token_ids == logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0.9, seed=7, logprobs=True)] * 3
    share = split[1].run(chunks, **seam, sampling=params)  # all of [cut, V)
    with torch.inference_mode():
        joined = torch.cat((split[0].model.lm_head(share["hidden"]), share["logits"]), dim=1)
    assert torch.equal(joined, logits)
    drawn = split[0].sample_share(chunks, share, sampling=params)
    assert drawn == whole[1].run(chunks, **whole[0].run(chunks), sampling=params)
    with pytest.raises(ValueError, match="does not sample"):
        split[1].sample_share(chunks, share)
