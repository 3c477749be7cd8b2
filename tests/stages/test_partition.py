from __future__ import annotations

import logging

import pytest

from stages.errors import ConfigError
from stages.partition import (
    default_partition,
    imbalance_loss,
    layer_range,
    partition_from_env,
    partition_layers,
)


def test_seed_example_80_layers_over_6_stages() -> None:
    partition = partition_layers(80, 6)
    assert partition == [13, 13, 13, 14, 14, 13]
    assert round(100 * imbalance_loss(partition), 1) == 4.8


@pytest.mark.parametrize(
    ("num_layers", "pp_size", "expected"),
    [
        (80, 4, [20, 20, 20, 20]),  # divides: even
        (30, 1, [30]),
        (30, 4, [7, 8, 8, 7]),  # x = 2 <= S-2: middle stages
        (31, 4, [8, 8, 8, 7]),  # x = 3 = S-1: all but the last
        (5, 2, [3, 2]),  # S = 2: the first stage takes the remainder
        (4, 3, [1, 2, 1]),
        (32, 3, [11, 11, 10]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_default_rule(num_layers: int, pp_size: int, expected: list[int]) -> None:
    assert default_partition(num_layers, pp_size) == expected
    assert sum(expected) == num_layers


def test_last_stage_never_gets_a_remainder_layer() -> None:
    for num_layers in range(1, 50):
        for pp_size in range(1, num_layers + 1):
            partition = default_partition(num_layers, pp_size)
            assert sum(partition) == num_layers
            assert partition[-1] == num_layers // pp_size
            assert max(partition) - min(partition) <= 1


def test_layer_ranges_tile_the_model() -> None:
    partition = [13, 13, 13, 14, 14, 13]
    ranges = [layer_range(partition, rank) for rank in range(6)]
    assert ranges[0] == (0, 13)
    assert ranges[3] == (39, 53)
    assert ranges[-1] == (67, 80)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_even_split_loses_nothing() -> None:
    assert imbalance_loss([20, 20, 20, 20]) == 0.0


def test_uneven_split_is_logged_with_its_cost(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="stages.partition"):
        partition_layers(80, 6)
    assert "4.8%" in caplog.text and "PPRING_LAYER_PARTITION" in caplog.text


def test_override_is_used() -> None:
    assert partition_layers(80, 2, "48,32") == [48, 32]
    assert partition_layers(80, 2, " 48 , 32 ") == [48, 32]
    assert partition_layers(80, 2, "") == [40, 40]  # set but empty: the default


def test_override_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPRING_LAYER_PARTITION", "1,3")
    assert partition_from_env(4, 2) == [1, 3]
    monkeypatch.delenv("PPRING_LAYER_PARTITION")
    assert partition_from_env(4, 2) == [2, 2]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("48,30", "PPRING_LAYER_PARTITION=48,30 sums to 78 but the model has 80 layers"),
        ("40,20,20", "has 3 entries but --pp-size is 2"),
        ("80,0", "gives a stage no layers"),
        ("81,-1", "gives a stage no layers"),
        ("40.5,39.5", "not a comma-separated list of integers"),
        ("forty,forty", "not a comma-separated list of integers"),
    ],
)
def test_bad_override_names_the_fix(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as error:
        partition_layers(80, 2, override)
    message = str(error.value)
    assert needle in message
    assert "give 2 integers of at least 1 that sum to 80" in message
    assert "\n" not in message


def test_more_stages_than_layers_errors_clearly() -> None:
    with pytest.raises(ConfigError, match="--pp-size 8 exceeds the model's 4 layers"):
        partition_layers(4, 8)
    with pytest.raises(ConfigError, match="--pp-size 5 exceeds"):
        partition_layers(4, 5, "1,1,1,1,0")


def test_zero_stages_errors() -> None:
    with pytest.raises(ConfigError, match="at least 1"):
        partition_layers(4, 0)


def test_rank_outside_partition_errors() -> None:
    with pytest.raises(ConfigError, match="rank 2"):
        layer_range([2, 2], 2)
