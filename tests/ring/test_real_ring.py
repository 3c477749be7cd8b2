"""A ring of real stages (tiny random Llama, threads) against transformers: what the simulated
stages cannot check, that every chunk's KV lands where later steps read it, also when prompts
are spread over the slots."""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers import LlamaForCausalLM

from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.harness import ThreadRing
from ring.loop import ModelInfo
from stages.backend.cuda.graphs import EagerRecorder
from stages.config import ModelConfig
from stages.kv_cache import bytes_per_block
from stages.partition import layer_range
from stages.runner import StageRunner
from tests.tiny_llama import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("ring") / "tiny", seed=11, max_positions=512)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model


def device_path(queued: bool) -> dict:
    """A GPU stage's path on the CPU (`queued`): `launch` returns queued steps and decodes run
    through the graphs' static buffers, padded to the captured sizes."""
    if not queued:
        return {}
    return {"overlap": True, "cuda_graph_max_bs": 4, "graph_recorder": EagerRecorder()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("pp_size", "depth", "split", "queued"),
    [(2, 0, False, False), (2, 0, True, False), (3, 1, True, False), (2, 0, False, True),
     (3, 1, True, True)],
)  # fmt: skip
def test_greedy_tokens_of_concurrent_long_prompts_equal_transformers(
    tiny, pp_size, depth, split, queued
):
    """`split`: the lm_head split between the first and the last stage, the first sampling.
    `queued`: the stages take a GPU stage's path on the CPU: `launch` returns queued steps
    (stages/device_step.py) and decodes run through the graphs' static buffers
    (stages/backend/cuda/graphs.py, recorded by EagerRecorder), padded to the captured sizes."""
    folder, model = tiny
    rng = random.Random(pp_size)
    requests = [
        (f"r{i}", [rng.randrange(3, 256) for _ in range(rng.randint(40, 200))],
         SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        for i in range(10)
    ]  # fmt: skip
    cfg = RingConfig(
        pp_size=pp_size, pp_async_batch_depth=depth, max_running_requests=6,
        chunked_prefill_size=64, split_lm_head=split,
    )  # fmt: skip
    partition = [4 // pp_size + (i < 4 % pp_size) for i in range(pp_size)]

    def make(c: RingConfig) -> StageRunner:
        start, end = layer_range(partition, c.rank)
        return StageRunner(
            folder, start, end, kv_budget_bytes=4 << 20, rank=c.rank, split_lm_head=split,
            **device_path(queued),
        )  # fmt: skip

    with ThreadRing(cfg, make, ModelInfo(context_length=512), f"real{pp_size}") as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=90)
        got = dict(ring.driver.tokens)
        continued = ring.loops[0].scheduler.stats.num_continued_chunks
        replays = [loop.stage.graphs.replays for loop in ring.loops] if queued else []
    assert continued > 0  # prompts really were spread over slots
    assert all(n > 0 for n in replays)  # decodes ran through the static buffers
    for rid, prompt, _ in requests:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False
            )
        assert got[rid] == out[0, len(prompt) :].tolist(), rid


@pytest.mark.timeout(120)
def test_aborts_in_a_ring_of_real_stages_free_their_kv_and_leave_the_others_exact(tiny):
    """Aborts at every point of a request's life (waiting, prefilling, decoding) on stages that
    really hold its KV: the pool is whole on every stage afterwards, the others' tokens exact."""
    folder, model = tiny
    rng = random.Random(3)
    requests = [
        (f"r{i}", [rng.randrange(3, 256) for _ in range(rng.randint(20, 150))],
         SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        for i in range(16)
    ]  # fmt: skip
    at_once = {"r3", "r9"}  # aborted as soon as sent: waiting, or in their first chunk
    after_tokens = {"r1", "r6", "r12", "r15"}  # aborted once they have 2 tokens
    cfg = RingConfig(pp_size=2, max_running_requests=6, chunked_prefill_size=48)

    def make(c: RingConfig) -> StageRunner:
        start, end = layer_range([2, 2], c.rank)
        return StageRunner(folder, start, end, kv_budget_bytes=4 << 20, rank=c.rank)

    with ThreadRing(cfg, make, ModelInfo(context_length=512), "real-abort") as ring:
        driver = ring.driver
        driver.submit_many(requests)
        for rid in sorted(at_once):
            driver.abort(rid)
        pending = set(after_tokens)
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            driver.poll(0.01)
            for rid in [r for r in pending if len(driver.tokens[r]) >= 2]:
                driver.abort(rid)
                pending.discard(rid)
        driver.wait_finished([r[0] for r in requests], timeout_s=90)
        assert ring.stop() == {0: 0, 1: 0}
        for loop in ring.loops:  # each stage's replica of the pool, which places its real KV
            assert loop.scheduler.pool.is_whole(), loop.prefix
    reasons = {rid: driver.finished[rid].finish_reason for rid, _, _ in requests}
    assert [r for r in at_once | after_tokens if reasons[r] == "abort"], reasons
    for rid, prompt, _ in requests:
        if rid in at_once | after_tokens:
            continue
        assert reasons[rid] == "length", rid
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False
            )
        assert driver.tokens[rid] == out[0, len(prompt) :].tolist(), rid


