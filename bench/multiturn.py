"""`ppring bench serve --workload multiturn`: concurrent chats behind one shared system prompt,
with the prefix cache and without it (`--disable-radix-cache`), in one command.

    ppring bench serve --workload multiturn [--pp-sizes 2] [--chats 8] [--turns 6]
                       [--system-words 700] [--turn-tokens 24] [--backend ppring|openai]
                       [--repeats 3] [--out DIR]

Each of `--chats` chats sends `--turns` turns one after another, every turn the whole
conversation so far as chat messages (the system prompt, the user's questions, the answers it
got), greedy, `--turn-tokens` new tokens (EOS ignored, so every run does the same work); the
chats run at once. The system prompt is `--system-words` words of the shipped English text, the
questions sentences drawn from the rest of it (seeded). Through ppring's own client the answer's
`done` says how many prompt tokens the prefix cache held; through the OpenAI API (`--backend
openai`, chat completions, streamed) its usage's `prompt_tokens_details.cached_tokens` does.

For every layout of `--pp-sizes` it starts its rings at once, one with the cache per
`--schedule-policies` (fcfs, lpm) and one without it, each admitting at most `--concurrency`
requests (more chats than that queue), warms each up untimed (other text), and runs the
workload on each in alternated rounds (`--repeats`, every other round in reverse order). Each
round takes another window of the text as its system prompt, so no round finds the previous
round's prompt cached. It reports per ring the total time, the median time to first token of
each turn, the prompt tokens sent and the share of them the cache held, and how many answers
are the same text as the uncached ring's; then each cached ring's ratios to the uncached one
(median over rounds). JSON into `--out/bench_serve_multiturn.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import random
import re
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.clients import NativeBackend, OpenAIBackend

TEXT = Path(__file__).parent / "texts" / "quality_en.txt"
WARMUP_TURN_TOKENS = 8


@dataclass(frozen=True)
class Conversation:
    """One round's chats: a shared system prompt and each chat's questions, in turn order."""

    system: str
    questions: list[list[str]]  # [chat][turn]


@functools.cache
def text_words() -> tuple[str, ...]:
    return tuple(TEXT.read_text(encoding="utf-8").split())


@functools.cache
def text_sentences() -> tuple[str, ...]:
    """The text's sentences of 4-40 words: the questions are drawn from them."""
    split = re.split(r"(?<=[.!?])\s+", " ".join(text_words()))
    return tuple(s.strip() for s in split if 4 <= len(s.split()) <= 40)


def conversation(
    round_index: int, num_chats: int, num_turns: int, system_words: int, seed: int
) -> Conversation:
    """Round `round_index`'s system prompt (its own window of the text, wrapping round) and
    questions (sentences of the text, seeded by round)."""
    words = text_words()
    if system_words >= len(words):
        raise ValueError(f"--system-words must be under {len(words)}, the text's length")
    start = (round_index * system_words) % (len(words) - system_words)
    system = "You answer questions about this text.\n\n" + " ".join(
        words[start : start + system_words]
    )
    sentences = text_sentences()
    rng = random.Random(seed * 1000 + round_index)
    questions = [
        [f"What does this mean: {rng.choice(sentences)}" for _ in range(num_turns)]
        for _ in range(num_chats)
    ]
    return Conversation(system, questions)


@dataclass
class TurnRecord:
    chat: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    answer: str


@dataclass
class RunResult:
    ring: str
    round_index: int
    elapsed_s: float
    turns: list[TurnRecord] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        num_turns = max(t.turn for t in self.turns) + 1
        ttft = [
            statistics.median(t.ttft_s for t in self.turns if t.turn == k) for k in range(num_turns)
        ]
        later = [t.ttft_s for t in self.turns if t.turn >= 1]
        return {
            "ring": self.ring,
            "round": self.round_index,
            "total_s": round(self.elapsed_s, 3),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_prompt_tokens": prompt - cached,
            "cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "output_tokens": sum(t.output_tokens for t in self.turns),
            "ttft_median_ms_by_turn": [round(1000 * x, 1) for x in ttft],
            "ttft_median_ms_turns_2_on": round(1000 * statistics.median(later), 1)
            if later
            else None,
        }


