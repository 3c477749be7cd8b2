"""`ppring plan`: what a TP, PP or TP x PP layout costs, before a GPU is booked.

From a model's shape and a few hardware figures it derives, for every layout that uses the GPUs:
weight and KV bytes per GPU, the KV tokens and sequences that fit, the bytes a rank puts on the
wire per token (TP all-reduces against PP seam sends) and how long they take on NVLink or the
inter-node link, and the GPipe bubble table. Derived, not measured: bandwidth only, no
per-collective latency. With no arguments it prints the seed's scenario, Llama-3-70B in bf16 on
two 8 x H100 nodes joined by 400 Gb/s InfiniBand.

Torch-free arithmetic on config.json fields; every formula is a small function tests call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from protocol.dtypes import dtype_bytes, spellings
from stages.config import ModelConfig, read_config_json
from stages.errors import ConfigError
from stages.gguf_file import is_gguf, matrix_formats
from stages.partition import imbalance_loss, partition_layers

KiB = 1024
MiB = 1024**2
GiB = 1024**3

# The dtypes plan sizes weights and KV in, under every spelling (protocol/dtypes.py): the short
# names are what people type, the long ones what config.json holds.
PLAN_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
DTYPE_CHOICES = sorted(spelling for name in PLAN_DTYPES for spelling in spellings(name))

DEFAULT_BUBBLE_STAGES = (2, 4, 8)
DEFAULT_MICRO_BATCHES = (1, 4, 16, 64)


# The ModelConfig fields that set weight, KV and activation sizes: what --json shows of a model.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class PlanModel:
    """A model as plan sizes it: its shape, the name the report gives it, and the dtype of its
    weights (as typed: "bf16" stays "bf16" in the report)."""

    name: str
    config: ModelConfig
    dtype: str
    # a GGUF file's matrices: its tensor groups' formats and bytes (render says that a GPU
    # stage dequantizes them to `dtype` at load, which is what plan sizes); None otherwise
    gguf_formats: tuple[str, int] | None = None


# The config.json fields a preset states, in the order _preset takes them (head_dim is
# hidden_size / num_attention_heads unless the preset names it, as Qwen3's do).
PRESET_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def _preset(
    name: str, *values: int | bool, architecture: str = "LlamaForCausalLM", **extra: int
) -> PlanModel:
    """A published bf16 model from its config.json, cut to PRESET_FIELDS (and `extra`, such as
    head_dim); RoPE and norm settings take ModelConfig's defaults, which plan never reads. Its
    family's layer spec counts what it adds to Llama's layer (Qwen2's biases, Qwen3's norms)."""
    raw = {
        "architectures": [architecture],
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        **dict(zip(PRESET_FIELDS, values, strict=True)),
        **extra,
    }
    config = ModelConfig.from_dict(raw, source=name)
    return PlanModel(name, config, config.torch_dtype)


PRESETS = {
    model.name: model
    for model in (
        _preset("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, False),
        _preset("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, False),
        _preset("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, True),
        _preset(
            "Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, False, architecture="Qwen2ForCausalLM"
        ),
        _preset(
            "Qwen3-8B",
            36,
            4096,
            32,
            8,
            12288,
            151936,
            False,
            architecture="Qwen3ForCausalLM",
            head_dim=128,
        ),
        _preset(
            "Qwen3-0.6B",
            28,
            1024,
            16,
            8,
            3072,
            151936,
            True,
            architecture="Qwen3ForCausalLM",
            head_dim=128,
        ),
    )
}


@dataclass(frozen=True)
class Hardware:
    num_gpus: int
    gpus_per_node: int
    gpu_mem_gib: float  # what one GPU reports (an 80 GB H100 reports 79.65 GiB)
    mem_util: float  # share of it the engine may take, as vLLM's --gpu-memory-utilization
    reserved_gib: float  # of that share, kept for activations and CUDA graphs
    nvlink_gbps: float  # gigabits per second per direction, per GPU
    link_gbps: float  # inter-node, gigabits per second per direction, per GPU (one NIC each)


SEED_HARDWARE = Hardware(
    num_gpus=16,
    gpus_per_node=8,
    gpu_mem_gib=79.65,
    mem_util=0.9,
    reserved_gib=3.0,
    nvlink_gbps=3600.0,  # 450 GB/s per direction (900 GB/s bidirectional)
    link_gbps=400.0,  # InfiniBand NDR: 50 GB/s per direction
)


# --- the formulas, one job each ------------------------------------------------------------------


def usable_bytes(gpu_mem_gib: float, mem_util: float, reserved_gib: float) -> float:
    """Bytes one GPU gives weights plus KV: its capacity times the utilisation, less the
    reserve for activations and graphs (79.65 GiB x 0.9 - 3 GiB = 68.69 GiB)."""
    return (gpu_mem_gib * mem_util - reserved_gib) * GiB


def kv_heads_per_gpu(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a TP rank stores: split while TP <= h_kv, replicated past it (at least one)."""
    return max(num_kv_heads // tp_size, 1)


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, num_layers: int, elem_bytes: float) -> int:
    """K and V of one token: 2 * heads * d_head * bytes per layer, times the layers held
    (elem_bytes: kv_elem_bytes, an 8-bit cache's scales included)."""
    return math.ceil(2 * num_kv_heads * head_dim * elem_bytes * num_layers)


