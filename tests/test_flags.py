"""The flag table (launch/flags.py): what a launcher takes reaches each stage and the rendezvous."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from launch import local, serve, stage
from launch.flags import FLAGS, Flag, cuda_graph_max_bs, ring_config, stage_threads
from ring.config import RingConfig

AGREED = {
    "--pp-async-batch-depth",
    "--max-running-requests",
    "--pp-max-micro-batch-size",
    "--chunked-prefill-size",
    "--disable-radix-cache",
    "--schedule-policy",
    "--stage-impl",
    "--dtype",
    "--quantization",
    "--kv-cache-dtype",
    "--partition-rule",
    "--split-lm-head",
}


def other_value(flag: Flag) -> Any:
    """A valid value unlike the flag's default."""
    if flag.switch:
        return True
    if flag.choices:
        return next(choice for choice in flag.choices if choice != flag.default)
    if flag.type is str:
        return "other"
    return flag.type(3 * (flag.default or 1))


def launcher_argv(*extra: str) -> list[str]:
    words = [[flag.name] if flag.switch else [flag.name, str(other_value(flag))] for flag in FLAGS]
    return [word for pair in words for word in pair] + list(extra)


def test_stage_argv_carries_every_table_flag_to_the_stage():
    launcher = local.parse_args(launcher_argv())
    argv = local.stage_argv(launcher, 1, Path("other"))
    assert argv[1:3] == ["-m", "launch.stage"]
    got = stage.build_parser().parse_args(argv[3:])
    for flag in FLAGS:
        assert getattr(got, flag.dest) == other_value(flag), flag.name
    assert ring_config(got, 1) == ring_config(launcher, 1)


def test_ring_config_fills_each_field_from_its_flag():
    cfg = ring_config(local.parse_args(launcher_argv()), rank=1)
    for flag in FLAGS:
        if flag.field:
            assert getattr(cfg, flag.field) == other_value(flag), flag.name
    filled = {flag.field for flag in FLAGS if flag.field}
    per_process = {"rank", "debug_fault", "epoch"}  # epoch: the launcher's, per start
    resolved = {"split_lm_head"}  # from --split-lm-head with --pp-size and --device
    assert filled == {f.name for f in dataclasses.fields(RingConfig)} - per_process - resolved


def test_split_lm_head_auto_splits_real_cpu_rings_of_two_stages_or_more():
    def split(*argv: str) -> bool:
        return ring_config(local.parse_args(list(argv)), rank=0).split_lm_head

    assert split("--pp-size", "2")
    assert not split("--pp-size", "1")
    assert not split("--pp-size", "1", "--split-lm-head", "on")  # nothing to split
    assert not split("--pp-size", "2", "--split-lm-head", "off")
    assert not split("--pp-size", "2", "--device", "cuda")
    assert split("--pp-size", "2", "--device", "cuda", "--split-lm-head", "on")
    assert not split("--pp-size", "2", "--stage-impl", "sim")
    assert split("--pp-size", "3", "--stage-impl", "sim", "--split-lm-head", "on")


def test_cpu_rings_of_two_stages_or_more_default_to_one_async_slot_and_short_chunks():
    def shape(*argv: str) -> tuple[int, int, int]:
        cfg = ring_config(local.parse_args([*argv, "--dtype", "float32"]), rank=0)
        return cfg.pp_async_batch_depth, cfg.chunked_prefill_size, cfg.micro_batch_cap

    assert shape() == (0, 512, 64)  # one stage: nothing to pipeline
    # 64 running requests over 3 slots, rounded up: 22, 22 and 20 fit (not 32, 32 and none).
    assert shape("--pp-size", "2") == (1, 128, 22)
    assert shape("--pp-size", "2", "--max-running-requests", "32") == (1, 128, 11)
    assert shape("--pp-size", "2", "--device", "cuda") == (0, 512, 32)
    assert shape("--pp-size", "3", "--stage-impl", "sim") == (0, 512, 22)
    assert shape("--pp-size", "2", "--pp-async-batch-depth", "0") == (0, 128, 32)
    assert shape("--pp-size", "2", "--chunked-prefill-size", "1024") == (1, 1024, 22)


