"""`ppring bench serve` end to end, shrunk: real rings and HF generate on tiny random Llamas, so
it runs in seconds: one that speaks the default model's tokenizer, and one made by
bench/random_model.py (the script that builds the GPU run's Llama-3-8B), with its own."""

from __future__ import annotations

import json
import shutil

import pytest

from bench import serve as serve_bench
from bench.random_model import PRESETS, make_random_model
from bench.workload import make_workload
from tests.tiny_llama import make_tiny_llama


def tiny_model_speaking(default_model, tmp_path):
    """A two-layer random Llama with the default model's tokenizer (and vocabulary)."""
    model = make_tiny_llama(tmp_path / "tiny", vocab=49152, num_layers=2, max_positions=1024)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model / name).exists():
            shutil.copy(default_model / name, model / name)
    return model


@pytest.mark.timeout(300)
def test_bench_serve_runs_every_layout_and_the_baseline(default_model, tmp_path):
    model = tiny_model_speaking(default_model, tmp_path)
    out = tmp_path / "out"
    code = serve_bench.main(
        [
            "--model", str(model), "--pp-sizes", "1,2", "--num-requests", "6",
            "--concurrency", "3", "--prompt-tokens", "8,64", "--output-tokens", "4,12",
            "--rates", "20", "--out", str(out), "--trace-steps", str(tmp_path / "trace"),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "bench_serve.json").read_text())
    expected_tokens = result["workload"]["output_tokens_total"]
    points = {(p["layout"], p["rate_rps"]): p for p in result["points"]}
    assert set(points) == {("PP=1", None), ("PP=1", 20.0), ("PP=2", None), ("PP=2", 20.0)}
    for point in points.values():  # every request got exactly its max_new_tokens
        assert point["num_requests"] == 6 and point["output_tokens"] == expected_tokens
        assert point["output_tokens_per_s"] > 0
        # Every request has 4-12 tokens, so each has a TPOT, however fast the host: a fast
        # ring's may round to 0.0 ms (that its tokens still stream a step at a time, not in
        # one burst, is tests/e2e/test_streaming.py's and tests/test_client.py's to show).
        assert 0 <= point["tpot_p50_ms"] <= point["tpot_p99_ms"]
    for records in result["requests"].values():  # what the percentiles are taken from
        for r in records:
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            # the time after the first token, spread over the tokens after it
            after_first = r["tpot_s"] * (r["output_tokens"] - 1)
            assert r["ttft_s"] + after_first == pytest.approx(r["e2e_s"], rel=1e-9)
    assert result["baseline"]["output_tokens"] == expected_tokens
    assert set(result["headline"]["vs_hf_generate"]) == {"PP=1", "PP=2"}
    assert all(len(records) == 6 for records in result["requests"].values())
    assert (out / "bench_serve.png").read_bytes()[:4] == b"\x89PNG"
    for pp_size in (1, 2):  # --trace-steps reached every stage of each ring
        traces = sorted((tmp_path / "trace" / f"pp{pp_size}").glob("stage*.jsonl"))
        assert [t.name.split("-")[0] for t in traces] == [f"stage{r}" for r in range(pp_size)]
        steps = [json.loads(line) for line in traces[0].read_text().splitlines()]
        assert sum(s["tokens"] for s in steps) > 0


