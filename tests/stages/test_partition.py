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


def llama_config(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int):
    from stages.config import ModelConfig

    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": inter,
            "vocab_size": vocab,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
        }
    )


SMOLLM2 = (30, 576, 9, 3, 1536, 49152)
LLAMA_3_8B = (32, 4096, 32, 8, 14336, 128256)


def test_cost_rule_gives_the_lm_head_stage_fewer_layers() -> None:
    from stages.partition import StageCosts, partition_for_model

    smol = llama_config(*SMOLLM2)
    costs = StageCosts.for_model(smol)
    # The lm_head is ~7 layers of decode work, weighted by the 60% of tokens that decode.
    assert 6.5 < costs.last_extra / 0.6 / costs.layer < 7.5
    assert partition_for_model(smol, 2, "cost") == [17, 13]
    assert partition_for_model(smol, 2, "seed") == [15, 15]
    big = llama_config(*LLAMA_3_8B)
    assert partition_for_model(big, 2, "cost") == [17, 15]
    shares = StageCosts.for_model(smol).shares([17, 13])
    assert abs(shares[0] - shares[1]) < 0.01 and abs(sum(shares) - 1) < 1e-9


def test_a_split_lm_head_weighs_on_the_first_and_the_last_stage() -> None:
    from stages.partition import StageCosts, lm_head_rows, partition_for_model, vocab_cut

    smol = llama_config(*SMOLLM2)
    # Half the vocabulary each, so decode's extra work no longer calls for an uneven split.
    assert partition_for_model(smol, 2, "cost", split_lm_head=True) == [15, 15]
    assert partition_for_model(smol, 3, "cost", split_lm_head=True) == [9, 12, 9]
    big = llama_config(*LLAMA_3_8B)
    assert partition_for_model(big, 2, "cost", split_lm_head=True) == [16, 16]
    shares = StageCosts.for_model(smol, split_lm_head=True).shares([15, 15])
    assert abs(shares[0] - shares[1]) < 0.01
    # One stage: nothing moves, whatever the flag.
    one = StageCosts.for_model(smol, split_lm_head=True)
    assert one.stage_costs([30]) == StageCosts.for_model(smol).stage_costs([30])
    cut = vocab_cut(49152)
    assert cut == 24576 and vocab_cut(32001) % 16 == 0
    assert lm_head_rows(49152, True, False, True) == (0, cut)  # (first, last, split)
    assert lm_head_rows(49152, False, False, True) is None
    assert lm_head_rows(49152, False, True, True) == (cut, 49152)
    assert lm_head_rows(49152, True, True, True) == (0, 49152)
    assert lm_head_rows(49152, True, False, False) is None
    assert lm_head_rows(49152, False, True, False) == (0, 49152)


def test_cost_rule_is_the_least_max_split_and_even_where_it_can_be() -> None:
    import itertools

    from stages.partition import StageCosts, cost_partition

    for costs in (StageCosts(1.0, 0.0, 0.0), StageCosts(1.0, 0.3, 2.5), StageCosts(1.0, 0.0, 9.0)):
        for num_layers, pp_size in ((7, 3), (10, 4), (12, 2), (9, 5)):
            got = cost_partition(num_layers, pp_size, costs)
            assert sum(got) == num_layers and min(got) >= 1
            best = min(
                max(costs.stage_costs(list(p)))
                for p in itertools.product(range(1, num_layers + 1), repeat=pp_size)
                if sum(p) == num_layers
            )
            assert max(costs.stage_costs(got)) == pytest.approx(best)
    assert cost_partition(80, 6, StageCosts(1.0, 0.0, 0.0)) == [14, 14, 13, 13, 13, 13]
    # A last stage heavy enough to hold one layer leaves the others evenly split.
    assert sorted(cost_partition(30, 8, StageCosts(1.0, 0.0, 9.0))[:-1]) == [4] * 6 + [5]


def test_override_beats_the_cost_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages.partition import partition_for_model

    monkeypatch.setenv("PPRING_LAYER_PARTITION", "20,10")
    assert partition_for_model(llama_config(*SMOLLM2), 2, "cost") == [20, 10]
    with pytest.raises(ConfigError, match="--partition-rule fastest is not known"):
        partition_layers(30, 2, None, "fastest")
