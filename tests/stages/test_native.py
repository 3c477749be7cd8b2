"""ppring's CPU kernels (stages/backend/cpu/csrc/) against torch, one kernel at a time: every shape
path (one row, pairs of rows, odd tails; head_dim a multiple of 8 or not), fp32 and bf16."""

from __future__ import annotations

import math
import platform
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stages.backend.cpu import build, native
from stages.backend.cpu.linear import CpuBf16Linear, pack_int8_quads
from stages.backend.cpu.ops import NativeOps
from stages.backend.torch.ops import TorchOps
from stages.batch import BLOCK_SIZE

# AVX2 + FMA without AVX-512: the paths a CPU of that level runs, also checked on a CPU that
# has AVX-512 (where -march=native takes the AVX-512 paths instead).
AVX2_CFLAGS = (*build.PORTABLE_CFLAGS, "-mavx2", "-mfma", "-mf16c")
# AVX-512 without BF16 and VNNI (a Skylake-SP's level): attention by KV group over fp32
# queries, bf16 caches held as rows, not pairs; also checked where the CPU has more.
AVX512_CFLAGS = (*AVX2_CFLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")


def unpack_int8_quads(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int8_quads: [N, K] rows (only the tests need it)."""
    n, k = packed.shape
    return packed.view(n // 4, k // 32, 4, 32).permute(0, 2, 1, 3).contiguous().view(n, k)


def build_kernels(flags: tuple[str, ...], folder: Path) -> native.NativeKernels:
    compiler = build.find_compiler()
    assert compiler is not None
    return native.NativeKernels(build.compile_kernels(folder / "cpu_kernels.so", compiler, flags))


@pytest.fixture(scope="module", params=["native", "portable", "avx2", "avx512"])
def kernels(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> native.NativeKernels:
    """The kernels as a stage builds them (-march=native: AVX2 or AVX-512 where the CPU has
    them), built for the compiler's baseline (the portable C paths), for AVX2 alone and for
    AVX-512 without BF16 where the CPU runs them, so each level's paths are checked on every
    machine that can run them."""
    if request.param == "native":
        built = native.kernels()
        assert built is not None, native.unavailable_reason()  # CI has gcc: they must build
        return built
    if request.param == "avx2":
        if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has("avx2", "fma"):
            pytest.skip("this CPU does not run AVX2 + FMA")
        return build_kernels(AVX2_CFLAGS, tmp_path_factory.mktemp("avx2"))
    if request.param == "avx512":
        if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has(
            "avx512f", "avx512bw", "avx512vl", "avx512dq"
        ):
            pytest.skip("this CPU does not run AVX-512")
        return build_kernels(AVX512_CFLAGS, tmp_path_factory.mktemp("avx512"))
    return build_kernels(build.PORTABLE_CFLAGS, tmp_path_factory.mktemp("portable"))


def _cpu_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return False
    return set(flags) <= set(line.split(":", 1)[-1].split())


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (7, 9), (5, 33), (9, 100), (33, 17)])
def test_linear_f32_matches_f_linear_for_every_row_count(
    kernels: native.NativeKernels, n: int, k: int
) -> None:
    torch.manual_seed(n * k)
    weight = torch.randn(n, k)
    panels = kernels.pack_f32(weight)  # N not a multiple of 16: the last panel is padded
    assert panels.shape == (-(-n // 16), k, 16)
    for m in [*range(1, 14), 16, 17, 31, 32, 33, 64, 130]:  # every block split of the rows
        x = torch.randn(m, k)
        expected = F.linear(x, weight)
        got = kernels.linear_f32(x, panels, n)
        assert got.shape == (m, n)
        assert (got - expected).abs().max().item() < 1e-3 * math.sqrt(k), f"{m} rows"


@pytest.mark.parametrize(("n", "k"), [(960, 576), (7, 9), (9, 100), (5, 2048)])
def test_linear_int8_matches_its_dequantized_weights(
    kernels: native.NativeKernels, n: int, k: int
) -> None:
    torch.manual_seed(n + k)
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) / 100
    for m in [1, 2, 3, 4, 5, 8, 33]:  # one row; blocks of 4 (AVX-512) or 2 (AVX2) and tails
        x = torch.randn(m, k)
        expected = F.linear(x, qweight.float() * scale[:, None])
        got = kernels.linear_int8(x, qweight, scale)
        # activations are rounded to int16 per row: relative error ~ 2^-15 of the row's max
        assert got.dtype == torch.float32
        assert (got - expected).abs().max().item() < 1e-3 * expected.abs().max().item()
        # a bf16 stage's rows: read and written as bf16 (one rounding of the fp32 result)
        xb = x.to(torch.bfloat16)
        expected = F.linear(xb.float(), qweight.float() * scale[:, None])
        got = kernels.linear_int8(xb, qweight, scale)
        assert got.dtype == torch.bfloat16
        error = (got.float() - expected).abs()
        assert (error <= 2**-8 * expected.abs() + 1e-3 * expected.abs().max()).all()


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (8, 32), (12, 64)])
def test_int8_weights_in_quads_give_the_rows_results_bit_for_bit(
    kernels: native.NativeKernels, n: int, k: int
) -> None:
    # Where the kernels hold int8 weights in quads (AVX-512), the same products in the same
    # order as over rows: every row count, both dtypes, equal to the last bit.
    torch.manual_seed(n * k)
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) / 100
    packed = pack_int8_quads(qweight)
    assert torch.equal(unpack_int8_quads(packed), qweight)
    # quad 0's first 32 columns: row 0's 32 bytes, then rows 1, 2 and 3's
    assert torch.equal(packed.reshape(-1)[:128], qweight[:4, :32].reshape(-1))
    if not kernels.int8_quads:
        with pytest.raises(RuntimeError, match="quads"):
            kernels.linear_int8(torch.randn(1, k), packed, scale, quads=True)
        return
    for m in [1, 2, 3, 4, 5, 8, 33]:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            rows = kernels.linear_int8(x, qweight, scale)
            assert torch.equal(kernels.linear_int8(x, packed, scale, quads=True), rows)
    with pytest.raises(RuntimeError, match="quads"):  # N % 4 != 0: refused, not misread
        kernels.linear_int8(torch.randn(1, k), packed[:-1].contiguous(), scale[:-1], quads=True)


@pytest.mark.parametrize("k", [1, 9, 16, 33, 576, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_round_to_int16_as_lrintf_does(
    kernels: native.NativeKernels, k: int, dtype: torch.dtype
) -> None:
    # The vectorized rounding (16 values an instruction, then a scalar tail) against the rule
    # it implements: scale = max |x| / 32767 (1 for a zero row), x * (1 / scale) rounded to the
    # nearest, ties to even, in fp32.
    torch.manual_seed(k)
    x = (torch.randn(11, k) * torch.logspace(-3, 3, 11)[:, None]).to(dtype)
    x[3] = 0.0  # a zero row
    x[4, 0] = 0.5 * x[4].float().abs().max()  # x * inv at or next to a tie, 16383.5
    got = kernels.quantize_rows_q16(x)
    if got is None:
        pytest.skip("this build's int8 matmul widens to fp32 (no AVX2)")
    xq, scales = got
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    expected_scales = torch.where(amax > 0, amax / 32767.0, torch.ones_like(amax))
    inv = 1.0 / expected_scales  # fp32, as the kernel's 1.0f / scale
    expected = torch.round(xf * inv[:, None]).to(torch.int16)  # torch.round: ties to even
    assert torch.equal(scales, expected_scales)
    assert torch.equal(xq, expected)
    assert xq.abs().max().item() <= 32767


def test_the_native_build_multiplies_bf16_where_the_cpu_can() -> None:
    # a bf16 stage on such a CPU runs every matmul in the packed kernel: a build that lost it
    # (a wrong guard) would fall back to oneDNN silently, slower and batch-dependent
    built = native.kernels()
    assert built is not None
    if _cpu_has("avx512_bf16", "avx512bw", "avx512vl"):
        assert built.bf16_dot


@pytest.mark.parametrize(("n", "k"), [(960, 576), (7, 9), (9, 100), (5, 33), (40, 2048)])
def test_linear_bf16_matches_f_linear(kernels: native.NativeKernels, n: int, k: int) -> None:
    # vdpbf16ps over packed panels: K odd (the last pair half padding), N not a multiple of
    # 16 or of 32 (a lone panel; masked stores), 1-25 rows (blocks of up to 12 and their tails);
    # the sums are fp32, each result rounded once, as F.linear's
    torch.manual_seed(n * k)
    weight = torch.randn(n, k).to(torch.bfloat16)
    panels = kernels.pack_bf16(weight)
    assert panels.shape == (-(-n // 16), -(-k // 2), 16, 2)
    linear = CpuBf16Linear(weight, kernels)
    assert torch.equal(linear.dense_weight(), weight)
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(linear.rows(ids), weight[ids])  # a tied embedding's lookup
    assert linear.rows(ids).is_contiguous() and linear.rows(ids[:0]).shape == (0, k)
    with pytest.raises(ValueError, match="linear_bf16 takes"):  # one column too many
        linear(torch.ones(1, k + 1, dtype=torch.bfloat16))
    if not kernels.bf16_dot:
        with pytest.raises(RuntimeError, match="AVX512_BF16"):
            kernels.linear_bf16(torch.ones(1, k, dtype=torch.bfloat16), panels, n)
        return
    rows = {}
    for m in [*range(1, 14), 16, 25]:
        x = torch.randn(m, k).to(torch.bfloat16)
        exact = F.linear(x.double(), weight.double())
        got = kernels.linear_bf16(x, panels, n)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        # one bf16 rounding of an fp32 sum: within 2^-8 relative, plus the fp32 sum's error
        error = (got.double() - exact).abs()
        assert (error <= exact.abs() * 2**-8 + 1e-5 * math.sqrt(k)).all(), f"{m} rows"
        rows[m] = (x, got)
    # a row's result does not depend on the rows around it
    x25, y25 = rows[25]
    for m in (1, 3, 8, 12):
        assert torch.equal(kernels.linear_bf16(x25[m : 2 * m], panels, n), y25[m : 2 * m])


def scattered_chunks(
    specs: list[tuple[int, int]], rng: random.Random, spare_blocks: int = 0
) -> tuple[list[tuple[int, int, list[int]]], int]:
    """(start_pos, n) specs as chunks (start_pos, n, blocks) over blocks dealt out at random,
    and the number of blocks (spare_blocks more than they use)."""
    needs = [-(-(start + n) // BLOCK_SIZE) for start, n in specs]
    num_blocks = sum(needs) + spare_blocks
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = [
        (start, n, [free.pop() for _ in range(need)])
        for (start, n), need in zip(specs, needs, strict=True)
    ]
    return chunks, num_blocks


def attend_chunks(
    kernels: native.NativeKernels,
    q: torch.Tensor,
    kv: torch.Tensor,
    chunks: list[tuple[int, int, list[int]]],
) -> torch.Tensor:
    """The kernel's attention of q [T, h, d] (the chunks' rows in order) over kv [2, slots,
    kv_heads, d] (converted to the cache layout this build holds)."""
    i32 = torch.int32
    lengths = [n for _, n, _ in chunks]
    width = max(len(b) for _, _, b in chunks)
    return kernels.paged_attention(
        q,
        kernels.to_cache_layout(kv),  # as pairs where this build holds them so
        torch.tensor([sum(lengths[:i]) for i in range(len(chunks))], dtype=i32),
        torch.tensor(lengths, dtype=i32),
        torch.tensor([s + n for s, n, _ in chunks], dtype=i32),
        torch.tensor([b + [0] * (width - len(b)) for _, _, b in chunks], dtype=i32),
        q.shape[-1] ** -0.5,
    )


def reference_attention(
    q: torch.Tensor, kv: torch.Tensor, chunks: list[tuple[int, int, list[int]]]
) -> torch.Tensor:
    """q [T, h, d]; chunks (start_pos, n, blocks) in row order; plain softmax in fp64."""
    out = torch.empty_like(q, dtype=torch.float64)
    num_heads, num_kv_heads = q.shape[1], kv.shape[2]
    row = 0
    for start, n, blocks in chunks:
        ctx = start + n
        slots = torch.tensor(
            [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx)]
        )
        k = kv[0, slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [ctx, h, d]
        v = kv[1, slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        for i in range(n):
            qi = q[row + i].double()  # [h, d]
            scores = torch.einsum("hd,chd->hc", qi, k[: start + i + 1]) / math.sqrt(q.shape[-1])
            out[row + i] = torch.einsum("hc,chd->hd", scores.softmax(-1), v[: start + i + 1])
        row += n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 16), (8, 1, 128), (6, 2, 24), (32, 8, 8)],
)
def test_paged_attention_matches_a_plain_softmax(
    kernels: native.NativeKernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    # A mixed batch: fresh prefills, prefill chunks with earlier context, and decodes of many
    # lengths (one page, several, exactly a page, a page and one), over scattered blocks.
    specs = [(0, 40), (17, 1), (100, 1), (5, 9), (0, 1), (64, 64), (15, 1), (16, 1), (3, 30)]
    chunks, num_blocks = scattered_chunks(specs, random.Random(heads * head_dim), spare_blocks=4)
    torch.manual_seed(0)
    kv = torch.randn(2, num_blocks * BLOCK_SIZE, kv_heads, head_dim).to(dtype)
    used = {b * BLOCK_SIZE + j for _, _, blocks in chunks for b in blocks for j in range(16)}
    written = {
        blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for s, n, blocks in chunks
        for p in range(s + n)
    }
    for slot in used - written:  # slots past a context: whatever they hold must not leak
        kv[:, slot] = float("nan")
    num_tokens = sum(n for _, n, _ in chunks)
    q = torch.randn(num_tokens, heads, head_dim).to(dtype)
    got = attend_chunks(kernels, q, kv, chunks)
    expected = reference_attention(q, kv, chunks)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert not got.isnan().any()
    assert (got.double() - expected).abs().max().item() < tolerance


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128)])
def test_paged_attention_over_long_contexts_matches_a_plain_softmax(
    kernels: native.NativeKernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
    threads: int,
) -> None:  # fmt: skip
    # Contexts of hundreds of keys, each against fp64: lone decodes below and from 512 keys
    # (where a lone sequence's KV groups go out a task per thread), then a batch with a
    # prefill chunk whose rows see from 200 to 320 keys.
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(heads)
        rng = random.Random(head_dim)
        for specs in ([(256, 1)], [(512, 1)], [(1099, 1)], [(700, 1)], [(200, 120), (900, 1)]):
            chunks, num_blocks = scattered_chunks(specs, rng)
            kv = torch.randn(2, num_blocks * BLOCK_SIZE, kv_heads, head_dim).to(dtype)
            q = torch.randn(sum(n for _, n in specs), heads, head_dim).to(dtype)
            got = attend_chunks(kernels, q, kv, chunks)
            expected = reference_attention(q, kv, chunks)
            # relative to the outputs, which shrink as a context grows (means of random values)
            error = ((got.double() - expected).abs().max() / expected.abs().max()).item()
            assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"{specs}: {error}"
    finally:
        torch.set_num_threads(threads_before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 16)])
def test_paged_attention_of_a_row_does_not_depend_on_its_batch(
    kernels: native.NativeKernels,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    threads: int,
) -> None:
    # The kernel splits its work by batch (one sequence: a task per KV head, or from 512 keys
    # a task per thread's share of them; many: every head of a sequence in one task) and walks
    # a context in runs of pages (where a bf16 cache is held as pairs). A row must come out bit
    # for bit the same alone, in a batch of decodes, and as a row of a prefill chunk that
    # reaches the same position. Two threads deal a lone sequence's 3 KV groups out as 2 and 1.
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_row_independence(kernels, dtype, heads, kv_heads, head_dim)
    finally:
        torch.set_num_threads(threads_before)


def check_row_independence(
    kernels: native.NativeKernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(heads + head_dim)
    lengths = [1, 15, 16, 17, 31, 33, 64, 65, 100, 200, 513, 1100]
    tables, next_block = [], 0
    for n in lengths:
        need = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + need))[::-1])  # scattered pages
        next_block += need
    kv = kernels.to_cache_layout(
        torch.randn(2, next_block * BLOCK_SIZE, kv_heads, head_dim).to(dtype)
    )
    width = max(len(t) for t in tables)
    i32 = torch.int32

    def attend(seqs: list[int], q: torch.Tensor, q_len: list[int]) -> torch.Tensor:
        starts = [sum(q_len[:i]) for i in range(len(seqs))]
        return kernels.paged_attention(
            q,
            kv,
            torch.tensor(starts, dtype=i32),
            torch.tensor(q_len, dtype=i32),
            torch.tensor([lengths[s] for s in seqs], dtype=i32),
            torch.tensor([tables[s] + [0] * (width - len(tables[s])) for s in seqs], dtype=i32),
            head_dim**-0.5,
        )

    everyone = list(range(len(lengths)))
    q = torch.randn(len(lengths), heads, head_dim).to(dtype)  # each sequence's last query
    batched = attend(everyone, q, [1] * len(lengths))
    for s in everyone:
        assert torch.equal(attend([s], q[s : s + 1], [1])[0], batched[s]), f"length {lengths[s]}"
    # the longest sequence's last 40 positions as one prefill chunk, its last row = the decode
    s, n = len(lengths) - 1, 40
    chunk_q = torch.randn(n, heads, head_dim).to(dtype)
    chunk_q[-1] = q[s]
    assert torch.equal(attend([s], chunk_q, [n])[-1], batched[s])


def rope_store_both(
    ours: NativeOps, theirs: TorchOps, dtype: torch.dtype, head_dim: int, num_slots: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One batch of 11 tokens' qkv (6 heads over 2 KV heads) through both ops' rope_store, each
    into a fresh cache of num_slots: (q, kv) of each."""
    heads, kv_heads = 6, 2
    positions = torch.tensor([0, 5, 17, 300, 1, 2, 3, 4, 1000, 7, 8])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim).to(dtype)
    slots = torch.randperm(num_slots)[: len(positions)]
    results = []
    for ops in (ours, theirs):
        kv = torch.zeros(2, num_slots, kv_heads, head_dim, dtype=dtype)
        q = ops.rope_store(qkv, *ops.rope_tables(positions, inv_freq, dtype), slots, kv, heads)
        results.append((q, kv))
    return results[0], results[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ops_match_torch(kernels: native.NativeKernels, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    ours, theirs = NativeOps(kernels), TorchOps()
    num_tokens, hidden = 11, 96
    h, residual = (
        torch.randn(num_tokens, hidden).to(dtype),
        torch.randn(num_tokens, hidden).to(dtype),
    )
    weight = torch.rand(hidden).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for res in (residual, None):
        (x1, r1), (x2, r2) = (
            ours.add_rms_norm(h, res, weight, 1e-5),
            theirs.add_rms_norm(h, res, weight, 1e-5),
        )
        assert torch.equal(r1, r2)
        assert (x1.float() - x2.float()).abs().max().item() < tolerance
    gate_up = (4 * torch.randn(num_tokens, 2 * hidden)).to(dtype)
    assert (ours.silu_mul(gate_up).float() - theirs.silu_mul(gate_up).float()).abs().max() < (
        tolerance * 10
    )

    (q1, kv_ours), (q2, kv_theirs) = rope_store_both(ours, theirs, dtype, 16, num_slots=64)
    assert (q1.float() - q2.float()).abs().max().item() < tolerance * 10
    assert (kv_ours.float() - kv_theirs.float()).abs().max().item() < tolerance * 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torch_argmax_ties_nan_and_strides_included(
    kernels: native.NativeKernels, dtype: torch.dtype
) -> None:
    torch.manual_seed(5)
    for rows, vocab in [(1, 1), (3, 17), (9, 1000), (32, 49152), (4, 24577)]:
        ties = torch.randint(-3, 4, (rows, vocab)).to(dtype)  # many equal maxima per row
        spread = torch.randn(rows, vocab).to(dtype)
        strided = torch.randn(rows, 2 * vocab).to(dtype)[:, :vocab]  # a split's half row
        edges = torch.full((rows, vocab), -math.inf, dtype=dtype)  # all -inf: index 0
        edges[-1, vocab // 2] = math.inf
        for x in (ties, spread, strided, edges):
            assert torch.equal(kernels.row_argmax(x), x.argmax(dim=-1))
        if vocab > 1:  # a NaN beats every number, and the first NaN wins
            ties[0, vocab - 1] = ties[-1, vocab // 2] = ties[-1, vocab - 1] = math.nan
            assert torch.equal(kernels.row_argmax(ties), ties.argmax(dim=-1))
    with pytest.raises(ValueError, match="unit stride"):
        kernels.row_argmax(torch.randn(8, 4).t())


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_store_writes_the_layout_attention_reads(
    kernels: native.NativeKernels, head_dim: int
) -> None:
    # A bf16 cache this build holds as pairs (AVX512_BF16, head_dim a multiple of 64): the K and
    # V that rope_store writes, read back as rows, are TorchOps'. (Attention reading that
    # layout: test_paged_attention_matches_a_plain_softmax, over a converted cache.)
    torch.manual_seed(head_dim)
    dtype = torch.bfloat16
    (q1, kv_ours), (q2, kv_theirs) = rope_store_both(
        NativeOps(kernels), TorchOps(), dtype, head_dim, num_slots=48
    )
    assert torch.equal(q1, q2)  # the same roundings (test_small_ops_match_torch: head_dim 16)
    assert torch.equal(kernels.from_cache_layout(kv_ours), kv_theirs)
    assert torch.equal(kv_ours, kernels.to_cache_layout(kv_theirs))
    if kernels.kv_as_pairs(dtype, head_dim):
        assert not torch.equal(kv_ours, kv_theirs)  # the layout did change
        assert not torch.equal(kv_ours[1], kv_theirs[1])  # values too


def test_kernels_refuse_tensors_they_would_misread(kernels: native.NativeKernels) -> None:
    h = torch.randn(4, 8)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.add_rms_norm(h.double(), None, torch.ones(8).double(), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.add_rms_norm(torch.randn(8, 4).t(), None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="panels"):
        kernels.linear_f32(torch.randn(2, 8), kernels.pack_f32(torch.randn(3, 9)), 3)
    with pytest.raises(ValueError, match="panels"):  # N does not match the panels
        kernels.linear_f32(torch.randn(2, 9), kernels.pack_f32(torch.randn(3, 9)), 17)
    with pytest.raises(ValueError, match="float32"):
        kernels.pack_f32(torch.randn(3, 9).double())


def test_cpu_linear_matches_f_linear_and_serves_its_rows(kernels: native.NativeKernels) -> None:
    from stages.backend.cpu.linear import CpuLinear

    torch.manual_seed(3)
    weight = torch.randn(70, 48)
    linear = CpuLinear(weight, kernels)
    assert (linear.in_features, linear.out_features) == (48, 70)
    assert torch.equal(linear.dense_weight(), weight)
    for rows in (1, 3, 4, 5, 32, 64, 65, 130):
        x = torch.randn(rows, 48)
        assert (linear(x) - F.linear(x, weight)).abs().max().item() < 1e-4, f"{rows} rows"
    ids = torch.tensor([0, 69, 15, 16, 33, 0])
    assert torch.equal(linear.rows(ids), F.embedding(ids, weight))  # a tied embedding's lookup


@pytest.fixture(scope="module")
def portable_kernels(tmp_path_factory: pytest.TempPathFactory) -> native.NativeKernels:
    return build_kernels(build.PORTABLE_CFLAGS, tmp_path_factory.mktemp("scalar"))


@pytest.mark.parametrize("head_dim", [16, 24])
def test_bf16_small_ops_round_as_the_scalar_code_does(
    kernels: native.NativeKernels, portable_kernels: native.NativeKernels, head_dim: int
) -> None:
    # The vector paths (8 lanes) round to bf16 exactly where the scalar code does, so a stage
    # computes the same bf16 values on every CPU; rows of 100 leave a tail of 4 to the scalar
    # loop, and NaN stays NaN.
    torch.manual_seed(head_dim)
    vec, ref = NativeOps(kernels), NativeOps(portable_kernels)
    num_tokens, hidden = 9, 100
    h = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    residual = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    h[3, 5] = float("nan")
    weight = torch.rand(hidden).to(torch.bfloat16)
    (x1, r1), (x2, r2) = (
        vec.add_rms_norm(h, residual, weight, 1e-5),
        ref.add_rms_norm(h, residual, weight, 1e-5),
    )
    assert torch.equal(r1.isnan(), r2.isnan()) and torch.equal(r1.nan_to_num(), r2.nan_to_num())
    ok = ~x2.isnan().any(dim=1)  # the sum of squares is summed in another order: an ulp apart
    assert (x1[ok].float() - x2[ok].float()).abs().max().item() <= 2**-7 * x2[
        ok
    ].float().abs().max()
    gate_up = (4 * torch.randn(num_tokens, 2 * hidden)).to(torch.bfloat16)
    assert torch.equal(vec.silu_mul(gate_up), ref.silu_mul(gate_up))

    heads, kv_heads = 6, 2
    positions = torch.tensor([0, 5, 17, 300, 1, 2, 3, 1000, 7])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    slots = torch.randperm(32)[:num_tokens]
    kv1 = torch.zeros(2, 32, kv_heads, head_dim, dtype=torch.bfloat16)
    kv2 = kv1.clone()
    tables = vec.rope_tables(positions, inv_freq, torch.bfloat16)
    q1 = vec.rope_store(qkv, *tables, slots, kv1, heads)
    q2 = ref.rope_store(qkv, *tables, slots, kv2, heads)
    assert torch.equal(q1, q2) and torch.equal(kv1, kv2)
