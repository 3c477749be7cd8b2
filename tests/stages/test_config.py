from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from stages.config import ModelConfig, RopeScaling
from stages.errors import ConfigError
from tests.stages.conftest import LLAMA3_SCALING

LLAMA_V4_CONFIG = {
    # The pre-transformers-5 layout: rope_theta and rope_scaling beside each other.
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def write_config(folder: Path, config: dict, generation: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_reads_a_transformers_5_folder(tiny_dirs: dict[str, Path]) -> None:
    config = ModelConfig.from_folder(tiny_dirs["gqa"])
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (
        64,
        4,
        4,
        2,
    )
    assert config.head_dim == 16
    assert config.vocab_size == 256
    assert config.rope_scaling is None
    assert config.rope_theta == 10000.0
    assert config.eos_token_ids == (2,)
    assert config.bos_token_id == 1
    assert config.tie_word_embeddings is False
    assert config.torch_dtype == "float32"


def test_reads_llama3_rope_scaling(tiny_dirs: dict[str, Path]) -> None:
    config = ModelConfig.from_folder(tiny_dirs["llama3"])
    assert config.rope_scaling == RopeScaling(
        "llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,
    )
    assert LLAMA3_SCALING["factor"] == config.rope_scaling.factor


def test_reads_the_older_config_layout(tmp_path: Path) -> None:
    generation = {"eos_token_id": [128001, 128008, 128009]}
    config = ModelConfig.from_folder(write_config(tmp_path, LLAMA_V4_CONFIG, generation))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    assert config.head_dim == 128
    # generation_config.json's eos list wins: it is what generation stops on.
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.torch_dtype == "bfloat16"
    # Llama-3-8B: 2 * 8 * 128 * 2 bytes = 4 KiB per token per layer in bf16.
    assert config.kv_bytes_per_token_per_layer("bfloat16") == 4096
    assert config.kv_bytes_per_token_per_layer("float32") == 8192


def test_linear_rope_scaling(tiny_dirs: dict[str, Path]) -> None:
    config = ModelConfig.from_folder(tiny_dirs["linear"])
    assert config.rope_scaling == RopeScaling("linear", factor=4.0)


def test_config_hash_is_stable_and_sensitive(tiny_dirs: dict[str, Path]) -> None:
    a = ModelConfig.from_folder(tiny_dirs["gqa"])
    assert a.config_hash == ModelConfig.from_folder(tiny_dirs["gqa"]).config_hash
    assert len(a.config_hash) == 64
    assert a.config_hash != replace(a, num_layers=5).config_hash
    assert a.config_hash != ModelConfig.from_folder(tiny_dirs["tied"]).config_hash


def test_mistral_without_sliding_window_is_accepted(tmp_path: Path) -> None:
    raw = {**LLAMA_V4_CONFIG, "architectures": ["MistralForCausalLM"], "sliding_window": None}
    config = ModelConfig.from_folder(write_config(tmp_path, raw))
    assert config.architecture == "MistralForCausalLM"
    assert config.layer_windows == () and config.kv_window is None


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Phi3ForCausalLM"])
def test_a_sliding_window_shorter_than_the_context_windows_every_layer(
    tmp_path: Path, architecture: str
) -> None:
    raw = {**LLAMA_V4_CONFIG, "architectures": [architecture], "sliding_window": 4096}
    config = ModelConfig.from_folder(write_config(tmp_path, raw))
    assert config.layer_windows == (4096,) * config.num_layers
    assert config.window_of(3) == 4096 and config.kv_window == 4096
    raw["sliding_window"] = raw["max_position_embeddings"]  # as long as the context: none
    assert ModelConfig.from_folder(write_config(tmp_path, raw)).layer_windows == ()
    raw["architectures"] = ["LlamaForCausalLM"]  # transformers' Llama ignores one
    raw["sliding_window"] = 4096
    assert ModelConfig.from_folder(write_config(tmp_path, raw)).layer_windows == ()


def test_folder_without_config_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no config.json; pass --model a local Hugging Face"):
        ModelConfig.from_folder(tmp_path)


def test_non_llama_model_names_the_fix(tmp_path: Path) -> None:
    raw = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 12}
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_folder(write_config(tmp_path, raw))
    message = str(error.value)
    assert "GPT2LMHeadModel" in message and "pass --model a Llama-family folder" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type=yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without low_freq_factor"),
        ({"attention_bias": True}, "bias"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"hidden_size": None}, "lacks an integer hidden_size"),
        ({"partial_rotary_factor": 37 / 128}, "turns 37 of 128 dims"),
        (
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [1.0],
                    "original_max_position_embeddings": 64,
                }
            },
            "longrope factors hold 1 and 1 values",
        ),
        (
            {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0]}},
            "without original_max_position_embeddings",
        ),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window=0"),
        ({"architectures": ["GraniteForCausalLM"], "logits_scaling": 0}, "logits_scaling=0"),
        ({"architectures": ["Olmo2ForCausalLM"], "attention_bias": True}, "OLMo 2"),
    ],
)
def test_unsupported_variants_are_refused(tmp_path: Path, change: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_folder(write_config(tmp_path, {**LLAMA_V4_CONFIG, **change}))


def test_unreadable_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        ModelConfig.from_folder(tmp_path)
