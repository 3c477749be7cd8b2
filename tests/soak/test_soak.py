"""The soak: many requests against a real PP=2 ring on the default model, with random prompts,
lengths and sampling, a fifth of the streams abandoned at random points; then the ring idles.
Half the prompts start with one of a few shared "system prompts", so the prefix cache (on, as
by default) is matched, held, evicted and released all the way through.

Nothing may be lost: every request not abandoned ends with `done` and exactly its tokens
(every request ignores EOS; a sample of greedy and seeded ones is run again alone afterwards
and must get the same tokens), the KV pool is whole on every stage at idle (each stage's own
scheduler replica, read from /metrics), and each stage's resident memory stays flat.

`make test` runs a short form (PPRING_SOAK_REQUESTS, default 48); `make soak` the full 10,000.
The figures go to PPRING_SOAK_REPORT (JSON) when set.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.client import AsyncClient
from tests.e2e.conftest import LocalServer
from tests.e2e.test_orphans import children_of

NUM_REQUESTS = int(os.environ.get("PPRING_SOAK_REQUESTS", "48"))
CONCURRENCY = 32
ABANDON_SHARE = 0.2
# Greedy and seeded requests run again alone afterwards, one at a time (slow: a sample).
RECHECK = 20 if NUM_REQUESTS >= 2000 else 4
WORDS = (
    "the a pipeline stage ring token cache model layer batch request answer river mountain "
    "seven blue quickly write explain why because however numbers list code python function "
    "France Paris history music light energy water small large first last next"
).split()


_SYSTEM_RNG = random.Random(7)
SYSTEMS = [" ".join(_SYSTEM_RNG.choice(WORDS) for _ in range(n)) for n in (30, 60, 90, 150)]


def make_request(rng: random.Random, n: int) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    if rng.random() < 0.5:
        prompt = rng.choice(SYSTEMS) + "\n" + prompt
    sampling: dict = {"max_new_tokens": rng.randint(1, 40), "ignore_eos": True}
    kind = rng.random()
    if kind < 0.4:
        sampling["temperature"] = 0.0
    else:
        sampling.update(temperature=rng.uniform(0.3, 1.3), seed=rng.randrange(2**31))
        if rng.random() < 0.5:
            sampling["top_k"] = rng.choice([5, 20, 50])
        if rng.random() < 0.5:
            sampling["top_p"] = rng.uniform(0.5, 1.0)
        if rng.random() < 0.3:
            sampling["min_p"] = rng.uniform(0.0, 0.2)
        if rng.random() < 0.2:
            sampling["repetition_penalty"] = rng.uniform(1.0, 1.5)
    abandon_after = (
        rng.randint(0, sampling["max_new_tokens"]) if rng.random() < ABANDON_SHARE else None
    )
    return {"n": n, "prompt": prompt, "sampling": sampling, "abandon_after": abandon_after}


def stage_rss_kib(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out.append(int(line.split()[1]))
    return out


def stage_kv(server) -> dict[str, float]:
    return {
        sample.labels["stage"]: sample.value
        for sample in samples(server)
        if sample.name == "ppring:stage_kv_blocks_used"
    }


def samples(server) -> list:
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def prefix_cache_tokens(server) -> dict[str, float]:
    """The frontend's prefix cache counters: prompt tokens looked up, and found."""
    wanted = {
        "ppring:prefix_cache_queries_total": "queries",
        "ppring:prefix_cache_hits_total": "hits",
    }
    return {wanted[s.name]: s.value for s in samples(server) if s.name in wanted}


async def one(client: AsyncClient, req: dict, results: dict) -> None:
    tokens: list[int] = []
    done = None
    stream = client.generate(req["prompt"], **req["sampling"])
    try:
        async for msg in stream:
            if msg.kind == "done":
                done = msg
                continue  # the stream ends after it
            tokens += msg.token_ids
            if req["abandon_after"] is not None and len(tokens) >= req["abandon_after"]:
                break  # leaving the stream aborts the request in the ring
    finally:
        await stream.aclose()
    results[req["n"]] = (tokens, done)


async def soak(server, requests: list[dict], stages: list[int]) -> dict:
    results: dict[int, tuple] = {}
    rss: dict[str, list[int]] = {}
    mark = max(len(requests) // 5, 1)  # "the 2,000th of 10,000"
    queue = list(requests)
    async with AsyncClient(server.addr, timeout_s=600) as client:

        async def worker() -> None:
            while queue:
                req = queue.pop(0)
                await one(client, req, results)
                if len(results) == mark and "mark" not in rss:
                    rss["mark"] = stage_rss_kib(stages)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        rss["end"] = stage_rss_kib(stages)
        again = {}
        checked = [r for r in requests if r["abandon_after"] is None][:RECHECK]
        for req in checked:  # alone: a seeded draw depends on (seed, position) only
            again[req["n"]] = (await client.complete(req["prompt"], **req["sampling"])).token_ids
    return {"results": results, "rss": rss, "again": again}


@pytest.mark.timeout(max(600, NUM_REQUESTS // 2))  # about 4 requests a second
def test_soak_loses_nothing(default_model, tmp_path):
    rng = random.Random(2026)
    requests = [make_request(rng, n) for n in range(NUM_REQUESTS)]
    server = LocalServer(["--pp-size", "2", "--dtype", "float32"], tmp_path)
    started = time.monotonic()
    try:
        server.wait_ready()
        stages = children_of(server.proc.pid)
        assert len(stages) == 2
        out = asyncio.run(soak(server, requests, stages))
        deadline = time.monotonic() + 10
        while any(v != 0 for v in stage_kv(server).values()) and time.monotonic() < deadline:
            time.sleep(0.2)  # the stages report once more on going idle
        kv = stage_kv(server)
        cache = prefix_cache_tokens(server)
        assert server.stop() == 0
    finally:
        if server.proc.poll() is None:
            server.stop()
    wall = time.monotonic() - started
    results = out["results"]
    kept = [r for r in requests if r["abandon_after"] is None]
    lost = [r["n"] for r in kept if results[r["n"]][1] is None]
    wrong = [r["n"] for r in kept if len(results[r["n"]][0]) != r["sampling"]["max_new_tokens"]]
    differ = [n for n, tokens in out["again"].items() if tokens != results[n][0]]
    growth = [end / mark - 1 for mark, end in zip(out["rss"]["mark"], out["rss"]["end"])]
    figures = {
        "requests": len(requests),
        "tokens": sum(len(t) for t, _ in results.values()),
        "abandoned": len(requests) - len(kept),
        "lost": len(lost),
        "wrong_length": len(wrong),
        "rerun_alone_differ": len(differ),
        "kv_blocks_used_at_idle": kv,
        "prefix_cache_tokens": cache,
        "rss_kib_at_20pct": out["rss"]["mark"],
        "rss_kib_at_end": out["rss"]["end"],
        "wall_s": round(wall, 1),
    }
    print(json.dumps(figures))
    if os.environ.get("PPRING_SOAK_REPORT"):
        Path(os.environ["PPRING_SOAK_REPORT"]).write_text(json.dumps(figures, indent=1))
    assert lost == [] and wrong == [] and differ == [], figures
    assert sorted(kv) == ["0", "1"] and all(v == 0 for v in kv.values()), figures
    assert cache["hits"] > 0.1 * cache["queries"], figures  # the shared prompts were found
    if NUM_REQUESTS >= 2000:  # a short run is too short to see a trend
        assert all(g < 0.05 for g in growth), figures
