"""Which layers each pipeline stage owns.

Two rules, picked by `--partition-rule` (PPRING_LAYER_PARTITION=a,b,... overrides both):

- `cost` (the default): stages of equal cost, counting what each really runs per decoded token:
  its layers (weights and attention over a typical context), the first stage's embedding, the
  last stage's final norm, lm_head and sampler. The costs are derived from the model's shape
  (`StageCosts.for_model`), the same on every node, so every stage computes the same split.
  For SmolLM2 the lm_head (49,152 x 576) is about seven layers of decode work: at PP=2 the
  seed's [15, 15] left stage 0 waiting 43% of the time for the last stage; `cost` gives
  [17, 13].
  With the lm_head split (`--split-lm-head`, the CPU default at PP >= 2), the first and the
  last stage each multiply by half of the vocabulary and the first one samples, so that decode's
  extra work no longer sits on one stage: SmolLM2 then splits [15, 15] at PP=2.
- `seed` (DESIGN.md §4): every stage gets `L // S` layers and the remainder `x` goes one layer
  each to the `x` stages just before the last. That is the same as "all but the last" when
  `x = S - 1`, and "the middle stages, first and last excluded" when `S > 2` and `x <= S - 2`:
  the last stage also runs the final norm, lm_head and the sampler, and the first holds the
  embedding, so they are the ones to keep light.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.errors import ConfigError

if TYPE_CHECKING:
    from stages.config import ModelConfig

logger = logging.getLogger(__name__)

PARTITION_ENV = "PPRING_LAYER_PARTITION"
PARTITION_RULES = ("cost", "seed")
# The context a decode step's attention is costed at: a typical serving context, long enough
# that attention is not free and short enough that weights dominate, as they do in serving.
COST_CONTEXT_TOKENS = 512
# The share of the tokens through a stage that are decode tokens, the only ones that reach the
# lm_head (a prefill chunk samples at most its last row). Decode-dominated serving: chat
# answers run about as long as their prompts. Measured on the equal-work bench (prompts of
# 8-120 tokens, 64 new tokens each: 60% decode) at PP=2: [18, 12] (the lm_head at full weight)
# left stage 1 waiting 21% for stage 0, [17, 13] waited 13% and 16%: the round trip at depth 0.
DECODE_SHARE = 0.6


def vocab_cut(vocab_size: int) -> int:
    """With the lm_head split, the first stage multiplies by vocabulary rows [0, cut) and the
    last by [cut, V): half each, the cut on a multiple of 16 (the CPU kernels' panel width, so
    both halves pack without padding)."""
    return max(vocab_size // 2 // 16 * 16, 1)


def lm_head_rows(
    vocab_size: int, is_first: bool, is_last: bool, split: bool
) -> tuple[int, int] | None:
    """The vocabulary rows [lo, hi) of the lm_head that a stage multiplies by: all of them on
    the last stage, or with the split half on the first and half on the last; None for a stage
    that has none."""
    if not split or (is_first and is_last):
        return (0, vocab_size) if is_last else None
    cut = vocab_cut(vocab_size)
    return (0, cut) if is_first else (cut, vocab_size) if is_last else None


@dataclass(frozen=True)
class StageCosts:
    """Per token through the ring, in FLOPs: one layer, and what the first and the last stage
    add (the lm_head weighted by the share of decode tokens). With `split_lm_head` the first
    stage multiplies by its half of the vocabulary and samples, the last by the other half."""

    layer: float
    first_extra: float  # embedding lookup
    last_extra: float  # final norm, lm_head, sampling
    first_head: float = 0.0  # of last_extra, what the lm_head split moves to the first stage

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        context: int = COST_CONTEXT_TOKENS,
        decode_share: float = DECODE_SHARE,
        split_lm_head: bool = False,
    ) -> StageCosts:
        d, head_dim = config.hidden_size, config.head_dim
        q_size = config.num_heads * head_dim
        kv_size = config.num_kv_heads * head_dim
        weights = d * (q_size + 2 * kv_size) + q_size * d + 3 * d * config.intermediate_size
        attention = 4 * context * q_size  # q.k and p.v over the context, every query head
        elementwise = 20 * d + 4 * config.intermediate_size  # norms, RoPE, SiLU: small
        elementwise += config.layer_spec.extra_flops(d, q_size, kv_size)  # the family's adds
        vocab = config.vocab_size
        # the lm_head matmul and the sampler's few passes over the logits, for the decode
        # tokens only; the final norm for every token
        last_extra = decode_share * (2 * vocab * d + 8 * vocab) + 10 * d
        # With the split: the first stage's rows of the lm_head, and the sampler
        first_head = decode_share * (2 * vocab_cut(vocab) * d + 8 * vocab)
        return cls(
            layer=2 * weights + attention + elementwise,
            first_extra=d,
            last_extra=last_extra,
            first_head=first_head if split_lm_head else 0.0,
        )

    def stage_cost(self, rank: int, num_layers: int, pp_size: int) -> float:
        """What stage `rank` of `pp_size` costs when it holds `num_layers` layers."""
        cost = num_layers * self.layer
        cost += self.first_extra if rank == 0 else 0.0
        moved = self.first_head if pp_size > 1 else 0.0  # one stage has nothing to split
        if rank == 0:
            cost += moved
        if rank == pp_size - 1:
            cost += self.last_extra - moved
        return cost

    def stage_costs(self, partition: list[int]) -> list[float]:
        return [self.stage_cost(r, n, len(partition)) for r, n in enumerate(partition)]

    def shares(self, partition: list[int]) -> list[float]:
        """Each stage's share of the whole step's cost (they sum to 1)."""
        costs = self.stage_costs(partition)
        return [c / sum(costs) for c in costs]


def cost_partition(num_layers: int, pp_size: int, costs: StageCosts) -> list[int]:
    """The split whose most expensive stage costs least; among those, the most even (least sum
    of squared stage costs), so stages with slack are not split at random. Exact, by dynamic
    programming over (stages, layers so far), twice."""
    _check_sizes(num_layers, pp_size)

    def solve(combine, cap: float) -> list[int]:
        # best[s][n]: the best value for stages 0..s-1 holding the first n layers
        inf = float("inf")
        best = [[inf] * (num_layers + 1) for _ in range(pp_size + 1)]
        choice = [[0] * (num_layers + 1) for _ in range(pp_size + 1)]
        best[0][0] = 0.0
        for s in range(1, pp_size + 1):
            for n in range(s, num_layers - (pp_size - s) + 1):
                for k in range(1, n - s + 2):  # stage s-1 takes k layers
                    cost = costs.stage_cost(s - 1, k, pp_size)
                    if cost > cap or best[s - 1][n - k] == inf:
                        continue
                    value = combine(best[s - 1][n - k], cost)
                    if value < best[s][n]:
                        best[s][n], choice[s][n] = value, k
        partition, n = [], num_layers
        for s in range(pp_size, 0, -1):
            partition.append(choice[s][n])
            n -= choice[s][n]
        return partition[::-1]

    bottleneck = max(costs.stage_costs(solve(max, float("inf"))))
    return solve(lambda total, cost: total + cost * cost, bottleneck * (1 + 1e-12))


def default_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layer counts per stage under the seed's rule, e.g. (80, 6) -> [13, 13, 13, 14, 14, 13]."""
    _check_sizes(num_layers, pp_size)
    base, remainder = divmod(num_layers, pp_size)
    partition = [base] * pp_size
    # Stages S-1-x .. S-2 get one more layer each; the last stage never does.
    for rank in range(pp_size - 1 - remainder, pp_size - 1):
        partition[rank] += 1
    return partition


