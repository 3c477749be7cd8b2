/* ppring's CPU kernels: attention that reads the paged KV cache in place, fp32 matmuls over
 * weights packed in panels, the matrix-vector products of weight-only int8, bf16 matmuls over
 * packed weights (vdpbf16ps, where the CPU has AVX512_BF16) or over GGUF codes (those and, by
 * default, vpdpbusd over int8-quantized rows, where it has AVX512_VNNI too), and a layer's small
 * ops. The fp32, int8 and small ops have a portable C path; AVX2 and AVX-512 paths where
 * -march=native enables them. The bf16 ones exist only with their instructions (elsewhere a
 * bf16 stage multiplies with torch).
 *
 * Built at run time by backend/cpu/native.py (gcc -O3 -march=native -fopenmp) and called through
 * ctypes with the data pointers of contiguous tensors; nothing here allocates a tensor or holds a
 * pointer past the call. The OpenMP runtime is the one torch already loaded (same soname), so
 * these loops share torch's thread pool and thread count instead of fighting it for the cores.
 *
 * Shapes (row-major, contiguous):
 *   q, out     [T, H, D]             this forward's queries (RoPE applied) and the result
 *   kv         [2, slots, Hkv, D]    one layer's cache: K at 0, V at slots * Hkv * D
 *   block table [num_seqs, table_stride] int32; slot of position p: table[p / 16] * 16 + p % 16
 * Sequence s owns query rows [q_start[s], q_start[s] + q_len[s]); its context is ctx_len[s] keys
 * (its new tokens included, already written), and query i sits at position ctx_len - q_len + i:
 * it sees keys 0..that position (causal, aligned bottom-right). A decode is q_len == 1.
 */

/* This header is what the kernels' translation units share (backend/cpu/native.py compiles every .c
 * of this folder into one library, and hashes this header with them): the feature macros of
 * the build, the sizes and codes native.py checks, the structs backend/cpu/fused_layer.py mirrors,
 * the small per-row and per-vector helpers more than one file inlines, and the declarations of
 * what one file defines and another calls. By concern:
 *   attention.c    paged attention: its tasks, plan and per-page kernels
 *   attention_amx.c  a long prefill chunk's attention on AMX tiles
 *   matmul_f32.c   fp32 matmuls over packed panels and over grid codes
 *   matmul_int8.c  weight-only int8 matmuls
 *   matmul_bf16.c  bf16 matmuls over packed panels and over grid codes (vdpbf16ps)
 *   matmul_a8.c    grid codes x int8-quantized activations (vpdpbusd)
 *   matmul_amx.c   bf16 matmuls on AMX tiles, over matmul_bf16.c's panels
 *   ops.c          the small ops: norms, RoPE and the cache store, SiLU, argmax, biases
 *   layers.c       a whole decoder layer stack in one call, the greedy lm_head, the structs */
#ifndef PPRING_H
#define PPRING_H

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* vdpbf16ps and the masked 256-bit stores around it: AVX512_BF16, BW and VL */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BF16_DOT
#endif

/* AVX2 and FMA: the eight-lane paths (attention, the int8 matmul, the small ops) */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_ATTENTION
#endif

/* AVX-512 F and BW: the sixteen-lane paths (attention groups a KV group's heads: attention.c) */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_ATTENTION
#endif

/* vpdpbusd: grid codes x int8-quantized activations (matmul_a8.c), and the decoder stack in one
 * team (layers.c) */
#if defined(HAVE_BF16_DOT) && defined(__AVX512VNNI__)
#define HAVE_A8_DOT
#endif

/* AMX tiles with bf16 products (matmul_amx.c), where the build targets a CPU that has them; the
 * process must still be granted the tile state at run time (ppr_has_amx_bf16) */
#if defined(HAVE_BF16_DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX_BF16
#endif

#ifdef HAVE_AMX_BF16
/* ldtilecfg's 64-byte operand (palette 1) */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_tile_config;

/* The tiles every AMX kernel here uses (matmul_amx.c, attention_amx.c): all eight 16 rows of
 * 64 bytes (a C tile: 16 x 16 fp32; an A or B tile: 16 rows of 32 bf16). Each thread loads it
 * before its first tile instruction and releases the tiles after its last. */
static inline void amx_configure_tiles(void) {
    amx_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}
#endif

/* A function one file of the kernels defines and another calls: in the library, not exported
 * from it (the exported entry points are the ppr_* ones) */
#define PPR_INTERNAL __attribute__((visibility("hidden")))

#define PAGE 16 /* tokens per KV block: stages.batch.BLOCK_SIZE (checked by native.py) */
#define MAX_TILE_ROWS 128 /* query vectors (rows x heads of one KV group) one task holds */
#define PANEL 16 /* output channels per panel of a packed weight (matmul_f32.c, matmul_bf16.c) */
#define GRID_BLOCK 32 /* weights along K per scale of a grid (matmul_f32.c describes the codes) */

/* What an entry point returns when an index it would write or read through lies outside the
 * sizes it was given; backend/cpu/native.py raises each as one sentence (an IndexError or a
 * ValueError, as the torch path does). Every entry point that takes slots, block ids,
 * positions or row ranges checks them all once, before it writes anything: no caller can make
 * these kernels touch memory outside the buffers it described. */
enum {
    PPR_REFUSED = -1,      /* a kind or shape this build lacks, or no memory for a buffer */
    PPR_BAD_SLOT = -2,     /* a cache slot outside [0, num_slots) */
    PPR_BAD_BLOCK = -3,    /* a block id outside the pool's num_slots / PAGE blocks */
    PPR_BAD_ROWS = -4,     /* a row count or a query range outside the rows given */
    PPR_BAD_POSITION = -5, /* a position outside the rotary tables' rows */
    PPR_BAD_CONTEXT = -6,  /* a context shorter than its queries, or past its block table */
};

