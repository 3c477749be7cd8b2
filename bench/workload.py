"""The serving bench's fixed, seeded workload: prompts of mixed lengths and output lengths.

Prompts are token ids drawn from the model's vocabulary (no text: the bench measures the
engine, not the tokenizer). Prompt lengths are log-uniform, so most prompts are short and a few
are long, as in chat traffic; output lengths are uniform. Every request runs to its own
`max_new_tokens` (`ignore_eos`), so ppring and Hugging Face `generate` produce the same number
of tokens for the same request and the comparison counts the same work.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    input_ids: list[int]
    max_new_tokens: int


@dataclass(frozen=True)
class Workload:
    seed: int
    requests: list[Request]

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    @property
    def mean_output_tokens(self) -> float:
        return self.num_output_tokens / len(self.requests)

    def describe(self) -> dict[str, float | int]:
        prompts = sorted(len(r.input_ids) for r in self.requests)
        outputs = sorted(r.max_new_tokens for r in self.requests)
        return {
            "seed": self.seed,
            "num_requests": len(self.requests),
            "prompt_tokens_min": prompts[0],
            "prompt_tokens_median": prompts[len(prompts) // 2],
            "prompt_tokens_max": prompts[-1],
            "output_tokens_min": outputs[0],
            "output_tokens_median": outputs[len(outputs) // 2],
            "output_tokens_max": outputs[-1],
            "output_tokens_total": self.num_output_tokens,
        }


def make_workload(
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 49152,
    prompt_tokens: tuple[int, int] = (16, 512),
    output_tokens: tuple[int, int] = (16, 128),
) -> Workload:
    if num_requests < 1:
        raise ValueError("the workload needs at least one request")
    lo, hi = prompt_tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"prompt lengths must satisfy 1 <= min <= max, got {prompt_tokens}")
    if not 1 <= output_tokens[0] <= output_tokens[1]:
        raise ValueError(f"output lengths must satisfy 1 <= min <= max, got {output_tokens}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        # Skip the lowest ids: special tokens (BOS/EOS/pad) sit there in most vocabularies.
        prompt = [rng.randrange(256, vocab_size) for _ in range(length)]
        requests.append(Request(prompt, rng.randint(*output_tokens)))
    return Workload(seed, requests)