def kv_elem_bytes(kv_dtype: str, head_dim: int) -> float:
    """Bytes a K or V element costs: the dtype's, or int8's with its share of the scales (a K
    scale byte per 16-token page and channel, a bf16 V scale per token and head: 134 bytes a
    token and head of 64 where bf16 takes 256; stages/kv_quant.py)."""
    if kv_dtype == "int8":
        return 1 + (2 + head_dim / 16) / (2 * head_dim)
    return dtype_bytes(kv_dtype)


def layer_params_per_gpu(shape: ModelConfig, tp_size: int) -> int:
    """Parameters of one decoder layer on one TP rank. q/o and the MLP split by TP; k/v follow
    the KV heads (replicated past h_kv); the two RMSNorm weights are replicated."""
    d, dh = shape.hidden_size, shape.head_dim
    q_and_o = 2 * d * shape.num_heads * dh // tp_size
    k_and_v = 2 * d * kv_heads_per_gpu(shape.num_kv_heads, tp_size) * dh
    mlp = 3 * d * shape.intermediate_size // tp_size  # gate, up, down
    heads = shape.num_heads // tp_size
    extra = shape.layer_spec.extra_params(
        d, dh, heads, kv_heads_per_gpu(shape.num_kv_heads, tp_size)
    )
    return q_and_o + k_and_v + mlp + 2 * d + extra


def stage_params_per_gpu(
    shape: ModelConfig, tp_size: int, num_stage_layers: int, is_first: bool, is_last: bool
) -> int:
    """Parameters one TP rank of a stage holds: its layers, the embedding on the first stage,
    the final norm and lm_head on the last (vocab split over TP). A tied lm_head is free only
    when the embedding sits on the same stage."""
    vocab_shard = math.ceil(shape.vocab_size / tp_size) * shape.hidden_size
    params = num_stage_layers * layer_params_per_gpu(shape, tp_size)
    if is_first:
        params += vocab_shard
    if is_last:
        params += shape.hidden_size
        if not (shape.tie_word_embeddings and is_first):
            params += vocab_shard
    return params


def model_params(model: PlanModel) -> int:
    """Parameters of the whole model (one GPU, one stage)."""
    shape = model.config
    return stage_params_per_gpu(shape, 1, shape.num_layers, is_first=True, is_last=True)