/* The kinds of ppr_linear_t (layers.c run_linear; backend/cpu/fused_layer.py's _F32 ...) */
enum {
    PPR_F32 = 1, PPR_GRID_F32 = 2, PPR_BF16 = 3, PPR_GRID_BF16 = 4, PPR_INT8 = 5, PPR_GRID_A8 = 6,
    PPR_INT8_QUADS = 7, PPR_GRID_A8_1 = 8 /* PPR_GRID_A8 with one pass over x (a8_quantize_row) */
};

/* The formats of a grid-a8 weight (ppr_linear_t bits; matmul_a8.c describes each layout): GGUF's
 * Q4_1 (Q4_0 too) and Q8_0 (Q5_0 too) as 4- and 8-bit codes with fp16 scales, the k-quants
 * Q4_K, Q5_K and Q6_K as 4-bit codes plus 0, 1 or 2 planes of high bits with fp32 scales, and
 * GRID_KM: rows of Q6_K joined with Q4_K or Q5_K rows (a Q4_K_M file's q, k and v), 6-bit
 * codes with a d and an m per 16. */
enum { GRID_Q4 = 4, GRID_Q8 = 8, GRID_K4 = 20, GRID_K5 = 21, GRID_K6 = 22, GRID_KM = 23 };

static inline int grid_is_k(int bits) { return bits >= GRID_K4 && bits <= GRID_KM; }

/* planes of high bits of a k-quant (bit 4, bit 5), each two 64-bit masks per group of 8 k */
static inline int grid_k_planes(int bits) {
    return bits == GRID_K4 ? 0 : bits == GRID_K5 ? 1 : 2;
}

/* bytes of codes per panel of 16 channels (K a multiple of 32): nibbles K * 8, 8-bit codes
 * K * 16; a k-quant's nibbles then its masks, K / 8 groups of 2 planes x 2 halves x 8 bytes */
static inline int64_t grid_panel_code_bytes(int K, int bits) {
    if (bits == GRID_Q8) return (int64_t)K * 16;
    return (int64_t)K * 8 + (grid_is_k(bits) ? (int64_t)(K / 8) * 16 * grid_k_planes(bits) : 0);
}

/* weights along K per scale: 32, Q6_K's and GRID_KM's 16 */
static inline int grid_scale_group(int bits) {
    return bits == GRID_K6 || bits == GRID_KM ? 16 : 32;
}

/* whether the format has offsets (w = d q + m): Q4_1, Q4_K, Q5_K per 32, GRID_KM per 16 */
static inline int grid_has_offset(int bits) {
    return bits == GRID_Q4 || bits == GRID_K4 || bits == GRID_K5 || bits == GRID_KM;
}

/* weights along K per offset */
static inline int grid_offset_group(int bits) { return bits == GRID_KM ? 16 : 32; }

/* quantized rows per row of x for a grid-a8 kind */
static inline int a8_passes(int kind) { return kind == PPR_GRID_A8_1 ? 1 : 2; }

/* One weight matrix [N, K] as its module holds it. f32, bf16: a = panels; grid (and grid a8):
 * a = codes, b = scale, c = offset (NULL for Q8_0); int8 (rows or quads): a = the weight, b = its
 * fp32 scales. */
typedef struct {
    int32_t kind, n, k, bits;
    const void *a, *b, *c;
    /* PPR_GRID_BF16 held both ways (backend/cpu/linear.py GridBf16Linear): calls of more than
     * code_rows rows multiply the bf16 panels instead, for the same results; NULL: codes only */
    const void *panels;
    int32_t code_rows;
    /* calls of at least amx_rows rows multiply on AMX tiles (matmul_amx.c), over the panels
     * (PPR_BF16, PPR_GRID_BF16) or the codes decoded a unit at a time (PPR_GRID_A8*); 0: never.
     * The stage measures where the tiles start to win (backend/cpu/amx_choice.py). */
    int32_t amx_rows;
} ppr_linear_t;

/* What a layer holds: its four matrices, two norm weights [d] and its shape; then what some
 * families add (NULL where a layer has none). In a layer: norm, qkv matmul, qkv bias, q/k
 * norms, rope_store, attention, o matmul, o bias, [attn_out_norm], norm, the MLP,
 * [mlp_out_norm]. A NULL input_norm or post_attn_norm (OLMo 2) means that attention or the MLP
 * reads the residual stream itself: the add alone. */
typedef struct {
    ppr_linear_t qkv, o, gate_up, down;
    const void *input_norm, *post_attn_norm;
    float eps;
    int32_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    /* [(H + 2 Hkv) D] in the stage dtype, or NULL: added to the qkv matmul's rows (Qwen2) */
    const void *qkv_bias;
    const void *o_bias; /* [d] or NULL: added to the o matmul's rows */
    /* [D] each, or NULL: an RMSNorm of every q head and every k head (eps = the layer's eps),
     * before the rotary (Qwen3) */
    const void *q_norm, *k_norm;
    /* [d] each, or NULL: the RMSNorm of attention's output (after the o bias) and of the MLP's
     * before they join the residual stream (OLMo 2) */
    const void *attn_out_norm, *mlp_out_norm;
    /* 1: q_norm [H D] and k_norm [Hkv D] norm the whole q and k projections (OLMo 2); 0: every
     * head, with weights [D] (Qwen3) */
    int32_t qk_norm_whole;
    /* > 0: attention sees the last `window` positions (attention_window.c); 0: all of them */
    int32_t window;
    /* > 0: scores become softcap tanh(score / softcap) before the softmax (Gemma 2); 0: none */
    float softcap;
    int32_t gelu; /* 1: the MLP's gate is gelu_tanh (Gemma's GeGLU); 0: silu */
    /* 1: the step's second rotary tables (ppr_step_t cos_local, sin_local: Gemma 3's windowed
     * layers); 0: its first */
    int32_t rope_local;
} ppr_layer_t;