def test_bf16_cpu_rings_default_to_no_async_slot():
    def depth(*argv: str) -> int:
        return ring_config(local.parse_args(["--pp-size", "2", *argv]), rank=0).pp_async_batch_depth

    assert depth("--dtype", "bfloat16") == 0  # vdpbf16ps-bound: two slots of more rows
    assert depth("--dtype", "bfloat16", "--quantization", "int8") == 1
    assert depth("--dtype", "bfloat16", "--pp-async-batch-depth", "2") == 2
    assert depth("--dtype", "float32") == 1


def test_the_rendezvous_compares_resolved_pipeline_defaults():
    """Two nodes resolving `--dtype auto` on different CPUs (bf16 on one, fp32 on the other)
    would pick different depths: the values compared are the resolved ones, so that is a
    clear error at start-up, not schedulers diverging mid-run."""
    base = ["--node-rank", "0", "--nnodes", "2", "--dist-init-addr", "h:1", "--pp-size", "2"]

    def ring_flags(*argv: str) -> dict[str, Any]:
        return serve.hello_info(serve.parse_args([*base, *argv]), "hash", [15, 15])["ring_flags"]

    bf16, fp32 = ring_flags("--dtype", "bfloat16"), ring_flags("--dtype", "float32")
    assert bf16["--pp-async-batch-depth"] == 0 and fp32["--pp-async-batch-depth"] == 1
    assert bf16["--chunked-prefill-size"] == fp32["--chunked-prefill-size"] == 128
    assert (
        ring_flags("--pp-async-batch-depth", "1", "--dtype", "bfloat16")["--pp-async-batch-depth"]
        == 1
    )


def test_a_flag_left_at_none_is_not_written():
    launcher = local.parse_args([])
    argv = local.stage_argv(launcher, 0, Path("model"))
    assert "--pp-max-micro-batch-size" not in argv
    got = stage.build_parser().parse_args(argv[3:])
    assert got.pp_max_micro_batch_size is None
    assert ring_config(got, 0) == ring_config(launcher, 0)


def test_hello_info_holds_exactly_the_agreed_flags():
    args = serve.parse_args(
        launcher_argv("--node-rank", "0", "--nnodes", "3", "--dist-init-addr", "h:1")
    )
    info = serve.hello_info(args, "hash", [2, 2, 2])
    assert set(info) == {"host", "config_hash", "partition", "nnodes", "ring_flags", "port"}
    assert set(info["ring_flags"]) == AGREED
    by_name = {flag.name: flag for flag in FLAGS}
    for name, value in info["ring_flags"].items():
        assert value == other_value(by_name[name]), name


def test_cuda_graphs_default_to_the_micro_batch_cap_and_switch_off():
    def max_bs(*argv: str) -> int:
        args = local.parse_args(["--device", "cuda", *argv])
        return cuda_graph_max_bs(args, ring_config(args, rank=0))

    assert max_bs() == 64  # 64 running requests, one stage
    assert max_bs("--pp-size", "2", "--max-running-requests", "128") == 64
    assert max_bs("--cuda-graph-max-bs", "24") == 24
    assert max_bs("--disable-cuda-graph") == 0
    assert "--disable-cuda-graph" in local.stage_argv(
        local.parse_args(["--disable-cuda-graph"]), 0, Path("model")
    )


def test_a_gpu_stage_takes_one_host_thread_unless_told_and_a_cpu_stage_its_share():
    assert stage_threads(local.parse_args(["--device", "cuda", "--pp-size", "2"])) == 1
    assert stage_threads(local.parse_args(["--device", "cuda", "--threads-per-stage", "4"])) == 4
    cpu = local.parse_args(["--pp-size", "2"])
    assert stage_threads(cpu) == cpu.threads_per_stage >= 1


def test_the_start_up_summary_says_whether_the_prefix_cache_is_on():
    on = local.prefix_cache_line(ring_config(local.parse_args([]), 0))
    off = local.prefix_cache_line(ring_config(local.parse_args(["--disable-radix-cache"]), 0))
    assert on.startswith("prefix cache: on") and off.startswith("prefix cache: off")
    assert "--disable-radix-cache" in local.stage_argv(
        local.parse_args(["--disable-radix-cache"]), 0, Path("model")
    )
