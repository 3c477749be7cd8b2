"""The stage's backend, picked once (stages/backend/__init__.py): which one, why, the switches it
read, and the start-up line of a stage whose layers cannot run as one call."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from stages.backend import Backend
from stages.backend.cpu import native
from stages.backend.cpu.fused_layer import FusedLayers
from stages.backend.switches import Switches
from stages.errors import ConfigError
from stages.runner import StageRunner
from tests.stages.conftest import KV_BUDGET, without_native_kernels

CPU = torch.device("cpu")


def test_a_cpu_stage_picks_the_kernels_and_says_so() -> None:
    assert native.kernels() is not None, native.unavailable_reason()
    backend = Backend.pick(CPU, torch.float32)
    assert backend.name == "cpu" and backend.kernels is native.kernels()
    assert backend.describe().startswith("cpu (ppring's CPU kernels")
    assert backend.ops.name == "native"


def test_without_the_kernels_a_cpu_stage_runs_torch_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_native_kernels(monkeypatch)
    backend = Backend.pick(CPU, torch.float32)
    assert (backend.name, backend.ops.name, backend.kernels) == ("torch", "torch", None)
    assert "turned off by the test" in backend.describe()
    with pytest.raises(ConfigError, match="--quantization int8 needs ppring's CPU kernels"):
        Backend.pick(CPU, torch.float32, "int8")


def test_the_switches_are_read_once_and_the_summary_names_those_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PPRING_FUSED_LAYERS", "0")
    monkeypatch.setenv("PPRING_GRID_ACTIVATIONS", "int8")
    backend = Backend.pick(CPU, torch.bfloat16)
    monkeypatch.delenv("PPRING_FUSED_LAYERS")  # read at the pick, not later
    assert backend.switches == Switches(fused_layers=False, grid_activations="int8")
    assert backend.describe().endswith("; PPRING_FUSED_LAYERS=0 PPRING_GRID_ACTIVATIONS=int8")
    assert Switches.read().changed() == "PPRING_GRID_ACTIVATIONS=int8"
    monkeypatch.setenv("PPRING_GRID_ACTIVATIONS", "int4")
    with pytest.raises(ConfigError, match="PPRING_GRID_ACTIVATIONS='int4' is not a choice"):
        Backend.pick(CPU, torch.bfloat16)


def test_layers_the_stack_cannot_run_take_the_general_path_with_one_line_why(
    tiny_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.INFO, logger="stages.runner"):
        fused = StageRunner(tiny_dirs["gqa"], 0, 4, kv_budget_bytes=KV_BUDGET)
    assert fused.model.fused is not None
    assert "LlamaForCausalLM plain layers (fused); backend: cpu (" in caplog.text
    layers = list(fused.model.layers)
    assert FusedLayers.refusal(layers, native.kernels(), torch.float32) is None
    assert "float32 or bfloat16" in FusedLayers.refusal(layers, native.kernels(), torch.float16)
    # a bias the kernels cannot read as rows of the stage dtype: refused, not misread
    layers[1].qkv_bias = torch.zeros(2 * 96, dtype=torch.float32)[::2]
    assert FusedLayers.refusal(layers, native.kernels(), torch.float32) == (
        "its qkv_bias is not contiguous in the stage dtype"
    )
    assert FusedLayers.build(layers, native.kernels(), torch.float32) is None
    caplog.clear()
    monkeypatch.setenv("PPRING_FUSED_LAYERS", "0")
    with caplog.at_level(logging.INFO, logger="stages.runner"):
        general = StageRunner(tiny_dirs["gqa"], 0, 4, kv_budget_bytes=KV_BUDGET)
    assert general.model.fused is None
    assert "plain layers (one call per op: PPRING_FUSED_LAYERS=0)" in caplog.text