/* What one forward shares across its layers: T rows, the rotary tables (cos and sin [T, D],
 * or with positions [T] tables read at those rows: rope_store_rows), the slots this step
 * writes, the paged-attention metadata, and the scratch every layer reuses (each row-major,
 * in the stage dtype): x [T, d], qkv [T, (H + 2 Hkv) D], q and attn [T, H, D], h [T, d],
 * gate_up [T, 2 I], act [T, I]. */
typedef struct {
    int32_t elem_bytes, num_tokens, num_seqs, table_stride;
    int64_t num_slots;
    int32_t max_tokens; /* rows the scratch below holds: num_tokens may not exceed it */
    int32_t rope_rows;  /* with positions: the rows of cos and sin, which positions index */
    const float *cos, *sin;
    const int64_t *positions;
    const int64_t *slot_mapping;
    const int32_t *q_start, *q_len, *ctx_len, *block_table;
    float scale;
    void *x, *qkv, *q, *attn, *h, *gate_up, *act;
    /* the rotary tables of layers with rope_local (laid out as cos and sin), or NULL */
    const float *cos_local, *sin_local;
    /* the cache's kind: elem_bytes (the stage dtype's), or 1 (the 8-bit cache: kv_kind_ok) */
    int32_t kv_bytes;
} ppr_step_t;

static inline float bf16_load(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (scores minus their running max), vectorizable: Cephes' expf (range reduction
 * by ln 2 and a degree-6 polynomial, about 1 ulp). libm's expf is a scalar call, and a decode
 * step takes hundreds of thousands of them. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f /* ln 2 in two parts, hi + lo, for an exact reduction */
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f /* the polynomial, highest degree first */
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * EXP_LOG2E + 0.5f);
    float r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* exp(x) over the whole float range (clamped to [-87, 88]), vectorizable. */
static inline float exp_any(float x) {
    x = x > 88.0f ? 88.0f : x;
    return exp_nonpositive(x);
}

#ifdef HAVE_AVX2_ATTENTION
/* exp_nonpositive on eight lanes */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
                                   _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* silu(g) = g / (1 + exp(-g)) on eight lanes: -g clamped to 88 from above (to -87 inside
 * exp8), as exp_any does */
static inline __m256 silu8(__m256 g) {
    const __m256 e = exp8_nonpositive(
        _mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.0f)));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* bf16 on eight lanes, with the scalar helpers' exact rounding (nearest even, NaN kept quiet):
 * the bf16 small ops ran scalar, 8x their fp32 twins (silu_mul 5.6 against 0.65 ms in a decode
 * step of 32 on a Zen 5 EPYC). bf16x8_round is fl_bf16(x) held as fp32: bf16_load(bf16_store). */
static inline __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256i bf16x8_bits(__m256 f) { /* the rounded value's bits, low half zero */
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_and_si256(_mm256_blendv_epi8(rounded, quiet, nan),
                            _mm256_set1_epi32((int)0xffff0000u));
}

static inline __m256 bf16x8_round(__m256 f) { return _mm256_castsi256_ps(bf16x8_bits(f)); }

static inline void bf16x8_store(uint16_t *p, __m256 f) {
    const __m256i h = _mm256_srli_epi32(bf16x8_bits(f), 16);       /* 8 x u32 < 2^16 */
    const __m256i packed = _mm256_packus_epi32(h, h);               /* per 128-bit lane */
    _mm_storeu_si128((__m128i *)p,
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xd8)));
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif

#ifdef HAVE_AVX512_ATTENTION
static inline __m512 exp16_nonpositive(__m512 x) { /* exp8_nonpositive on sixteen lanes */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
                                   _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* lane j of the result = the sum of a[j]'s sixteen lanes (a transposing add tree, 45 ops) */
static inline __m512 hsum16x16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a[2i], a[2i+1], a[2i], a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: a[4i] .. a[4i+3] */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes: halves of a[8i..8i+3], of a[8i+4..8i+7] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                         _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

/* sixteen bf16 values from p as fp32 (exact: the bits shifted into the high half) */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* sixteen values from p (bf16 or fp32) as fp32: K or V rows, an int8 matmul's input rows */
static inline __m512 f32x16_load(const void *p, int bf16) {
    if (bf16) return bf16x16_load((const uint16_t *)p);
    return _mm512_loadu_ps(p);
}

#endif

#ifdef HAVE_BF16_DOT
/* bf16 on sixteen lanes where the CPU has AVX512_BF16. vcvtneps2bf16 rounds to nearest even
 * and keeps a NaN quiet in one instruction, where bf16x8_bits takes nine, but it flushes a
 * denormal to zero; torch rounds it (silu(-100) * 0.01 is 1e-39 there, not 0), so sixteen
 * lanes holding one take the scalar helper instead, and the results stay bf16_store's. */
static inline __m256i bf16x16_bits(__m512 f) {
    const __m512 magnitude = _mm512_abs_ps(f);
    const __mmask16 below_normal =
        _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(FLT_MIN), _CMP_LT_OQ);
    const __mmask16 denormal =
        _mm512_mask_cmp_ps_mask(below_normal, magnitude, _mm512_setzero_ps(), _CMP_GT_OQ);
    if (__builtin_expect(denormal != 0, 0)) {
        float lanes[16];
        uint16_t bits[16];
        _mm512_storeu_ps(lanes, f);
        for (int i = 0; i < 16; i++) bits[i] = bf16_store(lanes[i]);
        return _mm256_loadu_si256((const __m256i *)bits);
    }
    return (__m256i)_mm512_cvtneps_pbh(f);
}

