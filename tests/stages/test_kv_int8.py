"""The 8-bit KV cache (--kv-cache-dtype int8): the CPU kernels store and read it as
stages/kv_quant.py does in plain torch (the reference), its bytes, and the flag's refusals."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from stages import kv_quant
from stages.backend.cpu import fused_layer, native
from stages.batch import BLOCK_SIZE
from stages.config import ModelConfig
from stages.errors import ConfigError
from stages.kv_cache import (
    KVCache,
    bytes_per_block,
    gather_kv,
    num_blocks_for_budget,
    resolve_kv_cache_dtype,
    store_kv,
)
from tests.stages import test_native_heads
from tests.stages.conftest import (
    Chain,
    drive_teacher_forced,
    greedy_generate,
    without_native_kernels,
)
from tests.stages.test_native_heads import PROMPT_LENS, SEQS

grid_dir = test_native_heads.grid_dir  # its fixture: a tiny Llama on GGUF grids

H, H_KV, D = 6, 2, 64


def kernels() -> native.NativeKernels:
    found = native.kernels()
    assert found is not None, native.unavailable_reason()
    return found


def rope_tables(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(n, D // 2, generator=torch.Generator().manual_seed(seed))
    cos = torch.cat([angles.cos(), angles.cos()], 1)
    return cos, torch.cat([-angles.sin(), angles.sin()], 1)  # [n, D] each, the sine signed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D] rotated as the fp32 kernels do (rotate-half)."""
    half = torch.cat([x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos[:, None] + half * sin[:, None]


def slots_of(table: list[int], positions: range) -> torch.Tensor:
    return torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])


