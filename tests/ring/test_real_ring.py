"""A ring of real stages (tiny random Llama, threads) against transformers: what the simulated
stages cannot check, that every chunk's KV lands where later steps read it, also when prompts
are spread over the slots."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

from protocol.sampling import SamplingParams
from ring.config import RingConfig
from ring.harness import ThreadRing
from ring.loop import ModelInfo
from stages.partition import layer_range
from stages.runner import StageRunner
from tests.tiny_llama import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("ring") / "tiny", seed=11, max_positions=512)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pp_size", "depth"), [(2, 0), (3, 1)])
def test_greedy_tokens_of_concurrent_long_prompts_equal_transformers(tiny, pp_size, depth):
    folder, model = tiny
    rng = random.Random(pp_size)
    requests = [
        (f"r{i}", [rng.randrange(3, 256) for _ in range(rng.randint(40, 200))],
         SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        for i in range(10)
    ]  # fmt: skip
    cfg = RingConfig(
        pp_size=pp_size, pp_async_batch_depth=depth, max_running_requests=6,
        chunked_prefill_size=64,
    )  # fmt: skip
    partition = [4 // pp_size + (i < 4 % pp_size) for i in range(pp_size)]

    def make(c: RingConfig) -> StageRunner:
        start, end = layer_range(partition, c.rank)
        return StageRunner(folder, start, end, kv_budget_bytes=4 << 20, rank=c.rank)

    with ThreadRing(cfg, make, ModelInfo(context_length=512), f"real{pp_size}") as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=90)
        got = dict(ring.driver.tokens)
        continued = ring.loops[0].scheduler.stats.num_continued_chunks
    assert continued > 0  # prompts really were spread over slots
    for rid, prompt, _ in requests:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False
            )
        assert got[rid] == out[0, len(prompt) :].tolist(), rid
