from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import stages.weights as weights_module
from stages.batch import SeqChunk
from stages.config import ModelConfig
from stages.errors import ConfigError
from stages.runner import StageRunner
from stages.weights import load_stage_weights, stage_tensor_names
from tests.stages.conftest import KV_BUDGET
from tests.tiny_llama import make_tiny_llama

PER_LAYER = 9  # tensors in one decoder layer


class RecordingOpen:
    """Wraps safetensors.safe_open to record every tensor actually read."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __call__(self, *args, **kwargs):
        handle = safe_open(*args, **kwargs)
        record = self.read

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, name: str) -> torch.Tensor:
                record.append(name)
                return handle.get_tensor(name)

        return Handle()


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> RecordingOpen:
    recording = RecordingOpen()
    monkeypatch.setattr(weights_module, "safe_open", recording)
    return recording


def test_middle_stage_reads_only_its_layers(tiny_dirs: dict[str, Path], recorder) -> None:
    folder = tiny_dirs["gqa"]
    config = ModelConfig.from_folder(folder)
    loaded = load_stage_weights(folder, config, 1, 3)
    assert loaded.num_tensors_read == 2 * PER_LAYER
    assert sorted(recorder.read) == sorted(loaded.tensors)
    assert {name.split(".")[2] for name in recorder.read} == {"1", "2"}


def test_first_and_last_stages_add_embedding_and_head(tiny_dirs: dict[str, Path], recorder) -> None:
    folder = tiny_dirs["gqa"]
    config = ModelConfig.from_folder(folder)
    first = load_stage_weights(folder, config, 0, 2)
    assert first.num_tensors_read == 1 + 2 * PER_LAYER
    assert "model.embed_tokens.weight" in first.tensors and "lm_head.weight" not in first.tensors
    recorder.read.clear()
    last = load_stage_weights(folder, config, 2, 4)
    assert last.num_tensors_read == 2 * PER_LAYER + 2
    assert set(recorder.read) >= {"model.norm.weight", "lm_head.weight"}
    assert "model.embed_tokens.weight" not in recorder.read


def test_tied_last_stage_reads_the_embedding_as_lm_head(
    tiny_dirs: dict[str, Path], recorder
) -> None:
    folder = tiny_dirs["tied"]
    config = ModelConfig.from_folder(folder)
    last = load_stage_weights(folder, config, 2, 4)
    assert "model.embed_tokens.weight" in recorder.read
    assert "lm_head.weight" not in recorder.read
    assert last.tensors["lm_head.weight"] is last.tensors["model.embed_tokens.weight"]
    recorder.read.clear()
    # One stage holding both ends reads the shared matrix once.
    whole = load_stage_weights(folder, config, 0, 4)
    assert recorder.read.count("model.embed_tokens.weight") == 1
    assert whole.num_tensors_read == 1 + 4 * PER_LAYER + 1


@pytest.mark.parametrize("keep_index", [True, False])
def test_sharded_folders_load_the_same_tensors(
    tmp_path: Path, keep_index: bool, tiny_dirs: dict[str, Path]
) -> None:
    folder = make_tiny_llama(tmp_path / "sharded", seed=1, shards=3, keep_index=keep_index)
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert (folder / "model.safetensors.index.json").exists() == keep_index
    config = ModelConfig.from_folder(folder)
    sharded = load_stage_weights(folder, config, 0, 4)
    single = load_stage_weights(tiny_dirs["gqa"], ModelConfig.from_folder(tiny_dirs["gqa"]), 0, 4)
    assert sharded.tensors.keys() == single.tensors.keys()
    for name, tensor in single.tensors.items():
        assert torch.equal(sharded.tensors[name], tensor), name


def test_cast_to_requested_dtype(tiny_dirs: dict[str, Path]) -> None:
    folder = tiny_dirs["gqa"]
    loaded = load_stage_weights(folder, ModelConfig.from_folder(folder), 0, 1, "bfloat16")
    assert {t.dtype for t in loaded.tensors.values()} == {torch.bfloat16}


def test_matrices_come_in_fp32_only_from_an_fp32_checkpoint(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A bf16 stage asks for its matrices in fp32 (to find a GGUF grid in them): the norms
    still come in bf16, and a bf16 checkpoint's matrices are not widened (no values to find)."""
    folder = tiny_dirs["gqa"]
    config = ModelConfig.from_folder(folder)
    loaded = load_stage_weights(folder, config, 0, 1, "bfloat16", matrix_dtype="float32")
    for name, tensor in loaded.tensors.items():
        assert tensor.dtype == (torch.float32 if tensor.dim() == 2 else torch.bfloat16), name
    halved = tmp_path / "bf16"
    halved.mkdir()
    for item in folder.iterdir():
        if item.suffix != ".safetensors":
            (halved / item.name).write_bytes(item.read_bytes())
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k).to(torch.bfloat16) for k in handle.keys()}
    save_file(tensors, str(halved / "model.safetensors"))
    loaded = load_stage_weights(halved, config, 0, 1, "bfloat16", matrix_dtype="float32")
    assert {t.dtype for t in loaded.tensors.values()} == {torch.bfloat16}


