"""`ppring bench serve` end to end, shrunk: real rings and HF generate on a tiny random Llama
that speaks the default model's tokenizer, so it runs in seconds."""

from __future__ import annotations

import json
import shutil

import pytest

from bench import serve as serve_bench
from tests.tiny_llama import make_tiny_llama


@pytest.mark.timeout(300)
def test_bench_serve_runs_every_layout_and_the_baseline(default_model, tmp_path):
    model = make_tiny_llama(tmp_path / "tiny", vocab=49152, num_layers=2, max_positions=1024)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model / name).exists():
            shutil.copy(default_model / name, model / name)
    out = tmp_path / "out"
    code = serve_bench.main(
        [
            "--model", str(model), "--pp-sizes", "1,2", "--num-requests", "6",
            "--concurrency", "3", "--prompt-tokens", "8,64", "--output-tokens", "4,12",
            "--rates", "20", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "bench_serve.json").read_text())
    expected_tokens = result["workload"]["output_tokens_total"]
    points = {(p["layout"], p["rate_rps"]): p for p in result["points"]}
    assert set(points) == {("PP=1", None), ("PP=1", 20.0), ("PP=2", None), ("PP=2", 20.0)}
    for point in points.values():  # every request got exactly its max_new_tokens
        assert point["num_requests"] == 6 and point["output_tokens"] == expected_tokens
        assert point["output_tokens_per_s"] > 0 and point["tpot_p50_ms"] > 0
    assert result["baseline"]["output_tokens"] == expected_tokens
    assert set(result["headline"]["vs_hf_generate"]) == {"PP=1", "PP=2"}
    assert all(len(records) == 6 for records in result["requests"].values())
    assert (out / "bench_serve.png").read_bytes()[:4] == b"\x89PNG"
