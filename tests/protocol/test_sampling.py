from __future__ import annotations

import pytest

from protocol.errors import ProtocolError
from protocol.sampling import SamplingParams


def test_defaults_are_valid_and_greedy_is_temperature_zero():
    assert not SamplingParams().is_greedy
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_new_tokens", 0, "at least 1"),
        ("max_new_tokens", 1.5, "integer"),
        ("max_new_tokens", True, "integer"),
        ("min_tokens", -1, "min_tokens must be at least 0"),
        ("min_tokens", 129, "min_tokens must be at most 128"),  # max_new_tokens' default
        ("temperature", -0.1, "temperature must be in"),
        ("temperature", float("nan"), "NaN"),
        ("temperature", "hot", "number"),
        ("top_k", 0, "top_k must be -1"),
        ("top_k", -2, "at least -1"),
        ("top_p", 0.0, r"top_p must be in \(0.0, 1.0\]"),
        ("top_p", 1.01, "top_p"),
        ("min_p", -0.5, "min_p"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2.0, 2.0\]"),
        ("frequency_penalty", -2.01, "frequency_penalty must be in"),
        ("frequency_penalty", None, "number"),
        ("logit_bias", [], "logit_bias must be a map"),
        ("logit_bias", {str(i): 1.0 for i in range(1025)}, "at most 1024"),
        ("logit_bias", {"-1": 1.0}, "keys must be token ids, got '-1'"),
        ("logit_bias", {"007": 1.0}, "token ids"),
        ("logit_bias", {" 7": 1.0}, "token ids"),
        ("logit_bias", {"\u00b2": 1.0}, "token ids"),  # a digit to str.isdigit, not to int()
        ("logit_bias", {"9" * 11: 1.0}, "token ids"),
        ("logit_bias", {7: 1.0}, "token ids"),
        ("logit_bias", {"7": 100.5}, r"logit_bias\[7\] must be in \[-100.0, 100.0\]"),
        ("logit_bias", {"7": "up"}, "number"),
        ("seed", -1, "seed must be at least 0"),
        ("seed", 2**64, "seed must be at most"),
        ("stop_token_ids", [1, -3], "at least 0"),
        ("stop_token_ids", "1", "list"),
        ("ignore_eos", 1, "bool"),
        ("logprobs", "yes", "bool"),
        ("top_logprobs", 21, "top_logprobs must be at most 20"),
        ("top_logprobs", -1, "top_logprobs must be at least 0"),
        ("top_logprobs", 2.0, "top_logprobs must be an integer"),
    ],
)
def test_out_of_range_values_are_one_clear_error(field, value, words):
    with pytest.raises(ProtocolError, match=words):
        SamplingParams(**{field: value})


def test_what_reads_the_history_and_what_moves_the_logits():
    assert not SamplingParams().needs_history and not SamplingParams().changes_logits
    for penalty in (
        {"repetition_penalty": 1.1},
        {"presence_penalty": -1},
        {"frequency_penalty": 2},
    ):
        assert SamplingParams(**penalty).needs_history
        assert SamplingParams(**penalty).changes_logits
    biased = SamplingParams(logit_bias={"0": -1.0, "49151": 5})
    assert not biased.needs_history and biased.changes_logits
    assert biased.logit_bias_ids() == {0: -1.0, 49151: 5}


def test_top_logprobs_needs_logprobs():
    with pytest.raises(ProtocolError, match="top_logprobs needs logprobs"):
        SamplingParams(top_logprobs=3)
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20
