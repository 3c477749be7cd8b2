"""Which layers each pipeline stage owns.

Default rule (DESIGN.md §4): every stage gets `L // S` layers and the remainder `x` goes one
layer each to the `x` stages just before the last. That is the same as "all but the last" when
`x = S - 1`, and "the middle stages, first and last excluded" when `S > 2` and `x <= S - 2`:
the last stage also runs the final norm, lm_head and the sampler, and the first holds the
embedding, so they are the ones to keep light.
"""

from __future__ import annotations

import logging
import os

from stages.errors import ConfigError

logger = logging.getLogger(__name__)

PARTITION_ENV = "PPRING_LAYER_PARTITION"


def default_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layer counts per stage under the default rule, e.g. (80, 6) -> [13, 13, 13, 14, 14, 13]."""
    _check_sizes(num_layers, pp_size)
    base, remainder = divmod(num_layers, pp_size)
    partition = [base] * pp_size
    # Stages S-1-x .. S-2 get one more layer each; the last stage never does.
    for rank in range(pp_size - 1 - remainder, pp_size - 1):
        partition[rank] += 1
    return partition


def partition_layers(num_layers: int, pp_size: int, override: str | None = None) -> list[int]:
    """Layer counts per stage: `override` ("a,b,...", from PPRING_LAYER_PARTITION) if given,
    else the default rule. An uneven result is logged with the throughput it costs."""
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


def partition_from_env(num_layers: int, pp_size: int) -> list[int]:
    """`partition_layers` with the override read from the PPRING_LAYER_PARTITION variable."""
    return partition_layers(num_layers, pp_size, os.environ.get(PARTITION_ENV))


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
