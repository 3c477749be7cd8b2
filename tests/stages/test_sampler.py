from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from protocol.sampling import SamplingParams
from stages.batch import History
from stages.sampler import GREEDY, _apply_penalties, sample

VOCAB = 50


def make_logits(rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * 3  # [rows, V]


def test_greedy_is_argmax() -> None:
    logits = make_logits(8)
    result = sample(logits, [GREEDY] * 8, positions=list(range(8)))
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs is None


def test_greedy_rows_stay_argmax_beside_sampled_rows() -> None:
    logits = make_logits(4)
    params = [GREEDY, SamplingParams(temperature=1.0, seed=3)] * 2
    result = sample(logits, params, positions=[5] * 4)
    assert result.token_ids[0] == logits[0].argmax().item()
    assert result.token_ids[2] == logits[2].argmax().item()


def test_seeded_request_is_independent_of_its_batch() -> None:
    row = make_logits(1, seed=1)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=30, seed=1234)
    alone = [sample(row, [params], positions=[p]).token_ids[0] for p in range(40)]
    others = make_logits(5, seed=2)
    in_batch = []
    for p in range(40):
        batch = torch.cat([others[:2], row, others[2:]])
        mixed = [
            SamplingParams(temperature=1.0),  # unseeded
            GREEDY,
            params,
            SamplingParams(temperature=2.0, seed=7),
            SamplingParams(temperature=0.5, min_p=0.1),
            SamplingParams(temperature=1.0, repetition_penalty=1.3),
        ]
        out = sample(
            batch, mixed, positions=[p + 100, p, p, p, 3, 9], histories=[History([], [])] * 6
        )
        in_batch.append(out.token_ids[2])
    assert alone == in_batch
    assert len(set(alone)) > 1  # positions give different draws, not one repeated token


def test_different_seeds_give_different_streams() -> None:
    row = make_logits(1, seed=1)
    streams = {
        tuple(
            sample(row, [SamplingParams(temperature=1.0, seed=s)], positions=[p]).token_ids[0]
            for p in range(20)
        )
        for s in range(5)
    }
    assert len(streams) == 5


def draws(logits_row: torch.Tensor, params: SamplingParams, count: int = 400) -> Counter[int]:
    """`count` draws from one distribution, as one batch of differently seeded rows."""
    batch = logits_row.expand(count, -1)
    seeded = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(count)]
    return Counter(sample(batch, seeded, positions=[0] * count).token_ids)


def test_top_k_samples_only_the_k_most_likely() -> None:
    row = make_logits(1, seed=3)[0]
    allowed = set(row.topk(5).indices.tolist())
    got = draws(row, SamplingParams(temperature=1.5, top_k=5))
    assert set(got) <= allowed
    assert len(got) == 5


def test_top_p_samples_only_the_nucleus() -> None:
    row = make_logits(1, seed=4)[0]
    probs = row.softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    # smallest prefix whose mass reaches 0.8
    size = int((sorted_probs.cumsum(0) < 0.8).sum().item()) + 1
    allowed = set(order[:size].tolist())
    got = draws(row, SamplingParams(temperature=1.0, top_p=0.8))
    assert set(got) <= allowed
    assert len(got) > 1


def test_min_p_drops_tokens_below_the_fraction_of_the_best() -> None:
    row = make_logits(1, seed=5)[0] / 3  # flatter, so several tokens pass the bar
    probs = row.softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    got = draws(row, SamplingParams(temperature=1.0, min_p=0.2))
    assert set(got) <= allowed
    assert len(allowed) > 1 and len(got) > 1


def test_sampling_follows_the_distribution() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)))
    got = draws(row, SamplingParams(temperature=1.0), count=4000)
    for token, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        sigma = math.sqrt(p * (1 - p) / 4000)
        assert abs(got[token] / 4000 - p) < 5 * sigma


def test_temperature_sharpens() -> None:
    row = torch.log(torch.tensor([0.6, 0.4] + [1e-9] * (VOCAB - 2)))
    cold = draws(row, SamplingParams(temperature=0.05), count=500)
    assert cold[0] >= 495  # (0.6 / 0.4)^20 > 3000: the first token nearly always


def test_repetition_penalty_pushes_seen_tokens_down() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 2.0  # best, and seen
    logits[:, 8] = 1.5
    logits[:, 9] = -1.0  # seen, negative: multiplied, so it goes further down
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    histories = [History([7], [9, 7]), History([7, 9], [])]
    out = sample(logits, [params, GREEDY], positions=[0, 0], histories=histories)
    assert out.token_ids == [8, 7]  # 2.0 / 2 = 1.0 < 1.5; the unpenalised row keeps 7


def test_repetition_penalty_reads_the_prompt_too() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 2.0, 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = sample(logits, [params], positions=[0], histories=[History([7], [])])
    assert out.token_ids == [8]


@pytest.mark.parametrize(
    "penalty", [{"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": -1}]
)
def test_a_penalty_needs_history(penalty: dict) -> None:
    params = SamplingParams(temperature=0.0, **penalty)
    with pytest.raises(ValueError, match="history"):
        sample(make_logits(1), [params], positions=[0])
    with pytest.raises(ValueError, match="history"):
        sample(
            make_logits(2), [params, params], positions=[0, 0], histories=[History([], []), None]
        )