def kv_token_capacity(free_bytes: float, bytes_per_token: int) -> int:
    """Tokens of KV that fit in `free_bytes`; zero when the weights already overflow."""
    return max(int(free_bytes // bytes_per_token), 0)


def concurrency_gain(kv_tokens: int, baseline_kv_tokens: int) -> float:
    """Fractional change in concurrency against a baseline (0.16 means +16%)."""
    return kv_tokens / baseline_kv_tokens - 1.0


def allreduce_bytes_per_rank(message_bytes: float, num_ranks: int) -> float:
    """Bytes a ring all-reduce sends out of every rank: 2 (N-1)/N of the message
    (reduce-scatter, then all-gather)."""
    return 2 * (num_ranks - 1) / num_ranks * message_bytes


def allreduces_per_forward(num_layers: int, tp_size: int) -> int:
    """A Llama block all-reduces twice under TP (after o_proj, after down_proj): 2L."""
    return 2 * num_layers if tp_size > 1 else 0


def tp_wire_bytes(
    num_tokens: int, num_layers: int, hidden_size: int, elem_bytes: int, tp_size: int
) -> float:
    """Bytes one TP rank sends in the all-reduces of `num_layers` layers on [T, d]."""
    message = num_tokens * hidden_size * elem_bytes
    return allreduces_per_forward(num_layers, tp_size) * allreduce_bytes_per_rank(message, tp_size)


def seam_bytes(num_tokens: int, hidden_size: int, elem_bytes: int, tp_size: int = 1) -> float:
    """Bytes one rank sends across one PP seam: hidden states and the un-added residual, [T, d]
    each (2 T d b), split over the TP ranks when the send is sharded and all-gathered after."""
    return 2 * num_tokens * hidden_size * elem_bytes / tp_size


def transfer_seconds(num_bytes: float, gbps: float) -> float:
    """Time for `num_bytes` on a link of `gbps` gigabits per second, bandwidth only."""
    return num_bytes * 8 / (gbps * 1e9)


def gpipe_bubble(num_stages: int, num_micro_batches: int) -> float:
    """Idle fraction of a GPipe fill and drain: (S - 1) / (S + M - 1)."""
    return (num_stages - 1) / (num_stages + num_micro_batches - 1)


def tp_group_crosses_nodes(stage: int, tp_size: int, gpus_per_node: int) -> bool:
    """Whether stage `stage`'s TP group spans two nodes. Global rank = stage * TP + tp_rank
    (TP fastest, as vLLM and SGLang number them)."""
    first = stage * tp_size
    return first // gpus_per_node != (first + tp_size - 1) // gpus_per_node


def seam_crosses_nodes(stage: int, tp_size: int, gpus_per_node: int) -> bool:
    """Whether the send from `stage` to `stage + 1` leaves the node for any TP rank."""
    return any(
        (stage * tp_size + r) // gpus_per_node != ((stage + 1) * tp_size + r) // gpus_per_node
        for r in range(tp_size)
    )


def layout_problem(shape: ModelConfig, tp_size: int, pp_size: int) -> str | None:
    """Why the model cannot run at this TP x PP, or None if it can."""
    if shape.num_heads % tp_size:
        return f"{shape.num_heads} attention heads do not split over TP={tp_size}"
    h_kv = shape.num_kv_heads
    if (h_kv % tp_size) if tp_size <= h_kv else (tp_size % h_kv):
        return f"{h_kv} KV heads neither split over nor replicate evenly across TP={tp_size}"
    if shape.intermediate_size % tp_size:
        return f"intermediate size {shape.intermediate_size} does not split over TP={tp_size}"
    if pp_size > shape.num_layers:
        return f"PP={pp_size} exceeds the model's {shape.num_layers} layers"
    return None


# --- one layout, all figures ---------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutPlan:
    label: str
    tp_size: int
    pp_size: int
    num_gpus: int
    partition: list[int]  # layers per stage
    partition_loss: float  # throughput lost to the slowest stage (0 when even)
    weight_bytes_per_gpu: int  # heaviest stage
    kv_heads_per_gpu: int
    kv_bytes_per_token_per_gpu: int  # stage with the most layers
    kv_tokens: int  # the ring's KV capacity: every stage must hold every running token
    max_sequences: int  # kv_tokens // context_len
    sequences_per_batch: int  # with pp_size batches in flight, each admits 1/S of the total
    gain_vs_baseline: float | None
    tp_link: str
    seam_link: str
    allreduces: int  # per forward pass, all stages
    allreduce_bytes_per_token: float  # one rank of each stage, summed along the forward
    seams: int
    seam_bytes_per_token: float  # one rank, one seam (sharded over TP)
    allreduce_bytes_at_t: float  # one all-reduce of [T, d], per rank
    step_bytes_per_rank: float  # at T: a rank of the heaviest stage, its all-reduces and seam
    comm_ms_nvlink: float  # at T: the forward's wire time were every link NVLink
    comm_ms_inter_node: float  # ... were every link the inter-node one
    comm_ms_placed: float  # ... with each group and seam on the link it really uses


def layout_label(tp_size: int, pp_size: int) -> str:
    if pp_size == 1:
        return f"TP={tp_size}"
    if tp_size == 1:
        return f"PP={pp_size}"
    return f"TP={tp_size} x PP={pp_size}"


def _link_name(crossings: int, total: int) -> str:
    if total == 0:
        return "-"
    if crossings == 0:
        return "NVLink"
    if crossings == total:
        return "inter-node"
    return f"{crossings} of {total} inter-node"


def plan_layout(
    model: PlanModel,
    hw: Hardware,
    tp_size: int,
    pp_size: int,
    context_len: int,
    num_tokens: int,
    kv_elem_bytes: float,
    baseline_kv_tokens: int | None = None,
    label: str | None = None,
) -> LayoutPlan:
    shape = model.config
    b = dtype_bytes(model.dtype)
    d = shape.hidden_size
    partition = partition_layers(shape.num_layers, pp_size)
    heads = kv_heads_per_gpu(shape.num_kv_heads, tp_size)
    usable = usable_bytes(hw.gpu_mem_gib, hw.mem_util, hw.reserved_gib)

    weights, kv_per_token, tokens = [], [], []
    for stage, num_stage_layers in enumerate(partition):
        is_first, is_last = stage == 0, stage == pp_size - 1
        stage_bytes = b * stage_params_per_gpu(shape, tp_size, num_stage_layers, is_first, is_last)
        per_token = kv_bytes_per_token(heads, shape.head_dim, num_stage_layers, kv_elem_bytes)
        weights.append(stage_bytes)
        kv_per_token.append(per_token)
        tokens.append(kv_token_capacity(usable - stage_bytes, per_token))
    kv_tokens = min(tokens)
    max_sequences = kv_tokens // context_len

    gpn = hw.gpus_per_node
    tp_crossing = [tp_group_crosses_nodes(s, tp_size, gpn) for s in range(pp_size)]
    seam_crossing = [seam_crosses_nodes(s, tp_size, gpn) for s in range(pp_size - 1)]
    one_allreduce = allreduce_bytes_per_rank(num_tokens * d * b, tp_size) if tp_size > 1 else 0.0
    one_seam = seam_bytes(num_tokens, d, b, tp_size)
    # Along one forward pass the stages run in turn: their all-reduces and seams add up.
    placed_s = 0.0
    for stage, num_stage_layers in enumerate(partition):
        stage_bytes = tp_wire_bytes(num_tokens, num_stage_layers, d, b, tp_size)
        placed_s += transfer_seconds(
            stage_bytes, hw.link_gbps if tp_crossing[stage] else hw.nvlink_gbps
        )
    for crosses in seam_crossing:
        placed_s += transfer_seconds(one_seam, hw.link_gbps if crosses else hw.nvlink_gbps)
    forward_bytes = tp_wire_bytes(num_tokens, shape.num_layers, d, b, tp_size)
    forward_bytes += (pp_size - 1) * one_seam
    heaviest = max(partition)
    step_bytes = tp_wire_bytes(num_tokens, heaviest, d, b, tp_size)
    step_bytes += one_seam if pp_size > 1 else 0.0

    return LayoutPlan(
        label=label or layout_label(tp_size, pp_size),
        tp_size=tp_size,
        pp_size=pp_size,
        num_gpus=tp_size * pp_size,
        partition=partition,
        partition_loss=imbalance_loss(partition),
        weight_bytes_per_gpu=max(weights),
        kv_heads_per_gpu=heads,
        kv_bytes_per_token_per_gpu=max(kv_per_token),
        kv_tokens=kv_tokens,
        max_sequences=max_sequences,
        sequences_per_batch=max_sequences // pp_size,
        gain_vs_baseline=(
            concurrency_gain(kv_tokens, baseline_kv_tokens) if baseline_kv_tokens else None
        ),
        tp_link=_link_name(sum(tp_crossing), pp_size if tp_size > 1 else 0),
        seam_link=_link_name(sum(seam_crossing), pp_size - 1),
        allreduces=allreduces_per_forward(shape.num_layers, tp_size),
        allreduce_bytes_per_token=tp_wire_bytes(1, shape.num_layers, d, b, tp_size),
        seams=pp_size - 1,
        seam_bytes_per_token=seam_bytes(1, d, b, tp_size) if pp_size > 1 else 0.0,
        allreduce_bytes_at_t=one_allreduce,
        step_bytes_per_rank=step_bytes,
        comm_ms_nvlink=1e3 * transfer_seconds(forward_bytes, hw.nvlink_gbps),
        comm_ms_inter_node=1e3 * transfer_seconds(forward_bytes, hw.link_gbps),
        comm_ms_placed=1e3 * placed_s,
    )


# --- the whole report ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    model: PlanModel
    hardware: Hardware
    context_len: int
    num_tokens: int
    kv_dtype: str
    weight_bytes: int  # whole model
    kv_bytes_per_token_per_layer: int  # whole model, all KV heads
    kv_bytes_per_token: int
    usable_bytes_per_gpu: float
    baseline: LayoutPlan  # pure TP inside one node: what most people run
    layouts: list[LayoutPlan]
    skipped: list[dict[str, str]]  # layouts the model's shape rules out, with the reason
    pp_wire_ratio: float  # baseline TP rank's all-reduce bytes per token / one PP seam's
    bubbles: list[dict[str, float]]  # {"stages", "micro_batches", "bubble"}


def candidate_layouts(
    num_gpus: int, tp_size: int | None, pp_size: int | None
) -> list[tuple[int, int]]:
    """(TP, PP) pairs with TP x PP = num_gpus, TP descending; fixed by --tp-size / --pp-size."""
    if tp_size is not None and pp_size is not None:
        if tp_size < 1 or pp_size < 1 or tp_size * pp_size != num_gpus:
            raise ConfigError(
                f"--tp-size {tp_size} x --pp-size {pp_size} is {tp_size * pp_size} GPUs but "
                f"--gpus is {num_gpus}; make the product equal --gpus"
            )
        return [(tp_size, pp_size)]
    fixed, flag = (tp_size, "--tp-size") if tp_size is not None else (pp_size, "--pp-size")
    if fixed is not None and (fixed < 1 or num_gpus % fixed):
        divisors = ", ".join(str(n) for n in range(1, num_gpus + 1) if num_gpus % n == 0)
        raise ConfigError(
            f"--gpus {num_gpus} does not divide into {flag} {fixed}; use one of {divisors}"
        )
    if tp_size is not None:
        return [(tp_size, num_gpus // tp_size)]
    if pp_size is not None:
        return [(num_gpus // pp_size, pp_size)]
    return [(tp, num_gpus // tp) for tp in range(num_gpus, 0, -1) if num_gpus % tp == 0]


def build_report(
    model: PlanModel,
    hw: Hardware,
    context_len: int = 8192,
    num_tokens: int = 64,
    kv_dtype: str | None = None,
    tp_size: int | None = None,
    pp_size: int | None = None,
    bubble_stages: tuple[int, ...] = DEFAULT_BUBBLE_STAGES,
    micro_batches: tuple[int, ...] = DEFAULT_MICRO_BATCHES,
) -> Report:
    check_inputs(hw, context_len, num_tokens)
    shape = model.config
    kv_dtype = kv_dtype or model.dtype
    kv_b = kv_elem_bytes(kv_dtype, shape.head_dim)
    b = dtype_bytes(model.dtype)
    pairs = candidate_layouts(hw.num_gpus, tp_size, pp_size)
    explicit = tp_size is not None or pp_size is not None
    common = dict(context_len=context_len, num_tokens=num_tokens, kv_elem_bytes=kv_b)

    # Baseline: the widest pure TP one node holds; the seed's "TP=8, what most people run".
    one_node = min(hw.num_gpus, hw.gpus_per_node)
    base_tp = next(tp for tp in range(one_node, 0, -1) if not layout_problem(shape, tp, 1))
    base_label = layout_label(base_tp, 1) + (" (1 node)" if base_tp < hw.num_gpus else "")
    base = plan_layout(model, hw, base_tp, 1, label=base_label, **common)
    base = replace(base, gain_vs_baseline=0.0 if base.kv_tokens else None)

    layouts, skipped = [], []
    for tp, pp in pairs:
        problem = layout_problem(shape, tp, pp)
        if problem and explicit:
            raise ConfigError(f"{model.name} cannot run at {layout_label(tp, pp)}: {problem}")
        if problem:
            skipped.append({"layout": layout_label(tp, pp), "reason": problem})
            continue
        if (tp, pp) == (base_tp, 1):
            layouts.append(base)
            continue
        layouts.append(
            plan_layout(model, hw, tp, pp, baseline_kv_tokens=base.kv_tokens or None, **common)
        )

    return Report(
        model=model,
        hardware=hw,
        context_len=context_len,
        num_tokens=num_tokens,
        kv_dtype=kv_dtype,
        weight_bytes=b * model_params(model),
        kv_bytes_per_token_per_layer=kv_bytes_per_token(
            shape.num_kv_heads, shape.head_dim, 1, kv_b
        ),
        kv_bytes_per_token=kv_bytes_per_token(
            shape.num_kv_heads, shape.head_dim, shape.num_layers, kv_b
        ),
        usable_bytes_per_gpu=usable_bytes(hw.gpu_mem_gib, hw.mem_util, hw.reserved_gib),
        baseline=base,
        layouts=layouts,
        skipped=skipped,
        pp_wire_ratio=tp_wire_bytes(1, shape.num_layers, shape.hidden_size, b, base_tp)
        / seam_bytes(1, shape.hidden_size, b),
        bubbles=[
            {"stages": s, "micro_batches": m, "bubble": gpipe_bubble(s, m)}
            for s in bubble_stages
            for m in micro_batches
        ],
    )


def check_inputs(hw: Hardware, context_len: int, num_tokens: int) -> None:
    """One sentence per figure that cannot describe real hardware or a real request."""
    positive = {
        "--gpus": hw.num_gpus,
        "--gpus-per-node": hw.gpus_per_node,
        "--gpu-mem": hw.gpu_mem_gib,
        "--nvlink-gbps": hw.nvlink_gbps,
        "--link-gbps": hw.link_gbps,
        "--context": context_len,
        "--tokens": num_tokens,
    }
    for flag, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    if not 0 < hw.mem_util <= 1:
        raise ConfigError(f"--mem-util must be in (0, 1], got {hw.mem_util}")
    if hw.reserved_gib < 0:
        raise ConfigError(f"--reserved-gib must not be negative, got {hw.reserved_gib}")


# --- model lookup --------------------------------------------------------------------------------


def load_model(spec: str, dtype: str | None = None) -> PlanModel:
    """A preset by name (any case), a Hugging Face model folder, a config.json path, or a GGUF
    file (sized as a GPU holds it: dequantized to `dtype`, bf16 by default)."""
    presets = {name.lower(): model for name, model in PRESETS.items()}
    if spec.lower() in presets:
        model = presets[spec.lower()]
        return model if dtype is None else replace(model, dtype=dtype)
    path = Path(spec)
    if is_gguf(path) and path.is_file():
        cfg = ModelConfig.from_path(path)
        model_dtype = dtype or "bfloat16"  # what a GPU stage dequantizes the file to
        return PlanModel(path.stem, cfg, model_dtype, matrix_formats(path))
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        what = "a folder without config.json" if path.is_dir() else "not an existing file or folder"
        raise ConfigError(
            f"--model {spec} is not a preset and is {what}; pass one of {', '.join(PRESETS)}, "
            "a Hugging Face model folder, or its config.json"
        )
    cfg = ModelConfig.from_dict(read_config_json(config_path), source=str(config_path))
    name = (path if path.is_dir() else config_path.parent).resolve().name or str(config_path)
    model_dtype = dtype or cfg.torch_dtype
    if model_dtype not in DTYPE_CHOICES:
        raise ConfigError(
            f"{config_path} stores {model_dtype} weights, which plan cannot size; pass --dtype"
        )
    return PlanModel(name, cfg, model_dtype)


# --- text ----------------------------------------------------------------------------------------


def report_json(report: Report) -> dict[str, object]:
    """The report as --json prints it; the model as its name, shape fields and dtype."""
    model = report.model
    shape = {field: getattr(model.config, field) for field in SHAPE_FIELDS}
    described = {"dtype": model.dtype}
    if model.gguf_formats:
        described["gguf_formats"], described["gguf_matrix_bytes"] = model.gguf_formats
    out = asdict(report)
    out["model"] = {"name": model.name, **shape, **described}
    return out


def format_bytes(num_bytes: float) -> str:
    """Binary units, four significant digits: 4.375 MiB, 32 KiB, 16.43 GiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if num_bytes >= size:
            return f"{num_bytes / size:.4g} {unit}"
    return f"{num_bytes:.4g} B"


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """First column left-aligned, the rest right-aligned, two spaces between."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        parts = [cells[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(row) for row in rows)])


def _partition_text(plan: LayoutPlan) -> str:
    if len(set(plan.partition)) == 1:
        count = plan.partition[0]
        return str(count) if plan.pp_size == 1 else f"{count} x {plan.pp_size}"
    text = ",".join(str(n) for n in plan.partition)
    return f"{text} (-{100 * plan.partition_loss:.1f}%)"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _rows(report: Report) -> list[LayoutPlan]:
    # The one-node baseline first, unless it is itself one of the layouts.
    listed = report.baseline in report.layouts
    return report.layouts if listed else [report.baseline, *report.layouts]


def render(report: Report) -> str:
    m, hw = report.model, report.hardware
    shape = m.config
    nodes = math.ceil(hw.num_gpus / hw.gpus_per_node)
    base = report.baseline
    plans = _rows(report)
    lines = [
        f"model     {m.name}: L={shape.num_layers}, d={shape.hidden_size}, "
        f"{shape.num_heads} heads, {shape.num_kv_heads} KV heads, head_dim {shape.head_dim}, "
        f"{m.dtype}",
        *(
            [
                f"          GGUF: {m.gguf_formats[0]} ({format_bytes(m.gguf_formats[1])} of "
                f"matrices in the file), dequantized to {m.dtype} at load on a GPU, as sized here"
            ]
            if m.gguf_formats
            else []
        ),
        f"          {format_bytes(report.weight_bytes)} of weights; KV "
        f"{format_bytes(report.kv_bytes_per_token_per_layer)}/token/layer, "
        f"{format_bytes(report.kv_bytes_per_token)}/token for all {shape.num_layers} layers "
        f"({report.kv_dtype})",
        f"hardware  {hw.num_gpus} GPUs, {hw.gpus_per_node} per node ({nodes} node"
        f"{'s' if nodes > 1 else ''}); {hw.gpu_mem_gib:g} GiB x {hw.mem_util:g} - "
        f"{hw.reserved_gib:g} GiB reserved = {report.usable_bytes_per_gpu / GiB:.2f} GiB per GPU",
        f"links     NVLink {hw.nvlink_gbps / 8:g} GB/s, inter-node {hw.link_gbps / 8:g} GB/s "
        f"({hw.link_gbps:g} Gb/s), per direction per GPU",
        "",
        f"KV capacity per GPU, {report.context_len}-token sequences "
        f"(vs {base.label.split()[0]} on one node, what most people run)",
    ]
    headers = ["layout", "GPUs", "layers", "weights", "KV heads", "KV/token"]
    headers += ["KV tokens", "seqs", "per batch", f"vs {base.label.split()[0]}"]
    rows = [
        [
            p.label,
            str(p.num_gpus),
            _partition_text(p),
            format_bytes(p.weight_bytes_per_gpu),
            str(p.kv_heads_per_gpu),
            format_bytes(p.kv_bytes_per_token_per_gpu),
            f"{p.kv_tokens:,}" if p.kv_tokens else "no room",
            f"{p.max_sequences:,}",
            f"{p.sequences_per_batch:,}",
            "base" if p is base else _percent(p.gain_vs_baseline),
        ]
        for p in plans
    ]
    lines += [format_table(headers, rows)]
    lines += [
        "  per batch: with S batches in flight, each admits 1/S of the sequences",
        *(f"  skipped {s['layout']}: {s['reason']}" for s in report.skipped),
        "",
        "Wire bytes per token, one rank of each stage along one forward pass",
    ]
    headers = ["layout", "all-reduces", "AR bytes", "TP link", "seams", "seam bytes", "seam link"]
    rows = [
        [
            p.label,
            str(p.allreduces),
            format_bytes(p.allreduce_bytes_per_token) if p.allreduces else "0",
            p.tp_link,
            str(p.seams),
            format_bytes(p.seam_bytes_per_token) if p.seams else "0",
            p.seam_link,
        ]
        for p in plans
    ]
    lines += [format_table(headers, rows)]
    lines.append("  seam bytes: 2 x d x bytes (hidden + residual), split over the TP ranks")
    if base.tp_size > 1:
        seam = seam_bytes(1, shape.hidden_size, dtype_bytes(m.dtype))
        lines.append(
            f"  per token, a {base.label.split()[0]} rank all-reduces "
            f"{format_bytes(base.allreduce_bytes_per_token)}; a PP seam sends "
            f"{format_bytes(seam)}: {report.pp_wire_ratio:.0f}x fewer bytes"
        )
    lines += [
        "",
        f"Wire time at T={report.num_tokens} tokens per step (bandwidth only, no collective "
        "latency)",
    ]
    headers = ["layout", "MB/all-reduce", "MB/rank/step"]
    headers += ["ms if NVLink", "ms if inter-node", "ms as placed"]
    rows = [
        [
            p.label,
            f"{p.allreduce_bytes_at_t / 1e6:.3g}",
            f"{p.step_bytes_per_rank / 1e6:.3g}",
            f"{p.comm_ms_nvlink:.3g}",
            f"{p.comm_ms_inter_node:.3g}",
            f"{p.comm_ms_placed:.3g}",
        ]
        for p in plans
    ]
    lines += [format_table(headers, rows)]
    stages = sorted({int(row["stages"]) for row in report.bubbles})
    micro = sorted({int(row["micro_batches"]) for row in report.bubbles})
    bubble = {(int(r["stages"]), int(r["micro_batches"])): r["bubble"] for r in report.bubbles}
    lines += [
        "",
        "GPipe bubble (S-1)/(S+M-1), S stages x M micro-batches",
        format_table(
            ["S \\ M", *(str(n) for n in micro)],
            [[str(s), *(f"{100 * bubble[s, n]:.1f}%" for n in micro)] for s in stages],
        ),
        "  decode keeps S batches in flight instead: stages idle only when fewer than S exist",
    ]
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} has a value below 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppring plan",
        description="KV capacity, wire bytes and bubbles of every TP / PP / TPxPP layout of a "
        "model on a set of GPUs. With no arguments: Llama-3-70B bf16 on two 8xH100 nodes.",
    )
    hw = SEED_HARDWARE
    add = parser.add_argument
    add(
        "--model",
        default="Llama-3-70B",
        help=f"a preset ({', '.join(PRESETS)}), a Hugging Face model folder, or its config.json "
        "(default: %(default)s)",
    )
    add("--dtype", choices=DTYPE_CHOICES, metavar="DTYPE", help="weights (default: model's)")
    add(
        "--kv-dtype",
        "--kv-cache-dtype",
        choices=(*DTYPE_CHOICES, "int8"),
        metavar="DTYPE",
        help="KV (default: --dtype); int8: 8-bit codes with their scales, as a CPU stage's "
        "--kv-cache-dtype int8 stores them",
    )
    add("--gpus", type=int, default=hw.num_gpus, help="GPUs every layout uses (%(default)s)")
    add(
        "--gpus-per-node",
        type=int,
        default=hw.gpus_per_node,
        help="one NVLink domain (%(default)s)",
    )
    add("--gpu-mem", type=float, default=hw.gpu_mem_gib, help="GiB one GPU reports (%(default)s)")
    add("--mem-util", type=float, default=hw.mem_util, help="share of --gpu-mem (%(default)s)")
    add(
        "--reserved-gib",
        type=float,
        default=hw.reserved_gib,
        help="GiB of that share kept for activations and graphs (%(default)s)",
    )
    add(
        "--nvlink-gbps",
        type=float,
        default=hw.nvlink_gbps,
        help="NVLink Gb/s per direction per GPU (%(default)s = 450 GB/s)",
    )
    add(
        "--link-gbps",
        type=float,
        default=hw.link_gbps,
        help="inter-node Gb/s per direction per GPU (%(default)s: InfiniBand NDR)",
    )
    add("--context", type=int, default=8192, help="tokens per sequence (%(default)s)")
    add("--tokens", type=int, default=64, help="T, tokens per forward step (%(default)s)")
    add("--tp-size", type=int, help="plan only this TP (PP = --gpus / TP)")
    add("--pp-size", type=int, help="plan only this PP (TP = --gpus / PP)")
    add("--bubble-stages", type=_int_list, default=DEFAULT_BUBBLE_STAGES, help="S (2,4,8)")
    add("--micro-batches", type=_int_list, default=DEFAULT_MICRO_BATCHES, help="M (1,4,16,64)")
    add("--json", action="store_true", help="print the same figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    hw = Hardware(
        num_gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_mem_gib=args.gpu_mem,
        mem_util=args.mem_util,
        reserved_gib=args.reserved_gib,
        nvlink_gbps=args.nvlink_gbps,
        link_gbps=args.link_gbps,
    )
    try:
        model = load_model(args.model, args.dtype)
        report = build_report(
            model,
            hw,
            context_len=args.context,
            num_tokens=args.tokens,
            kv_dtype=args.kv_dtype,
            tp_size=args.tp_size,
            pp_size=args.pp_size,
            bubble_stages=args.bubble_stages,
            micro_batches=args.micro_batches,
        )
    except ConfigError as exc:
        print(f"ppring plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report_json(report), indent=2))
    else:
        print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
