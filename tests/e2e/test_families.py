"""End-to-end: `ppring local` serves tiny Qwen2 and Qwen3 folders (tests/tiny_families.py, with
their tokenizer) and gives transformers' greedy tokens, at PP = 1, 2, 3 through the CPU's default
path (the layers fused into one C call) and at PP = 2, 3 through its general path
(PPRING_FUSED_LAYERS=0: one call per kernel); a folder of an architecture ppring does not serve
is refused in one sentence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from launch.client import Client
from launch.procs import ROOT, find_free_base_port
from stages.backend.cpu import fused_layer
from tests.e2e.conftest import PROMPTS
from tests.tiny_families import (
    LONGROPE_ORIGINAL,
    TOKENIZER_EOS_ID,
    TOKENIZER_VOCAB,
    make_tiny_gemma,
    make_tiny_granite,
    make_tiny_mistral,
    make_tiny_olmo2,
    make_tiny_phi3,
    make_tiny_qwen2,
    make_tiny_qwen3,
)
from tests.tiny_llama import make_tiny_llama

NEW_TOKENS = 16
MIN_MARGIN = 1e-3  # transformers' greedy path keeps its best logit this far above the next
# Initialised 10x wider than transformers' default: at the default, Qwen2's greedy text is one
# token whatever the prompt (its v bias outweighs the rest); at 0.2 it follows the prompt.
INIT_STD = 0.2
# Of the 0.25 GiB conftest's rings get, touching the pages took 1.5 s of a PP=3 ring's start on
# this 2-core CI; 20 MiB still hold 10k tokens of these models per stage.
KV_ARGS = ("--kv-memory-gib", "0.02")


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    common = {"vocab": TOKENIZER_VOCAB, "tokenizer": True, "init_std": INIT_STD}
    return {
        "qwen2": make_tiny_qwen2(root / "qwen2", seed=31, **common),
        "qwen3": make_tiny_qwen3(root / "qwen3", seed=32, **common),
        "phi3-longrope": make_tiny_phi3(root / "phi3", longrope=True, seed=33, **common),
        "olmo2": make_tiny_olmo2(root / "olmo2", seed=36, **common),
        "granite": make_tiny_granite(root / "granite", seed=35, **common),
        "mistral-window": make_tiny_mistral(root / "mistral", seed=38, **common),
        "gemma2": make_tiny_gemma(root / "gemma2", seed=39, **common),
        "gemma3": make_tiny_gemma(root / "gemma3", version=3, seed=40, **common),
    }


# One byte a token: the first two cross LongRoPE's switch at 64 positions as they decode (and
# are computed again, at the long factors), the third is past it from its prompt on.
LONGROPE_PROMPTS = [
    "Once upon a time, in a small village by the sea, there",
    "The three primary colors are red, yellow and blue; mixed",
    "Water boils at a temperature of one hundred degrees Celsius at sea level, and",
]


@pytest.fixture(scope="module")
def hf_tokens(family_folders: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """family -> prompt -> transformers' greedy continuation on the same folder and tokenizer.
    No step is a near tie (a token ppring picks otherwise is its error, not rounding), and none
    reaches EOS (all NEW_TOKENS tokens are compared)."""
    expected: dict[str, dict[str, list[int]]] = {}
    for family, folder in family_folders.items():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert type(model).__name__ == model.config.architectures[0]
        expected[family] = {}
        for prompt in LONGROPE_PROMPTS if family == "phi3-longrope" else PROMPTS[:3]:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            for step, logits in enumerate(out.logits):  # each [1, V]
                best, second = logits[0].topk(2).values.tolist()
                assert best - second > MIN_MARGIN, f"{family} {prompt!r}: a near tie at {step}"
            tokens = out.sequences[0, ids.shape[1] :].tolist()
            assert len(tokens) == NEW_TOKENS and TOKENIZER_EOS_ID not in tokens
            expected[family][prompt] = tokens
    return expected


ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "phi3-longrope": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM", "mistral-window": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
}  # fmt: skip
# Qwen2 and Qwen3 at every PP size on the default path and at PP=3 on the general path (PP=1
# and 2 on it: tests/stages/test_families.py's); the later families once each (every path and
# PP size: tests/stages/test_families.py): Phi-3 with LongRoPE through the general path, where
# prompts cross its switch at 64 positions as they decode and are computed again at the long
# factors; Mistral with a 32-position window, past which its prompts run; Gemma 2 and 3
# (windowed and full layers, soft caps, two rotaries). 14 rings, each 5-10 s to start and stop
# on 2 cores.
QWEN_RINGS = ((1, "fused"), (2, "fused"), (3, "fused"), (3, "general"))
RINGS = [
    *((family, pp_size, path) for family in ("qwen2", "qwen3") for pp_size, path in QWEN_RINGS),
    ("phi3-longrope", 3, "general"), ("olmo2", 2, "fused"), ("granite", 2, "fused"),
    ("mistral-window", 2, "fused"), ("gemma2", 2, "fused"), ("gemma3", 3, "general"),
]  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "pp_size", "path"), RINGS)
def test_greedy_tokens_equal_transformers(
    start_local,
    family_folders: dict[str, Path],
    hf_tokens: dict[str, dict[str, list[int]]],
    family: str,
    pp_size: int,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stages read the environment the launcher passes on.
    monkeypatch.setenv(fused_layer.DISABLE_ENV, "1" if path == "fused" else "0")
    server = start_local(
        "--model", str(family_folders[family]), "--pp-size", str(pp_size), "--dtype", "float32",
        *KV_ARGS,
    )  # fmt: skip
    # every stage on ppring's CPU kernels (fused or not), not on a fallback to torch alone,
    # and its layers the way this test asked for
    log = server.log_text()
    assert log.count("backend: cpu (") == pp_size
    layers = "fused" if path == "fused" else "one call per op: PPRING_FUSED_LAYERS=0"
    assert log.count(f"{ARCHITECTURES[family]} ") == pp_size
    assert log.count(f"layers ({layers})") == pp_size
    with Client(server.addr, timeout_s=60) as client:
        for prompt, expected in hf_tokens[family].items():
            got = client.complete(prompt, max_new_tokens=NEW_TOKENS, temperature=0).token_ids
            assert got == expected, prompt


def test_the_longrope_prompts_cross_the_switch_as_they_decode() -> None:
    lengths = [len(prompt.encode()) for prompt in LONGROPE_PROMPTS]
    assert lengths[0] < LONGROPE_ORIGINAL < lengths[0] + NEW_TOKENS
    assert lengths[1] < LONGROPE_ORIGINAL < lengths[1] + NEW_TOKENS
    assert lengths[2] > LONGROPE_ORIGINAL


@pytest.mark.timeout(120)
def test_an_architecture_not_served_exits_nonzero_with_one_sentence(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "gemma", num_layers=2, architecture="GemmaForCausalLM")
    run = subprocess.run(
        [sys.executable, "-m", "launch", "local", "--model", str(folder), "--pp-size", "2",
         "--dtype", "float32", "--port", str(find_free_base_port(16)), "--http-port", "0"],
        capture_output=True, text=True, timeout=100, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    (line,) = [line for line in run.stderr.splitlines() if "GemmaForCausalLM" in line]
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in line