def test_presence_and_frequency_penalties_subtract_over_the_output_only() -> None:
    logits = make_logits(2, seed=11)
    prompt, output = [1, 2, 2, 3], [3, 4, 4, 4, 49]
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=-1.0),
    ]
    expected = logits.clone()
    for token, count in Counter(output).items():  # the prompt's 1 and 2 are not touched
        expected[0, token] -= 0.5 + 0.25 * count
    for token in set(prompt + output):  # repetition first, over prompt and output
        value = expected[1, token]
        expected[1, token] = value / 2.0 if value > 0 else value * 2.0
    for token in set(output):
        expected[1, token] += 1.0
    histories = [History(prompt, output)] * 2
    processed = _apply_penalties(logits.float(), params, histories)
    assert torch.allclose(processed, expected, atol=1e-6)
    assert sample(logits, params, [0, 0], histories).token_ids == expected.argmax(-1).tolist()


def test_a_frequency_penalty_grows_with_the_count() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 1.0, 1.2  # 6 is best until generated twice
    params = SamplingParams(temperature=0.0, frequency_penalty=0.15)
    picks = [sample(logits, [params], [0], [History([], [6] * n)]).token_ids[0] for n in range(3)]
    assert picks == [6, 6, 5]  # 1.2, 1.05, 0.9 against 1.0


def test_logit_bias_moves_greedy_and_sampled_choices_but_not_logprobs() -> None:
    logits = make_logits(2, seed=12)
    worst = int(logits[0].argmin())
    bias = {str(worst): 100.0}
    greedy = SamplingParams(temperature=0.0, logit_bias=bias, logprobs=True)
    hot = SamplingParams(temperature=1.0, seed=3, logit_bias=bias)
    out = sample(logits, [greedy, hot], positions=[0, 0])
    assert out.token_ids[0] == worst
    assert out.logprobs is not None
    assert out.logprobs[0] == pytest.approx(logits[0].log_softmax(-1)[worst].item(), abs=1e-5)
    assert out.token_ids[1] == worst  # +100 leaves the rest e^-80 of the mass at most
    banned = int(logits[1].argmax())
    out = sample(
        logits[1:], [SamplingParams(temperature=0.0, logit_bias={str(banned): -100.0})], [0]
    )
    assert out.token_ids[0] != banned


def test_logit_bias_beyond_the_vocabulary_is_skipped() -> None:
    logits = make_logits(1, seed=13)
    params = SamplingParams(temperature=0.0, logit_bias={str(VOCAB + 5): 100.0})
    assert sample(logits, [params], [0]).token_ids == [int(logits[0].argmax())]


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = make_logits(3, seed=6)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.7, top_k=3, seed=1, logprobs=True),
        GREEDY,
    ]
    out = sample(logits, params, positions=[0, 0, 0])
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert out.logprobs is not None
    assert torch.allclose(torch.tensor(out.logprobs), expected)


def test_mismatched_lengths_fail() -> None:
    with pytest.raises(ValueError):
        sample(make_logits(2), [GREEDY], positions=[0])


def test_top_logprobs_are_the_raw_distributions_best_per_row() -> None:
    logits = make_logits(3, seed=14)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4),
        SamplingParams(temperature=0.0, logprobs=True),  # the chosen token's only
        SamplingParams(temperature=1.0, seed=2, logprobs=True, top_logprobs=1, min_p=0.5),
    ]
    out = sample(logits, params, positions=[0, 0, 0])
    raw = logits.log_softmax(-1)
    best = raw.topk(4, dim=-1)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids[0] == best.indices[0].tolist()
    assert out.top_logprobs[0] == pytest.approx(best.values[0].tolist(), abs=1e-6)
    assert out.top_ids[1] == [] and out.top_logprobs[1] == []
    assert out.top_ids[2] == [best.indices[2, 0].item()]  # of the raw distribution, not min_p's
    assert out.top_ids[0][0] == out.token_ids[0]  # greedy: the chosen token is the best
    assert out.top_logprobs[0][0] == pytest.approx(out.logprobs[0], abs=1e-6)
    assert sample(logits[:1], [params[1]], [0]).top_ids is None  # nobody asked: nothing


def test_the_logit_bias_comes_before_the_repetition_penalty() -> None:
    # vLLM v1's order: the bias, then the penalty.
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = -1.0, 1.6
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={"7": 4.0})
    histories = [History([7], [])]
    # bias first: (-1 + 4) / 2 = 1.5 < 1.6, so 8; penalty first: -1 * 2 + 4 = 2.0 > 1.6, so 7
    assert sample(logits, [params], [0], histories).token_ids == [8]


def test_min_tokens_suppressed_ids_are_never_chosen() -> None:
    logits = make_logits(2, seed=15)
    best = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=1.0, seed=4, min_tokens=3, logit_bias={str(best[1]): 100}),
    ]
    histories = [History([1], [], suppressed_ids=[best[0]]), History([1], [], [best[1]])]
    out = sample(logits, params, [0, 0], histories)
    assert out.token_ids[0] == int(logits[0].topk(2).indices[1])  # the runner-up
    assert out.token_ids[1] != best[1]  # a +100 bias does not lift a suppressed id


def test_row_argmax_is_argmax_ties_and_nan_included() -> None:
    # the greedy paths use max(dim).indices (torch's bf16 argmax is a slow loop on a CPU)
    from stages.sampler import row_argmax

    torch.manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randint(-3, 4, (9, 1000)).to(dtype)  # many ties per row
        x[4, 700] = float("nan")
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))