static inline __m512 bf16x16_round(__m512 f) { /* bf16x8_round on sixteen lanes */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_bits(f)), 16));
}

static inline void bf16x16_store(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, bf16x16_bits(f));
}

static inline __m512 silu16(__m512 g) { /* silu8 on sixteen lanes */
    const __m512 e = exp16_nonpositive(
        _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.0f)));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

/* residual_out = h + residual (or h, when residual is NULL: a stage's first layer), then
 * x_out = residual_out * rsqrt(mean(residual_out^2) + eps) * weight, rows [T, d]. The add is
 * rounded to the dtype before the norm reads it, as torch's separate ops do; the norm's
 * statistics are fp32 whatever the dtype, as transformers computes them. Row t here;
 * add_rms_norm_rows and ppr_add_rms_norm take them all. */
static inline void add_rms_norm_row(int elem_bytes, const void *h, const void *residual,
                                    const void *weight, void *residual_out, void *x_out, int t,
                                    int d, float eps) {
    const int64_t row = (int64_t)t * d;
    float sum_sq = 0.0f;
    if (elem_bytes == 4) {
        const float *hr = (const float *)h + row;
        const float *rr = residual ? (const float *)residual + row : NULL;
        float *out = (float *)residual_out + row;
        if (rr) {
#pragma omp simd reduction(+ : sum_sq)
            for (int i = 0; i < d; i++) {
                out[i] = hr[i] + rr[i];
                sum_sq += out[i] * out[i];
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int i = 0; i < d; i++) {
                out[i] = hr[i];
                sum_sq += out[i] * out[i];
            }
        }
        const float inv = 1.0f / sqrtf(sum_sq / d + eps);
        const float *w = (const float *)weight;
        float *x = (float *)x_out + row;
#pragma omp simd
        for (int i = 0; i < d; i++) x[i] = out[i] * inv * w[i];
    } else {
        uint16_t *out = (uint16_t *)residual_out + row;
        const uint16_t *hb = (const uint16_t *)h + row, *wb = (const uint16_t *)weight;
        const uint16_t *rb = residual ? (const uint16_t *)residual + row : NULL;
        uint16_t *xb = (uint16_t *)x_out + row;
        int i0 = 0;
#ifdef HAVE_AVX2_ATTENTION
        __m256 sq = _mm256_setzero_ps();
#ifdef HAVE_BF16_DOT
        for (; i0 + 16 <= d; i0 += 16) {
            __m512 r = bf16x16_load(hb + i0);
            if (rb) r = bf16x16_round(_mm512_add_ps(r, bf16x16_load(rb + i0)));
            bf16x16_store(out + i0, r);
            /* the squares summed eight lanes at a time, in the 8-lane loop's order */
            const __m256 lo = _mm512_castps512_ps256(r);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1));
            sq = _mm256_fmadd_ps(hi, hi, _mm256_fmadd_ps(lo, lo, sq));
        }
#endif
        for (; i0 + 8 <= d; i0 += 8) {
            __m256 r = bf16x8_load(hb + i0);
            if (rb) r = bf16x8_round(_mm256_add_ps(r, bf16x8_load(rb + i0)));
            bf16x8_store(out + i0, r);
            sq = _mm256_fmadd_ps(r, r, sq);
        }
        sum_sq = hsum8(sq);
#endif
        for (int i = i0; i < d; i++) {
            float r = bf16_load(hb[i]);
            if (rb) r = bf16_load(bf16_store(r + bf16_load(rb[i])));
            out[i] = bf16_store(r);
            sum_sq += r * r;
        }
        const float inv = 1.0f / sqrtf(sum_sq / d + eps);
        /* rounded where transformers rounds: the normalized value, then the product */
        int i1 = 0;
#ifdef HAVE_BF16_DOT
        const __m512 inv16 = _mm512_set1_ps(inv);
        for (; i1 + 16 <= d; i1 += 16)
            bf16x16_store(xb + i1, _mm512_mul_ps(bf16x16_round(_mm512_mul_ps(
                                                     bf16x16_load(out + i1), inv16)),
                                                 bf16x16_load(wb + i1)));
#endif
#ifdef HAVE_AVX2_ATTENTION
        const __m256 inv8 = _mm256_set1_ps(inv);
        for (; i1 + 8 <= d; i1 += 8)
            bf16x8_store(xb + i1, _mm256_mul_ps(bf16x8_round(_mm256_mul_ps(
                                                    bf16x8_load(out + i1), inv8)),
                                                bf16x8_load(wb + i1)));
#endif
        for (int i = i1; i < d; i++)
            xb[i] = bf16_store(bf16_load(bf16_store(bf16_load(out[i]) * inv)) *
                               bf16_load(wb[i]));
    }
}

/* out[T, I] = silu(gate) * up, where gate and up are [T, I] with rows strided by `row` elements
 * (a fused gate_up matmul's output holds both in one row). silu(x) = x / (1 + exp(-x)). Row t
 * here; silu_mul_rows and ppr_silu_mul take them all. */
