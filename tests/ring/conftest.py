from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from protocol.sampling import SamplingParams
from ring import sim_stage
from ring.config import RingConfig
from ring.harness import ThreadRing
from ring.loop import ModelInfo
from ring.sim_stage import SimStage

_run_ids = itertools.count()


@dataclass
class SimSpec:
    num_kv_blocks: int = 4096
    t0_s: float = 0.0
    t_token_s: float = 0.0
    sample_delay_s: float = 0.0
    overlap: bool = True
    kv_model: bool = False  # stages keep token ids as KV; tokens depend on what they read


def sim_ring(
    cfg: RingConfig, spec: SimSpec | None = None, context_length: int = 4096
) -> ThreadRing:
    spec = spec or SimSpec()

    def make(stage_cfg: RingConfig) -> SimStage:
        return SimStage(
            is_first_stage=stage_cfg.is_first_stage,
            is_last_stage=stage_cfg.is_last_stage,
            num_kv_blocks=spec.num_kv_blocks + stage_cfg.rank,  # unequal: the ring agrees the min
            t0_s=spec.t0_s,
            t_token_s=spec.t_token_s,
            sample_delay_s=spec.sample_delay_s if stage_cfg.is_last_stage else 0.0,
            overlap=spec.overlap,
            split_lm_head=stage_cfg.split_lm_head,
            kv_model=spec.kv_model,
        )

    return ThreadRing(cfg, make, ModelInfo(context_length=context_length), f"t{next(_run_ids)}")


def random_requests(
    rng: random.Random, n: int, max_prompt: int = 200, max_new: int = 24, prefix: str = "r"
) -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i in range(n):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, max_prompt))]
        sampling = SamplingParams(max_new_tokens=rng.randint(1, max_new), seed=rng.randrange(2**40))
        out.append((f"{prefix}{i}", prompt, sampling))
    return out


def expected_tokens(prompt: list[int], sampling: SamplingParams) -> list[int]:
    """What a simulated ring sends the request: each token chained from the one fed before it."""
    return sim_stage.expected_tokens(
        prompt, sampling.seed, sampling.max_new_tokens, sampling.stop_token_ids
    )


def expected_tokens_kv(prompt: list[int], sampling: SamplingParams, pp_size: int) -> list[int]:
    """What a simulated ring with a KV model sends the request (SimSpec.kv_model)."""
    return sim_stage.expected_tokens_kv(
        prompt, sampling.seed, sampling.max_new_tokens, pp_size, sampling.stop_token_ids
    )
