"""Sampling parameters: one frozen dataclass, validated on construction.

Names and meanings follow SGLang's / vLLM's `SamplingParams` so a user can move over without a
dictionary: `top_k = -1` and `top_p = 1.0` and `min_p = 0.0` disable those filters,
`temperature = 0` is greedy. The penalties are vLLM's: `repetition_penalty` scales the logits of
every token the request has seen (prompt and output, as transformers does), `presence_penalty`
and `frequency_penalty` subtract from the logits of tokens it has generated (once, and per
occurrence), and `logit_bias` adds to chosen tokens' logits (OpenAI's, keyed by token id).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import ProtocolError

# Largest seed we accept: it must survive msgpack (int64) and torch.Generator.manual_seed.
MAX_SEED = 2**63 - 1
MAX_STOP_ENTRIES = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20  # vLLM's default cap (max_logprobs), OpenAI's for chat


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    # vLLM's: no EOS, stop token id or stop string ends the answer before this many tokens
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id (a decimal string, as in OpenAI's JSON and so msgpack's map keys) -> added logit
    logit_bias: dict[str, float] = field(default_factory=dict)
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    # with logprobs: also the this many most likely tokens' logprobs at each step
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_new_tokens)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ProtocolError("top_k must be -1 (disabled) or at least 1, got 0")
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, high=10.0, low_open=True
        )
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_logit_bias(self.logit_bias)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_ENTRIES:
            raise ProtocolError(
                f"stop_token_ids must be a list of at most {MAX_STOP_ENTRIES} token ids"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise ProtocolError("ignore_eos must be a bool")
        if not isinstance(self.logprobs, bool):
            raise ProtocolError("logprobs must be a bool")
        _check_int("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """A penalty reads the request's tokens so far (min_tokens, how many are out)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
        )

    @property
    def changes_logits(self) -> bool:
        """Something moves the raw logits before the choice (so greedy is not their argmax)."""
        return self.needs_history or bool(self.logit_bias)

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with int keys (checked decimal at construction)."""
        return {int(token_id): bias for token_id, bias in self.logit_bias.items()}


def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    # bool is an int subclass in Python; a client that sends `true` for a count is wrong.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer, got {type(value).__name__}")
    if low is not None and value < low:
        raise ProtocolError(f"{name} must be at least {low}, got {value}")
    if high is not None and value > high:
        raise ProtocolError(f"{name} must be at most {high}, got {value}")


def _check_logit_bias(logit_bias: object) -> None:
    if not isinstance(logit_bias, dict) or len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ProtocolError(
            f"logit_bias must be a map of at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases"
        )
    for token_id, bias in logit_bias.items():
        if not _is_token_id(token_id):
            raise ProtocolError(f"logit_bias keys must be token ids, got {token_id!r}")
        _check_float(f"logit_bias[{token_id}]", bias, low=-100.0, high=100.0)


def _is_token_id(key: object) -> bool:
    """A token id as "12": ASCII digits without sign, spaces or leading zeros (one token, one key),
    and short enough for int() to be cheap."""
    return (
        isinstance(key, str)
        and 0 < len(key) <= 10
        and key.isascii()
        and key.isdigit()
        and (key == "0" or key[0] != "0")
    )


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{name} must be a number, got {type(value).__name__}")
    if value != value:  # NaN compares unequal to itself
        raise ProtocolError(f"{name} must be a number, got NaN")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise ProtocolError(f"{name} must be in {bracket}{low}, {high}], got {value}")
