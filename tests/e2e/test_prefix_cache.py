"""The prefix cache through `ppring local` on the default model, in float32 against
transformers: chats behind one shared system prompt, each next turn its whole conversation so
far, at PP = 1, 2, 3 with the cache and at PP = 2 without it. The same greedy tokens every way;
what was cached is told in the native `done`, the OpenAI usage and /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from launch.client import AsyncClient

TEXT = Path(__file__).parents[2] / "bench" / "texts" / "quality_en.txt"
SYSTEM = "Answer in one sentence.\n\n" + " ".join(TEXT.read_text().split()[:150])
QUESTIONS = [
    ["What is the text about?", "Say it again, shorter."],
    ["Name one thing it mentions.", "Why that one?"],
    ["Is the text old?", "How can you tell?"],
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def hf_answer(default_model):
    """transformers' greedy answer to a conversation, through the chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()

    def answer(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1] :].tolist()

    return answer


async def chats(addr: str) -> list[list[tuple[list[dict[str, str]], object]]]:
    """Every chat at once, turn after turn; per chat, (messages sent, completion) per turn."""
    async with AsyncClient(addr, timeout_s=120) as client:

        async def chat(questions: list[str]):
            messages = [{"role": "system", "content": SYSTEM}]
            turns = []
            for question in questions:
                messages = [*messages, {"role": "user", "content": question}]
                done = await client.chat(messages, max_new_tokens=MAX_NEW, temperature=0)
                turns.append((messages, done))
                messages = [*messages, {"role": "assistant", "content": done.text}]
            return turns

        return await asyncio.gather(*(chat(q) for q in QUESTIONS))


def metric(http_url: str, name: str) -> float:
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("pp_size", "cache"),
    # PP=3 is long (a third process loading the model); its short form is
    # tests/ring/test_real_ring.py's PP=3 ring of real stages, cached, against transformers.
    [(1, True), (2, True), pytest.param(3, True, marks=pytest.mark.long), (2, False)],
    ids=str,
)
def test_chats_behind_a_shared_prompt_are_transformers_tokens_cached_or_not(
    start_local, hf_answer, pp_size, cache
):
    flags = ["--pp-size", str(pp_size), "--dtype", "float32", "--served-model-name", "smol"]
    server = start_local(*flags, *([] if cache else ["--disable-radix-cache"]))
    assert (b"prefix cache: on" if cache else b"prefix cache: off") in server.stdout
    turns = asyncio.run(chats(server.addr))
    for chat in turns:
        for k, (messages, done) in enumerate(chat):
            assert done.token_ids == hf_answer(messages), (messages[-1], k)
            cached = done.done.cached_tokens
            assert cached % 16 == 0 and cached < done.done.prompt_tokens
            if not cache:
                assert cached == 0
            elif k == 1:  # the first turn's prompt is the start of this one's: cached
                assert cached >= chat[0][1].done.prompt_tokens // 16 * 16
    # The same conversation once more through the official client: all of it cached now.
    messages, _ = turns[0][1]
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0) as client:
        again = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=MAX_NEW, temperature=0
        )
    details = again.usage.prompt_tokens_details
    hits = metric(server.http_url, "ppring:prefix_cache_hits_total")
    queries = metric(server.http_url, "ppring:prefix_cache_queries_total")
    assert queries >= sum(d.done.prompt_tokens for chat in turns for _, d in chat)
    if cache:
        assert details.cached_tokens >= again.usage.prompt_tokens - 16
        told = sum(d.done.cached_tokens for chat in turns for _, d in chat)
        assert hits >= details.cached_tokens + told
    else:
        assert details.cached_tokens == 0 and hits == 0