static inline void silu_mul_row(int elem_bytes, const void *gate, const void *up, int64_t row,
                                void *out, int t, int I) {
    const int64_t src = (int64_t)t * row, dst = (int64_t)t * I;
    if (elem_bytes == 4) {
        const float *g = (const float *)gate + src, *u = (const float *)up + src;
        float *o = (float *)out + dst;
        int i = 0;
#ifdef HAVE_AVX2_ATTENTION
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)),
                                                  _mm256_loadu_ps(u + i)));
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + exp_any(-g[i])) * u[i];
    } else {
        const uint16_t *g = (const uint16_t *)gate + src, *u = (const uint16_t *)up + src;
        uint16_t *o = (uint16_t *)out + dst;
        int i = 0;
#ifdef HAVE_BF16_DOT
        for (; i + 16 <= I; i += 16)
            bf16x16_store(o + i, _mm512_mul_ps(bf16x16_round(silu16(bf16x16_load(g + i))),
                                               bf16x16_load(u + i)));
#endif
#ifdef HAVE_AVX2_ATTENTION
        for (; i + 8 <= I; i += 8) /* silu rounded to bf16 before the multiply, as below */
            bf16x8_store(o + i, _mm256_mul_ps(bf16x8_round(silu8(bf16x8_load(g + i))),
                                              bf16x8_load(u + i)));
#endif
        for (; i < I; i++) {
            const float gi = bf16_load(g[i]);
            /* torch rounds silu's result to bf16 before the multiply */
            o[i] = bf16_store(bf16_load(bf16_store(gi / (1.0f + exp_any(-gi)))) * bf16_load(u[i]));
        }
    }
}

/* y[j] += bias[j] for j < N, one row in the stage dtype: in fp32 the sum, in bf16 the sum of
 * the two values rounded to bf16 once (torch's bf16 `y + b`, bit for bit). Row t of a matmul's
 * output here; ppr_add_bias takes rows, and layers.c adds a layer's biases row by row. */
static inline void add_bias_row(int elem_bytes, void *y, const void *bias, int N) {
    if (elem_bytes == 4) {
        float *yr = (float *)y;
        const float *b = (const float *)bias;
#pragma omp simd
        for (int j = 0; j < N; j++) yr[j] += b[j];
        return;
    }
    uint16_t *yr = (uint16_t *)y;
    const uint16_t *b = (const uint16_t *)bias;
    int j = 0;
#ifdef HAVE_BF16_DOT
    for (; j + 16 <= N; j += 16)
        bf16x16_store(yr + j, _mm512_add_ps(bf16x16_load(yr + j), bf16x16_load(b + j)));
#endif
#ifdef HAVE_AVX2_ATTENTION
    for (; j + 8 <= N; j += 8)
        bf16x8_store(yr + j, _mm256_add_ps(bf16x8_load(yr + j), bf16x8_load(b + j)));
#endif
    for (; j < N; j++) yr[j] = bf16_store(bf16_load(yr[j]) + bf16_load(b[j]));
}

/* Heads [first_head, first_head + num_heads) of one row x (head h's D values at h D), each
 * replaced in place by its RMSNorm times weight [D]: add_rms_norm_row on the head with no
 * residual, so the same arithmetic, and the same bits, as ppr_add_rms_norm over those heads
 * taken as rows (fp32 statistics; bf16 rounded where transformers rounds). Qwen3's q and k
 * norms, before the rotary. */
static inline void rms_norm_heads_row(int elem_bytes, void *x, int first_head, int num_heads,
                                      int D, const void *weight, float eps) {
    for (int h = first_head; h < first_head + num_heads; h++) {
        char *head = (char *)x + (int64_t)h * D * elem_bytes;
        add_rms_norm_row(elem_bytes, head, NULL, weight, head, head, 0, D, eps);
    }
}

/* whether attention runs group_page_avx512 (the heads of a KV group taking each page together)
 * for head_dim D in this build */
static inline int avx512_attention(int D) {
#ifdef HAVE_AVX512_ATTENTION
    return D % 64 == 0;
#else
    (void)D;
    return 0;
#endif
}

/* Whether this build holds a bf16 cache's pages as pairs: within each 16-slot page, each KV
 * head's keys as [D / 2][16][2] (dimension pair, slot, element) and its values as [8][D][2]
 * (slot pair, dimension, element), not as 16 rows of D. vdpbf16ps then scores a query against
 * the page's 16 keys with no sum across lanes (a transposing add tree cost 45 ops a head and
 * page), and multiplies the page's 16 probabilities, rounded to bf16 pairs, into V (each V row
 * had been widened to fp32 for 64 FMAs a head and page). One layer, 32 decodes of context 512
 * on a Zen 4 EPYC: 1.20 -> 0.95 ms on one thread, 0.62 -> 0.52 on two. A stage's cache is
 * written only by ppr_rope_store and read only by ppr_paged_attention, which both follow this;
 * native.py converts a cache built by hand (tests). */
static inline int kv_as_pairs(int elem_bytes, int D) {
#ifdef HAVE_BF16_DOT
    return elem_bytes == 2 && avx512_attention(D);
#else
    (void)elem_bytes, (void)D;
    return 0;
#endif
}

/* ---- The 8-bit cache (kv_bytes 1: --kv-cache-dtype int8) -----------------------------------
 * One layer's cache is one allocation (stages/kv_cache.py), [2, slots, Hkv, D] int8 codes (K,
 * then V) followed by their scales, each laid out by page and KV head (kv8_key_page ...):
 *   K codes  [slots / PAGE, Hkv, D / 2, PAGE, 2]  a page's keys as pairs of channels per slot
 *   V codes  [slots / PAGE, Hkv, PAGE / 2, D, 2]  its values as pairs of slots per channel
 *   K scales [slots / PAGE, Hkv, D] uint8         one per page, KV head and channel: 2^(e / 8),
 *                                                 e = byte - 128 (kv8_scale)
 *   V scales [slots / PAGE, Hkv, PAGE] bf16       one per token and KV head
 * The pairs are bf16 pairs' layout (kv_as_pairs) in bytes: one 32-byte load is 16 slots' codes
 * of two channels (K) or 16 channels' of two slots (V), which vpdpwssd multiplies as int16
 * pairs (attention.c kv8_page_scores_i16), and the AMX prefill converts page for page (kv8.c).
 * K per channel of a page because keys carry outlier channels (bench/kv_study.py: KLD added to
 * the default model's fp32 logits, 4 windows, per token and head 0.00064, per channel of a page
 * 0.00014; bf16 0.00002), and one byte a scale because 134 bytes per token and head (not 138
 * with fp16 scales) is what makes the same memory hold 1.9x bf16's blocks. V per token: a
 * token's values are summed with one weight. A page's K scale only grows: tokens written into a
 * page that already holds some raise a channel's e where they need it and round the page's
 * earlier codes again at the new scale (ops.c kv8_store_keys); a prefill writes a page's tokens
 * in one call, so once. Codes lie in [-127, 127]. stages/kv_quant.py does the same arithmetic
 * in torch (the torch path, and the tests' reference). */
