"""`ppring bench step` and bench/random_model.py: the tools of the GPU run, checked on a CPU."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import step as step_bench
from bench.random_model import PRESETS, make_random_model
from stages.config import ModelConfig


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("random"), PRESETS["tiny"], "float32")


def test_random_model_has_the_preset_shape_and_a_tokenizer_of_its_vocabulary(random_model):
    shape = PRESETS["tiny"]
    config = ModelConfig.from_folder(random_model)
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (512, 64, 4)
    assert (config.num_heads, config.num_kv_heads, config.eos_token_ids) == (4, 2, (2,))
    tokenizer = AutoTokenizer.from_pretrained(random_model)
    assert len(tokenizer) == shape.vocab_size
    assert tokenizer.eos_token_id == shape.eos_token_id
    ids = [7, 300, 511, 256]
    text = tokenizer.decode(ids)
    assert text == "t7 t300 t511 t256"
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    # Hugging Face loads the same folder: the baseline runs on exactly these weights.
    model = AutoModelForCausalLM.from_pretrained(random_model, dtype=torch.float32)
    assert model.config.vocab_size == shape.vocab_size
    assert PRESETS["llama-3-8b"].num_layers == 32 and PRESETS["llama-3-8b"].vocab_size == 128256


def test_bench_step_times_decode_steps_against_the_bandwidth_bound(random_model, tmp_path):
    code = step_bench.main(
        [
            "--model", str(random_model), "--dtype", "float32", "--batch-sizes", "1,3",
            # 26 + 3 warm-up + 3 timed steps fill two blocks exactly; the rounds' untimed
            # steps need a third (the pool was once sized without them: the kernels wrote
            # past it)
            "--context", "26",
            "--steps", "3", "--rounds", "2", "--threads", "1", "--copy-mib", "16",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "bench_step.json").read_text())
    config = ModelConfig.from_folder(random_model)
    embedding = config.vocab_size * config.hidden_size * 4  # untied: only its rows are read
    assert result["kv_bytes_per_token"] == 4 * 2 * 2 * 16 * 4  # layers, K+V, h_kv, d, fp32
    assert result["copy_bandwidth_bytes_per_s"] > 0
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    assert result["cuda_graph_sizes"] == []  # graphs are for CUDA stages
    held = result["weight_bytes_by_format"]  # the matrices, packed for the fp32 kernels
    assert list(held) == ["fp32 panels"] and 0 < held["fp32 panels"] < result["weight_bytes"]
    assert not any(r["cuda_graph"] for r in result["rows"])
    for row in result["rows"]:
        # 3 steps in 2 rounds: a copy before each round and one after the last; the bounds
        # use their median
        assert len(row["copy_bandwidths"]) == 3 and min(row["copy_bandwidths"]) > 0
        assert row["copy_bandwidth_bytes_per_s"] == sorted(row["copy_bandwidths"])[1]
        bandwidth = row["copy_bandwidth_bytes_per_s"]
        assert row["bound_weights_ms"] == pytest.approx(  # (written to the ns)
            1000 * row["weight_read_bytes"] / bandwidth, abs=1e-6
        )
        assert row["weight_read_bytes"] == result["weight_bytes"] - embedding
        assert row["step_ms"] > 0 and row["bound_ms"] > row["bound_weights_ms"] > 0
        assert row["of_bound"] == pytest.approx(row["bound_ms"] / row["step_ms"], abs=2e-3)
        # 26 context tokens, 3 warm-up steps (positions 26-28), then two rounds of a copy, an
        # untimed step and the round's timed steps: 30, then 32 and 33.
        expected_kv = row["batch"] * (30 + 32 + 33) / 3 * result["kv_bytes_per_token"]
        assert row["kv_read_bytes"] == round(expected_kv)
        # The compute floor: the faster matmul pass plus the KV bytes over the bandwidth.
        fastest = min(row["matmuls_ms"], row["f_linear_ms"])
        assert row["floor_ms"] == pytest.approx(fastest + row["kv_ms"], abs=2e-3)
        assert row["over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"], rel=1e-2)
        assert row["over_weights_bound"] == pytest.approx(
            row["step_ms"] / row["bound_weights_ms"], rel=1e-2
        )


def test_bench_step_counts_an_8_bit_caches_bytes(random_model, tmp_path):
    code = step_bench.main(
        [
            "--model", str(random_model), "--dtype", "float32", "--batch-sizes", "2",
            "--context", "20", "--steps", "2", "--rounds", "1", "--threads", "1",
            "--copy-mib", "16", "--kv-cache-dtype", "int8", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "bench_step.json").read_text())
    # codes (2 x h_kv x d), K's scales (a byte a channel per 16 tokens), V's (bf16 a head)
    per_layer = 2 * 2 * 16 + 2 * 16 / 16 + 2 * 2
    assert result["kv_cache_dtype"] == "int8"
    assert result["kv_bytes_per_token"] == 4 * per_layer
    row = result["rows"][0]
    assert row["kv_read_bytes"] > 0 and row["step_ms"] > 0


def test_the_header_says_what_each_batch_reads():
    assert step_bench.read_summary({1: 10**8, 32: 10**8}) == "0.10 GB read per step"
    assert step_bench.read_summary({1: 10**8, 32: 27 * 10**7}) == (
        "GB read per step by batch: 1: 0.10, 32: 0.27"
    )


def test_the_header_says_what_the_matrices_are_held_as():
    held = {"bf16 panels": 2**20, "Q4_K": 40 * 2**20, "Q6_K": 12 * 2**20}
    assert step_bench.formats_summary(held) == "Q4_K 40.0 MiB + Q6_K 12.0 MiB + bf16 panels 1.0 MiB"


def test_bench_step_refuses_bad_arguments(capsys):
    for bad in (
        ["--batch-sizes", "1,x"], ["--batch-sizes", "0"], ["--context", "0"], ["--rounds", "0"]
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            step_bench.parse_args(bad)
        assert exc.value.code == 2
    assert "comma-separated" in capsys.readouterr().err