# -- sending one turn ------------------------------------------------------------------------------


class NativeChats(NativeBackend):
    """ppring's ZeroMQ client: chat messages, the cached count from `done`."""

    async def turn(self, messages: list[dict[str, str]], max_tokens: int) -> tuple:
        sent, first, text, done = time.perf_counter(), None, [], None
        async for msg in self.client.generate(
            messages=messages, max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            if msg.kind == "done":
                done = msg
            elif msg.token_ids:
                first = first or time.perf_counter()
                text.append(msg.text)
        ended = time.perf_counter()
        usage = (done.prompt_tokens, done.cached_tokens, done.completion_tokens)
        return "".join(text), usage, (first or ended) - sent, ended - sent


class OpenAIChats(OpenAIBackend):
    """`POST /v1/chat/completions`, streamed, the cached count from the usage's
    `prompt_tokens_details` (as OpenAI's API reports it)."""

    async def turn(self, messages: list[dict[str, str]], max_tokens: int) -> tuple:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent, first, text, usage = time.perf_counter(), None, [], None
        async for event in self.events("/chat/completions", body):
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
        ended = time.perf_counter()
        if usage is None:
            raise RuntimeError(f"{self.base_url} sent no usage")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        counts = (usage["prompt_tokens"], cached, usage["completion_tokens"])
        return "".join(text), counts, (first or ended) - sent, ended - sent


async def run_chats(client, convo: Conversation, turn_tokens: int, ring: str, index: int):
    """Every chat at once, each turn after the one before it; the whole round's records."""
    result = RunResult(ring, index, 0.0)

    async def chat(c: int) -> None:
        messages = [{"role": "system", "content": convo.system}]
        for k, question in enumerate(convo.questions[c]):
            messages.append({"role": "user", "content": question})
            answer, (prompt, cached, out), ttft, e2e = await client.turn(messages, turn_tokens)
            messages.append({"role": "assistant", "content": answer})
            result.turns.append(TurnRecord(c, k, prompt, cached, out, ttft, e2e, answer))

    async with client:
        started = time.perf_counter()
        await asyncio.gather(*(chat(c) for c in range(len(convo.questions))))
        result.elapsed_s = time.perf_counter() - started
    result.turns.sort(key=lambda t: (t.chat, t.turn))
    return result


# -- the bench -------------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: list[str] | None, model_dir: Path) -> int:
    """The multiturn bench (bench/serve.py's main hands it over)."""
    from bench.serve import _log_dir, local_ring

    backend = args.backends[0]
    if len(args.backends) != 1 or args.base_url:
        raise SystemExit("ppring bench serve --workload multiturn: one --backend, no --base-url")
    try:
        convos = [
            conversation(r, args.chats, args.turns, args.system_words, args.seed)
            for r in range(args.repeats + 1)  # the last: the warm-up's text
        ]
    except ValueError as exc:
        raise SystemExit(f"ppring bench serve: {exc}") from None
    warmup = Conversation(convos[-1].system, [q[:1] for q in convos[-1].questions])
    print(f"ppring bench serve --workload multiturn: {model_dir.name}, {args.dtype}, "
          f"{args.chats} chats x {args.turns} turns, {args.system_words}-word system prompt, "
          f"{args.turn_tokens} tokens a turn, via {backend}, {args.repeats} round(s)",
          flush=True)  # fmt: skip
    runs: list[RunResult] = []
    args.out.mkdir(parents=True, exist_ok=True)
    with _log_dir(args.log_dir) as logs:
        for pp_size in args.pp_sizes:
            with ExitStack() as stack:
                clients = {}
                for name, extra in rings(pp_size, args.schedule_policies):
                    tag = name.lower().replace("=", "").replace(" ", "-")
                    addr, http_url = stack.enter_context(
                        local_ring(args, model_dir, pp_size, logs, tag=tag, extra=extra)
                    )
                    clients[name] = (
                        (lambda a=addr: NativeChats(a))
                        if backend == "ppring"
                        else (lambda u=http_url: OpenAIChats(u))
                    )
                for name, make in clients.items():
                    asyncio.run(run_chats(make(), warmup, WARMUP_TURN_TOKENS, name, -1))
                for r in range(args.repeats):
                    order = list(clients.items())
                    for name, make in order if r % 2 == 0 else order[::-1]:
                        chats = run_chats(make(), convos[r], args.turn_tokens, name, r)
                        result = asyncio.run(chats)
                        runs.append(result)
                        s = result.summary()
                        print(f"  {name:>16} round {r}: {s['total_s']:6.2f} s, TTFT median by "
                              f"turn {s['ttft_median_ms_by_turn']} ms, {s['prompt_tokens']} "
                              f"prompt tokens, {100 * s['cache_hit_rate']:.1f}% cached",
                              flush=True)  # fmt: skip
                write_multiturn(args, argv, model_dir, runs)
    write_multiturn(args, argv, model_dir, runs, quiet=False)
    return 0


def rings(pp_size: int, policies: list[str]) -> list[tuple[str, list[str]]]:
    """(name, `ppring local` flags) of one layout's rings: one with the cache per admission
    policy (fcfs unnamed), and one without it."""
    named = [
        (f"PP={pp_size} cache" + ("" if policy == "fcfs" else f" {policy}"),
         ["--schedule-policy", policy])
        for policy in policies
    ]  # fmt: skip
    return [*named, (f"PP={pp_size} no cache", ["--disable-radix-cache"])]


def compare(runs: list[RunResult], ring: str, against: str) -> dict[str, Any] | None:
    """`ring` against `against` in each round, and the medians over rounds."""
    cached = {r.round_index: r for r in runs if r.ring == ring}
    plain = {r.round_index: r for r in runs if r.ring == against}
    rounds = sorted(set(cached) & set(plain))
    if not rounds:
        return None
    per_round = []
    for r in rounds:
        a, b = cached[r].summary(), plain[r].summary()
        same = [x.answer == y.answer for x, y in zip(cached[r].turns, plain[r].turns)]
        per_round.append(
            {
                "round": r,
                "total_time_ratio": round(a["total_s"] / b["total_s"], 3),
                "ttft_turns_2_on_ratio": round(
                    a["ttft_median_ms_turns_2_on"] / b["ttft_median_ms_turns_2_on"], 3
                ),
                "cache_hit_rate": a["cache_hit_rate"],
                "same_answers": sum(same),
                "answers": len(same),
            }
        )
    return {
        "ring": ring,
        "against": against,
        "total_time_ratio_median": statistics.median(x["total_time_ratio"] for x in per_round),
        "ttft_turns_2_on_ratio_median": statistics.median(
            x["ttft_turns_2_on_ratio"] for x in per_round
        ),
        "cache_hit_rate_median": statistics.median(x["cache_hit_rate"] for x in per_round),
        "rounds": per_round,
    }


def write_multiturn(args, argv, model_dir: Path, runs: list[RunResult], quiet: bool = True):
    pairs = [
        (name, f"PP={pp} no cache")
        for pp in args.pp_sizes
        for name, _ in rings(pp, args.schedule_policies)[:-1]
    ]
    comparisons = [c for ring, against in pairs if (c := compare(runs, ring, against))]
    result = {
        "bench": "serve multiturn",
        "argv": argv,
        "model": str(model_dir),
        "dtype": args.dtype,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "shape": {
            "chats": args.chats,
            "turns": args.turns,
            "system_words": args.system_words,
            "turn_tokens": args.turn_tokens,
            "backend": args.backends[0],
            "max_running_requests": args.concurrency,
        },
        "runs": [r.summary() for r in runs],
        "comparisons": comparisons,
    }
    path = args.out / "bench_serve_multiturn.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if quiet:
        return
    for c in comparisons:
        same = sum(x["same_answers"] for x in c["rounds"])
        total = sum(x["answers"] for x in c["rounds"])
        print(f"{c['ring']} / {c['against']}, median of {len(c['rounds'])} round(s): "
              f"total time {c['total_time_ratio_median']:.2f}x, median TTFT of turns 2-"
              f"{args.turns} {c['ttft_turns_2_on_ratio_median']:.2f}x; cache hit rate "
              f"{100 * c['cache_hit_rate_median']:.1f}% of prompt tokens; answers the same "
              f"text: {same} of {total}")  # fmt: skip
    print(f"wrote {path}")