#define KV8_CODE_MAX 127
/* Whether a cache of kv_bytes (1: this 8-bit one; else the stage dtype's, elem_bytes) is one the
 * kernels store and read: an 8-bit one in whole pages (its scales are per page). */
static inline int kv_kind_ok(int elem_bytes, int kv_bytes, int64_t num_slots) {
    return (elem_bytes == 4 || elem_bytes == 2) &&
           (kv_bytes == elem_bytes || (kv_bytes == 1 && num_slots % PAGE == 0));
}
#define KV8_E_MIN (-128)
#define KV8_E_MAX 127

/* Where head g's keys and values of page `block` start (bytes into the layer), and where slot
 * j's channel d lies within them */
static inline int64_t kv8_key_page(int64_t block, int g, int Hkv, int D) {
    return (block * Hkv + g) * D * PAGE;
}
static inline int64_t kv8_value_page(int64_t num_slots, int64_t block, int g, int Hkv, int D) {
    return num_slots * Hkv * D + kv8_key_page(block, g, Hkv, D);
}
static inline int kv8_key_at(int j, int d) { return ((d / 2) * PAGE + j) * 2 + d % 2; }
static inline int kv8_value_at(int j, int d, int D) { return ((j / 2) * D + d) * 2 + j % 2; }

/* attention.c's 8-bit kernels hold a query's per-channel products on the stack: D <= 256 */
#define ATT_KV8_MAX_D 256

/* bytes before K's scales and before V's; page `block`'s scales of head g are at
 * (block * Hkv + g) * D of the first, (block * Hkv + g) * PAGE of the second (bf16) */
static inline int64_t kv8_k_scale_at(int64_t num_slots, int Hkv, int D) {
    return 2 * num_slots * Hkv * D;
}
static inline int64_t kv8_v_scale_at(int64_t num_slots, int Hkv, int D) {
    return kv8_k_scale_at(num_slots, Hkv, D) + num_slots / PAGE * Hkv * D;
}

/* 2^(e / 8) for e = b - 128: 2^(e mod 8 / 8), rounded to fp32 (stages/kv_quant.py's table),
 * times 2^floor(e / 8), exactly (an exponent in [-16, 15]) */
static inline float kv8_scale_of(int e) {
    static const uint32_t frac_bits[8] = {0x3f800000u, 0x3f8b95c2u, 0x3f9837f0u, 0x3fa5fed7u,
                                          0x3fb504f3u, 0x3fc5672au, 0x3fd744fdu, 0x3feac0c7u};
    const uint32_t bits = (uint32_t)((int32_t)frac_bits[e & 7] + (e >> 3) * (1 << 23));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline float kv8_scale(uint8_t b) { return kv8_scale_of((int)b - 128); }

/* the smallest e in [KV8_E_MIN, KV8_E_MAX] whose scale takes amax into KV8_CODE_MAX (the
 * largest for amax past them all, infinite or NaN) */
static inline int kv8_exponent(float amax) {
    if (!(amax <= KV8_CODE_MAX * kv8_scale_of(KV8_E_MAX))) return KV8_E_MAX;
    if (amax <= KV8_CODE_MAX * kv8_scale_of(KV8_E_MIN)) return KV8_E_MIN;
    int e = (int)ceilf(8.0f * log2f(amax / KV8_CODE_MAX)); /* a guess, then made exact */
    e = e < KV8_E_MIN ? KV8_E_MIN : e > KV8_E_MAX ? KV8_E_MAX : e;
    while (e > KV8_E_MIN && KV8_CODE_MAX * kv8_scale_of(e - 1) >= amax) e--;
    while (e < KV8_E_MAX && KV8_CODE_MAX * kv8_scale_of(e) < amax) e++;
    return e;
}

/* x / scale rounded to the nearest code (ties to even, as torch.round), in [-127, 127] */
static inline int8_t kv8_code(float x, float scale) {
    const float c = rintf(x / scale);
    return (int8_t)(c > KV8_CODE_MAX ? KV8_CODE_MAX : c < -KV8_CODE_MAX ? -KV8_CODE_MAX
                                                 : c == c            ? c
                                                                     : 0.0f);
}

/* One task: query rows [row0, row0 + nrows) of one sequence, for the query heads of KV heads
 * [g0, g1). Online softmax over the context, one 16-key page at a time, in fp32. A page of the
 * cache holds all KV heads of its 16 slots back to back (16 * Hkv * D values for K, the same
 * for V), so a task over all heads reads it front to back, and the next page is prefetched. */
typedef struct {
    int seq, g0, g1, row0, nrows;
    int h0, nh; /* the query heads [h0, h0 + nh) of each group (all G, unless a lone sequence's
                   heads are split so that every thread has work) */
} Task;

/* The bf16 matmuls' stores (matmul_bf16.c; matmul_a8.c's micro-kernel stores through them) */
#ifdef HAVE_BF16_DOT
/* channels [16 p, 16 p + 16) of one row of y: 16 fp32 sums, each rounded to bf16 once (those
 * past N left alone) */
static inline __attribute__((always_inline)) void bf16_store16(uint16_t *y_row, int N, int p,
                                                               __m512 sums) {
    const int n0 = 16 * p;
    const __mmask16 keep = N - n0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1);
    _mm256_mask_storeu_epi16(y_row + n0, keep, (__m256i)_mm512_cvtneps_pbh(sums));
}