def partition_layers(
    num_layers: int,
    pp_size: int,
    override: str | None = None,
    rule: str = "seed",
    costs: StageCosts | None = None,
) -> list[int]:
    """Layer counts per stage: `override` ("a,b,...", from PPRING_LAYER_PARTITION) if given,
    else `rule` ("cost" needs `costs`). An uneven result is logged with the throughput it
    costs."""
    if rule not in PARTITION_RULES:
        raise ConfigError(f"--partition-rule {rule} is not known; use one of {PARTITION_RULES}")
    if (override is None or not override.strip()) and rule == "cost" and costs is not None:
        partition = cost_partition(num_layers, pp_size, costs)
        if pp_size > 1:
            shares = ", ".join(f"{100 * x:.0f}%" for x in costs.shares(partition))
            logger.info(
                "layers partitioned by cost over %d stages: %s (%s)", pp_size, partition, shares
            )
        return partition
    if override is None or not override.strip():
        partition = default_partition(num_layers, pp_size)
    else:
        _check_sizes(num_layers, pp_size)
        partition = parse_partition(override, num_layers, pp_size)
    if len(set(partition)) > 1:
        logger.info(
            "layers partitioned unevenly over %d stages: %s; the slowest stage sets the pace, "
            "costing %.1f%% of throughput (override with %s=a,b,...)",
            pp_size,
            partition,
            100 * imbalance_loss(partition),
            PARTITION_ENV,
        )
    return partition