@pytest.mark.timeout(120)
def test_a_split_lm_head_samples_exactly_as_the_unsplit_ring(tiny):
    """Seeded sampling (temperature, top-k, top-p, min-p), logprobs and a repetition penalty:
    with the lm_head split the first stage samples the joined logits, so every token and logprob
    equals the unsplit ring's (the greedy shortcut, best logits only, is in the test above)."""
    folder, _ = tiny
    rng = random.Random(5)
    kinds = [
        SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
        SamplingParams(max_new_tokens=8, temperature=1.2, top_k=20, seed=2, logprobs=True,
                       ignore_eos=True),
        SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True),
        SamplingParams(max_new_tokens=8, temperature=0.0, repetition_penalty=1.5,
                       ignore_eos=True),
        SamplingParams(max_new_tokens=8, temperature=0.7, min_p=0.1, seed=3, ignore_eos=True),
    ]  # fmt: skip
    requests = [
        (f"r{i}", [rng.randrange(3, 256) for _ in range(rng.randint(5, 60))], kinds[i % 5])
        for i in range(10)
    ]
    results = {}
    for split in (False, True):
        cfg = RingConfig(pp_size=2, max_running_requests=6, split_lm_head=split)

        def make(c: RingConfig, split: bool = split) -> StageRunner:
            start, end = layer_range([2, 2], c.rank)
            return StageRunner(
                folder, start, end, kv_budget_bytes=4 << 20, rank=c.rank, split_lm_head=split
            )

        with ThreadRing(cfg, make, ModelInfo(context_length=512), f"split{split}") as ring:
            ring.driver.submit_many(requests)
            ring.driver.wait_finished([r[0] for r in requests], timeout_s=90)
            results[split] = (dict(ring.driver.tokens), dict(ring.driver.logprobs))
    tokens, logprobs = results[True]
    assert tokens == results[False][0]
    for rid, values in logprobs.items():
        assert values == pytest.approx(results[False][1][rid], abs=1e-5), rid
    assert all(v is not None for v in logprobs["r1"])  # the logprobs path really ran


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("pp_size", "depth", "queued", "cache"),
    [(1, 0, False, True), (2, 0, False, True), (3, 1, False, True), (2, 1, True, True),
     (2, 0, False, False)],
)  # fmt: skip
def test_chats_behind_a_shared_prompt_reuse_its_kv_and_equal_transformers(
    tiny, pp_size, depth, queued, cache
):
    """Real stages reading a prefix another request wrote: a shared system prompt, then each
    chat's next turn (its prompt, transformers' answer and a new question), on a pool small
    enough to evict. Every answer equals transformers' with the cache and without it."""
    folder, model = tiny
    rng = random.Random(40 + pp_size)
    system = [rng.randrange(3, 256) for _ in range(70)]  # four full blocks and 6 tokens

    def answer(prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False
            )
        return out[0, len(prompt) :].tolist()

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    first = [system + [rng.randrange(3, 256) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    second = [p + answer(p) + [rng.randrange(3, 256) for _ in range(9)] for p in first]
    second += [system[:40] + [7] * 30]  # a prefix cut inside the system prompt's third block
    cfg = RingConfig(
        pp_size=pp_size, pp_async_batch_depth=depth, max_running_requests=4,
        chunked_prefill_size=32, disable_radix_cache=not cache,
    )  # fmt: skip
    partition = [4 // pp_size + (i < 4 % pp_size) for i in range(pp_size)]

    def make(c: RingConfig) -> StageRunner:
        start, end = layer_range(partition, c.rank)
        # 40 blocks: fewer than the two waves' prompts hold, so cached blocks get evicted
        budget = 40 * bytes_per_block(ModelConfig.from_folder(folder), end - start, "float32")
        return StageRunner(
            folder, start, end, kv_budget_bytes=budget, rank=c.rank, **device_path(queued)
        )

    with ThreadRing(cfg, make, ModelInfo(context_length=512), f"real-prefix{pp_size}") as ring:
        driver = ring.driver
        for wave, prompts in (("a", first), ("b", second)):
            requests = [(f"{wave}{i}", p, greedy) for i, p in enumerate(prompts)]
            driver.submit_many(requests)
            driver.wait_finished([r[0] for r in requests], timeout_s=90)
        stats = ring.loops[0].scheduler.stats
        assert ring.stop() == {r: 0 for r in range(pp_size)}
        for loop in ring.loops:
            assert loop.scheduler.pool.is_whole(), loop.prefix
    for wave, prompts in (("a", first), ("b", second)):
        for i, prompt in enumerate(prompts):
            assert driver.tokens[f"{wave}{i}"] == answer(prompt), (wave, i)
    cached = {rid: n for rid, n in driver.cached_tokens.items()}
    if not cache:
        assert stats.prefix_hit_tokens == 0 and not any(cached.values())
        return
    # the second wave found the first's prompts, and its answers' full blocks, cached
    for i, prompt in enumerate(first):
        assert cached[f"b{i}"] >= len(prompt) // 16 * 16, (i, cached)
    assert cached["b4"] == 32  # two whole blocks of the system prompt, not the cut third


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp_size", [1, 2])
def test_a_windowed_model_serves_a_sequence_past_its_pool_with_transformers_tokens(
    tmp_path_factory, pp_size
):
    """A Mistral whose every layer sees its last 32 positions, on an 8-block pool: a sequence
    of 10 blocks (prompt 40, then 120 tokens: past 4x the window) runs, because the blocks
    behind the window go back to the pool as it grows, and its tokens are transformers'."""
    from transformers import MistralForCausalLM

    from tests.tiny_families import TINY_WINDOW, make_tiny_mistral

    folder = make_tiny_mistral(tmp_path_factory.mktemp("window") / "m", seed=95, init_std=0.2)
    model = MistralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = ModelConfig.from_folder(folder)
    assert config.kv_window == TINY_WINDOW
    prompt = [random.Random(6).randrange(3, 256) for _ in range(40)]
    greedy = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
    expected: list[int] = []
    with torch.inference_mode():  # plain argmax (an ignore_eos request may pick EOS too)
        cache = None
        ids = torch.tensor([prompt])
        for _ in range(120):
            out = model(ids, cache=cache, use_cache=True)
            cache = out.cache
            (best, second), (token, _) = out.logits[0, -1].topk(2)
            assert best - second > 1e-3  # no near tie: a token otherwise is ppring's error
            expected.append(int(token))
            ids = token.view(1, 1)
    cfg = RingConfig(pp_size=pp_size, chunked_prefill_size=32)
    partition = [4 // pp_size] * pp_size

    def make(c: RingConfig) -> StageRunner:
        start, end = layer_range(partition, c.rank)
        budget = 8 * bytes_per_block(config, end - start, "float32")
        return StageRunner(folder, start, end, kv_budget_bytes=budget, rank=c.rank)

    info = ModelInfo(context_length=512, kv_window=config.kv_window)
    with ThreadRing(cfg, make, info, f"window{pp_size}") as ring:
        ring.driver.submit_many([("w", prompt, greedy)])
        ring.driver.wait_finished(["w"], timeout_s=90)
        got = ring.driver.tokens["w"]
        assert ring.loops[0].scheduler.num_kv_blocks == 8
        assert ring.stop() == {r: 0 for r in range(pp_size)}
        stats = [loop.scheduler.stats for loop in ring.loops]
        whole = [loop.scheduler.pool.is_whole() for loop in ring.loops]
    assert got == expected
    # the window's two blocks, a 32-token chunk's two, and the block each starts inside
    assert all(s.max_held_blocks <= 5 for s in stats) and all(whole)