@pytest.mark.timeout(300)
def test_bench_serve_at_several_concurrencies_on_a_random_model(tmp_path):
    """The GPU run's shape (closed loops at several concurrencies, no sweep, HF generate at
    each) on a model from bench/random_model.py, whose word-level tokenizer the frontend loads."""
    model = make_random_model(tmp_path / "random", PRESETS["tiny"], dtype="float32")
    out = tmp_path / "out"
    code = serve_bench.main(
        [
            "--model", str(model), "--pp-sizes", "1,2", "--num-requests", "8",
            "--concurrency", "4,1", "--no-sweep", "--prompt-tokens", "8,64",
            "--output-tokens", "4,12", "--kv-memory-gib", "0.05",
            "--log-dir", str(tmp_path / "logs"), "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "bench_serve.json").read_text())
    assert result["concurrencies"] == [1, 4] and result["concurrency"] == 4
    points = {(p["layout"], p["closed_loop_concurrency"]): p for p in result["points"]}
    assert set(points) == {("PP=1", 1), ("PP=1", 4), ("PP=2", 1), ("PP=2", 4)}
    assert all(p["rate_rps"] is None for p in result["points"])  # --no-sweep
    # --num-requests 8: every closed loop runs all 8, at C=1 too (not max(2C, 6) of them).
    assert points[("PP=1", 1)]["num_requests"] == 8 and points[("PP=1", 4)]["num_requests"] == 8
    baselines = {b["closed_loop_concurrency"]: b for b in result["baselines"]}
    assert set(baselines) == {1, 4} and result["baseline"] == baselines[4]
    for c in (1, 4):  # the same requests, so the same tokens, in every layout and in HF
        assert points[("PP=1", c)]["output_tokens"] == baselines[c]["output_tokens"]
        assert points[("PP=2", c)]["output_tokens"] == baselines[c]["output_tokens"]
    by_c = result["headline"]["closed_loop_tokens_per_s"]
    assert set(by_c) == {"1", "4"} and set(by_c["1"]) == {"PP=1", "PP=2", "HF generate"}
    assert (tmp_path / "logs" / "pp2").is_dir()  # --log-dir keeps the rings' logs
    assert (out / "bench_serve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(300)
def test_repeats_alternate_every_ring_and_baseline_and_report_the_median_round(tmp_path):
    model = make_random_model(tmp_path / "random", PRESETS["tiny"], dtype="float32")
    out = tmp_path / "out"
    code = serve_bench.main(
        [
            "--model", str(model), "--pp-sizes", "1,2", "--num-requests", "4",
            "--concurrency", "2", "--no-sweep", "--repeats", "3", "--prompt-tokens", "8,32",
            "--output-tokens", "2,4", "--kv-memory-gib", "0.05", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "bench_serve.json").read_text())
    expected_tokens = result["workload"]["output_tokens_total"]
    reported = [*result["points"], *result["baselines"]]
    assert [p["layout"] for p in reported] == ["PP=1", "PP=2", "HF generate"]
    for point in reported:  # the median of three rounds, each round's figure kept
        rounds = point["output_tokens_per_s_rounds"]
        assert len(rounds) == 3 and point["output_tokens"] == expected_tokens
        assert point["output_tokens_per_s"] == pytest.approx(sorted(rounds)[1], abs=0.01)
    paired = result["headline"]["median_of_round_ratios"]["2"]
    assert set(paired) == {"PP=1 / HF generate", "PP=2 / HF generate", "PP=2 / PP=1"}
    pp1, pp2 = (p["output_tokens_per_s_rounds"] for p in result["points"])
    ratios = [b / a for a, b in zip(pp1, pp2)]
    assert paired["PP=2 / PP=1"]["rounds"] == pytest.approx(ratios, abs=1e-3)
    assert paired["PP=2 / PP=1"]["median"] == pytest.approx(sorted(ratios)[1], abs=1e-3)


def test_repeats_need_closed_loops_of_our_own_rings():
    for bad in (["--repeats", "0"], ["--repeats", "3"], ["--repeats", "3", "--no-sweep",
                "--base-url", "http://127.0.0.1:8000/v1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            serve_bench.parse_args(bad)
    assert serve_bench.parse_args(["--repeats", "3", "--no-sweep"]).repeats == 3


@pytest.mark.timeout(300)
def test_bench_serve_through_the_openai_api_and_the_native_client_side_by_side(
    default_model, tmp_path
):
    """`--backend ppring,openai`: the same ring through both clients, alternated; then
    `--base-url` against that server's API alone is what a user runs against another engine."""
    model = tiny_model_speaking(default_model, tmp_path)
    out = tmp_path / "out"
    code = serve_bench.main(
        [
            "--model", str(model), "--pp-sizes", "1", "--num-requests", "6",
            "--concurrency", "3", "--prompt-tokens", "8,64", "--output-tokens", "4,12",
            "--no-sweep", "--no-baseline", "--backend", "ppring,openai", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "bench_serve.json").read_text())
    expected_tokens = result["workload"]["output_tokens_total"]
    points = {p["layout"]: p for p in result["points"]}
    assert set(points) == {"PP=1", "PP=1 HTTP"}
    for point in points.values():  # the server's own count of tokens, over either client
        assert point["num_requests"] == 6 and point["output_tokens"] == expected_tokens
        assert point["ttft_p50_ms"] > 0
    assert set(result["headline"]["http_over_native"]) == {"PP=1 HTTP"}


def test_bench_serve_backend_flags_are_checked():
    for bad in (["--backend", "grpc"], ["--base-url", "http://x/v1", "--backend", "ppring"]):
        with pytest.raises(SystemExit):
            serve_bench.parse_args(bad)
    args = serve_bench.parse_args(["--base-url", "http://127.0.0.1:8000/v1"])
    assert args.backends == ["openai"]


def test_every_other_round_runs_backwards_so_each_point_sits_early_and_late_alike():
    servers = ["PP=1", "PP=2", "HF"]
    first, second = (serve_bench.round_order(n, [32, 64], servers) for n in (0, 1))
    assert first[:3] == [(32, "PP=1"), (32, "PP=2"), (32, "HF")] and len(first) == 6
    assert second == first[::-1]
    assert serve_bench.round_order(2, [32, 64], servers) == first
    # Over a pair of rounds every point's positions sum alike: none is always measured first,
    # nor always right after `generate`.
    position_sums = {pt: first.index(pt) + second.index(pt) for pt in first}
    assert set(position_sums.values()) == {len(first) - 1}


def test_the_default_workload_refills_every_closed_loop_and_an_asked_size_is_kept():
    """64 requests at 64 in flight would be one static batch (its ramp and its tail), not 64 in
    flight: by default the workload holds twice the highest concurrency."""
    args = serve_bench.parse_args(["--no-sweep", "--concurrency", "32,64"])
    assert args.num_requests == 128
    workload = make_workload(args.num_requests, args.seed)
    assert len(serve_bench._closed_subset(workload, 64, args.min_point_requests).requests) == 128
    assert len(serve_bench._closed_subset(workload, 32, args.min_point_requests).requests) == 64
    smaller = make_workload(64, args.seed)
    assert smaller.requests == workload.requests[:64]  # C=32's requests: as before
    asked = serve_bench.parse_args(["--no-sweep", "--concurrency", "64", "--num-requests", "16"])
    assert asked.num_requests == 16 and asked.closed_requests == 16


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["ppring", "openai"])
def test_the_multiturn_workload_runs_with_and_without_the_cache_and_reports_its_hits(
    default_model, tmp_path, backend
):
    model = tiny_model_speaking(default_model, tmp_path)
    out = tmp_path / "out"
    policies = {"ppring": "fcfs,lpm", "openai": "fcfs"}  # a ring fewer through HTTP
    code = serve_bench.main(
        [
            "--model", str(model), "--workload", "multiturn", "--pp-sizes", "2",
            "--chats", "3", "--turns", "3", "--system-words", "80", "--turn-tokens", "5",
            "--schedule-policies", policies[backend], "--backend", backend, "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "bench_serve_multiturn.json").read_text())
    runs = {r["ring"]: r for r in result["runs"]}
    cached = ["PP=2 cache", "PP=2 cache lpm"] if backend == "ppring" else ["PP=2 cache"]
    assert set(runs) == {*cached, "PP=2 no cache"}
    for run in runs.values():
        assert run["output_tokens"] == 3 * 3 * 5 and len(run["ttft_median_ms_by_turn"]) == 3
    assert runs["PP=2 no cache"]["cached_tokens"] == 0
    # every later turn finds its chat's history, the first turns the shared system prompt
    assert runs["PP=2 cache"]["cache_hit_rate"] > 0.5
    comparisons = {c["ring"]: c for c in result["comparisons"]}
    assert set(comparisons) == set(cached)
    assert comparisons["PP=2 cache"]["rounds"][0]["answers"] == 9
