"""Turn the last stage's logits into tokens: greedy, temperature, top-k, top-p, min-p,
penalties, logit bias, per-request seeds.

Order of processing, vLLM v1's: on the raw logits the logit bias (one of its logits processors,
which run before the penalties), then the repetition penalty, then the presence and frequency
penalties (its `apply_penalties` order), then min_tokens' ban on stop ids; then greedy argmax,
or temperature -> top-k -> top-p -> min-p -> sample. top-p and min-p act on the distribution
left after the earlier filters (renormalised).

Sampling is an exponential race: token = argmax(p / E) with E ~ Exp(1) i.i.d., which draws
exactly from p. A seeded request draws its E from its own generator, seeded from (seed,
position), so it gets the same tokens whatever else is in the batch and on every stage layout.

Logprobs are of the chosen token under the raw model distribution (log_softmax of the logits
before penalty, temperature and filters), which is what vLLM and SGLang return by default; so are
the top_logprobs most likely tokens a request may ask for besides.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.sampling import SamplingParams
from stages.batch import History, SampleResult

GREEDY = SamplingParams(temperature=0.0)

_MASK64 = (1 << 64) - 1


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    histories: Sequence[History | None] | None = None,
) -> SampleResult:
    """logits [N, V]; one SamplingParams, one position (that of the token being sampled) and
    optionally one history (for the penalties; None for a row without) per row."""
    if logits.shape[0] != len(params) or len(params) != len(positions):
        raise ValueError("sample() needs one SamplingParams and one position per logits row")
    raw = logits.float()  # [N, V]
    processed = _apply_penalties(_apply_logit_bias(raw, params), params, histories)
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        tokens = processed.argmax(dim=-1)  # [N]; the common fast path: one op for the batch
    else:
        tokens = processed.argmax(dim=-1)
        rows = [i for i, g in enumerate(greedy) if not g]
        row_index = torch.tensor(rows, device=raw.device)
        sampled = _sample_rows(
            processed.index_select(0, row_index),
            [params[i] for i in rows],
            [positions[i] for i in rows],
        )
        tokens.index_copy_(0, row_index, sampled)
    if not any(p.logprobs for p in params):
        return SampleResult(token_ids=tokens.tolist())
    log_probs = raw.log_softmax(dim=-1)  # [N, V]
    logprobs = log_probs.gather(1, tokens[:, None]).squeeze(1).tolist()  # [N]
    top_k = [p.top_logprobs for p in params]
    if not any(top_k):
        return SampleResult(token_ids=tokens.tolist(), logprobs=logprobs)
    top_values, top_index = log_probs.topk(min(max(top_k), log_probs.shape[1]), dim=-1)  # [N, k]
    values, index = top_values.tolist(), top_index.tolist()
    return SampleResult(
        token_ids=tokens.tolist(),
        logprobs=logprobs,
        top_ids=[row[:k] for row, k in zip(index, top_k)],
        top_logprobs=[row[:k] for row, k in zip(values, top_k)],
    )


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History | None] | None,
) -> torch.Tensor:
    """logits [N, V] -> a copy with each row's penalties applied (the input where no row has
    one). Repetition: tokens seen in prompt or output have positive logits divided by the
    penalty and negative ones multiplied (so a penalty > 1 always makes them less likely).
    Then, over the output only: minus presence_penalty for each token generated at least once,
    minus frequency_penalty times its count. Last, -inf for the ids min_tokens suppresses."""
    rows = [i for i, p in enumerate(params) if p.needs_history]
    if not rows:
        return logits
    if histories is None or any(histories[i] is None for i in rows):
        raise ValueError("a penalty needs the request's token history")
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        p, history = params[i], histories[i]
        output = torch.tensor(history.output_ids, dtype=torch.long, device=logits.device)
        output = output[output < vocab]  # [n_out]; ids the model cannot produce count nothing
        if p.repetition_penalty != 1.0:
            prompt = torch.tensor(history.prompt_ids, dtype=torch.long, device=logits.device)
            seen = torch.cat([prompt[prompt < vocab], output]).unique()  # [n_seen]
            values = logits[i, seen]
            penalty = p.repetition_penalty
            logits[i, seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and output.numel():
            counts = torch.bincount(output, minlength=vocab).to(logits.dtype)  # [V]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        suppressed = [t for t in history.suppressed_ids if t < vocab]
        if suppressed:
            logits[i, suppressed] = float("-inf")
    return logits


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, V] plus each row's logit_bias (ids beyond the vocabulary are refused by the
    frontend; here they are skipped, so a ring-side client cannot index out of bounds)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    vocab = logits.shape[1]
    biased = logits.clone()
    for i in rows:
        bias = {t: b for t, b in params[i].logit_bias_ids().items() if t < vocab}
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            biased[i, ids] += torch.tensor(list(bias.values()), device=logits.device)
    return biased


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> torch.Tensor:
    """Random sampling for rows with temperature > 0: logits [R, V] -> tokens [R]."""
    device = logits.device
    num_rows, vocab = logits.shape
    temperature = torch.tensor([p.temperature for p in params], device=device)
    x = logits / temperature[:, None]  # [R, V]

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        # Keep logits >= the k-th largest (ties at the boundary are kept too).
        kth_values = x.topk(max(top_k), dim=-1).values  # [R, kmax]
        k_index = torch.tensor(top_k, device=device)[:, None].clamp_max(kth_values.shape[1]) - 1
        threshold = kth_values.gather(1, k_index)  # [R, 1]
        full = torch.tensor([k == vocab for k in top_k], device=device)[:, None]
        x = x.masked_fill((x < threshold) & ~full, float("-inf"))

    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]  # [R, 1]
    if bool((top_p < 1.0).any()):
        probs = x.softmax(dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))

    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    if bool((min_p > 0.0).any()):
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))

    probs = x.softmax(dim=-1)  # [R, V]
    noise = torch.empty_like(probs)
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    for i, p in enumerate(params):
        if p.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(_mix_seed(p.seed, positions[i]))
            noise[i].exponential_(generator=generator)
    # Exp(1) is almost surely > 0; clamp so a zero can never turn 0 / 0 into a NaN winner.
    return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N]: each row's first maximal index, as argmax(dim=-1) (ties, NaN alike). In
    bf16 on a CPU torch's argmax is a slow loop: [32, 49152] took 5.7 ms on one thread against
    1.0 for max(dim) (0.97 against 0.17 ms for [11, 24576], a PP=2 stage's half vocabulary);
    a profile of a PP=2 ring had argmax at 9% of each stage's time."""
    return logits.max(dim=-1).indices


def _mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, token position): splitmix64 finaliser, so
    neighbouring positions get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