/* rows [0, MR) of y, panels p0, p0 + 1 (np). Each store names its panel as a constant: indexed
 * by np, the sums had to live in memory and the micro-kernels spilled them (the a8 kernel
 * of matmul_a8.c ran 25-45% slower that way). */
static inline __attribute__((always_inline)) void pb_store(const int MR, __m512 (*acc)[2],
                                                           uint16_t *y, int N, int p0, int np) {
    for (int m = 0; m < MR; m++) {
        bf16_store16(y + (int64_t)m * N, N, p0, acc[m][0]);
        if (np > 1) bf16_store16(y + (int64_t)m * N, N, p0 + 1, acc[m][1]);
    }
}
#endif

/* matmul_a8.c's quantization of x's rows, which layers.c's one-team stack inlines into its norm
 * and silu loops too */
#ifdef HAVE_A8_DOT
/* One block of 32 values (lo, hi: its first and last 16) -> xq [32] int8: dx = max |x| / 127,
 * xq = round(x / dx) (nearest even); *dx, *sx = dx sum(xq) and *sq = sum(xq) set, and lo, hi
 * left holding what xq misses, x - dx xq (at most dx / 2 a value). */
static inline void a8_quantize_block(__m512 *lo, __m512 *hi, int8_t *xq, float *dx, float *sx,
                                     int32_t *sq, int32_t *sq16) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(*lo), _mm512_abs_ps(*hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(*lo, inv)); /* nearest even */
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(*hi, inv));
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtepi32_epi8(qlo)); /* |x / dx| <= 127 */
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtepi32_epi8(qhi));
    const int32_t sum_lo = _mm512_reduce_add_epi32(qlo), sum_hi = _mm512_reduce_add_epi32(qhi);
    const int32_t sum = sum_lo + sum_hi;
    const float d = amax / 127.0f;
    *dx = d, *sq = sum, *sx = d * (float)sum;
    sq16[0] = sum_lo, sq16[1] = sum_hi;
    const __m512 vd = _mm512_set1_ps(d);
    *lo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), vd, *lo);
    *hi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), vd, *hi);
}

/* One row of x [K] bf16 -> `passes` (1 or 2) rows of int8, x ~ dx1 xq1 (+ dx2 xq2) per block
 * of 32: the first pass quantizes x, the second what the first missed. Into xq [passes, K] (rows
 * `row_stride` apart) and, per pass and block, dx, dx sum(xq) and sum(xq) ([passes, K / 32]
 * each, rows `block_stride` apart), and sum(xq) per 16 ([passes, K / 16], rows twice
 * `block_stride` apart: Q6_K's scales are per 16). */
static inline void a8_quantize_row(const uint16_t *x, int K, int passes, int8_t *xq,
                                   int64_t row_stride, float *dx, float *sx, int32_t *sq,
                                   int32_t *sq16, int64_t block_stride) {
    for (int b = 0; b < K / GRID_BLOCK; b++) {
        const __m512i raw = _mm512_loadu_si512(x + (int64_t)b * GRID_BLOCK); /* 32 bf16 */
        __m512 lo = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        __m512 hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        for (int pass = 0; pass < passes; pass++) {
            const int64_t at = pass * block_stride + b;
            a8_quantize_block(&lo, &hi, xq + pass * row_stride + (int64_t)b * GRID_BLOCK,
                              dx + at, sx + at, sq + at, sq16 + 2 * at);
        }
    }
}

/* The quantized rows of one call of M rows of x (`passes` quantized rows each: row
 * passes m + pass): per quantized row and block of 32, dx, dx sum(xq) and sum(xq)
 * ([passes M, K / 32] each), sum(xq) per 16 ([passes M, K / 16]), then xq [passes M, K]
 * int8, cut from one buffer of
 * a8_scratch_bytes(M, K) (which grows with K: a buffer for the largest K serves every smaller
 * one, and holds A8_MAX_PASSES passes). */
typedef struct {
    float *dx, *sx;
    int32_t *sq, *sq16;
    int8_t *xq;
    int passes;
} A8Rows;

/* row m of x [., K] bf16 quantized into rows r.passes m, ... of r */
static inline void a8_quantize_into(const uint16_t *x, int m, int K, A8Rows r) {
    const int KB = K / GRID_BLOCK;
    const int64_t q = (int64_t)r.passes * m;
    a8_quantize_row(x + (int64_t)m * K, K, r.passes, r.xq + q * K, K, r.dx + q * KB,
                    r.sx + q * KB, r.sq + q * KB, r.sq16 + 2 * q * KB, KB);
}

#endif

/* Whether ppr_linear_grid_a8 and ppr_grid_a8_rows take this weight: K a multiple of 32, a
 * format above, offsets given exactly where it has them, in a build with AVX512_BF16 and
 * VNNI. */
static inline int a8_weight_ok(int K, int bits, const void *offset) {
#ifdef HAVE_A8_DOT
    const int format = bits == GRID_Q4 || bits == GRID_Q8 || grid_is_k(bits);
    return K > 0 && K % GRID_BLOCK == 0 && format && !grid_has_offset(bits) == !offset;
#else
    (void)K, (void)bits, (void)offset;
    return 0;
#endif
}

/* ---- what one file defines and another calls ---- */

/* attention.c */
PPR_INTERNAL int attention_plan(int kv_bytes, int num_seqs, const int32_t *q_len,
                                const int32_t *ctx_len, int H, int Hkv, int D, int num_threads,
                                Task *tasks);