def partition_from_env(
    num_layers: int, pp_size: int, rule: str = "seed", costs: StageCosts | None = None
) -> list[int]:
    """`partition_layers` with the override read from the PPRING_LAYER_PARTITION variable."""
    return partition_layers(num_layers, pp_size, os.environ.get(PARTITION_ENV), rule, costs)


def partition_for_model(
    config: ModelConfig, pp_size: int, rule: str = "cost", split_lm_head: bool = False
) -> list[int]:
    """The split every stage of a ring over `config` computes alike: the override if set, else
    `rule` with costs derived from the model's shape."""
    costs = StageCosts.for_model(config, split_lm_head=split_lm_head)
    return partition_from_env(config.num_layers, pp_size, rule, costs)


def parse_partition(text: str, num_layers: int, pp_size: int) -> list[int]:
    """Parse and validate an override: `pp_size` integers, each >= 1, summing to `num_layers`."""
    fix = f"give {pp_size} integers of at least 1 that sum to {num_layers}"
    try:
        partition = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"{PARTITION_ENV}={text} is not a comma-separated list of integers; {fix}"
        ) from None
    if len(partition) != pp_size:
        raise ConfigError(
            f"{PARTITION_ENV}={text} has {len(partition)} entries but --pp-size is {pp_size}; {fix}"
        )
    if min(partition) < 1:
        raise ConfigError(f"{PARTITION_ENV}={text} gives a stage no layers; {fix}")
    if sum(partition) != num_layers:
        raise ConfigError(
            f"{PARTITION_ENV}={text} sums to {sum(partition)} but the model has "
            f"{num_layers} layers; {fix}"
        )
    return partition


def layer_range(partition: list[int], rank: int) -> tuple[int, int]:
    """The global layer indices `[start, end)` stage `rank` owns."""
    if not 0 <= rank < len(partition):
        raise ConfigError(
            f"stage rank {rank} is outside a {len(partition)}-stage partition; "
            f"use a rank from 0 to {len(partition) - 1}"
        )
    start = sum(partition[:rank])
    return start, start + partition[rank]


def imbalance_loss(partition: list[int]) -> float:
    """Fraction of throughput lost to an uneven split: every stage runs at the pace of the one
    with the most layers, so the loss is 1 - mean/max ([13,13,13,14,14,13] -> 0.048)."""
    return 1.0 - (sum(partition) / len(partition)) / max(partition)


def _check_sizes(num_layers: int, pp_size: int) -> None:
    if pp_size < 1:
        raise ConfigError(f"--pp-size must be at least 1, got {pp_size}")
    if pp_size > num_layers:
        raise ConfigError(
            f"--pp-size {pp_size} exceeds the model's {num_layers} layers and every stage needs "
            f"at least one; use --pp-size {num_layers} or less"
        )
