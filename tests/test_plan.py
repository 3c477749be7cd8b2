"""`ppring plan` reproduces the seed chapter's derived figures (DESIGN.md §10, Planner)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from launch import cli, plan
from launch.plan import GiB, KiB, MiB
from stages.layer_spec import LayerSpec

LLAMA_70B = plan.PRESETS["Llama-3-70B"]
SEED = plan.SEED_HARDWARE

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
}


def seed_report() -> plan.Report:
    return plan.build_report(LLAMA_70B, SEED)


def layout(report: plan.Report, label: str) -> plan.LayoutPlan:
    return next(p for p in [report.baseline, *report.layouts] if p.label == label)


# --- KV sizing -----------------------------------------------------------------------------------


def test_llama_3_70b_kv_is_4_kib_per_token_per_layer_and_320_kib_per_token() -> None:
    assert plan.kv_bytes_per_token(8, 128, 1, 2) == 4 * KiB
    assert plan.kv_bytes_per_token(8, 128, 80, 2) == 320 * KiB


def test_kv_heads_split_up_to_h_kv_and_replicate_past_it() -> None:
    assert [plan.kv_heads_per_gpu(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]


def test_an_h100_leaves_71_69_gib_at_0_9_and_68_69_after_the_reserve() -> None:
    assert plan.usable_bytes(79.65, 0.9, 0) / GiB == pytest.approx(71.69, abs=0.005)
    assert plan.usable_bytes(79.65, 0.9, 3) / GiB == pytest.approx(68.69, abs=0.005)


def test_seed_concurrency_gains_from_131_gib_of_weights() -> None:
    # The seed's arithmetic: 131 GiB split evenly, 1 KV head per GPU at TP=8 and at TP=16.
    usable = plan.usable_bytes(79.65, 0.9, 3)
    kv_80_layers = plan.kv_bytes_per_token(plan.kv_heads_per_gpu(8, 8), 128, 80, 2)
    kv_tp16 = plan.kv_bytes_per_token(plan.kv_heads_per_gpu(8, 16), 128, 80, 2)
    kv_40_layers = plan.kv_bytes_per_token(plan.kv_heads_per_gpu(8, 8), 128, 40, 2)
    tp8 = plan.kv_token_capacity(usable - 131 * GiB / 8, kv_80_layers)
    tp16 = plan.kv_token_capacity(usable - 131 * GiB / 16, kv_tp16)
    tp8_pp2 = plan.kv_token_capacity(usable - 131 * GiB / 16, kv_40_layers)
    assert (usable - 131 * GiB / 8) / GiB == pytest.approx(52, abs=0.5)  # "~52 GiB left for KV"
    assert plan.concurrency_gain(tp16, tp8) == pytest.approx(0.16, abs=0.01)
    assert plan.concurrency_gain(tp8_pp2, tp8) == pytest.approx(1.32, abs=0.01)


def test_preset_weighs_131_gib_and_16_4_gib_per_gpu_at_tp8() -> None:
    report = seed_report()
    assert report.weight_bytes / GiB == pytest.approx(131, abs=0.5)
    assert layout(report, "TP=8 (1 node)").weight_bytes_per_gpu / GiB == pytest.approx(
        16.4, abs=0.05
    )


def test_planned_layouts_reproduce_plus_16_and_plus_132_percent() -> None:
    report = seed_report()
    assert report.baseline.label == "TP=8 (1 node)"
    assert layout(report, "TP=16").gain_vs_baseline == pytest.approx(0.16, abs=0.01)
    assert layout(report, "TP=8 x PP=2").gain_vs_baseline == pytest.approx(1.32, abs=0.01)


def test_param_counts_match_the_published_model_sizes() -> None:
    assert 70.5e9 < plan.model_params(LLAMA_70B) < 70.6e9
    assert 8.0e9 < plan.model_params(plan.PRESETS["Llama-3-8B"]) < 8.1e9
    # Tied: the lm_head shares the embedding.
    assert 134e6 < plan.model_params(plan.PRESETS["SmolLM2-135M"]) < 135e6


def test_weights_that_overflow_the_gpu_leave_no_kv_room() -> None:
    report = plan.build_report(LLAMA_70B, replace(SEED, gpu_mem_gib=8))
    assert all(p.kv_tokens == 0 and p.max_sequences == 0 for p in report.layouts)


# --- wire bytes ----------------------------------------------------------------------------------


def test_one_allreduce_at_t64_n8_is_1_84_mb_and_294_mb_per_step() -> None:
    one = plan.allreduce_bytes_per_rank(64 * 8192 * 2, 8)
    assert round(one / 1e6, 2) == 1.84
    assert plan.allreduces_per_forward(80, 8) == 160
    step = plan.tp_wire_bytes(64, 80, 8192, 2, 8)
    assert round(step / 1e6) == 294
    assert plan.transfer_seconds(step, 3600) * 1e3 == pytest.approx(0.65, abs=0.005)
    assert plan.transfer_seconds(step, 400) * 1e3 == pytest.approx(5.9, abs=0.05)


def test_pp_seam_moves_140x_fewer_bytes_than_tp8_allreduces() -> None:
    tp8 = plan.tp_wire_bytes(1, 80, 8192, 2, 8)
    seam = plan.seam_bytes(1, 8192, 2)
    assert tp8 == 4.375 * MiB
    assert seam == 32 * KiB
    assert tp8 / seam == 140
    assert plan.seam_bytes(1, 8192, 2, tp_size=8) == 4 * KiB
    assert seed_report().pp_wire_ratio == 140


def test_tp_pays_2l_collectives_and_pp_s_minus_1_seams() -> None:
    hw = replace(SEED, num_gpus=4)
    pp4 = plan.plan_layout(LLAMA_70B, hw, 1, 4, context_len=8192, num_tokens=64, kv_elem_bytes=2)
    assert (pp4.allreduces, pp4.seams) == (0, 3)
    assert plan.allreduces_per_forward(80, 4) == 160


def test_links_follow_the_node_boundary() -> None:
    report = seed_report()
    assert layout(report, "TP=8 (1 node)").tp_link == "NVLink"
    assert layout(report, "TP=16").tp_link == "inter-node"
    assert layout(report, "TP=8 x PP=2").seam_link == "inter-node"
    assert layout(report, "PP=16").seam_link == "1 of 15 inter-node"
    assert layout(report, "TP=16").comm_ms_placed == pytest.approx(6.29, abs=0.01)


# --- bubbles and partitions ----------------------------------------------------------------------


def test_gpipe_bubble_at_four_stages() -> None:
    bubbles = [round(100 * plan.gpipe_bubble(4, m), 1) for m in (1, 4, 16, 64)]
    assert bubbles == [75.0, 42.9, 15.8, 4.5]


def test_uneven_80_layer_split_over_6_stages_loses_4_8_percent() -> None:
    hw = replace(SEED, num_gpus=6)
    pp6 = plan.plan_layout(LLAMA_70B, hw, 1, 6, context_len=8192, num_tokens=64, kv_elem_bytes=2)
    assert pp6.partition == [13, 13, 13, 14, 14, 13]
    assert round(100 * pp6.partition_loss, 1) == 4.8


# --- command line --------------------------------------------------------------------------------


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = plan.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def gain_in_row(out: str, label: str) -> float:
    row = next(line for line in out.splitlines() if line.startswith(label + "  "))
    return float(re.search(r"([+-][\d.]+)%$", row).group(1))


def test_no_arguments_prints_the_seed_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([], capsys)
    assert code == 0
    for figure in ("Llama-3-70B", "131.4 GiB", "4 KiB/token/layer", "320 KiB/token", "68.69 GiB"):
        assert figure in out
    for figure in ("16.43 GiB", "4.375 MiB", "32 KiB", "4 KiB", "140x", "1.84", "294"):
        assert figure in out
    assert gain_in_row(out, "TP=16") == pytest.approx(16, abs=1)
    assert gain_in_row(out, "TP=8 x PP=2") == pytest.approx(132, abs=1)
    assert re.search(r"^4 +75\.0% +42\.9% +15\.8% +4\.5%$", out, re.MULTILINE)


def test_json_prints_the_same_figures(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 320 * KiB
    gains = {p["label"]: p["gain_vs_baseline"] for p in data["layouts"]}
    assert gains["TP=16"] == pytest.approx(0.16, abs=0.01)
    assert gains["TP=8 x PP=2"] == pytest.approx(1.32, abs=0.01)
    assert {"stages": 4, "micro_batches": 4, "bubble": pytest.approx(3 / 7)} in data["bubbles"]


def test_plan_is_a_ppring_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.SUBCOMMANDS["plan"][0] == "launch.plan"
    assert cli.main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "Llama-3-70B"


@pytest.mark.parametrize("use_file", [False, True], ids=["folder", "config.json"])
def test_a_config_json_sizes_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], use_file: bool
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    model = tmp_path / "config.json" if use_file else tmp_path
    code, out, _ = run(["--model", str(model), "--gpus", "2", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["model"]["num_layers"] == 4
    assert data["kv_bytes_per_token_per_layer"] == 2 * 2 * 16 * 2  # 2 KV heads x head_dim 16
    assert [p["label"] for p in data["layouts"]] == ["TP=2", "PP=2"]


def test_an_8_bit_kv_cache_is_sized_with_its_scales(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    sizes = {}
    for kv in ("bf16", "int8"):
        code, out, _ = run(
            ["--model", str(tmp_path), "--gpus", "2", "--json", "--kv-cache-dtype", kv], capsys
        )
        assert code == 0
        sizes[kv] = json.loads(out)
    # int8: codes (2 x 2 heads x 16), a K scale byte a channel per 16 tokens, a bf16 V scale
    assert sizes["int8"]["kv_bytes_per_token_per_layer"] == 2 * 2 * 16 + 2 * 16 // 16 + 2 * 2
    bf16, eight = (sizes[kv]["layouts"][0]["kv_tokens"] for kv in ("bf16", "int8"))
    assert eight / bf16 == pytest.approx(128 / 70, rel=0.01)  # bf16: 2 x 2 x 16 x 2 bytes


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--model", "Llama-9-1T"], "preset"),
        (["--gpus", "16", "--tp-size", "3"], "--tp-size"),
        (["--tp-size", "8", "--pp-size", "4"], "--gpus"),
        (["--model", "/nonexistent/config.json"], "config.json"),
        (["--gpus", "6", "--tp-size", "6"], "attention heads"),
    ],
    ids=["unknown-preset", "tp-does-not-divide", "product-mismatch", "missing-file", "heads"],
)
def test_bad_input_is_one_sentence_and_exit_2(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("ppring plan: error: ") and names in err


def test_plan_imports_no_torch() -> None:
    check = "import launch.plan, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True, cwd=Path(__file__).parents[1])


def test_qwen_presets_count_their_published_parameters_with_what_their_family_adds():
    # Qwen2.5-7B: 7.62B; Qwen3-8B: 8.19B; Qwen3-0.6B (tied): 0.60B (their model cards)
    assert 7.60e9 < plan.model_params(plan.PRESETS["Qwen2.5-7B"]) < 7.63e9
    assert 8.18e9 < plan.model_params(plan.PRESETS["Qwen3-8B"]) < 8.20e9
    assert 0.59e9 < plan.model_params(plan.PRESETS["Qwen3-0.6B"]) < 0.61e9
    qwen2 = plan.PRESETS["Qwen2.5-7B"].config
    as_llama = plan.layer_params_per_gpu(replace(qwen2, layer_spec=LayerSpec()), 1)
    bias = (qwen2.num_heads + 2 * qwen2.num_kv_heads) * qwen2.head_dim
    assert plan.layer_params_per_gpu(qwen2, 1) == as_llama + bias
    qwen3 = plan.PRESETS["Qwen3-8B"].config
    as_llama = plan.layer_params_per_gpu(replace(qwen3, layer_spec=LayerSpec()), 1)
    assert plan.layer_params_per_gpu(qwen3, 1) == as_llama + 2 * qwen3.head_dim  # q, k norms


def test_a_gguf_file_is_sized_as_a_gpu_holds_it_and_its_formats_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.tiny_families import TOKENIZER_VOCAB, byte_level_tokenizer
    from tests.tiny_gguf import write_gguf
    from tests.tiny_llama import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "hf", hidden=256, intermediate=512, vocab=TOKENIZER_VOCAB)
    byte_level_tokenizer().save_pretrained(folder)
    formats = {"attn_q": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
    path = write_gguf(folder, tmp_path / "m.gguf", formats, default_format="F16")
    code, out, _ = run(["--model", str(path), "--gpus", "2", "--json"], capsys)
    assert code == 0
    model = json.loads(out)["model"]
    assert (model["num_layers"], model["hidden_size"], model["dtype"]) == (4, 256, "bfloat16")
    assert "attn_q Q4_K" in model["gguf_formats"] and "ffn_down Q6_K" in model["gguf_formats"]
    assert 0 < model["gguf_matrix_bytes"] < path.stat().st_size
    code, out, _ = run(["--model", str(path), "--gpus", "2"], capsys)
    assert code == 0 and "GGUF: " in out and "dequantized to bfloat16 at load on a GPU" in out