PPR_INTERNAL size_t attention_scratch_floats(int D);
PPR_INTERNAL void attention_run(const Task *tasks, int num_tasks, int elem_bytes, int kv_bytes,
                               const void *q,
                                const void *kv, void *out, const int32_t *q_start,
                                const int32_t *q_len, const int32_t *ctx_len,
                                const int32_t *table, int table_stride, int64_t num_slots, int H,
                                int Hkv, int D, float scale, float *scratch);
PPR_INTERNAL int attention_shapes_ok(int elem_bytes, int H, int Hkv);
PPR_INTERNAL int attention_indices_check(int num_tokens, int num_seqs, const int32_t *q_start,
                                         const int32_t *q_len, const int32_t *ctx_len,
                                         const int32_t *table, int table_stride,
                                         int64_t num_slots);
PPR_INTERNAL int paged_attention(int elem_bytes, int kv_bytes, const void *q, const void *kv, void *out,
                                 int num_seqs, const int32_t *q_start, const int32_t *q_len,
                                 const int32_t *ctx_len, const int32_t *table, int table_stride,
                                 int64_t num_slots, int H, int Hkv, int D, float scale);

/* attention_window.c */
PPR_INTERNAL int paged_attention_window(int elem_bytes, int kv_bytes, const void *q, const void *kv, void *out,
                                        int num_seqs, const int32_t *q_start,
                                        const int32_t *q_len, const int32_t *ctx_len,
                                        const int32_t *table, int table_stride,
                                        int64_t num_slots, int H, int Hkv, int D, float scale,
                                        int window, float softcap);

/* ops.c */
PPR_INTERNAL void rope_store_rows(int elem_bytes, int kv_bytes, void *qkv, int64_t row,
                                  void *q_out, const float *cos, const float *sin,
                                  const int64_t *positions, const int64_t *slots, void *kv,
                                  int64_t num_slots, int T, int H, int Hkv, int D);
PPR_INTERNAL void rope_store(int elem_bytes, int kv_bytes, void *qkv, int64_t row, void *q_out,
                             const float *cos, const float *sin, const int64_t *positions,
                             const int64_t *slots, void *kv, int64_t num_slots, int T, int H,
                             int Hkv, int D);
PPR_INTERNAL int slots_positions_check(int T, const int64_t *slots, int64_t num_slots,
                                       const int64_t *positions, int64_t rope_rows);
PPR_INTERNAL void add_bias_rows(int elem_bytes, void *y, int64_t row_stride, const void *bias,
                                int T, int N);
void ppr_add_rms_norm(int elem_bytes, const void *h, const void *residual, const void *weight,
                      void *residual_out, void *x_out, int T, int d, float eps);
void ppr_silu_mul(int elem_bytes, const void *gate, const void *up, int64_t row, void *out, int T,
                  int I);
void ppr_gelu_tanh_mul(int elem_bytes, const void *gate, const void *up, int64_t row, void *out,
                       int T, int I);
void ppr_row_argmax(int elem_bytes, const void *x, int64_t stride, int64_t *out, int N, int V);
int ppr_add_bias(int elem_bytes, void *y, int64_t row_stride, const void *bias, int T, int N);
int ppr_add(int elem_bytes, const void *h, const void *residual, void *out, int T, int d);

/* the matmuls (layers.c run_linear) */
void ppr_linear_f32(const float *x, const float *panels, float *y, int M, int N, int K);
int ppr_linear_grid(const float *x, const uint8_t *codes, const float *scale, const float *offset,
                    float *y, int M, int N, int K, int bits);
void ppr_linear_int8(int elem_bytes, const void *x, const int8_t *w, const float *scale, void *y,
                     int M, int N, int K);
int ppr_linear_int8_quads(int elem_bytes, const void *x, const int8_t *w, const float *scale,
                          void *y, int M, int N, int K);
int ppr_linear_bf16(const uint16_t *x, const uint16_t *panels, uint16_t *y, int M, int N, int K);
int ppr_has_amx_bf16(void);
int ppr_linear_bf16_amx(const uint16_t *x, const uint16_t *panels, uint16_t *y, int M, int N,
                        int K);
int ppr_prefill_attention_amx(const uint16_t *q, const uint16_t *kv, uint16_t *out, int num_tokens,
                              int q_start, int q_len, int ctx_len, const int32_t *table,
                              int table_len, int64_t num_slots, int H, int Hkv, int D,
                              float scale);
int ppr_linear_grid_a8_amx(const uint16_t *x, const uint8_t *codes, const void *scale,
                           const void *offset, uint16_t *y, int M, int N, int K, int bits);
int ppr_linear_grid_bf16(const uint16_t *x, const uint8_t *codes, const uint16_t *scale,
                         const uint16_t *offset, uint16_t *y, int M, int N, int K, int bits);
int ppr_linear_grid_a8(const uint16_t *x, const uint8_t *codes, const void *scale,
                       const void *offset, uint16_t *y, int M, int N, int K, int bits,
                       int passes);

#ifdef HAVE_A8_DOT
/* matmul_a8.c: the quantized rows and the units of a grid-a8 matmul, for the one-team stack */
PPR_INTERNAL size_t a8_scratch_bytes(int M, int K);
PPR_INTERNAL A8Rows a8_rows_at(char *scratch, int M, int K, int passes);
PPR_INTERNAL void a8_quantize_rows(const uint16_t *x, int M, int K, A8Rows r);
PPR_INTERNAL void a8_units(A8Rows rows, const uint8_t *codes, const void *scale,
                           const void *offset, uint16_t *y, int M, int N, int K, int bits);
#endif

#endif /* PPRING_H */