def test_stage_bytes_halve_with_two_stages(tiny_dirs: dict[str, Path]) -> None:
    folder = tiny_dirs["gqa"]
    config = ModelConfig.from_folder(folder)
    whole = StageRunner(folder, 0, 4, kv_budget_bytes=KV_BUDGET)
    first = StageRunner(folder, 0, 2, kv_budget_bytes=KV_BUDGET)
    last = StageRunner(folder, 2, 4, kv_budget_bytes=KV_BUDGET)
    vocab_matrix = config.vocab_size * config.hidden_size * 4
    norm = config.hidden_size * 4
    layer_bytes = whole.parameter_bytes - 2 * vocab_matrix - norm
    assert first.parameter_bytes - vocab_matrix == layer_bytes // 2
    assert last.parameter_bytes - vocab_matrix - norm == layer_bytes // 2


def test_tied_single_stage_holds_the_matrix_once(tiny_dirs: dict[str, Path]) -> None:
    folder = tiny_dirs["tied"]
    config = ModelConfig.from_folder(folder)
    whole = StageRunner(folder, 0, 4, kv_budget_bytes=KV_BUDGET)
    untied_names = stage_tensor_names(config, 0, 4)
    assert "lm_head.weight" not in untied_names
    untied = StageRunner(tiny_dirs["gqa"], 0, 4, kv_budget_bytes=KV_BUDGET)
    vocab_matrix = config.vocab_size * config.hidden_size * 4
    head_dim = config.hidden_size // config.num_heads
    # the same shapes but kv_heads (4 here, 2 there): the tied stage holds one vocab matrix
    kv_extra = config.num_layers * 2 * (4 - 2) * head_dim * config.hidden_size * 4
    assert whole.parameter_bytes == untied.parameter_bytes - vocab_matrix + kv_extra
    tokens = [0, 5, config.vocab_size - 1]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(torch.tensor([tokens])).logits[0, -1]
    whole.allocate_kv(whole.num_kv_blocks)
    got = whole.forward_logits([SeqChunk(tokens, 0, [0], sample=True)])[0]
    assert (got - expected).abs().max().item() < 1e-4  # the lookup reads the tied matrix


def _drop_tensor(src: Path, dst: Path, name: str, config_change: dict | None = None) -> Path:
    dst.mkdir()
    with safe_open(str(src / "model.safetensors"), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys() if k != name}
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.update(config_change or {})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_tensor_names_tensor_and_folder(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    name = "model.layers.2.mlp.up_proj.weight"
    folder = _drop_tensor(tiny_dirs["gqa"], tmp_path / "broken", name)
    config = ModelConfig.from_folder(folder)
    load_stage_weights(folder, config, 0, 2)  # a stage that does not need it loads fine
    with pytest.raises(ConfigError) as error:
        load_stage_weights(folder, config, 2, 4)
    message = str(error.value)
    assert name in message and str(folder) in message and "re-export" in message


def test_untied_checkpoint_without_lm_head(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    folder = _drop_tensor(tiny_dirs["gqa"], tmp_path / "headless", "lm_head.weight")
    with pytest.raises(ConfigError, match="no lm_head.weight .* tie_word_embeddings=false"):
        StageRunner(folder, 2, 4, kv_budget_bytes=KV_BUDGET)


def test_folder_without_safetensors(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    (tmp_path / "config.json").write_text((tiny_dirs["gqa"] / "config.json").read_text())
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        StageRunner(tmp_path, 0, 4, kv_budget_bytes=KV_BUDGET)


def test_unknown_dtype_is_refused(tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="--dtype float64 is not supported"):
        StageRunner(tiny_dirs["gqa"], 0, 4, kv_budget_bytes=KV_BUDGET, dtype="float64")
