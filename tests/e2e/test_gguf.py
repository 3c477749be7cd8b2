"""End-to-end: `ppring local --model FILE.gguf` serves a tiny Llama and a tiny Qwen2 written as
GGUF files in mixed formats (tests/tiny_gguf.py: every format ppring serves between the two),
config, weights and tokenizer from the file, and gives transformers' greedy tokens for the same
file; a file in a format ppring does not serve exits 2 with one sentence naming those it does."""

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
from stages.gguf_file import SERVED_FORMATS
from tests.e2e.conftest import PROMPTS
from tests.stages.test_gguf import LLAMA_FORMATS, QWEN2_FORMATS
from tests.tiny_families import TOKENIZER_EOS_ID, TOKENIZER_VOCAB, byte_level_tokenizer
from tests.tiny_gguf import tiny_gguf_pair, write_gguf
from tests.tiny_llama import make_tiny_llama

NEW_TOKENS = 12
MIN_MARGIN = 1e-3
KV_ARGS = ("--kv-memory-gib", "0.02")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    formats = {"llama": LLAMA_FORMATS, "qwen2": QWEN2_FORMATS}
    return tiny_gguf_pair(tmp_path_factory.mktemp("gguf-e2e"), formats, seeds=(13, 14, 15))


def hf_greedy(path: Path) -> dict[str, list[int]]:
    """prompt -> transformers' greedy tokens for the file (no near tie, no EOS)."""
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    expected = {}
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        for step, logits in enumerate(out.logits):
            best, second = logits[0].topk(2).values.tolist()
            assert best - second > MIN_MARGIN, f"{prompt!r}: a near tie at {step}"
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        assert len(tokens) == NEW_TOKENS and TOKENIZER_EOS_ID not in tokens
        expected[prompt] = tokens
    return expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "pp_size"), [("llama", 2), ("qwen2", 3)])
def test_greedy_tokens_of_a_gguf_file_equal_transformers(
    start_local, files: dict[str, Path], model: str, pp_size: int
) -> None:
    path = files[model]
    expected = hf_greedy(path)
    server = start_local(
        "--model", str(path), "--pp-size", str(pp_size), "--dtype", "float32", *KV_ARGS
    )  # fmt: skip
    assert b"GGUF weights: " in server.stdout  # the start-up summary's line of formats
    with Client(server.addr, timeout_s=60) as client:
        for prompt, tokens in expected.items():
            got = client.complete(prompt, max_new_tokens=NEW_TOKENS, temperature=0).token_ids
            assert got == tokens, prompt


@pytest.mark.timeout(120)
def test_a_gguf_format_not_served_exits_2_with_one_sentence(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "hf", hidden=256, intermediate=512, vocab=TOKENIZER_VOCAB)
    byte_level_tokenizer().save_pretrained(folder)
    path = write_gguf(folder, tmp_path / "iq.gguf", {"ffn_up": "IQ4_NL"}, default_format="F16")
    run = subprocess.run(
        [sys.executable, "-m", "launch", "local", "--model", str(path), "--pp-size", "2",
         "--port", str(find_free_base_port(16)), "--http-port", "0"],
        capture_output=True, text=True, timeout=100, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    (line,) = [line for line in run.stderr.splitlines() if "IQ4_NL" in line]
    assert all(name in line for name in SERVED_FORMATS)