def qkv_rows(n: int, seed: int) -> torch.Tensor:
    """[n, (H + 2 H_KV) D] with channels of very different sizes (outliers), as real keys."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-1, 1, (H + 2 * H_KV) * D)[
        torch.randperm((H + 2 * H_KV) * D, generator=g)
    ]
    return torch.randn(n, (H + 2 * H_KV) * D, generator=g) * spread


# Two sequences written in turns: prompt chunks crossing pages, then decodes one at a time, so
# pages are new, filled at once, and grown token by token (scales that rise round codes again).
STEPS = [(0, 21), (1, 16), (0, 1), (1, 1), (0, 11), (1, 1), (0, 1), (0, 1), (1, 9), (0, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_store_what_the_torch_reference_stores_bit_for_bit_and_attend_over_it(
    dtype: torch.dtype,
) -> None:
    """fp32: products in fp32 (the decoded page); bf16: the codes as int16 pairs (vpdpwssd),
    queries and probabilities rounded to 15 bits of their largest (csrc/attention.c)."""
    k8 = kernels()
    if dtype == torch.bfloat16 and not k8.bf16_dot:
        pytest.skip("a bf16 stage's kernels need AVX512_BF16")
    native_kv = KVCache(1, 12, H_KV, D, dtype, kv_cache_dtype="int8")
    torch_kv = KVCache(1, 12, H_KV, D, dtype, kv_cache_dtype="int8")
    tables = [[7, 2, 9, 4], [3, 11, 0, 5]]
    lengths = [0, 0]
    for step, (seq, n) in enumerate(STEPS):
        positions = range(lengths[seq], lengths[seq] + n)
        lengths[seq] += n
        slots = slots_of(tables[seq], positions)
        qkv = qkv_rows(n, step).to(dtype)
        cos, sin = rope_tables(n, step)
        rotated = qkv.clone()  # the 8-bit store leaves its keys rotated in place
        q = k8.rope_store(rotated, cos, sin, slots, native_kv.layer(0), H)
        k = rotated[:, H * D : (H + H_KV) * D].view(n, H_KV, D)
        exact = rotate(qkv[:, H * D : (H + H_KV) * D].float().view(n, H_KV, D), cos, sin)
        assert (k.float() - exact).abs().max() < (1e-4 if dtype == torch.float32 else 0.3)
        store_kv(torch_kv.layer(0), slots, k, qkv[:, (H + H_KV) * D :].view(n, H_KV, D))
        for mine, reference in zip(
            kv_quant.parts(native_kv.layer(0)), kv_quant.parts(torch_kv.layer(0))
        ):
            assert torch.equal(mine, reference), f"step {step}"
        # attention over the whole context, against SDPA over the dequantized keys and values
        context = lengths[seq]
        table = torch.tensor([tables[seq]], dtype=torch.int32)
        meta = [torch.tensor([x], dtype=torch.int32) for x in (0, n, context)]
        k_all, v_all = gather_kv(
            native_kv.layer(0), slots_of(tables[seq], range(context)), torch.float32
        )
        mask = torch.ones(n, context, dtype=torch.bool).tril(context - n)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None], k_all.transpose(0, 1)[None],
            v_all.transpose(0, 1)[None], attn_mask=mask, scale=D**-0.5, enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip
        # fp32: rounding apart (values up to ~10); bf16: about the output's own rounding
        tolerance = 1e-4 if dtype == torch.float32 else 0.01 * expected.abs().max().item()
        got = k8.paged_attention(q, native_kv.layer(0), *meta, table, D**-0.5)
        assert (got.float() - expected).abs().max().item() < tolerance, f"step {step}"
        windowed = k8.paged_attention(q, native_kv.layer(0), *meta, table, D**-0.5, window=4096)
        assert (windowed.float() - expected).abs().max().item() < tolerance, f"step {step}"


def test_a_page_rounds_once_when_written_whole_and_again_where_a_later_token_raises_its_scale():
    kv = KVCache(1, 2, 1, 16, torch.float32, kv_cache_dtype="int8")
    keys = torch.full((3, 1, 16), 1.0)
    keys[2, 0, 5] = 4.0  # the third token needs four times channel 5's scale
    values = torch.randn(3, 1, 16)
    store_kv(kv.layer(0), torch.tensor([16, 17]), keys[:2], values[:2])
    k_codes, v_codes, k_scale, v_scale = kv_quant.parts(kv.layer(0))
    first = k_scale[1, 0].clone()
    k_codes = k_codes.reshape(2, 16, 1, 16)  # [page, slot, head, channel] (a copy)
    # 1.0 at the smallest of the scales 2^(e / 8) that holds it: code round(1 / 2^(-55 / 8))
    assert torch.equal(k_codes[1, :2, 0], torch.full((2, 16), 117, dtype=torch.int8))
    store_kv(kv.layer(0), torch.tensor([18]), keys[2:], values[2:])
    k_codes = kv_quant.parts(kv.layer(0))[0].reshape(2, 16, 1, 16)
    assert torch.equal(k_scale[1, 0, :5], first[:5]) and k_scale[1, 0, 5] == first[5] + 16
    assert k_codes[1, 0, 0, 5] == 29 and k_codes[1, 2, 0, 5] == 117  # 117 at 4x: 29.25
    assert k_codes[1, 0, 0, 4] == 117  # other channels untouched
    dequantized = kv_quant.dequantize(kv.layer(0))
    assert (dequantized[0, 16:19] - keys).abs().max() <= 4.0 / 127 / 2 * 1.01
    scale = values.abs().amax(-1, keepdim=True) / 127  # per token and head
    assert ((dequantized[1, 16:19] - values).abs() <= scale * 0.51).all()
    # a page written again from its first slot starts over (the old scales were nobody's)
    store_kv(kv.layer(0), torch.tensor([16]), keys[:1] / 64, values[:1])
    assert k_scale[1, 0, 5] < first[5]


def test_the_scale_exponent_is_the_smallest_that_holds_the_largest_value() -> None:
    amax = torch.tensor(
        [0.0, 1e-30, 1e-3, 1.0, 127.0, 127.0001, 3e6, 1e30, float("inf"), float("nan")]
    )
    e = kv_quant.exponent(amax)
    scales = kv_quant.SCALES[e - kv_quant.E_MIN]
    finite = amax <= 127 * kv_quant.SCALES[-1]
    assert (127 * scales[finite] >= amax[finite]).all()
    inner = finite & (e > kv_quant.E_MIN)
    assert (127 * kv_quant.SCALES[e[inner] - 1 - kv_quant.E_MIN] < amax[inner]).all()
    assert e[0] == kv_quant.E_MIN and e[4] == 0 and e[5] == 1 and (e[-3:] == kv_quant.E_MAX).all()
    assert kv_quant.SCALES[8 - kv_quant.E_MIN] == 2.0  # eight steps an octave, exactly


def test_an_8_bit_cache_holds_1_9x_the_blocks_of_bf16_in_the_same_memory(
    tiny_dirs: dict[str, Path],
) -> None:
    # SmolLM2's KV shape: 3 KV heads of 64
    default_shape = replace(ModelConfig.from_folder(tiny_dirs["gqa"]), num_kv_heads=3, head_dim=64)
    budget = 1 << 30
    bf16 = num_blocks_for_budget(default_shape, 30, budget, "bfloat16")
    eight = num_blocks_for_budget(default_shape, 30, budget, "bfloat16", "int8")
    assert bytes_per_block(default_shape, 1, "bfloat16", "int8") == 16 * 3 * (2 * 64 + 2) + 3 * 64
    assert eight / bf16 >= 1.9
    cache = KVCache(30, eight, 3, 64, torch.bfloat16, kv_cache_dtype="int8")
    assert cache.nbytes == eight * bytes_per_block(default_shape, 30, "bfloat16", "int8") <= budget


def test_the_flag_refuses_in_one_sentence_what_a_stage_cannot_store() -> None:
    assert resolve_kv_cache_dtype("auto", torch.float32) == "auto"
    assert resolve_kv_cache_dtype("bf16", torch.bfloat16) == "auto"
    assert resolve_kv_cache_dtype("int8", torch.float32) == "int8"
    for requested, dtype, device, words in [
        ("bf16", torch.float32, "cpu", "needs a bf16 stage"),
        ("fp8_e4m3", torch.bfloat16, "cpu", "not built yet"),
        ("int8", torch.bfloat16, "cuda", "CPU stages only"),
        ("int4", torch.bfloat16, "cpu", "is not one of"),
    ]:
        with pytest.raises(ConfigError, match=words):
            resolve_kv_cache_dtype(requested, dtype, device)


def test_the_kernels_refuse_an_int8_tensor_that_is_not_an_8_bit_cache_layer() -> None:
    k8 = kernels()
    bare = torch.zeros(2, 32, H_KV, D, dtype=torch.int8)  # codes with no scales after them
    qkv, (cos, sin) = qkv_rows(1, 0), rope_tables(1, 0)
    with pytest.raises(ValueError, match="no scales follow"):
        k8.rope_store(qkv, cos, sin, torch.tensor([3]), bare, H)
    with pytest.raises(ValueError, match="no scales follow"):
        one = torch.tensor([1], dtype=torch.int32)
        k8.paged_attention(torch.zeros(1, H, D), bare, one - 1, one, one, one[None] - 1, 1.0)
    kv = KVCache(1, 2, H_KV, D, torch.float32, kv_cache_dtype="int8")
    with pytest.raises(IndexError, match="outside the KV pool"):
        k8.rope_store(qkv, cos, sin, torch.tensor([32]), kv.layer(0), H)  # one slot past it


SPLITS = {"PP1": [4], "PP2": [2, 2], "PP3": [1, 2, 1]}


def int8_logits(folder: Path, partition: list[int], dtype: str) -> list[torch.Tensor]:
    """A chain with 8-bit caches, teacher-forced: prompts in chunks of 8 (pages filled in two
    writes), then decodes, mixed in batches."""
    chain = Chain(folder, partition, dtype=dtype, kv_cache_dtype="int8")
    rng = random.Random(7)
    prompt_lens = [23, 40, 9, 17]
    seqs = [[rng.randrange(3, 256) for _ in range(n + 12)] for n in prompt_lens]
    return drive_teacher_forced(chain, seqs, prompt_lens, chunk_size=8, stagger=1)


@pytest.mark.parametrize("split", list(SPLITS))
def test_8_bit_kv_stages_match_the_torch_reference_within_fp32_rounding(
    tiny_dirs: dict[str, Path], split: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_dirs["gqa"]
    got = int8_logits(folder, SPLITS[split], "float32")
    exact = Chain(folder, SPLITS[split])
    with monkeypatch.context() as m:
        without_native_kernels(m)
        reference = int8_logits(folder, SPLITS[split], "float32")
    for mine, theirs in zip(got, reference):
        assert (mine - theirs).abs().max().item() < 1e-4
    assert exact.stages[0].kv is not None and exact.stages[0].kv.kv_bytes == 4
    del exact


def test_8_bit_kv_costs_the_tiny_model_little_and_is_not_the_full_cache(
    tiny_dirs: dict[str, Path],
) -> None:
    folder = tiny_dirs["gqa"]
    rng = random.Random(7)
    prompt_lens = [23, 40, 9, 17]
    seqs = [[rng.randrange(3, 256) for _ in range(n + 12)] for n in prompt_lens]
    full = drive_teacher_forced(Chain(folder, [2, 2]), seqs, prompt_lens, chunk_size=8, stagger=1)
    eight = int8_logits(folder, [2, 2], "float32")
    worst = max((a - b).abs().max().item() for a, b in zip(full, eight))
    assert 0 < worst < 0.02  # quantized (not the same numbers), and close


def test_a_bf16_stage_with_an_8_bit_cache_stays_close_to_the_torch_reference(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_dirs["gqa"]
    got = int8_logits(folder, [2, 2], "bfloat16")
    with monkeypatch.context() as m:
        without_native_kernels(m)
        reference = int8_logits(folder, [2, 2], "bfloat16")
    for mine, theirs in zip(got, reference):
        assert (mine - theirs).abs().max().item() < 0.02


def test_the_one_team_stack_stores_and_reads_an_8_bit_cache_as_the_layer_calls_do(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 stage on GGUF grids runs its layers in one team (csrc/layers.c): the same store
    and attention as the one-call-per-op path, bit for bit."""
    folder = request.getfixturevalue("grid_dir")
    built = kernels()
    if not built.bf16_dot:
        pytest.skip("a bf16 stage multiplies with the kernels only on AVX512_BF16")
    logits = {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            m.setenv(fused_layer.DISABLE_ENV, "1" if fused else "0")
            chain = Chain(folder, [4], dtype="bfloat16", kv_cache_dtype="int8")
            assert (chain.stages[0].model.fused is not None) == fused
            logits[fused] = drive_teacher_forced(chain, SEQS, PROMPT_LENS, chunk_size=5, stagger=2)
    for got, expected in zip(logits[True], logits[False], strict=True):
        assert torch.equal(got, expected) and torch.isfinite(got).all()


def test_greedy_tokens_through_kept_decode_steps_match_the_torch_reference(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling runs decode-only batches on the buffers kept from step to step
    (backend/cpu/kept_decode.py), which hand the kernels the cache's kind themselves."""
    prompts = [[5, 9, 31, 7, 100], [3] * 19, list(range(40, 73))]
    chain = Chain(tiny_dirs["gqa"], [2, 2], kv_cache_dtype="int8")
    assert all(stage.cpu_decode is not None for stage in chain.stages)
    got = greedy_generate(chain, prompts, 20)
    with monkeypatch.context() as m:
        without_native_kernels(m)
        reference = greedy_generate(
            Chain(tiny_dirs["gqa"], [2, 2], kv_cache_dtype="int8"), prompts, 20
        )
    assert got == reference


def test_pages_convert_to_the_bf16_pairs_the_tiles_read_as_the_dequantized_values_rounded():
    k8 = kernels()
    if not k8.bf16_dot:
        pytest.skip("bf16 pairs need AVX512_BF16")
    kv = KVCache(1, 6, H_KV, D, torch.float32, kv_cache_dtype="int8")
    table = [4, 1, 5]
    n = 40
    qkv, (cos, sin) = qkv_rows(n, 3), rope_tables(n, 3)
    k8.rope_store(qkv, cos, sin, slots_of(table, range(n)), kv.layer(0), H)
    pages = torch.tensor(table, dtype=torch.int32)
    pairs = k8.kv8_pairs(kv.layer(0), pages)
    assert pairs is not None
    slots = slots_of(table, range(len(table) * BLOCK_SIZE))
    expected = gather_kv(kv.layer(0), slots, torch.float32).to(torch.bfloat16)
    assert torch.equal(k8.from_cache_layout(pairs), expected)
    with pytest.raises(IndexError, match="outside the KV pool"):
        k8.kv8_pairs(kv.layer(0), torch.tensor([6], dtype=torch.int32))


def test_a_long_prefill_chunk_over_an_8_bit_cache_attends_on_the_tiles_as_the_reference():
    from stages.backend.cpu.prefill_attention import PrefillAttention
    from stages.inputs import PagedAttn

    k8 = kernels()
    if not k8.amx_bf16:
        pytest.skip("no AMX-BF16 here")
    kv = KVCache(1, 8, H_KV, D, torch.bfloat16, kv_cache_dtype="int8")
    table = [6, 0, 3, 7, 2]
    context, rows = 70, 45  # a chunk of 45 rows after 25 earlier keys
    qkv = qkv_rows(context, 5).to(torch.bfloat16)
    cos, sin = rope_tables(context, 5)
    q = k8.rope_store(qkv, cos, sin, slots_of(table, range(context)), kv.layer(0), H)[-rows:]
    meta = [torch.tensor([x], dtype=torch.int32) for x in (0, rows, context)]
    paged = PagedAttn(*meta, torch.tensor([table], dtype=torch.int32), max_q_len=rows)
    got = PrefillAttention(k8)(q.contiguous(), kv.layer(0), paged, D**-0.5)
    # the tiles multiply the dequantized keys and values rounded to bf16 (csrc/kv8.c)
    k_all, v_all = gather_kv(kv.layer(0), slots_of(table, range(context)), torch.bfloat16).float()
    mask = torch.ones(rows, context, dtype=torch.bool).tril(context - rows)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
        attn_mask=mask, scale=D**-0.5, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    assert (got.float() - expected).abs().max().item() < 0.1  # P rounded to bf16; values ~10


def test_the_start_up_summary_says_what_the_kv_cache_holds_and_refuses_what_it_cannot(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from launch import local

    folder = tiny_dirs["gqa"]
    config = ModelConfig.from_folder(folder)
    argv = ["--model", str(folder), "--dtype", "float32"]
    lines = local.compute_lines(local.parse_args([*argv, "--kv-cache-dtype", "int8"]), config)
    (line,) = [x for x in lines if x.startswith("KV cache:")]
    assert "int8" in line and "against float32's" in line
    (line,) = [x for x in local.compute_lines(local.parse_args(argv), config) if "KV" in x]
    assert line.startswith("KV cache: float32,")
    assert local.main([*argv, "--kv-cache-dtype", "fp8_e4m3", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --kv-cache-dtype fp8_e4m3 is not built yet")


def test_a_head_dim_off_the_vector_width_stores_as_the_reference_too() -> None:
    """head_dim 24: the scalar store and the decoded page (csrc/ops.c, attention.c)."""
    k8 = kernels()
    d, heads, kv_heads = 24, 2, 1
    native_kv = KVCache(1, 4, kv_heads, d, torch.float32, kv_cache_dtype="int8")
    torch_kv = KVCache(1, 4, kv_heads, d, torch.float32, kv_cache_dtype="int8")
    table, done = [2, 0, 3], 0
    for step, n in enumerate([19, 1, 1, 9]):
        g = torch.Generator().manual_seed(step)
        qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g) * 3
        angles = torch.randn(n, d // 2, generator=g)
        cos = torch.cat([angles.cos()] * 2, 1)
        sin = torch.cat([-angles.sin(), angles.sin()], 1)
        slots = slots_of(table, range(done, done + n))
        done += n
        rotated = qkv.clone()
        q = k8.rope_store(rotated, cos, sin, slots, native_kv.layer(0), heads)
        k = rotated[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
        store_kv(torch_kv.layer(0), slots, k, qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d))
        for mine, reference in zip(
            kv_quant.parts(native_kv.layer(0)), kv_quant.parts(torch_kv.layer(0))
        ):
            assert torch.equal(mine, reference), f"step {step}"
        meta = [torch.tensor([x], dtype=torch.int32) for x in (0, n, done)]
        got = k8.paged_attention(
            q, native_kv.layer(0), *meta, torch.tensor([table], dtype=torch.int32), d**-0.5
        )
        k_all, v_all = gather_kv(native_kv.layer(0), slots_of(table, range(done)), torch.float32)
        mask = torch.ones(n, done, dtype=torch.bool).tril(done - n)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
            attn_mask=mask, scale=d**-0.5, enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip
        assert (got - expected).abs().max().item() < 1e-4
