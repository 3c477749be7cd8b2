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
        ("temperature", -0.1, "temperature must be in"),
        ("temperature", float("nan"), "NaN"),
        ("temperature", "hot", "number"),
        ("top_k", 0, "top_k must be -1"),
        ("top_k", -2, "at least -1"),
        ("top_p", 0.0, r"top_p must be in \(0.0, 1.0\]"),
        ("top_p", 1.01, "top_p"),
        ("min_p", -0.5, "min_p"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("seed", -1, "seed must be at least 0"),
        ("seed", 2**64, "seed must be at most"),
        ("stop_token_ids", [1, -3], "at least 0"),
        ("stop_token_ids", "1", "list"),
        ("ignore_eos", 1, "bool"),
        ("logprobs", "yes", "bool"),
    ],
)
def test_out_of_range_values_are_one_clear_error(field, value, words):
    with pytest.raises(ProtocolError, match=words):
        SamplingParams(**{field: value})
