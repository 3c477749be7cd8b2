/* ppring's CPU kernels: attention that reads the paged KV cache in place, fp32 matmuls over
 * weights packed in panels, the matrix-vector products of weight-only int8, bf16 matmuls over
 * packed weights (vdpbf16ps, where the CPU has AVX512_BF16) or over GGUF codes (those and, by
 * default, vpdpbusd over int8-quantized rows, where it has AVX512_VNNI too), and a layer's small
 * ops. The fp32, int8 and small ops have a portable C path; AVX2 and AVX-512 paths where
 * -march=native enables them. The bf16 ones exist only with their instructions (elsewhere a
 * bf16 stage multiplies with torch).
 *
 * Built at run time by stages/native.py (gcc -O3 -march=native -fopenmp) and called through
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
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* vdpbf16ps and the masked 256-bit stores around it: AVX512_BF16, BW and VL */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BF16_DOT
#endif

#define PAGE 16 /* tokens per KV block: stages.batch.BLOCK_SIZE (checked by native.py) */
#define MAX_TILE_ROWS 128 /* query vectors (rows x heads of one KV group) one task holds */

int ppr_block_size(void) { return PAGE; }

/* What an entry point returns when an index it would write or read through lies outside the
 * sizes it was given; stages/native.py raises each as one sentence (an IndexError or a
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

/* One query row against one page of 16 keys: the scores of keys [0, lim), then the online
 * softmax update of the row's running max m, sum l and output acc [D]. kp and vp point at the
 * page's first key and value row of this KV head; rows are kstride floats apart; qr is the
 * query, already scaled by 1/sqrt(D). */
static inline void row_page_generic(const float *qr, const float *kp, const float *vp,
                                    int64_t kstride, int lim, int D, float *m, float *l,
                                    float *acc) {
    float s[PAGE];
    float page_max = -INFINITY;
    for (int j = 0; j < lim; j++) {
        const float *kj = kp + j * kstride;
        float dot = 0.0f;
        for (int d = 0; d < D; d++) dot += qr[d] * kj[d];
        s[j] = dot;
        page_max = dot > page_max ? dot : page_max;
    }
    if (page_max > *m) {
        /* exp(-inf) is 0: the first page rescales nothing that was not zero already */
        const float correction = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - page_max);
        *l *= correction;
        for (int d = 0; d < D; d++) acc[d] *= correction;
        *m = page_max;
    }
    float sum = 0.0f;
    for (int j = 0; j < lim; j++) {
        s[j] = exp_nonpositive(s[j] - *m);
        sum += s[j];
    }
    *l += sum;
    for (int j = 0; j < lim; j++)
        for (int d = 0; d < D; d++) acc[d] += s[j] * vp[j * kstride + d];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_ATTENTION

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

/* the eight sums of a0..a7, as one vector */
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                             __m256 a6, __m256 a7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* row_page_generic for D a multiple of 8. Keys are scored eight at a time (eight independent
 * sums, reduced together), up to nk8 = lim rounded up to 8, which stays inside the page; the
 * scores of keys at or past lim are replaced by -inf and their weights by 0 (whatever those
 * slots hold is never used). */
static inline void row_page_avx2(const float *qr, const float *kp, const float *vp,
                                 int64_t kstride, int lim, int D, float *m, float *l,
                                 float *acc) {
    const int nk8 = (lim + 7) & ~7;
    __m256 sc[2], valid[2];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int b = 0; b < 2; b++) {
        valid[b] = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(lim - 8 * b), lane));
        sc[b] = _mm256_set1_ps(-INFINITY);
        if (8 * b >= nk8) continue;
        const float *k = kp + 8 * b * kstride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
               a7 = a0;
        for (int d = 0; d < D; d += 8) {
            const __m256 qd = _mm256_loadu_ps(qr + d);
            a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + d), a0);
            a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + kstride + d), a1);
            a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 2 * kstride + d), a2);
            a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 3 * kstride + d), a3);
            a4 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 4 * kstride + d), a4);
            a5 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 5 * kstride + d), a5);
            a6 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 6 * kstride + d), a6);
            a7 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 7 * kstride + d), a7);
        }
        sc[b] = _mm256_blendv_ps(sc[b], hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7), valid[b]);
    }
    const float page_max = hmax8(_mm256_max_ps(sc[0], sc[1]));
    if (page_max > *m) {
        const float correction = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - page_max);
        *l *= correction;
        const __m256 c = _mm256_set1_ps(correction);
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), c));
        *m = page_max;
    }
    const __m256 mv = _mm256_set1_ps(*m);
    const __m256 p0 = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(sc[0], mv)), valid[0]);
    const __m256 p1 = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(sc[1], mv)), valid[1]);
    *l += hsum8(_mm256_add_ps(p0, p1));
    float p[PAGE];
    _mm256_storeu_ps(p, p0);
    _mm256_storeu_ps(p + 8, p1);
    int d = 0;
    for (; d + 64 <= D; d += 64) { /* eight accumulators in registers across the page */
        __m256 o0 = _mm256_loadu_ps(acc + d), o1 = _mm256_loadu_ps(acc + d + 8);
        __m256 o2 = _mm256_loadu_ps(acc + d + 16), o3 = _mm256_loadu_ps(acc + d + 24);
        __m256 o4 = _mm256_loadu_ps(acc + d + 32), o5 = _mm256_loadu_ps(acc + d + 40);
        __m256 o6 = _mm256_loadu_ps(acc + d + 48), o7 = _mm256_loadu_ps(acc + d + 56);
        for (int j = 0; j < lim; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *v = vp + j * kstride + d;
            o0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), o0);
            o1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), o1);
            o2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), o2);
            o3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), o3);
            o4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 32), o4);
            o5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 40), o5);
            o6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 48), o6);
            o7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 56), o7);
        }
        _mm256_storeu_ps(acc + d, o0), _mm256_storeu_ps(acc + d + 8, o1);
        _mm256_storeu_ps(acc + d + 16, o2), _mm256_storeu_ps(acc + d + 24, o3);
        _mm256_storeu_ps(acc + d + 32, o4), _mm256_storeu_ps(acc + d + 40, o5);
        _mm256_storeu_ps(acc + d + 48, o6), _mm256_storeu_ps(acc + d + 56, o7);
    }
    for (; d < D; d += 8) {
        __m256 o = _mm256_loadu_ps(acc + d);
        for (int j = 0; j < lim; j++)
            o = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vp + j * kstride + d), o);
        _mm256_storeu_ps(acc + d, o);
    }
}
#endif

/* The next page's K and V lines this task reads, into L2 (locality 2): its block can be
 * anywhere, so the hardware prefetcher cannot guess it. The lines (per slot, the task's KV heads)
 * are handed out a slice per query vector's call on the current page, so the fetches keep pace
 * with the compute. Issued in a burst (before: each KV head's rows of the next page at once),
 * they overflow the core's outstanding-miss queues and the core stalls until most have come.
 * On the 2-core EPYC, every layer's cache from DRAM, 2 threads, medians of 9, alternated runs:
 * 64 decodes of context 128, burst 40.6, 48.8, 44.6 ms, spread 32.0, 33.3, 34.0; 32 decodes of
 * context 512, 76.9 and 91.1 against 52.7 and 63.9; 1 decode of context 1024, level (8.9-11.1
 * either way). In a decode step of 64 (bench step's loop), attention 53.4, 49.0, 53.9 ms a step
 * against 42.4, 32.8, 38.3. */
typedef struct {
    const char *k, *v;        /* the next page's first row, at the task's first KV head */
    int64_t row_bytes;        /* between slots */
    int lines_per_row, lines; /* lines of span_bytes in one row; of the whole page */
} PagePrefetch;

/* The empty asm keeps gcc from vectorizing the loop: its vectorizer drops prefetches, and gcc 12
 * turned a plain loop of them into one that fetched nothing. */
static inline void prefetch_slice(const PagePrefetch *pf, int call, int num_calls) {
    const int l0 = (int)((int64_t)pf->lines * call / num_calls);
    const int l1 = (int)((int64_t)pf->lines * (call + 1) / num_calls);
    /* row and line of l0, then row by row: a division per line cost more than the fetch saved */
    int row = l0 / pf->lines_per_row, col = l0 - row * pf->lines_per_row;
    for (int ln = l0; ln < l1; row++, col = 0) {
        const char *k = pf->k + row * pf->row_bytes, *v = pf->v + row * pf->row_bytes;
        for (; col < pf->lines_per_row && ln < l1; col++, ln++) {
            __builtin_prefetch(k + col * 64, 0, 2);
            __builtin_prefetch(v + col * 64, 0, 2);
            __asm__ volatile("");
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_ATTENTION
/* A page of 16 keys is one AVX-512 vector of scores. The heads of a KV group that share a query
 * row share each page's keys, so they take the page together: each K and V row is loaded (and
 * widened from bf16) once for all of them, not once per head. The AVX2 path walks one query
 * vector at a time; on a Zen 5 EPYC it was compute-bound, not memory-bound (a layer's bf16 cache
 * in L3 took as long per layer as 30 layers' from DRAM: 0.72 against 0.63 ms at 32 decodes of
 * context 512, 2 threads). */

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

/* scores of the fp32 query q (times the scale) against the page's 16 keys (lane j: key j),
 * before masking. (Where this build has AVX512_BF16, a bf16 cache is held as pairs and scored
 * by page_scores_pairs.) */
static inline __attribute__((always_inline)) __m512 page_scores_avx512(
    int bf16, const float *qf, const void *kp, int64_t kstride, int D) {
    __m512 a[PAGE];
    for (int j = 0; j < PAGE; j++) a[j] = _mm512_setzero_ps();
    const int esize = bf16 ? 2 : 4;
    for (int c = 0; c < D; c += 16) {
        const __m512 qc = _mm512_loadu_ps(qf + c);
#pragma GCC unroll 16
        for (int j = 0; j < PAGE; j++)
            a[j] = _mm512_fmadd_ps(
                qc, f32x16_load((const char *)kp + (j * kstride + c) * esize, bf16), a[j]);
    }
    return hsum16x16(a);
}

/* out[h] += sum_j p[h][j] * V[j] for NH heads, 64 columns of the row at a time: each V row's
 * chunk is loaded once and multiplied into every head's accumulators (registers). */
static inline __attribute__((always_inline)) void page_values_avx512(
    const int NH, int bf16, const float (*p)[PAGE], const void *vp, int64_t kstride, int lim,
    int D, float *acc) {
    const int esize = bf16 ? 2 : 4;
    for (int c = 0; c < D; c += 64) {
        __m512 o[4][4];
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) o[h][i] = _mm512_loadu_ps(acc + h * D + c + 16 * i);
        for (int j = 0; j < lim; j++) {
            const char *v = (const char *)vp + (j * kstride + c) * esize;
            __m512 vv[4];
            for (int i = 0; i < 4; i++) vv[i] = f32x16_load(v + 16 * i * esize, bf16);
            for (int h = 0; h < NH; h++) {
                const __m512 ph = _mm512_set1_ps(p[h][j]);
                for (int i = 0; i < 4; i++) o[h][i] = _mm512_fmadd_ps(ph, vv[i], o[h][i]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc + h * D + c + 16 * i, o[h][i]);
    }
}

#ifdef HAVE_BF16_DOT
/* Scores of NH raw bf16 queries (q_stride elements apart) against a page held as pairs
 * (kv_as_pairs): lane j of each result is key j's score. Per pair of dimensions, the query's
 * pair is broadcast against one vector of all 16 keys' pairs; four sums per head in flight
 * hide vdpbf16ps's latency. */
static inline __attribute__((always_inline)) void page_scores_pairs(
    const int NH, const uint16_t *q, int64_t q_stride, const uint16_t *kt, int D, float scale,
    __m512 *out) {
    __m512 a[4][4];
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < 4; i++) a[h][i] = _mm512_setzero_ps();
    for (int c = 0; c < D / 2; c += 4) {
        __m512bh k[4];
        for (int i = 0; i < 4; i++) k[i] = (__m512bh)_mm512_loadu_si512(kt + (c + i) * 32);
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) {
                int32_t pair; /* dimensions 2 (c + i), 2 (c + i) + 1 of query h */
                memcpy(&pair, q + h * q_stride + 2 * (c + i), 4);
                a[h][i] = _mm512_dpbf16_ps(a[h][i], k[i], (__m512bh)_mm512_set1_epi32(pair));
            }
    }
    for (int h = 0; h < NH; h++)
        out[h] = _mm512_mul_ps(
            _mm512_add_ps(_mm512_add_ps(a[h][0], a[h][1]), _mm512_add_ps(a[h][2], a[h][3])),
            _mm512_set1_ps(scale));
}

/* acc[h] += sum_j p[h][j] V[j] over a page's first lim slots held as pairs (vt [8][D][2]):
 * per slot pair, the two probabilities as one bf16 pair broadcast against 16 dimensions of both
 * slots' values. p[h] is 0 from lim on; a slot past lim may hold anything (NaN), so the pair
 * that straddles lim has its second slot's values zeroed. */
static inline __attribute__((always_inline)) void page_values_pairs(
    const int NH, const uint16_t (*pb)[PAGE], const uint16_t *vt, int lim, int D, float *acc) {
    const int num_pairs = (lim + 1) / 2;
    for (int c = 0; c < D; c += 64) {
        __m512 o[4][4];
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) o[h][i] = _mm512_loadu_ps(acc + h * D + c + 16 * i);
        for (int kp = 0; kp < num_pairs; kp++) {
            __m512bh vv[4];
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_loadu_si512(vt + ((int64_t)kp * D + c + 16 * i) * 2);
                if (2 * kp + 1 >= lim) /* keep the even words: slot 2 kp's values */
                    v = _mm512_maskz_mov_epi16((__mmask32)0x55555555u, v);
                vv[i] = (__m512bh)v;
            }
            for (int h = 0; h < NH; h++) {
                int32_t pair; /* p[h][2 kp], p[h][2 kp + 1] */
                memcpy(&pair, &pb[h][2 * kp], 4);
                const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
                for (int i = 0; i < 4; i++) o[h][i] = _mm512_dpbf16_ps(o[h][i], vv[i], pp);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc + h * D + c + 16 * i, o[h][i]);
    }
}
#endif

/* One query's online-softmax step over one page: the scores sc (keys past the page's valid
 * ones may hold anything, NaN) masked, the running maximum m and sum l updated, and the page's
 * probabilities returned (0 past valid). *correction: what the query's sums acc must be
 * multiplied by before this page's values are added (1: nothing to do). */
static inline __m512 page_softmax(__m512 sc, __mmask16 valid, float *m, float *l,
                                  float *correction) {
    sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), sc);
    const float page_max = _mm512_reduce_max_ps(sc);
    *correction = 1.0f;
    if (page_max > *m) {
        *correction = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - page_max);
        *l *= *correction;
        *m = page_max;
    }
    const __m512 pv =
        _mm512_maskz_mov_ps(valid, exp16_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(*m))));
    *l += _mm512_reduce_add_ps(pv);
    return pv;
}

/* acc [D] *= c, D a multiple of 16 */
static inline void scale_row(float *acc, int D, float c) {
    const __m512 cv = _mm512_set1_ps(c);
    for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), cv));
}

/* nq query vectors of one query row (heads of one KV group: they see the same lim keys) against
 * one page, with the online-softmax update of each one's m, l and acc [nq, D]. q holds the fp32
 * queries, scaled, q_stride bytes apart. D is a multiple of 64. (A bf16 cache held as pairs
 * takes runs of pages instead: group_run_pairs.) */
static inline void group_page_avx512(int bf16, const float *q, const void *kp, const void *vp,
                                     int64_t kstride, int lim, int D, int nq, float *m, float *l,
                                     float *acc, const PagePrefetch *pf, int *call,
                                     int num_calls) {
    const __mmask16 valid = lim >= PAGE ? (__mmask16)0xffff : (__mmask16)((1u << lim) - 1);
    float p[4][PAGE]; /* the page's probabilities, per head */
    for (int h0 = 0; h0 < nq; h0 += 4) {
        const int nh = nq - h0 < 4 ? nq - h0 : 4;
        for (int h = 0; h < nh; h++) {
            const int r = h0 + h;
            if (pf) prefetch_slice(pf, (*call)++, 2 * num_calls);
            const __m512 sc = page_scores_avx512(bf16, q + r * D, kp, kstride, D);
            if (pf) prefetch_slice(pf, (*call)++, 2 * num_calls);
            float correction;
            _mm512_storeu_ps(p[h], page_softmax(sc, valid, &m[r], &l[r], &correction));
            if (correction != 1.0f) scale_row(acc + r * D, D, correction);
        }
        float *a = acc + h0 * D;
        switch (nh) {
        case 1: page_values_avx512(1, bf16, p, vp, kstride, lim, D, a); break;
        case 2: page_values_avx512(2, bf16, p, vp, kstride, lim, D, a); break;
        case 3: page_values_avx512(3, bf16, p, vp, kstride, lim, D, a); break;
        default: page_values_avx512(4, bf16, p, vp, kstride, lim, D, a); break;
        }
    }
}
#ifdef HAVE_BF16_DOT
/* Over pairs, a KV group's heads take PAGE_RUN pages a call: first every page's scores
 * (independent of each other), then page after page the running maximum, the rescale and the
 * probabilities, then page after page the values. A page at a time, each page's values waited
 * on its maximum, exponentials and sums, a chain the next page's loads could not overlap. The
 * arithmetic is still a page at a time, operation for operation (a maximum a page, the sums
 * rescaled before each page's values are added): the results are those of one page a call, bit
 * for bit (checked on the default model's 30 layers), at every batch size. A maximum a run
 * instead (as torch's flash attention takes one per 512 keys) moved the default model's bf16
 * logits by a rounding's worth, enough to turn its answer to "What is the capital of France?"
 * from "The capital of France is Paris." into a French non-answer. Default model, Zen 4 EPYC,
 * 2 threads, one page a call against runs of 2 alternated in one process (blocks of steps): one
 * decode at context 512-544 0.982x the step (faster in 62 of 85 blocks), at 2048 0.940x (60 of
 * 62); 32 decodes at 256-288 0.964x and 0.980x (two runs); a 512-token prefill 0.938x. Runs of
 * 4 were slower at 32 decodes (1.03x: with 3 KV groups a task, the scores outgrow the
 * registers). */
#define PAGE_RUN 2

/* The next run's pages, fetched a slice per call as prefetch_slice does one page's. */
typedef struct {
    const char *k[PAGE_RUN], *v[PAGE_RUN]; /* each page's first line of the task's heads */
    int num_pages, page_lines;             /* pages; lines of one page's K (as of its V) */
} RunPrefetch;

static inline void prefetch_run_slice(const RunPrefetch *pf, int call, int num_calls) {
    const int lines = pf->num_pages * pf->page_lines;
    const int l0 = (int)((int64_t)lines * call / num_calls);
    int l1 = (int)((int64_t)lines * (call + 1) / num_calls);
    if (l1 > lines) l1 = lines;
    int j = l0 / pf->page_lines, col = l0 - j * pf->page_lines; /* one division a call */
    for (int ln = l0; ln < l1; ln++) {
        __builtin_prefetch(pf->k[j] + col * 64, 0, 2);
        __builtin_prefetch(pf->v[j] + col * 64, 0, 2);
        __asm__ volatile("");
        if (++col == pf->page_lines) col = 0, j++;
    }
}

/* nq raw bf16 queries (q_stride elements apart: the heads of one KV group on one query row)
 * against np <= PAGE_RUN pages held as pairs: kt[j] and vt[j] the group's K and V on page j, of
 * which the row sees lim[j] keys (1 to 16), with the online-softmax update of each query's m,
 * l and acc [nq, D]. pf (NULL: none): the next run, a slice fetched before each page's
 * scores and values (*call counts the task's calls on this run, num_calls all of them). */
static inline void group_run_pairs(const uint16_t *q, int64_t q_stride, const uint16_t *const *kt,
                                   const uint16_t *const *vt, const int *lim, int np, int D,
                                   int nq, float scale, float *m, float *l, float *acc,
                                   const RunPrefetch *pf, int *call, int num_calls) {
    for (int h0 = 0; h0 < nq; h0 += 4) {
        const int nh = nq - h0 < 4 ? nq - h0 : 4;
        const uint16_t *qh = q + h0 * q_stride;
        __m512 scores[PAGE_RUN][4];
        float correction[PAGE_RUN][4]; /* the sums' rescale before page j's values; 1: none */
        uint16_t pb[PAGE_RUN][4][PAGE]; /* page j's probabilities per head, rounded to bf16 */
        for (int j = 0; j < np; j++) {
            if (pf) prefetch_run_slice(pf, (*call)++, num_calls);
            switch (nh) {
            case 1: page_scores_pairs(1, qh, q_stride, kt[j], D, scale, scores[j]); break;
            case 2: page_scores_pairs(2, qh, q_stride, kt[j], D, scale, scores[j]); break;
            case 3: page_scores_pairs(3, qh, q_stride, kt[j], D, scale, scores[j]); break;
            default: page_scores_pairs(4, qh, q_stride, kt[j], D, scale, scores[j]); break;
            }
        }
        for (int j = 0; j < np; j++) {
            const __mmask16 valid =
                lim[j] >= PAGE ? (__mmask16)0xffff : (__mmask16)((1u << lim[j]) - 1);
            for (int h = 0; h < nh; h++) {
                const int r = h0 + h;
                const __m512 pv =
                    page_softmax(scores[j][h], valid, &m[r], &l[r], &correction[j][h]);
                _mm256_storeu_si256((__m256i *)pb[j][h], (__m256i)_mm512_cvtneps_pbh(pv));
            }
        }
        float *a = acc + h0 * D;
        for (int j = 0; j < np; j++) {
            if (pf) prefetch_run_slice(pf, (*call)++, num_calls);
            for (int h = 0; h < nh; h++)
                if (correction[j][h] != 1.0f) scale_row(a + h * D, D, correction[j][h]);
            switch (nh) {
            case 1: page_values_pairs(1, pb[j], vt[j], lim[j], D, a); break;
            case 2: page_values_pairs(2, pb[j], vt[j], lim[j], D, a); break;
            case 3: page_values_pairs(3, pb[j], vt[j], lim[j], D, a); break;
            default: page_values_pairs(4, pb[j], vt[j], lim[j], D, a); break;
            }
        }
    }
}
#endif
#endif

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

int ppr_kv_as_pairs(int elem_bytes, int D) { return kv_as_pairs(elem_bytes, D); }

/* One task: query rows [row0, row0 + nrows) of one sequence, for the query heads of KV heads
 * [g0, g1). Online softmax over the context, one 16-key page at a time, in fp32. A page of the
 * cache holds all KV heads of its 16 slots back to back (16 * Hkv * D values for K, the same
 * for V), so a task over all heads reads it front to back, and the next page is prefetched. */
typedef struct {
    int seq, g0, g1, row0, nrows;
    int h0, nh; /* the query heads [h0, h0 + nh) of each group (all G, unless a lone sequence's
                   heads are split so that every thread has work) */
} Task;

/* Where query vector gh (head gh % nh of the task's group gh / nh) of packed row t starts in
 * q and out [T, H, D]: the load and the store of a task agree by construction. */
static inline int64_t query_offset(const Task *task, int64_t t, int gh, int G, int H, int D) {
    const int head = (task->g0 + gh / task->nh) * G + task->h0 + gh % task->nh;
    return (t * H + head) * D;
}

#ifdef HAVE_BF16_DOT
/* run = the first up-to-PAGE_RUN of `pages_left` pages listed at `pages`, for `task`'s KV
 * groups (none: run->num_pages 0) */
static inline void run_of_pages(RunPrefetch *run, const void *kv, const int32_t *pages,
                                int pages_left, const Task *task, int Hkv, int D,
                                int elem_bytes, int64_t v_offset) {
    run->num_pages = 0;
    run->page_lines = (int)((int64_t)PAGE * (task->g1 - task->g0) * D * elem_bytes / 64);
    for (int j = 0; j < PAGE_RUN && j < pages_left; j++, run->num_pages++) {
        run->k[j] = (const char *)kv +
                    ((int64_t)pages[j] * PAGE * Hkv + (int64_t)task->g0 * PAGE) * D * elem_bytes;
        run->v[j] = run->k[j] + v_offset * elem_bytes;
    }
}
#endif

/* `task` (see above); over pairs, its last run fetches `next_task`'s first (NULL: none) */
static void attend_task(const Task *task, const Task *next_task, int elem_bytes, const void *q,
                        const void *kv, void *out, const int32_t *q_start, const int32_t *q_len,
                        const int32_t *ctx_len, const int32_t *table, int table_stride,
                        int64_t num_slots, int H, int Hkv, int D, float scale, float *scratch) {
    const int G = H / Hkv;
    const int num_groups = task->g1 - task->g0, nh = task->nh;
    const int R = task->nrows * num_groups * nh; /* query vectors: r = (i * groups + g) * nh + h */
    float *qv = scratch;                          /* [R, D] */
    float *acc = qv + R * D;                      /* [R, D] */
    float *kbuf = acc + R * D;                    /* [PAGE, D] (bf16 pages, converted) */
    float *vbuf = kbuf + PAGE * D;                /* [PAGE, D] */
    float m[MAX_TILE_ROWS], l[MAX_TILE_ROWS];
    int pos[MAX_TILE_ROWS];
    const int s_idx = task->seq;
    const int first_pos = ctx_len[s_idx] - q_len[s_idx];
    const int64_t row_stride = (int64_t)Hkv * D; /* elements between consecutive slots */
    const int64_t v_offset = num_slots * row_stride;
    const int32_t *blocks = table + (int64_t)s_idx * table_stride;
#ifdef HAVE_AVX2_ATTENTION
    const int use_avx2 = D % 8 == 0;
#endif
#ifdef HAVE_AVX512_ATTENTION
    const int use_avx512 = avx512_attention(D);
#endif
    /* pairs: vdpbf16ps reads the bf16 queries where they are (group_run_pairs), no fp32 copy */
    const int pairs = kv_as_pairs(elem_bytes, D);

    for (int i = 0; i < task->nrows; i++) {
        const int64_t t = q_start[s_idx] + task->row0 + i;
        for (int gh = 0; gh < num_groups * nh; gh++) {
            const int r = i * num_groups * nh + gh;
            const int64_t off = query_offset(task, t, gh, G, H, D);
            if (elem_bytes == 4) {
                const float *src = (const float *)q + off;
                for (int d = 0; d < D; d++) qv[r * D + d] = src[d] * scale;
            } else if (!pairs) {
                const uint16_t *src = (const uint16_t *)q + off;
                for (int d = 0; d < D; d++) qv[r * D + d] = bf16_load(src[d]) * scale;
            }
            memset(acc + r * D, 0, sizeof(float) * D);
            m[r] = -INFINITY;
            l[r] = 0.0f;
            pos[r] = first_pos + task->row0 + i;
        }
    }
    const int last_pos = first_pos + task->row0 + task->nrows - 1;
    const int num_pages = last_pos / PAGE + 1;
    const int64_t span_bytes = (int64_t)num_groups * D * elem_bytes; /* a slot's task heads */
    PagePrefetch pf = {NULL, NULL, row_stride * elem_bytes, (int)((span_bytes + 63) / 64), 0};
    pf.lines = PAGE * pf.lines_per_row;
    const int first_row_pos = first_pos + task->row0;
#ifdef HAVE_BF16_DOT
    if (pairs) { /* runs of PAGE_RUN pages (group_run_pairs), the next run fetched meanwhile */
        const int head_blocks = (nh + 3) / 4; /* group_run_pairs' blocks of up to four heads */
        for (int page = 0; page < num_pages; page += PAGE_RUN) {
            const int run_pages = num_pages - page < PAGE_RUN ? num_pages - page : PAGE_RUN;
            const int key0 = page * PAGE, next = page + PAGE_RUN;
            const int rows_before = key0 > first_row_pos ? key0 - first_row_pos : 0;
            RunPrefetch run;
            run_of_pages(&run, kv, blocks + next, num_pages - next, task, Hkv, D, elem_bytes,
                         v_offset);
            if (!run.num_pages && next_task) {
                /* the task's last run: fetch the first run of the task this thread likely
                 * takes next (its pages, its groups), which otherwise started cold: with a
                 * step's weights streamed between two layers, a sequence's context is out of
                 * cache, and the first run's loads waited with nothing to overlap. Alternated
                 * in one process, medians: attention alone (16 decodes of context 116, 15
                 * layers, 96 MB streamed between passes), one thread, 9.54 -> 7.41 us a
                 * sequence and layer; 32 and 64 decodes on two threads 5.03 -> 4.29 and 4.78
                 * -> 3.83. Whole decode steps (StageRunner.run): 16 rows, one thread (a PP=2
                 * stage), layers 0-14 9.65 -> 9.29 ms (faster in 88 of 103 block pairs),
                 * layers 15-29 and the lm_head 13.93 -> 13.58 (58 of 71); 32 rows, two threads,
                 * 23.53 -> 23.00 (57 of 84). A lone sequence's tasks are its KV groups, one a
                 * thread: no next task, nothing fetched. */
                const int n_seq = next_task->seq;
                const int n_last = ctx_len[n_seq] - q_len[n_seq] + next_task->row0 +
                                   next_task->nrows - 1;
                run_of_pages(&run, kv, table + (int64_t)n_seq * table_stride, n_last / PAGE + 1,
                             next_task, Hkv, D, elem_bytes, v_offset);
            }
            /* the calls this run makes: two a page per block of heads, rows before it none */
            const int num_calls = (task->nrows - rows_before) * num_groups * 2 * run_pages *
                                  head_blocks;
            int call = 0;
            for (int g = task->g0; g < task->g1; g++) {
                const uint16_t *kt[PAGE_RUN], *vt[PAGE_RUN];
                for (int j = 0; j < run_pages; j++) {
                    kt[j] = (const uint16_t *)kv +
                            ((int64_t)blocks[page + j] * PAGE * Hkv + (int64_t)g * PAGE) * D;
                    vt[j] = kt[j] + v_offset;
                }
                for (int i = rows_before; i < task->nrows; i++) {
                    const int r = (i * num_groups + (g - task->g0)) * nh; /* its first head */
                    int lim[PAGE_RUN], np = 0; /* the pages of the run the row sees */
                    for (; np < run_pages && pos[r] + 1 > key0 + np * PAGE; np++) {
                        const int seen = pos[r] + 1 - (key0 + np * PAGE);
                        lim[np] = seen > PAGE ? PAGE : seen;
                    }
                    const int64_t t = q_start[s_idx] + task->row0 + i;
                    const uint16_t *qr = (const uint16_t *)q +
                                         query_offset(task, t, (g - task->g0) * nh, G, H, D);
                    group_run_pairs(qr, D, kt, vt, lim, np, D, nh, scale, &m[r], &l[r],
                                    acc + r * D, run.num_pages ? &run : NULL, &call, num_calls);
                }
            }
        }
    } else
#endif
    for (int page = 0; page < num_pages; page++) {
        const int key0 = page * PAGE;
        const int nk = last_pos + 1 - key0 < PAGE ? last_pos + 1 - key0 : PAGE;
        /* the calls this page makes: rows before the page (lim <= 0 below) make none */
        const int rows_before = key0 > first_row_pos ? key0 - first_row_pos : 0;
        const int calls_per_page = (task->nrows - rows_before) * num_groups * nh;
        const int prefetching = page + 1 < num_pages;
        if (prefetching) {
            pf.k = (const char *)kv +
                   ((int64_t)blocks[page + 1] * PAGE * Hkv + task->g0) * D *
                       elem_bytes;
            pf.v = pf.k + v_offset * elem_bytes;
        }
        int call = 0;
        for (int g = task->g0; g < task->g1; g++) {
            const int64_t base = ((int64_t)blocks[page] * PAGE * Hkv + g) * D;
#ifdef HAVE_AVX512_ATTENTION
            if (use_avx512) {
                const char *kb = (const char *)kv + base * elem_bytes;
                for (int i = 0; i < task->nrows; i++) {
                    const int r = (i * num_groups + (g - task->g0)) * nh; /* its first head */
                    int lim = pos[r] + 1 - key0;
                    if (lim <= 0) continue;
                    if (lim > nk) lim = nk;
                    group_page_avx512(elem_bytes == 2, qv + r * D, kb,
                                      kb + v_offset * elem_bytes, row_stride, lim, D, nh, &m[r],
                                      &l[r], acc + r * D, prefetching ? &pf : NULL, &call,
                                      calls_per_page);
                }
                continue;
            }
#endif
            const float *kp, *vp;
            int64_t kstride;
            if (elem_bytes == 4) {
                kp = (const float *)kv + base;
                vp = kp + v_offset;
                kstride = row_stride;
            } else {
                /* every row of the page, so the eight-key blocks may read past nk */
                const uint16_t *kb = (const uint16_t *)kv + base;
                for (int j = 0; j < PAGE; j++)
                    for (int d = 0; d < D; d++) {
                        kbuf[j * D + d] = bf16_load(kb[j * row_stride + d]);
                        vbuf[j * D + d] = bf16_load(kb[v_offset + j * row_stride + d]);
                    }
                kp = kbuf;
                vp = vbuf;
                kstride = D;
            }
            for (int i = 0; i < task->nrows; i++)
                for (int h = 0; h < nh; h++) {
                    const int r = (i * num_groups + (g - task->g0)) * nh + h;
                    int lim = pos[r] + 1 - key0; /* keys of this page this query sees */
                    if (lim <= 0) continue;
                    if (lim > nk) lim = nk;
                    if (prefetching) prefetch_slice(&pf, call++, calls_per_page);
#ifdef HAVE_AVX2_ATTENTION
                    if (use_avx2) {
                        row_page_avx2(qv + r * D, kp, vp, kstride, lim, D, &m[r], &l[r],
                                      acc + r * D);
                        continue;
                    }
#endif
                    row_page_generic(qv + r * D, kp, vp, kstride, lim, D, &m[r], &l[r],
                                     acc + r * D);
                }
        }
    }
    for (int i = 0; i < task->nrows; i++) {
        const int64_t t = q_start[s_idx] + task->row0 + i;
        for (int gh = 0; gh < num_groups * nh; gh++) {
            const int r = i * num_groups * nh + gh;
            const int64_t off = query_offset(task, t, gh, G, H, D);
            const float inv = 1.0f / l[r];
            if (elem_bytes == 4) {
                float *dst = (float *)out + off;
                for (int d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
            } else {
                uint16_t *dst = (uint16_t *)out + off;
                for (int d = 0; d < D; d++) dst[d] = bf16_store(acc[r * D + d] * inv);
            }
        }
    }
}

/* The context from which a lone sequence's KV groups go out a task per thread (see below).
 * One decode, 9 heads over 3 KV groups, head_dim 64, bf16 pairs, 2 threads, Zen 4, C harness
 * with 100 MB streamed between the 30 layers, medians of 4 alternated runs, us a layer: 128 keys
 * 6.3 -> 8.2 (slower), 256 13.8 -> 13.6, 512 25.7 -> 22.0, 1024 46.3 -> 37.9. */
#define LONE_CONTEXT 512

/* The tasks of one attention call for a team of num_threads threads (see ppr_paged_attention):
 * their count, and with `tasks` (non-NULL) the tasks themselves. How the work is cut depends on
 * the team and the batch; each head's arithmetic does not. */
static int attention_plan(int elem_bytes, int num_seqs, const int32_t *q_len,
                          const int32_t *ctx_len, int H, int Hkv, int D, int num_threads,
                          Task *tasks) {
    const int G = H / Hkv;
    /* A task holds up to MAX_TILE_ROWS query vectors. All KV heads in one task read each page
     * front to back; with few sequences (a single stream) the heads are split instead, so every
     * thread has work. */
    int row_tiles = 0;
    for (int s = 0; s < num_seqs; s++) row_tiles += q_len[s];
    int groups_per_task = MAX_TILE_ROWS / G;
    if (groups_per_task > Hkv) groups_per_task = Hkv;
    /* Few sequences (a single stream): one KV head per task, and if that still leaves a thread
     * idle, one query head per task (each then reads its group's pages; they are in cache) -
     * except where group_page_avx512 runs: there a group's heads share each page's loads and
     * widening, and splitting them cost more than the idle thread (one decode, 9 heads over 3
     * KV heads, 2 threads, Zen 4, alternated: context 128 18.0 19.8 17.2 -> 15.3 15.0 17.5 us a
     * layer, context 512 44.8 38.4 38.3 -> 30.9 34.0 25.3). */
    int heads_per_task = G;
    if (num_seqs < 2 * num_threads && row_tiles < 4 * num_threads) {
        groups_per_task = 1;
        if (!avx512_attention(D) && num_seqs * Hkv < 2 * num_threads) heads_per_task = 1;
        /* One sequence over pairs, with a context of LONE_CONTEXT keys or more: its KV groups
         * dealt out a task a thread (3 groups on 2 threads: 2 and 1, not 1 and 1 and then 1 more
         * on whichever thread is free first). A task walks its groups' pages together (a run at
         * a time, group after group), so the second group's loads overlap the first's chains
         * instead of waiting for them. Each head's arithmetic is unchanged. */
        if (num_seqs == 1 && kv_as_pairs(elem_bytes, D) && ctx_len[0] >= LONE_CONTEXT)
            groups_per_task = (Hkv + num_threads - 1) / num_threads;
    }
    int rows_per_task = MAX_TILE_ROWS / (heads_per_task * groups_per_task);
    if (rows_per_task < 1) rows_per_task = 1;
    int n = 0;
    for (int s = 0; s < num_seqs; s++)
        for (int row0 = 0; row0 < q_len[s]; row0 += rows_per_task)
            for (int g0 = 0; g0 < Hkv; g0 += groups_per_task)
                for (int h0 = 0; h0 < G; h0 += heads_per_task, n++) {
                    if (!tasks) continue;
                    int rows = q_len[s] - row0 < rows_per_task ? q_len[s] - row0 : rows_per_task;
                    int g1 = g0 + groups_per_task < Hkv ? g0 + groups_per_task : Hkv;
                    tasks[n] = (Task){s, g0, g1, row0, rows, h0, heads_per_task};
                }
    return n;
}

/* floats of one thread's attention scratch (attend_task) */
static size_t attention_scratch_floats(int D) {
    return (size_t)2 * MAX_TILE_ROWS * D + 2 * PAGE * D;
}

/* The tasks dealt out over the team this runs in (an orphaned `omp for`: called outside a
 * parallel region, one thread takes them all), each thread with its own scratch (NULL: that
 * thread's tasks are skipped, and the caller reports the failure). */
static void attention_run(const Task *tasks, int num_tasks, int elem_bytes, const void *q,
                          const void *kv, void *out, const int32_t *q_start, const int32_t *q_len,
                          const int32_t *ctx_len, const int32_t *table, int table_stride,
                          int64_t num_slots, int H, int Hkv, int D, float scale, float *scratch) {
    const int team = omp_get_num_threads();
    /* dynamic: a prefill task costs many times a decode task. Threads take the decode tasks of
     * a batch about in turn, so each fetches the task `team` places on (its likely next). */
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < num_tasks; i++)
        if (scratch)
            attend_task(&tasks[i], i + team < num_tasks ? &tasks[i + team] : NULL, elem_bytes,
                        q, kv, out, q_start, q_len, ctx_len, table, table_stride, num_slots, H,
                        Hkv, D, scale, scratch);
}

/* Whether ppr_paged_attention takes these shapes: H a multiple of Hkv, a KV group's heads in
 * one tile, fp32 or bf16. */
static int attention_shapes_ok(int elem_bytes, int H, int Hkv) {
    return Hkv > 0 && H % Hkv == 0 && H / Hkv <= MAX_TILE_ROWS &&
           (elem_bytes == 4 || elem_bytes == 2);
}

/* Whether the attention metadata stays inside what the caller described: every sequence's
 * query rows inside [0, num_tokens), its context at least its queries and at most its block
 * table's pages, and every block id its context reads inside the pool. 0, or a PPR_BAD_*. */
static int attention_indices_check(int num_tokens, int num_seqs, const int32_t *q_start,
                                   const int32_t *q_len, const int32_t *ctx_len,
                                   const int32_t *table, int table_stride, int64_t num_slots) {
    if (num_tokens < 0 || num_seqs < 0) return PPR_BAD_ROWS;
    if (table_stride < 0) return PPR_BAD_CONTEXT;
    const int64_t num_blocks = num_slots / PAGE;
    for (int s = 0; s < num_seqs; s++) {
        if (q_start[s] < 0 || q_len[s] < 0 || (int64_t)q_start[s] + q_len[s] > num_tokens)
            return PPR_BAD_ROWS;
        if (ctx_len[s] < q_len[s] || ctx_len[s] > (int64_t)table_stride * PAGE)
            return PPR_BAD_CONTEXT;
        const int32_t *blocks = table + (int64_t)s * table_stride;
        for (int64_t j = 0; j * PAGE < ctx_len[s]; j++)
            if (blocks[j] < 0 || blocks[j] >= num_blocks) return PPR_BAD_BLOCK;
    }
    return 0;
}

/* Attention of every query row in a packed batch over its sequence's paged context, its
 * metadata already checked (attention_indices_check). elem_bytes: 4 (float32) or 2 (bfloat16)
 * for q, kv and out. Returns 0, or -1 when H is not a multiple of Hkv or scratch cannot be
 * allocated. */
static int paged_attention(int elem_bytes, const void *q, const void *kv, void *out, int num_seqs,
                           const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                           const int32_t *table, int table_stride, int64_t num_slots, int H,
                           int Hkv, int D, float scale) {
    if (!attention_shapes_ok(elem_bytes, H, Hkv) || D <= 0) return PPR_REFUSED;
    const int num_threads = omp_get_max_threads();
    const int num_tasks =
        attention_plan(elem_bytes, num_seqs, q_len, ctx_len, H, Hkv, D, num_threads, NULL);
    Task *tasks = malloc(sizeof(Task) * (num_tasks > 0 ? num_tasks : 1));
    if (!tasks) return -1;
    attention_plan(elem_bytes, num_seqs, q_len, ctx_len, H, Hkv, D, num_threads, tasks);
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * attention_scratch_floats(D));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        attention_run(tasks, num_tasks, elem_bytes, q, kv, out, q_start, q_len, ctx_len, table,
                      table_stride, num_slots, H, Hkv, D, scale, scratch);
        free(scratch);
    }
    free(tasks);
    return failed ? -1 : 0;
}

/* paged_attention for a caller from outside: q and out [num_tokens, H, D], the cache
 * [2, num_slots, Hkv, D]; the metadata is checked against those sizes first. */
int ppr_paged_attention(int elem_bytes, const void *q, const void *kv, void *out, int num_tokens,
                        int num_seqs, const int32_t *q_start, const int32_t *q_len,
                        const int32_t *ctx_len, const int32_t *table, int table_stride,
                        int64_t num_slots, int H, int Hkv, int D, float scale) {
    const int bad = attention_indices_check(num_tokens, num_seqs, q_start, q_len, ctx_len, table,
                                            table_stride, num_slots);
    if (bad) return bad;
    return paged_attention(elem_bytes, q, kv, out, num_seqs, q_start, q_len, ctx_len, table,
                           table_stride, num_slots, H, Hkv, D, scale);
}

/* Streaming weights from memory is the whole cost of a small batch, and the hardware
 * prefetcher alone left much of the bandwidth unused (a core streamed int8 rows at 7 GB/s and
 * fp32 rows at 13 GB/s; with the next quad prefetched, 13 and 17 GB/s; two or more quads
 * ahead was slower again, measured on the 2-core EPYC). */
static inline void prefetch_next_quad(const void *w, int quad, int num_quads, int64_t quad_bytes) {
    if (quad + 1 >= num_quads) return;
    const char *p = (const char *)w + (int64_t)(quad + 1) * quad_bytes;
    for (int64_t b = 0; b < quad_bytes; b += 64) __builtin_prefetch(p + b);
}

/* The int8 matmuls: dot products of x [K] with four weight rows, in four independent sums (one
 * sum alone is a chain of dependent FMAs, bound by their latency rather than by memory). With
 * AVX2 they are written out by hand: gcc's vectorized reductions widen int8 to 32 lanes and
 * spill. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* int8 weights against int16 activations: vpmaddwd multiplies 16 pairs and adds neighbours
 * into 8 int32 lanes, a third of the instructions of widening int8 to fp32 for an FMA. The
 * int32 sums are moved into fp32 every I8_FLUSH steps (a lane gains at most 2 * 127 * 32767 a
 * step, so |sum| <= 64 * 2 * 127 * 32767 < 2^31). */
#define I8_FLUSH 64
static inline __m256i load16_i8(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

static void dot_i8_q16(int num_x, const int16_t *const *xs, const int8_t *w0, const int8_t *w1,
                       const int8_t *w2, const int8_t *w3, int K, float out[][4]) {
    /* num_x is 1 or 2: rows of x sharing each loaded weight vector */
    __m256 f[2][4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) f[i][j] = _mm256_setzero_ps();
    const int16_t *x0 = xs[0], *x1 = xs[num_x - 1];
    int k = 0;
    const int K16 = K / 16 * 16;
    while (k < K16) {
        const int end = k + 16 * I8_FLUSH < K16 ? k + 16 * I8_FLUSH : K16;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        if (num_x == 2) {
            for (; k < end; k += 16) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(x0 + k));
                const __m256i v = _mm256_loadu_si256((const __m256i *)(x1 + k));
                __m256i w = load16_i8(w0 + k);
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(u, w));
                b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(v, w));
                w = load16_i8(w1 + k);
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(u, w));
                b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(v, w));
                w = load16_i8(w2 + k);
                a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(u, w));
                b2 = _mm256_add_epi32(b2, _mm256_madd_epi16(v, w));
                w = load16_i8(w3 + k);
                a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(u, w));
                b3 = _mm256_add_epi32(b3, _mm256_madd_epi16(v, w));
            }
        } else {
            for (; k < end; k += 16) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(x0 + k));
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(u, load16_i8(w0 + k)));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(u, load16_i8(w1 + k)));
                a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(u, load16_i8(w2 + k)));
                a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(u, load16_i8(w3 + k)));
            }
        }
        f[0][0] = _mm256_add_ps(f[0][0], _mm256_cvtepi32_ps(a0));
        f[0][1] = _mm256_add_ps(f[0][1], _mm256_cvtepi32_ps(a1));
        f[0][2] = _mm256_add_ps(f[0][2], _mm256_cvtepi32_ps(a2));
        f[0][3] = _mm256_add_ps(f[0][3], _mm256_cvtepi32_ps(a3));
        f[1][0] = _mm256_add_ps(f[1][0], _mm256_cvtepi32_ps(b0));
        f[1][1] = _mm256_add_ps(f[1][1], _mm256_cvtepi32_ps(b1));
        f[1][2] = _mm256_add_ps(f[1][2], _mm256_cvtepi32_ps(b2));
        f[1][3] = _mm256_add_ps(f[1][3], _mm256_cvtepi32_ps(b3));
    }
    for (int i = 0; i < num_x; i++) {
        _mm_storeu_ps(out[i], hsum4(f[i][0], f[i][1], f[i][2], f[i][3]));
        const int16_t *x = xs[i];
        for (int kk = K16; kk < K; kk++) {
            out[i][0] += (float)(x[kk] * w0[kk]), out[i][1] += (float)(x[kk] * w1[kk]);
            out[i][2] += (float)(x[kk] * w2[kk]), out[i][3] += (float)(x[kk] * w3[kk]);
        }
    }
}

/* One int16 input row against one int8 weight row, read as one sequential stream. */
static inline float dot1_i8_q16(const int16_t *x, const int8_t *w, int K) {
    __m256 f = _mm256_setzero_ps();
    const int K32 = K / 32 * 32;
    int k = 0;
    while (k < K32) {
        const int end = k + 32 * I8_FLUSH < K32 ? k + 32 * I8_FLUSH : K32;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        for (; k < end; k += 32) {
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(
                _mm256_loadu_si256((const __m256i *)(x + k)), load16_i8(w + k)));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(
                _mm256_loadu_si256((const __m256i *)(x + k + 16)), load16_i8(w + k + 16)));
        }
        f = _mm256_add_ps(f, _mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1)));
    }
    float sum = hsum8(f);
    for (; k < K; k++) sum += (float)(x[k] * w[k]);
    return sum;
}

#if defined(__AVX512BW__)
/* The AVX-512 int8 path fetches the quad after next into L2: on a Zen 4 EPYC, 2 threads,
 * alternated over 3 rounds, int8 rows of K 576 streamed at 17.3 27.1 21.4 GB/s with the next
 * quad into L1 and at 24.6 27.9 28.0 this way (K 1536: 12.0 22.3 17.3 -> 20.5 25.4 21.6). */
static inline void prefetch_quad_after_next(const void *w, int quad, int num_quads,
                                            int64_t quad_bytes) {
    if (quad + 2 >= num_quads) return;
    const char *p = (const char *)w + (int64_t)(quad + 2) * quad_bytes;
    for (int64_t b = 0; b < quad_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* One int16 input row against four int8 weight rows, 32 lanes a step (AVX-512's vpmaddwd), the
 * quad after next prefetched. Row r's 32 columns from k are at w[r] + k * kmul: kmul 1 for
 * rows [N, K] (a quad read as four streams), 4 for quads (ppr_linear_int8_quads: one stream;
 * K % 32 = 0 there, so the scalar tail, which reads rows, never runs). dot1_i8_q16 read one
 * row per call, with no prefetch, at 25 GB/s on a Zen 5 EPYC. */
static inline __attribute__((always_inline)) void dot1x4_i8_q16(const int16_t *x,
                                                                const int8_t *const *w, int K,
                                                                float out[4], const int kmul) {
    __m512 f[4];
    for (int r = 0; r < 4; r++) f[r] = _mm512_setzero_ps();
    const int K32 = K / 32 * 32;
    int k = 0;
    while (k < K32) {
        const int end = k + 32 * I8_FLUSH < K32 ? k + 32 * I8_FLUSH : K32;
        __m512i a[4];
        for (int r = 0; r < 4; r++) a[r] = _mm512_setzero_si512();
        for (; k < end; k += 32) {
            const __m512i xv = _mm512_loadu_si512(x + k);
            for (int r = 0; r < 4; r++) {
                const __m512i wv = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(w[r] + (int64_t)k * kmul)));
                a[r] = _mm512_add_epi32(a[r], _mm512_madd_epi16(xv, wv));
            }
        }
        for (int r = 0; r < 4; r++) f[r] = _mm512_add_ps(f[r], _mm512_cvtepi32_ps(a[r]));
    }
    for (int r = 0; r < 4; r++) {
        out[r] = _mm512_reduce_add_ps(f[r]);
        for (int kk = K32; kk < K; kk++) out[r] += (float)(x[kk] * w[r][kk]);
    }
}

/* Four int16 rows of x against four int8 weight rows (a prefill's rows): 16 sums of 32 lanes,
 * with AVX512_VNNI's vpdpwssd where the CPU has it; the 16 results come out of one transposing
 * add tree. Rows past num_x repeat the last (their results are dropped). The weight rows as
 * dot1x4_i8_q16 reads them (kmul). The AVX2 kernel took two rows of x per pass. */
static inline __attribute__((always_inline)) void dot4x4_i8_q16(const int16_t *const *xs,
                                                                const int8_t *const *w, int K,
                                                                float out[16], const int kmul) {
    __m512 f[16];
    for (int i = 0; i < 16; i++) f[i] = _mm512_setzero_ps();
    const int K32 = K / 32 * 32;
    int k = 0;
    while (k < K32) {
        const int end = k + 32 * I8_FLUSH < K32 ? k + 32 * I8_FLUSH : K32;
        __m512i a[16];
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_si512();
        for (; k < end; k += 32) {
            __m512i wv[4];
            for (int r = 0; r < 4; r++)
                wv[r] = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(w[r] + (int64_t)k * kmul)));
            for (int m = 0; m < 4; m++) {
                const __m512i xv = _mm512_loadu_si512(xs[m] + k);
                for (int r = 0; r < 4; r++)
#ifdef __AVX512VNNI__
                    a[4 * m + r] = _mm512_dpwssd_epi32(a[4 * m + r], xv, wv[r]);
#else
                    a[4 * m + r] = _mm512_add_epi32(a[4 * m + r], _mm512_madd_epi16(xv, wv[r]));
#endif
            }
        }
        for (int i = 0; i < 16; i++) f[i] = _mm512_add_ps(f[i], _mm512_cvtepi32_ps(a[i]));
    }
    _mm512_storeu_ps(out, hsum16x16(f)); /* out[4 m + r] */
    for (int m = 0; m < 4; m++)
        for (int r = 0; r < 4; r++)
            for (int kk = K32; kk < K; kk++) out[4 * m + r] += (float)(xs[m][kk] * w[r][kk]);
}
#endif

/* y[i] = v in fp32 or bf16 (elem_bytes 4 or 2): a bf16 stage's int8 matmul reads and writes
 * bf16 itself, instead of two torch conversions around every call */
static inline void put_y(void *y, int64_t i, float v, int elem_bytes) {
    if (elem_bytes == 4)
        ((float *)y)[i] = v;
    else
        ((uint16_t *)y)[i] = bf16_store(v);
}

static inline float get_x(const void *x, int64_t i, int elem_bytes) {
    return elem_bytes == 4 ? ((const float *)x)[i] : bf16_load(((const uint16_t *)x)[i]);
}

/* One row x [K] (fp32 or bf16) rounded to int16, xq [K], with its scale max |x| / 32767 (1 for
 * a zero row), returned: x * (1 / scale) to the nearest, ties to even (lrintf's rounding; the
 * vector conversion's too). With AVX-512 sixteen values an instruction: a single stream's int8
 * step rounded ~100k values one at a time while the other thread waited (~0.4 ms of ~6). */
static float quantize_row_q16(const void *x, int elem_bytes, int K, int16_t *xq) {
    float amax = 0.0f;
    int k = 0;
#ifdef HAVE_AVX512_ATTENTION /* (AVX512F and BW: f32x16_load) */
    __m512 vmax = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) /* max_ps returns its second operand for a NaN, as below */
        vmax = _mm512_max_ps(
            _mm512_abs_ps(f32x16_load((const char *)x + (int64_t)k * elem_bytes, elem_bytes == 2)),
            vmax);
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; k < K; k++) {
        const float v = fabsf(get_x(x, k, elem_bytes));
        amax = v > amax ? v : amax;
    }
    const float scale = amax > 0.0f ? amax / 32767.0f : 1.0f, inv = 1.0f / scale;
    k = 0;
#ifdef HAVE_AVX512_ATTENTION
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; k + 16 <= K; k += 16) { /* |x| * inv <= 32767.5: the narrowing never saturates */
        const __m512 v = f32x16_load((const char *)x + (int64_t)k * elem_bytes, elem_bytes == 2);
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));
        _mm256_storeu_si256((__m256i *)(xq + k), _mm512_cvtsepi32_epi16(q));
    }
#endif
    for (; k < K; k++) xq[k] = (int16_t)lrintf(get_x(x, k, elem_bytes) * inv);
    return scale;
}

/* Rows x [M, K] (fp32 or bf16) rounded to int16 xq [M, K], each with its scale, scales [M], as
 * ppr_linear_int8 rounds its input (exported for the tests); returns 0. A prefill's rows in
 * parallel (on one thread they were ~9% of an int8 prefill of 128 tokens). */
int ppr_quantize_rows_q16(int elem_bytes, const void *x, int M, int K, int16_t *xq,
                          float *scales) {
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int mi = 0; mi < M; mi++)
        scales[mi] = quantize_row_q16((const char *)x + (int64_t)mi * K * elem_bytes, elem_bytes,
                                      K, xq + (int64_t)mi * K);
    return 0;
}

/* Rows x [M, K] rounded for the int8 matmuls: xq [M, K] int16 (*xq, the one allocation: free it)
 * and their scales [M] (returned). NULL where there is no memory. */
static float *rounded_rows(int elem_bytes, const void *x, int M, int K, int16_t **xq) {
    const size_t rows_bytes = ((size_t)M * K * sizeof(int16_t) + 63) / 64 * 64;
    char *buffer = malloc(rows_bytes + sizeof(float) * (size_t)M);
    *xq = (int16_t *)buffer;
    if (!buffer) return NULL;
    float *scales = (float *)(buffer + rows_bytes);
    ppr_quantize_rows_q16(elem_bytes, x, M, K, *xq, scales);
    return scales;
}

#if defined(__AVX512BW__)
/* The AVX-512 int8 matmul over quads of weight rows, the quad after next prefetched: one row of
 * x, or blocks of 4. interleaved: w holds each quad's rows as ppr_linear_int8_quads takes them
 * (blocks of 32 columns, the four rows' 32 bytes back to back; N % 4 = K % 32 = 0); else as
 * rows [N, K]. Rows xq [M, K] already rounded, with their scales. */
static void int8_quads_avx512(int elem_bytes, const int16_t *xq, const float *x_scale,
                              const int8_t *w, const float *scale, void *y, int M, int N, int K,
                              int interleaved) {
    const int num_quads = (N + 3) / 4;
#pragma omp parallel for schedule(guided, 4)
    for (int qd = 0; qd < num_quads; qd++) {
        const int rows = N - 4 * qd < 4 ? N - 4 * qd : 4;
        const int8_t *wr[4];
        for (int i = 0; i < 4; i++) /* a row's 32 columns from k: wr[i] + k * kmul */
            wr[i] = interleaved ? w + (int64_t)qd * 4 * K + 32 * i
                                : w + (int64_t)(4 * qd + (i < rows ? i : rows - 1)) * K;
        prefetch_quad_after_next(w, qd, num_quads, (int64_t)4 * K);
        if (M == 1) {
            float out[4];
            if (interleaved) dot1x4_i8_q16(xq, wr, K, out, 4);
            else dot1x4_i8_q16(xq, wr, K, out, 1);
            for (int i = 0; i < rows; i++)
                put_y(y, 4 * qd + i, out[i] * x_scale[0] * scale[4 * qd + i], elem_bytes);
            continue;
        }
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int num_x = M - m0 < 4 ? M - m0 : 4;
            const int16_t *xs[4];
            for (int m = 0; m < 4; m++)
                xs[m] = xq + (int64_t)(m0 + (m < num_x ? m : num_x - 1)) * K;
            float out[16];
            if (interleaved) dot4x4_i8_q16(xs, wr, K, out, 4);
            else dot4x4_i8_q16(xs, wr, K, out, 1);
            for (int m = 0; m < num_x; m++)
                for (int i = 0; i < rows; i++)
                    put_y(y, (int64_t)(m0 + m) * N + 4 * qd + i,
                          out[4 * m + i] * x_scale[m0 + m] * scale[4 * qd + i], elem_bytes);
        }
    }
}
#endif

/* y[M, N] = (x[M, K] @ Wq[N, K]^T) * scale[N]: weight-only int8, one fp32 scale per output
 * channel: a quarter of fp32's weight bytes, so a quarter of the single-stream step's reads.
 * Each row of x is first rounded to int16 with its own scale (max |x| / 32767: a relative
 * step of 2^-15 of the row's largest value, finer than bf16's 2^-8 mantissa), so the products
 * run in integers; y = sum * x_scale * w_scale. */
void ppr_linear_int8(int elem_bytes, const void *x, const int8_t *w, const float *scale, void *y,
                     int M, int N, int K) {
    int16_t *xq;
    const float *x_scale = rounded_rows(elem_bytes, x, M, K, &xq);
    if (!x_scale) {
        for (int64_t i = 0; i < (int64_t)M * N; i++) put_y(y, i, NAN, elem_bytes); /* loud */
        return;
    }
#if defined(__AVX512BW__)
    int8_quads_avx512(elem_bytes, xq, x_scale, w, scale, y, M, N, K, 0);
    free(xq);
    return;
#endif
    if (M == 1) {
#pragma omp parallel for schedule(guided, 64)
        for (int n = 0; n < N; n++)
            put_y(y, n, dot1_i8_q16(xq, w + (int64_t)n * K, K) * x_scale[0] * scale[n], elem_bytes);
        free(xq);
        return;
    }
    const int num_quads = (N + 3) / 4;
#pragma omp parallel for schedule(guided, 4)
    for (int qd = 0; qd < num_quads; qd++) {
        int n[4];
        for (int i = 0; i < 4; i++) n[i] = 4 * qd + i < N ? 4 * qd + i : N - 1;
        const int rows = N - 4 * qd < 4 ? N - 4 * qd : 4;
        prefetch_next_quad(w, qd, num_quads, (int64_t)4 * K);
        for (int mi = 0; mi < M; mi += 2) {
            const int num_x = mi + 1 < M ? 2 : 1;
            const int16_t *xs[2] = {xq + (int64_t)mi * K, xq + (int64_t)(mi + num_x - 1) * K};
            float out[2][4];
            dot_i8_q16(num_x, xs, w + (int64_t)n[0] * K, w + (int64_t)n[1] * K,
                       w + (int64_t)n[2] * K, w + (int64_t)n[3] * K, K, out);
            for (int j = 0; j < num_x; j++)
                for (int i = 0; i < rows; i++)
                    put_y(y, (int64_t)(mi + j) * N + n[i],
                          out[j][i] * x_scale[mi + j] * scale[n[i]], elem_bytes);
        }
    }
    free(xq);
}
#define HAVE_INT8_LINEAR

#else /* portable C: the compiler vectorizes what it can */
#define DOT4(WTYPE, NAME)                                                                      \
    static inline void NAME(const float *x, const WTYPE *w0, const WTYPE *w1, const WTYPE *w2, \
                            const WTYPE *w3, int K, float out[4]) {                            \
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                                  \
        for (int k = 0; k < K; k++) {                                                          \
            const float xk = x[k];                                                             \
            a0 += xk * (float)w0[k];                                                           \
            a1 += xk * (float)w1[k];                                                           \
            a2 += xk * (float)w2[k];                                                           \
            a3 += xk * (float)w3[k];                                                           \
        }                                                                                      \
        out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;                                    \
    }
DOT4(int8_t, dot4_i8)

#define DOT2X4(WTYPE, NAME, DOT4NAME)                                                          \
    static inline void NAME(const float *x0, const float *x1, const WTYPE *w0,                 \
                            const WTYPE *w1, const WTYPE *w2, const WTYPE *w3, int K,          \
                            float out0[4], float out1[4]) {                                    \
        DOT4NAME(x0, w0, w1, w2, w3, K, out0);                                                 \
        DOT4NAME(x1, w0, w1, w2, w3, K, out1);                                                 \
    }
DOT2X4(int8_t, dot2x4_i8, dot4_i8)

/* This build's int8 matmul widens the weights to fp32 and rounds no rows to int16: -1. */
int ppr_quantize_rows_q16(int elem_bytes, const void *x, int M, int K, int16_t *xq,
                          float *scales) {
    (void)elem_bytes, (void)x, (void)M, (void)K, (void)xq, (void)scales;
    return -1;
}
#endif

/* y[M, N] = (x[M, K] @ W[N, K]^T) * scale[N] for int8 weights (one fp32 scale per output
 * channel), portable C. Threads split the output channels in quads of four weight rows; a quad
 * (4 K values, in L1) is used for every input row, two at a time, so the weights are read from
 * memory once per call whatever M is. */
#define LINEAR(WTYPE, NAME, DOT4NAME, DOT2X4NAME)                                              \
    static void NAME(const float *x, const WTYPE *w, const float *scale, float *y, int M, int N, \
              int K) {                                                                         \
        const int num_quads = (N + 3) / 4;                                                     \
        _Pragma("omp parallel for schedule(guided, 4)") for (int qd = 0; qd < num_quads; qd++) { \
            int n[4];                                                                          \
            for (int i = 0; i < 4; i++) n[i] = 4 * qd + i < N ? 4 * qd + i : N - 1;            \
            const WTYPE *w0 = w + (int64_t)n[0] * K, *w1 = w + (int64_t)n[1] * K;              \
            const WTYPE *w2 = w + (int64_t)n[2] * K, *w3 = w + (int64_t)n[3] * K;              \
            float s[4];                                                                        \
            for (int i = 0; i < 4; i++) s[i] = scale ? scale[n[i]] : 1.0f;                     \
            const int rows = N - 4 * qd < 4 ? N - 4 * qd : 4;                                  \
            prefetch_next_quad(w, qd, num_quads, (int64_t)4 * K * sizeof(WTYPE));                   \
            int mi = 0;                                                                        \
            for (; mi + 2 <= M; mi += 2) {                                                     \
                float o0[4], o1[4];                                                            \
                DOT2X4NAME(x + (int64_t)mi * K, x + (int64_t)(mi + 1) * K, w0, w1, w2, w3, K,  \
                           o0, o1);                                                            \
                for (int i = 0; i < rows; i++) {                                               \
                    y[(int64_t)mi * N + n[i]] = o0[i] * s[i];                                  \
                    y[(int64_t)(mi + 1) * N + n[i]] = o1[i] * s[i];                            \
                }                                                                              \
            }                                                                                  \
            if (mi < M) {                                                                      \
                float o0[4];                                                                   \
                DOT4NAME(x + (int64_t)mi * K, w0, w1, w2, w3, K, o0);                          \
                for (int i = 0; i < rows; i++) y[(int64_t)mi * N + n[i]] = o0[i] * s[i];       \
            }                                                                                  \
        }                                                                                      \
    }
#ifndef HAVE_INT8_LINEAR /* portable: int8 widened to fp32 inside the dot products */
LINEAR(int8_t, linear_int8_rows, dot4_i8, dot2x4_i8)
void ppr_linear_int8(int elem_bytes, const void *x, const int8_t *w, const float *scale, void *y,
                     int M, int N, int K) {
    if (elem_bytes == 4) {
        linear_int8_rows(x, w, scale, y, M, N, K);
        return;
    }
    /* bf16: through fp32 copies of x and y */
    float *xf = malloc(sizeof(float) * (size_t)M * K), *yf = malloc(sizeof(float) * (size_t)M * N);
    if (xf && yf) {
        for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = bf16_load(((const uint16_t *)x)[i]);
        linear_int8_rows(xf, w, scale, yf, M, N, K);
    }
    for (int64_t i = 0; i < (int64_t)M * N; i++)
        ((uint16_t *)y)[i] = bf16_store(xf && yf ? yf[i] : NAN); /* loud, never silent */
    free(xf);
    free(yf);
}
#endif

/* Whether this build multiplies int8 weights held as ppr_linear_int8_quads takes them: AVX-512
 * does (a quad's rows then stream as one run of memory, not four). */
int ppr_int8_quads(void) {
#if defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* ppr_linear_int8 over weights held in quads: each 4 rows [4, K] as blocks of 32 columns, the
 * four rows' 32 bytes back to back ([N / 4, K / 32, 4, 32]; stages/linear.py pack_int8_quads).
 * The same products in the same order as ppr_linear_int8 over rows, so the same values bit for
 * bit. A single stream's int8 step read its rows as four streams a quad; one stream instead
 * (C harness, every matrix of SmolLM2 at one row, 2 threads, Zen 4 EPYC, alternated, 2 runs):
 * 5.75 -> 4.98 and 7.05 -> 6.24 ms. Returns 0, or -1 where this build has no AVX-512 (see
 * ppr_int8_quads), N % 4 or K % 32 is not 0, or no memory for a buffer. */
int ppr_linear_int8_quads(int elem_bytes, const void *x, const int8_t *w, const float *scale,
                          void *y, int M, int N, int K) {
#if defined(__AVX512BW__)
    if (N % 4 != 0 || K % 32 != 0) return -1;
    int16_t *xq;
    const float *x_scale = rounded_rows(elem_bytes, x, M, K, &xq);
    if (!x_scale) return -1;
    int8_quads_avx512(elem_bytes, xq, x_scale, w, scale, y, M, N, K, 1);
    free(xq);
    return 0;
#else
    (void)elem_bytes, (void)x, (void)w, (void)scale, (void)y, (void)M, (void)N, (void)K;
    return -1;
#endif
}

/* ---- fp32 matmul over weights packed in panels of 16 output channels ----
 *
 * panels [P, K, 16], P = ceil(N / 16): panels[p][k][j] = W[16p + j][k] (zero past N). One panel
 * is a contiguous stream of K * 64 bytes, read from memory once per call: every block of up to
 * six input rows then reuses it from L1/L2. A block keeps its 6 x 16 outputs in twelve AVX2
 * accumulators and, per k, loads two weight vectors and broadcasts six inputs: 8 loads per 12
 * FMAs, the shape BLIS uses on AVX2. Against oneDNN's prepacked weights (the previous path for
 * more than 4 rows) and this file's earlier row-major kernel, over every matmul of a SmolLM2
 * layer streamed from memory on the 2-core EPYC (ms, median): 1 thread, 15 layers: 1 row
 * 13 vs 22 (oneDNN), 16 rows 38 vs 49, 32 rows 60 vs 75; 2 threads, 30 layers: 1 row 20 vs 22
 * (the row-major kernel), 4 rows 22 vs 41, 32 rows 63 vs 79, 128 rows (10 layers) 79 vs 92,
 * 512 rows 267 vs 284. Each output is one FMA chain over k in order.
 *
 * While a panel is multiplied, the next one is fetched into L2, its lines shared evenly over
 * the panel's blocks so the fetches keep pace with memory instead of overflowing the core's
 * miss buffers. Fetched by the first block alone into L1, as before, a step's matmuls on one
 * thread (SmolLM2, all 30 layers and the lm_head, best of 5) took 56 ms at 8 rows, 71 at 16 and
 * 124 at 32; spread into L2, 33, 58 and 109 (spread into L1: 46, 67, 120). One row fetches four
 * lines every four k into L2: 17.8 against 19.5 ms on two threads (median of three). */
#define PANEL 16
#define MAX_BLOCK_ROWS 6
int ppr_panel_width(void) { return PANEL; }

void ppr_pack_f32(const float *w, float *panels, int N, int K) {
    const int num_panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < num_panels; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < PANEL; j++) {
                const int n = p * PANEL + j;
                panels[((int64_t)p * K + k) * PANEL + j] = n < N ? w[(int64_t)n * K + k] : 0.0f;
            }
}

/* y[rows, cols] (row stride ldy) = x[rows, K] (row stride K) @ panel[K, 16]; rows is a
 * constant after inlining, so the accumulators stay in registers. `next` (or NULL): the next
 * panel, whose lines pf_first, pf_first + pf_every, ... (one line per k) this block fetches
 * into L2 while it multiplies: the blocks of a panel share its fetch evenly. */
static inline __attribute__((always_inline)) void panel_block(const float *x, const float *panel,
                                                              int K, float *y, int64_t ldy,
                                                              int cols, const int rows,
                                                              const char *next, int pf_first,
                                                              int pf_every) {
#if defined(__AVX2__) && defined(__FMA__)
    /* Named accumulators: as an array, gcc kept them on the stack and stored all twelve every k
     * (1.7x slower at 32 rows). Rows past `rows` are dead code after inlining. */
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
    __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
#define PANEL_ROW(r)                                                                           \
    if (rows > r) {                                                                            \
        const __m256 xr = _mm256_broadcast_ss(x + (int64_t)r * K + k);                        \
        a##r = _mm256_fmadd_ps(xr, w0, a##r);                                                  \
        b##r = _mm256_fmadd_ps(xr, w1, b##r);                                                  \
    }
    int pf_k = next ? pf_first : K;
    for (int k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(panel + (int64_t)k * PANEL);
        const __m256 w1 = _mm256_loadu_ps(panel + (int64_t)k * PANEL + 8);
        if (k == pf_k) {
            __builtin_prefetch(next + (int64_t)k * PANEL * sizeof(float), 0, 1);
            pf_k += pf_every;
        }
        PANEL_ROW(0) PANEL_ROW(1) PANEL_ROW(2) PANEL_ROW(3) PANEL_ROW(4) PANEL_ROW(5)
    }
#undef PANEL_ROW
    const __m256 acc[MAX_BLOCK_ROWS][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
    for (int r = 0; r < rows; r++) {
        float *yr = y + (int64_t)r * ldy;
        if (cols == PANEL) {
            _mm256_storeu_ps(yr, acc[r][0]);
            _mm256_storeu_ps(yr + 8, acc[r][1]);
        } else {
            float out[PANEL];
            _mm256_storeu_ps(out, acc[r][0]);
            _mm256_storeu_ps(out + 8, acc[r][1]);
            memcpy(yr, out, sizeof(float) * cols);
        }
    }
#else
    float acc[MAX_BLOCK_ROWS][PANEL] = {{0}};
    (void)next, (void)pf_first, (void)pf_every;
    for (int k = 0; k < K; k++) {
        const float *wk = panel + (int64_t)k * PANEL;
        for (int r = 0; r < rows; r++) {
            const float xr = x[(int64_t)r * K + k];
#pragma omp simd
            for (int j = 0; j < PANEL; j++) acc[r][j] += xr * wk[j];
        }
    }
    for (int r = 0; r < rows; r++) memcpy(y + (int64_t)r * ldy, acc[r], sizeof(float) * cols);
#endif
}

/* One row: the panel streams once and is the whole cost, so four k at a time go to four
 * accumulator pairs (a single pair is a chain of dependent FMAs that cannot keep up with the
 * stream: measured 29 ms a SmolLM2 step against 20 with four). */
static inline void panel_row(const float *x, const float *panel, int K, float *y, int cols,
                             const char *next) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    int k = 0;
    for (; k + 4 <= K; k += 4) {
        const float *w = panel + (int64_t)k * PANEL;
        if (next) {
            const char *n = next + (int64_t)k * PANEL * sizeof(float);
            __builtin_prefetch(n, 0, 1), __builtin_prefetch(n + 64, 0, 1);
            __builtin_prefetch(n + 128, 0, 1), __builtin_prefetch(n + 192, 0, 1);
        }
        __m256 xk = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w), a0);
        b0 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w + 8), b0);
        xk = _mm256_broadcast_ss(x + k + 1);
        a1 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w + 16), a1);
        b1 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w + 24), b1);
        xk = _mm256_broadcast_ss(x + k + 2);
        a2 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w + 32), a2);
        b2 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w + 40), b2);
        xk = _mm256_broadcast_ss(x + k + 3);
        a3 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w + 48), a3);
        b3 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w + 56), b3);
    }
    for (; k < K; k++) {
        const __m256 xk = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(panel + (int64_t)k * PANEL), a0);
        b0 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(panel + (int64_t)k * PANEL + 8), b0);
    }
    float out[PANEL];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
    memcpy(y, out, sizeof(float) * cols);
#else
    panel_block(x, panel, K, y, 0, cols, 1, next, 0, 1);
#endif
}

/* Columns [16p, 16p + 16) of y[M, N] (row stride N) = x[M, K] @ panel[K, 16], row block by row
 * block; `next` (or NULL): the next panel, fetched into L2 meanwhile. */
static inline void multiply_panel(const float *x, const float *panel, int M, int N, int K, int p,
                                  float *y, const char *next) {
    const int num_blocks = (M + MAX_BLOCK_ROWS - 1) / MAX_BLOCK_ROWS;
    const int cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    int m = 0;
    for (int b = 0; b < num_blocks; b++) {
        const int rows = M / num_blocks + (b < M % num_blocks);
        const float *xb = x + (int64_t)m * K;
        float *yb = y + (int64_t)m * N + p * PANEL;
        switch (rows) {
        case 1: panel_row(xb, panel, K, yb, cols, b == 0 ? next : NULL); break;
        case 2: panel_block(xb, panel, K, yb, N, cols, 2, next, b, num_blocks); break;
        case 3: panel_block(xb, panel, K, yb, N, cols, 3, next, b, num_blocks); break;
        case 4: panel_block(xb, panel, K, yb, N, cols, 4, next, b, num_blocks); break;
        case 5: panel_block(xb, panel, K, yb, N, cols, 5, next, b, num_blocks); break;
        default: panel_block(xb, panel, K, yb, N, cols, 6, next, b, num_blocks); break;
        }
        m += rows;
    }
}

/* y[M, N] = x[M, K] @ W[N, K]^T, W given as panels (ppr_pack_f32). Threads split the panels;
 * the rows go in blocks of equal size, at most six (16 rows: 6, 5, 5; 8 rows: 4, 4), since a
 * block of one or two rows has too few accumulators to hide the FMA latency.
 *
 * Guided, not static: the two cores of this VM do not run at one speed (timed per block, one
 * core's 6-row blocks took 4,200-6,000 cycles while the other's took 7,000-7,700, in the same
 * call), and a stage shares them with the frontend and the clients; with a static split the
 * faster thread waits at the end of every call. 30 layers' matmuls at 64 rows, weights from
 * DRAM, 2 threads, medians of 11 alternated rounds, four runs: static 133.8, 134.7, 115.2 and
 * 134.2 ms, guided 125.3, 120.0, 108.0 and 112.3; serving 64 requests at 64 in flight (bench
 * serve, PP=1, three alternated rounds), a decode step of 64 took 253.6, 250.7, 254.1 ms against
 * 247.1, 246.9, 245.4. Other kernels are guided for the same reason. */
void ppr_linear_f32(const float *x, const float *panels, float *y, int M, int N, int K) {
    const int num_panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(guided, 4)
    for (int p = 0; p < num_panels; p++) {
        const float *panel = panels + (int64_t)p * K * PANEL;
        const char *next = p + 1 < num_panels ? (const char *)(panel + (int64_t)K * PANEL) : NULL;
        multiply_panel(x, panel, M, N, K, p, y, next);
    }
}

/* ---- fp32 matmul over weights held as integer codes on a per-block grid ----
 *
 * A checkpoint dequantized from GGUF's Q4_1 or Q8_0 (the default model is) holds fp32 weights
 * that are exactly w = d * q + m (Q4_1: q in 0..15, one d and m per 32 weights along K) or
 * w = d * q (Q8_0: q in -127..127). stages/grid.py finds such a matrix and hands its codes here;
 * each panel is turned back into the very same fp32 values (d * q rounded, then + m rounded, as
 * the converter computed them: never fused into one FMA) in a per-thread buffer, and multiplied
 * by panel_block / panel_row exactly as ppr_linear_f32 multiplies the fp32 panel. The results
 * are bit-identical; a decode step reads 5.3x (Q4_1) or 3.6x (Q8_0) fewer weight bytes.
 *
 * Layout, per panel of 16 output channels (P panels, K a multiple of 32):
 *   codes  Q4_1 [P, K, 8] bytes: byte i of row k = q[16p + i][k] | q[16p + 8 + i][k] << 4
 *          Q8_0 [P, K, 16] int8:  q[16p + j][k]
 *   scale  [P, K / 32, 16] fp32 (d), offset (Q4_1 only) [P, K / 32, 16] fp32 (m). */
#define GRID_BLOCK 32
/* v is rounded to its type here: the compiler cannot see through the empty asm, so it cannot
 * fuse the multiplication that made v with the addition that uses it into one FMA (gcc fuses
 * plain C and intrinsics alike at -O3 -march=native). */
#if defined(__x86_64__) || defined(__i386__)
#define ROUNDED(v) __asm__("" : "+x"(v))
#else
#define ROUNDED(v) __asm__("" : "+r"(v))
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The 16 weights of row k of a panel: codes c, the block's scales s0 s1 and offsets o0 o1
 * (lanes 0-7 and 8-15); lo, hi = fl(fl(d * q) + m) (has_offset) or fl(d * q). */
static inline __attribute__((always_inline)) void decode16(int bits, const uint8_t *c, __m256 s0,
                                                           __m256 s1, __m256 o0, __m256 o1,
                                                           int has_offset, __m256 *lo,
                                                           __m256 *hi) {
    __m256 l, h;
    if (bits == 4) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
        l = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        h = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    } else {
        l = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
        h = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8))));
    }
    l = _mm256_mul_ps(l, s0);
    h = _mm256_mul_ps(h, s1);
    if (has_offset) {
        ROUNDED(l);
        ROUNDED(h);
        l = _mm256_add_ps(l, o0);
        h = _mm256_add_ps(h, o1);
    }
    *lo = l, *hi = h;
}
#endif

/* codes of panel p -> buf [K, 16] fp32; fetches the next panel's codes and scales into L2
 * meanwhile (`next_*`, or NULL), a line every few k. */
static void dequant_panel(int bits, const uint8_t *codes, const float *scale, const float *offset,
                          int K, float *buf, const char *next_codes, const char *next_scale,
                          const char *next_offset) {
    const int code_bytes = bits == 4 ? 8 : 16; /* per k */
    for (int kb = 0; kb < K / GRID_BLOCK; kb++) {
        const float *s = scale + kb * PANEL, *o = offset ? offset + kb * PANEL : NULL;
        if (next_scale) {
            __builtin_prefetch(next_scale + kb * PANEL * 4, 0, 2);
            if (next_offset) __builtin_prefetch(next_offset + kb * PANEL * 4, 0, 2);
        }
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        const __m256 o0 = o ? _mm256_loadu_ps(o) : s0, o1 = o ? _mm256_loadu_ps(o + 8) : s1;
#endif
        for (int k = kb * GRID_BLOCK; k < (kb + 1) * GRID_BLOCK; k++) {
            const uint8_t *c = codes + (int64_t)k * code_bytes;
            if (next_codes && (k * code_bytes) % 64 == 0)
                __builtin_prefetch(next_codes + (int64_t)k * code_bytes, 0, 2);
            float *w = buf + (int64_t)k * PANEL;
#if defined(__AVX2__) && defined(__FMA__)
            __m256 lo, hi;
            decode16(bits, c, s0, s1, o0, o1, o != NULL, &lo, &hi);
            _mm256_storeu_ps(w, lo);
            _mm256_storeu_ps(w + 8, hi);
#else
            for (int j = 0; j < PANEL; j++) {
                const int q = bits == 4 ? (j < 8 ? c[j] & 15 : c[j - 8] >> 4) : (int8_t)c[j];
                float product = (float)q * s[j];
                ROUNDED(product);
                w[j] = o ? product + o[j] : product;
            }
#endif
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_GRID_ROW
/* One row, the codes decoded straight into the FMAs (no buffer: a single row uses each weight
 * once). The same four accumulator pairs, k mod 4, and the same final sums as panel_row, so the
 * result is bit-identical to panel_row over the decoded panel. */
static void grid_row(const float *x, int bits, const uint8_t *codes, const float *scale,
                     const float *offset, int K, float *y, int cols, const char *next_codes) {
    const int code_bytes = bits == 4 ? 8 : 16;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    for (int kb = 0; kb < K / GRID_BLOCK; kb++) {
        const float *s = scale + kb * PANEL, *o = offset ? offset + kb * PANEL : NULL;
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        const __m256 o0 = o ? _mm256_loadu_ps(o) : s0, o1 = o ? _mm256_loadu_ps(o + 8) : s1;
        for (int k = kb * GRID_BLOCK; k < (kb + 1) * GRID_BLOCK; k += 4) {
            const uint8_t *c = codes + (int64_t)k * code_bytes;
            if (next_codes && (k * code_bytes) % 64 == 0)
                __builtin_prefetch(next_codes + (int64_t)k * code_bytes, 0, 2);
            __m256 lo, hi;
            decode16(bits, c, s0, s1, o0, o1, o != NULL, &lo, &hi);
            __m256 xk = _mm256_broadcast_ss(x + k);
            a0 = _mm256_fmadd_ps(xk, lo, a0), b0 = _mm256_fmadd_ps(xk, hi, b0);
            decode16(bits, c + code_bytes, s0, s1, o0, o1, o != NULL, &lo, &hi);
            xk = _mm256_broadcast_ss(x + k + 1);
            a1 = _mm256_fmadd_ps(xk, lo, a1), b1 = _mm256_fmadd_ps(xk, hi, b1);
            decode16(bits, c + 2 * code_bytes, s0, s1, o0, o1, o != NULL, &lo, &hi);
            xk = _mm256_broadcast_ss(x + k + 2);
            a2 = _mm256_fmadd_ps(xk, lo, a2), b2 = _mm256_fmadd_ps(xk, hi, b2);
            decode16(bits, c + 3 * code_bytes, s0, s1, o0, o1, o != NULL, &lo, &hi);
            xk = _mm256_broadcast_ss(x + k + 3);
            a3 = _mm256_fmadd_ps(xk, lo, a3), b3 = _mm256_fmadd_ps(xk, hi, b3);
        }
    }
    float out[PANEL];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
    memcpy(y, out, sizeof(float) * cols);
}
#endif

/* y[M, N] = x[M, K] @ W[N, K]^T for W held as grid codes (see above; bits 4 or 8). */
int ppr_linear_grid(const float *x, const uint8_t *codes, const float *scale, const float *offset,
                    float *y, int M, int N, int K, int bits) {
    if (K % GRID_BLOCK || (bits != 4 && bits != 8)) return -1;
    if (M <= 0) return 0; /* e.g. a split lm_head's share of a step that samples nothing */
    const int num_panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_codes = (int64_t)K * (bits == 4 ? 8 : 16);
    const int64_t panel_scales = (int64_t)K / GRID_BLOCK * PANEL;
#ifdef HAVE_GRID_ROW
    const int buffered = M > 1; /* a single row decodes straight into its FMAs (grid_row) */
#else
    const int buffered = 1;
#endif
    int failed = 0;
#pragma omp parallel
    {
        float *buf = buffered ? aligned_alloc(64, sizeof(float) * PANEL * K) : NULL;
        if (buffered && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(guided, 4)
        for (int p = 0; p < num_panels; p++) {
            const int has_next = p + 1 < num_panels;
#ifdef HAVE_GRID_ROW
            if (!buffered) {
                const int cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
                grid_row(x, bits, codes + p * panel_codes, scale + p * panel_scales,
                         offset ? offset + p * panel_scales : NULL, K, y + p * PANEL, cols,
                         has_next ? (const char *)(codes + (p + 1) * panel_codes) : NULL);
                continue;
            }
#endif
            if (!buf) continue;
            dequant_panel(bits, codes + p * panel_codes, scale + p * panel_scales,
                          offset ? offset + p * panel_scales : NULL, K, buf,
                          has_next ? (const char *)(codes + (p + 1) * panel_codes) : NULL,
                          has_next ? (const char *)(scale + (p + 1) * panel_scales) : NULL,
                          has_next && offset ? (const char *)(offset + (p + 1) * panel_scales)
                                             : NULL);
            multiply_panel(x, buf, M, N, K, p, y, NULL); /* the codes were fetched ahead */
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* The codes of w [N, K] on a grid (stages/grid.py): for each block of 32 weights along a row
 * (block b = n * K / 32 + k / 32), the first of the `num_cand` scales cand[b, :] for which every
 * weight is exactly fl(fl(d * q) + offset[b]) (offset NULL: fl(d * q)) with q an integer in
 * [q_min, q_max]; q into codes [N, K], the scale into scale_out[b]. Returns how many blocks
 * have none (0: the matrix lies on the grid). */
int64_t ppr_grid_codes(const float *w, int N, int K, const float *cand, int num_cand,
               const float *offset, int q_min, int q_max, int8_t *codes, float *scale_out) {
    const int64_t num_blocks = (int64_t)N * (K / GRID_BLOCK);
    int64_t missing = 0;
#pragma omp parallel for schedule(static) reduction(+ : missing)
    for (int64_t b = 0; b < num_blocks; b++) {
        const float *wb = w + b * GRID_BLOCK;
        const float off = offset ? offset[b] : 0.0f;
        int found = 0;
        for (int c = 0; c < num_cand && !found; c++) {
            const float d = cand[b * num_cand + c];
            int ok = 1;
            for (int i = 0; i < GRID_BLOCK && ok; i++) {
                float q = d > 0.0f ? nearbyintf((wb[i] - off) / d) : 0.0f;
                q = q < q_min ? q_min : q > q_max ? q_max : q;
                float product = d * q;
                ROUNDED(product);
                ok = product + off == wb[i];
                codes[b * GRID_BLOCK + i] = (int8_t)q;
            }
            if (ok) {
                scale_out[b] = d;
                found = 1;
            }
        }
        missing += !found;
    }
    return missing;
}

/* The fp32 panels [P, K, 16] the codes stand for (what ppr_pack_f32 makes of the weight): the
 * stage checks them against the weight bit for bit before it trusts the codes. */
int ppr_unpack_grid(const uint8_t *codes, const float *scale, const float *offset, float *panels,
                    int N, int K, int bits) {
    if (K % GRID_BLOCK || (bits != 4 && bits != 8)) return -1;
    const int num_panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_codes = (int64_t)K * (bits == 4 ? 8 : 16);
    const int64_t panel_scales = (int64_t)K / GRID_BLOCK * PANEL;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < num_panels; p++)
        dequant_panel(bits, codes + p * panel_codes, scale + p * panel_scales,
                      offset ? offset + p * panel_scales : NULL, K,
                      panels + (int64_t)p * K * PANEL, NULL, NULL, NULL);
    return 0;
}

/* ---- the small ops around the matmuls: one call each instead of five to ten torch ops ---- */

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

/* ppr_add_rms_norm's rows, shared by the team this runs in (orphaned) */
static void add_rms_norm_rows(int elem_bytes, const void *h, const void *residual,
                              const void *weight, void *residual_out, void *x_out, int T, int d,
                              float eps) {
#pragma omp for schedule(guided, 4)
    for (int t = 0; t < T; t++)
        add_rms_norm_row(elem_bytes, h, residual, weight, residual_out, x_out, t, d, eps);
}

void ppr_add_rms_norm(int elem_bytes, const void *h, const void *residual, const void *weight,
                      void *residual_out, void *x_out, int T, int d, float eps) {
#pragma omp parallel if (T >= 8)
    add_rms_norm_rows(elem_bytes, h, residual, weight, residual_out, x_out, T, d, eps);
}

/* one bf16 head row x [D] rotated into o [D], rounded where transformers rounds in bf16: cos
 * and sin, each product, the sum (rounding once instead sent greedy text elsewhere within 30
 * tokens) */
static inline void rope_row_bf16(const uint16_t *x, const float *c, const float *s, uint16_t *o,
                                 int D) {
    const int half = D / 2;
    int i0 = 0;
#ifdef HAVE_BF16_DOT
    if (half % 16 == 0)
        for (; i0 + 16 <= D; i0 += 16) {
            const int j0 = i0 < half ? i0 + half : i0 - half;
            const __m512 cb = bf16x16_round(_mm512_loadu_ps(c + i0));
            const __m512 sb = bf16x16_round(_mm512_loadu_ps(s + i0));
            const __m512 xc = bf16x16_round(_mm512_mul_ps(bf16x16_load(x + i0), cb));
            const __m512 xs = bf16x16_round(_mm512_mul_ps(bf16x16_load(x + j0), sb));
            bf16x16_store(o + i0, _mm512_add_ps(xc, xs));
        }
#endif
#ifdef HAVE_AVX2_ATTENTION
    if (half % 8 == 0)
        for (; i0 + 8 <= D; i0 += 8) {
            const int j0 = i0 < half ? i0 + half : i0 - half;
            const __m256 cb = bf16x8_round(_mm256_loadu_ps(c + i0));
            const __m256 sb = bf16x8_round(_mm256_loadu_ps(s + i0));
            const __m256 xc = bf16x8_round(_mm256_mul_ps(bf16x8_load(x + i0), cb));
            const __m256 xs = bf16x8_round(_mm256_mul_ps(bf16x8_load(x + j0), sb));
            bf16x8_store(o + i0, _mm256_add_ps(xc, xs));
        }
#endif
    for (int i = i0; i < D; i++) {
        const int j = i < half ? i + half : i - half;
        const float cb = bf16_load(bf16_store(c[i])), sb = bf16_load(bf16_store(s[i]));
        o[i] = bf16_store(bf16_load(bf16_store(bf16_load(x[i]) * cb)) +
                          bf16_load(bf16_store(bf16_load(x[j]) * sb)));
    }
}

/* RoPE (rotate-half) on q and k, and this step's K and V stored at their cache slots. q, k and v
 * are column blocks of one fused [T, row] qkv matmul output: q [T, H, D] at column 0, k and v
 * [T, Hkv, D] at columns H*D and (H+Hkv)*D. The rotated q goes to q_out [T, H, D] (contiguous,
 * what attention reads); cos and signed sin are fp32 (the sine's first half negated):
 * out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i], row t's at row t of cos and sin [T, D],
 * or with `positions` [T] (non-NULL) at row positions[t] of tables [P, D] that cover them.
 * K and V land in rows of the cache, or as pairs where kv_as_pairs. */
static void rope_store_rows(int elem_bytes, const void *qkv, int64_t row, void *q_out,
                            const float *cos, const float *sin, const int64_t *positions,
                            const int64_t *slots, void *kv, int64_t num_slots, int T, int H,
                            int Hkv, int D) {
    const int half = D / 2, pairs = kv_as_pairs(elem_bytes, D);
    const int64_t v_offset = num_slots * Hkv * D;
#pragma omp for schedule(guided, 4)
    for (int t = 0; t < T; t++) {
        const int64_t at = (positions ? positions[t] : t) * D;
        const float *c = cos + at, *s = sin + at;
        /* pairs: slot j of its page; head g's keys and values start PAGE * D * g into the page */
        const int64_t page_start = slots[t] / PAGE * PAGE * Hkv * D, j = slots[t] % PAGE;
        for (int h = 0; h < H + Hkv; h++) {
            const int64_t src = (int64_t)t * row + (int64_t)h * D; /* q heads, then k heads */
            if (h >= H && pairs) { /* [D / 2][16][2] */
                uint16_t key[D];
                rope_row_bf16((const uint16_t *)qkv + src, c, s, key, D);
                uint16_t *kt = (uint16_t *)kv + page_start + (int64_t)(h - H) * PAGE * D;
                for (int d = 0; d < D; d++) kt[(d / 2) * 2 * PAGE + j * 2 + d % 2] = key[d];
                continue;
            }
            const int64_t dst = h < H ? ((int64_t)t * H + h) * D : (slots[t] * Hkv + h - H) * D;
            void *out = h < H ? q_out : kv;
            if (elem_bytes == 4) {
                const float *x = (const float *)qkv + src;
                float *o = (float *)out + dst;
#pragma omp simd
                for (int i = 0; i < half; i++) o[i] = x[i] * c[i] + x[i + half] * s[i];
#pragma omp simd
                for (int i = half; i < D; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
            } else {
                rope_row_bf16((const uint16_t *)qkv + src, c, s, (uint16_t *)out + dst, D);
            }
        }
        for (int g = 0; g < Hkv; g++) {
            const int64_t src = (int64_t)t * row + (int64_t)(H + Hkv + g) * D;
            if (pairs) { /* [8][D][2] */
                const uint16_t *x = (const uint16_t *)qkv + src;
                uint16_t *vt = (uint16_t *)kv + v_offset + page_start + (int64_t)g * PAGE * D +
                               (j / 2) * 2 * D + j % 2;
                for (int d = 0; d < D; d++) vt[2 * d] = x[d];
                continue;
            }
            const int64_t dst = v_offset + (slots[t] * Hkv + g) * D;
            memcpy((char *)kv + dst * elem_bytes, (const char *)qkv + src * elem_bytes,
                   (size_t)elem_bytes * D);
        }
    }
}

static void rope_store(int elem_bytes, const void *qkv, int64_t row, void *q_out,
                       const float *cos, const float *sin, const int64_t *positions,
                       const int64_t *slots, void *kv, int64_t num_slots, int T, int H, int Hkv,
                       int D) {
#pragma omp parallel if (T >= 8)
    rope_store_rows(elem_bytes, qkv, row, q_out, cos, sin, positions, slots, kv, num_slots, T, H,
                    Hkv, D);
}

/* Whether every one of T rows' cache slot lies in [0, num_slots) and, with positions (NULL:
 * none), its position in [0, rope_rows). 0, or a PPR_BAD_*. */
static int slots_positions_check(int T, const int64_t *slots, int64_t num_slots,
                                 const int64_t *positions, int64_t rope_rows) {
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots) return PPR_BAD_SLOT;
        if (positions && (positions[t] < 0 || positions[t] >= rope_rows)) return PPR_BAD_POSITION;
    }
    return 0;
}

/* rope_store_rows over cos and sin [T, D]: q_out [T, H, D], k and v into the cache
 * [2, num_slots, Hkv, D] at slots [T], each checked first. Returns 0 or PPR_BAD_SLOT. */
int ppr_rope_store(int elem_bytes, const void *qkv, int64_t row, void *q_out, const float *cos,
                   const float *sin, const int64_t *slots, void *kv, int64_t num_slots, int T,
                   int H, int Hkv, int D) {
    if (T < 0) return PPR_BAD_ROWS;
    const int bad = slots_positions_check(T, slots, num_slots, NULL, 0);
    if (bad) return bad;
    rope_store(elem_bytes, qkv, row, q_out, cos, sin, NULL, slots, kv, num_slots, T, H, Hkv, D);
    return 0;
}

/* out[n] = the first index of row n's largest value of x[N, V] (rows `stride` elements apart),
 * as torch's argmax: a NaN counts as the largest, the first NaN wins. torch's CPU argmax (and
 * max(dim), which the greedy paths used) runs a scalar loop: [32, 49152] bf16 took 1.4 ms on one
 * Zen 4 thread; here two vector passes over each row, the first for the maximum (and any NaN),
 * the second for its first index. */
static inline float row_value(const void *x, int64_t i, int elem_bytes) {
    return elem_bytes == 4 ? ((const float *)x)[i] : bf16_load(((const uint16_t *)x)[i]);
}

static int64_t row_argmax_scalar(const void *x, int64_t base, int V, int elem_bytes) {
    int64_t best = 0;
    float best_v = row_value(x, base, elem_bytes);
    if (best_v != best_v) return 0;
    for (int v = 1; v < V; v++) {
        const float f = row_value(x, base + v, elem_bytes);
        if (f != f) return v; /* NaN: the largest */
        if (f > best_v) best_v = f, best = v;
    }
    return best;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 row_load16(const void *x, int64_t i, int elem_bytes, __mmask16 keep) {
    if (elem_bytes == 4) return _mm512_maskz_loadu_ps(keep, (const float *)x + i);
    const __m256i b = _mm256_maskz_loadu_epi16(keep, (const uint16_t *)x + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

static int64_t row_argmax_avx512(const void *x, int64_t base, int V, int elem_bytes) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int v = 0; v < V; v += 16) {
        const __mmask16 keep = V - v >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - v)) - 1);
        const __m512 f = row_load16(x, base + v, elem_bytes, keep);
        nan |= _mm512_mask_cmp_ps_mask(keep, f, f, _CMP_UNORD_Q);
        top = _mm512_mask_max_ps(top, keep, top, f);
    }
    if (nan) return row_argmax_scalar(x, base, V, elem_bytes); /* the first NaN */
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int v = 0; v < V; v += 16) {
        const __mmask16 keep = V - v >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - v)) - 1);
        const __m512 f = row_load16(x, base + v, elem_bytes, keep);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(keep, f, best, _CMP_EQ_OQ);
        if (hit) return v + __builtin_ctz(hit);
    }
    return 0; /* not reached: the maximum is one of the row's values */
}
#endif

void ppr_row_argmax(int elem_bytes, const void *x, int64_t stride, int64_t *out, int N, int V) {
#pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        out[n] = row_argmax_avx512(x, (int64_t)n * stride, V, elem_bytes);
#else
        out[n] = row_argmax_scalar(x, (int64_t)n * stride, V, elem_bytes);
#endif
    }
}

/* exp(x) over the whole float range (clamped to [-87, 88]), vectorizable. */
static inline float exp_any(float x) {
    x = x > 88.0f ? 88.0f : x;
    return exp_nonpositive(x);
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

/* ppr_silu_mul's rows, shared by the team this runs in (orphaned) */
static void silu_mul_rows(int elem_bytes, const void *gate, const void *up, int64_t row,
                          void *out, int T, int I) {
#pragma omp for schedule(guided, 4)
    for (int t = 0; t < T; t++) silu_mul_row(elem_bytes, gate, up, row, out, t, I);
}

void ppr_silu_mul(int elem_bytes, const void *gate, const void *up, int64_t row, void *out, int T,
                  int I) {
#pragma omp parallel if (T >= 8)
    silu_mul_rows(elem_bytes, gate, up, row, out, T, I);
}

/* 1 where this build multiplies bf16 with vdpbf16ps (AVX512_BF16): the stage then packs its
 * bf16 weights for ppr_linear_bf16; elsewhere bf16 matmuls are torch's (oneDNN). */
int ppr_has_bf16_dot(void) {
#ifdef HAVE_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* bf16 matmuls, y[M, N] = x[M, K] @ W[N, K]^T: vdpbf16ps multiplies bf16 pairs exactly and
 * sums them in fp32; each y is rounded to bf16 once, as oneDNN's matmul does. The weight is
 * packed once, at load, in panels of 16 output channels with each K pair of a channel
 * adjacent, panels[p][kp][j][e] = w[16 p + j][2 kp + e] (zeros past N and K): one (panel,
 * pair) is 32 bf16, one 64-byte line, one vector. The micro-kernel broadcasts a pair of x
 * (32 bits) against it and accumulates 16 outputs in fp32, so no output is summed across
 * lanes. A row's sums run in the same order whatever the number of rows, so a sequence's
 * result does not depend on what it is batched with (oneDNN picks its kernel by M).
 * Against oneDNN on a Zen 5 EPYC, every SmolLM2 matmul of a step: 2 threads, 1 row 13.8 ->
 * 7.9 ms (oneDNN streamed the weights at 15-22 GB/s), 32 rows 22.8 -> 18.4, 64 rows 33.7 ->
 * 27.8, 512 rows 221 -> 187; half the model on one thread (a PP=2 stage), 11 rows 14.1 ->
 * 11.2, 16 rows 14.5 -> 12.0. A row-major kernel without packing (four weight rows, 32 lanes
 * summed per output at the end) matched this at one row and lost to oneDNN from 10 rows. */
void ppr_pack_bf16(const uint16_t *w, uint16_t *panels, int N, int K) {
    const int K2 = (K + 1) / 2, num_panels = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < num_panels; p++)
        for (int kp = 0; kp < K2; kp++)
            for (int j = 0; j < 16; j++)
                for (int e = 0; e < 2; e++) {
                    const int n = 16 * p + j, k = 2 * kp + e;
                    panels[(((int64_t)p * K2 + kp) * 16 + j) * 2 + e] =
                        n < N && k < K ? w[(int64_t)n * K + k] : 0;
                }
}

#ifdef HAVE_BF16_DOT
/* Rows of x per micro-kernel call: 12 x 2 panels = 24 accumulators of the 32 registers. Against
 * 8 (16 accumulators), alternated, half of SmolLM2 on one thread: 11 rows (a PP=2 stage's
 * micro-batch at 32 in flight) 6.1 -> 4.35 ms, 24 rows 9.3 -> 8.1; 2 threads, all of it, 32
 * rows 13.5 -> 12.7, 64 rows 23.8 -> 22.9; one row and 8 rows level. */
#define PB_MR 12
/* The next unit is fetched into L2, not L1 (it is consumed a unit later, and an L1 fill evicts
 * the unit being multiplied), its lines shared over every block of rows, not the first alone
 * (which then had to pull a unit from memory in the time of 12 rows). Half of SmolLM2 over
 * bf16 panels on a Zen 4 EPYC, alternated, medians: 1 thread, 16 rows 15.6 16.3 -> 14.9 14.0
 * ms, 32 rows 26.3 26.3 -> 25.9 24.7; 2 threads, 1 row 7.4 -> 6.3, 12 rows 7.6 -> 6.5, 32 rows
 * 15.8 -> 14.4. (Over grid codes, fetching into L2 changed nothing: 4.3 / 8.0 / 15.3 ms.) */
#define PB_FETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)

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
 * below ran 25-45% slower that way). */
static inline __attribute__((always_inline)) void pb_store(const int MR, __m512 (*acc)[2],
                                                           uint16_t *y, int N, int p0, int np) {
    for (int m = 0; m < MR; m++) {
        bf16_store16(y + (int64_t)m * N, N, p0, acc[m][0]);
        if (np > 1) bf16_store16(y + (int64_t)m * N, N, p0 + 1, acc[m][1]);
    }
}

/* y rows [0, MR) x panels p0, p0 + 1 (np of them: 1 or 2), whose packed pairs start at `unit`
 * (the panels' own memory, or a grid unit decoded into a buffer). `next`: the next unit's first
 * line (NULL: nothing to fetch); this block fetches its pairs fetch_first, fetch_first +
 * fetch_every, ... (two lines each, one per panel), so the blocks of a unit share the fetch. */
static inline __attribute__((always_inline)) void pb_micro(const int MR, const uint16_t *x,
                                                           const uint16_t *unit, uint16_t *y,
                                                           int N, int K, int p0, int np,
                                                           const char *next, int fetch_first,
                                                           int fetch_every) {
    const int K2 = (K + 1) / 2, kfull = K / 2; /* pairs with both halves inside the row */
    const __m512bh *w0 = (const __m512bh *)unit; /* panel p0's pairs, then panel p0 + 1's */
    const __m512bh *w1 = np > 1 ? w0 + K2 : w0;
    __m512 acc[PB_MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int fetch_kp = next ? fetch_first : K2;
    for (int kp = 0; kp < K2; kp++) {
        if (kp == fetch_kp) {
            PB_FETCH(next + (int64_t)kp * 64);
            PB_FETCH(next + ((int64_t)K2 + kp) * 64);
            fetch_kp += fetch_every;
        }
        /* unaligned loads: torch aligns the panels to 64 bytes, but nothing promises it */
        const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + kp);
        const __m512bh b = (__m512bh)_mm512_loadu_si512(w1 + kp);
        for (int m = 0; m < MR; m++) {
            int32_t pair; /* two bf16 of x, broadcast as one 32-bit lane */
            if (kp < kfull)
                memcpy(&pair, x + (int64_t)m * K + 2 * kp, 4);
            else /* K odd: the last pair's second half is the panels' zero */
                pair = x[(int64_t)m * K + 2 * kp];
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, a);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, b);
        }
    }
    pb_store(MR, acc, y, N, p0, np);
}

/* every row of x, PB_MR at a time, against panels p0, p0 + 1 (np) packed at `unit`; the first
 * block streams the unit in (from L2 where the previous unit fetched it), the later ones reuse
 * it from cache, and block b of e fetches the next unit's pairs b, b + e, ... */
static void pb_rows(const uint16_t *x, const uint16_t *unit, uint16_t *y, int M, int N, int K,
                    int p0, int np, const char *next) {
    const int num_blocks = (M + PB_MR - 1) / PB_MR;
    for (int m0 = 0; m0 < M; m0 += PB_MR) {
        const uint16_t *xm = x + (int64_t)m0 * K;
        uint16_t *ym = y + (int64_t)m0 * N;
        const int b = m0 / PB_MR, e = num_blocks;
        switch (M - m0 < PB_MR ? M - m0 : PB_MR) {
        case 1: pb_micro(1, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 2: pb_micro(2, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 3: pb_micro(3, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 4: pb_micro(4, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 5: pb_micro(5, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 6: pb_micro(6, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 7: pb_micro(7, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 8: pb_micro(8, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 9: pb_micro(9, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 10: pb_micro(10, xm, unit, ym, N, K, p0, np, next, b, e); break;
        case 11: pb_micro(11, xm, unit, ym, N, K, p0, np, next, b, e); break;
        default: pb_micro(12, xm, unit, ym, N, K, p0, np, next, b, e); break;
        }
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T in bf16 for W packed by ppr_pack_bf16. Returns -1 without
 * AVX512_BF16 (ppr_has_bf16_dot). Work is split over pairs of panels; each pair streams from
 * memory once and every block of up to PB_MR rows reuses it from cache. */
int ppr_linear_bf16(const uint16_t *x, const uint16_t *panels, uint16_t *y, int M, int N,
                    int K) {
#ifdef HAVE_BF16_DOT
    const int num_panels = (N + 15) / 16, num_units = (num_panels + 1) / 2;
    const int64_t unit_bytes = (int64_t)2 * ((K + 1) / 2) * 64;
#pragma omp parallel for schedule(guided, 2)
    for (int u = 0; u < num_units; u++) {
        const int np = num_panels - 2 * u < 2 ? num_panels - 2 * u : 2;
        /* the blocks of rows fetch the next unit into L2 as they go, spread over the unit's
         * pairs (a burst of a whole unit stalled the core) */
        const char *next = u + 1 < num_units ? (const char *)panels + (u + 1) * unit_bytes : NULL;
        pb_rows(x, panels + (int64_t)2 * u * ((K + 1) / 2) * 32, y, M, N, K, 2 * u, np, next);
    }
    return 0;
#else
    (void)x, (void)panels, (void)y, (void)M, (void)N, (void)K;
    return -1;
#endif
}

/* ---- bf16 matmuls over weights held as grid codes ----
 *
 * A bf16 stage holds a weight that lies on a GGUF grid (see the fp32 section above) as its codes
 * too: each (panel, K pair) is decoded to the 32 bf16 that ppr_pack_bf16 would have stored,
 * round(fl(d * q) + m) (or round(d * q)), and multiplied by vdpbf16ps exactly as pb_micro
 * multiplies the packed panel, in the same order: the same results as CpuBf16Linear, from 0.625
 * (Q4_1) or 1.06 (Q8_0) bytes a weight instead of 2. d and m are fp16 numbers (the grid's own),
 * q has at most 8 significant bits, so d * q is exact in fp32 and one FMA computes
 * fl(fl(d * q) + m); _mm512_cvtne2ps_pbh rounds to nearest even like torch (it flushes fp32
 * denormals, which such a product never is; the stage checks every decoded weight bit for bit
 * at load anyway, stages/linear.py).
 *
 * Layout, per panel of 16 output channels (P panels, K a multiple of 32, K2 = K / 2 pairs), in
 * the lane order the decode produces: decoded vector `lo` holds channels 0-7 and `hi` channels
 * 8-15, lane 2 j + e = channel j (or 8 + j), k = 2 kp + e, so _mm512_cvtne2ps_pbh(hi, lo) lands
 * each channel's pair in its 32-bit lane, as pb_micro expects:
 *   codes  Q4_1 [P, K2, 16] bytes: byte 2 j + e = q[16p + j][2kp + e]
 *                                                   | q[16p + 8 + j][2kp + e] << 4
 *          Q8_0 [P, K2, 32] int8: byte 2 j + e = q[16p + j][2kp + e],
 *                                 byte 16 + 2 j + e = q[16p + 8 + j][2kp + e]
 *   scale  [P, K / 32, 16] fp16 (d), offset (Q4_1 only) [P, K / 32, 16] fp16 (m), channel order */
#ifdef HAVE_BF16_DOT
/* one block's d and m (16 channels) spread over the decoded lanes: lo = channels 0-7 twice each */
typedef struct {
    __m512 d_lo, d_hi, m_lo, m_hi;
} gb_scales;

static inline __attribute__((always_inline)) gb_scales gb_block(const uint16_t *d,
                                                                 const uint16_t *m) {
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
    const __m512 m16 = m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)m))
                         : _mm512_setzero_ps();
    gb_scales s = {_mm512_permutexvar_ps(lo, d16), _mm512_permutexvar_ps(hi, d16),
                   _mm512_permutexvar_ps(lo, m16), _mm512_permutexvar_ps(hi, m16)};
    return s;
}

/* one (panel, pair): 16 (Q4_1) or 32 (Q8_0) code bytes -> the 32 bf16 pb_micro multiplies */
static inline __attribute__((always_inline)) __m512bh gb_decode(int bits, const uint8_t *c,
                                                                 const gb_scales *s) {
    __m512 lo, hi;
    if (bits == 4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
        lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
        hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        lo = _mm512_fmadd_ps(lo, s->d_lo, s->m_lo); /* d * q exact: one rounding, as the sum's */
        hi = _mm512_fmadd_ps(hi, s->d_hi, s->m_hi);
    } else {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
        lo = _mm512_mul_ps(lo, s->d_lo);
        hi = _mm512_mul_ps(hi, s->d_hi);
    }
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* Rows [0, MR) x panels p0, p0 + 1 (np), decoding each (panel, pair) once, straight into the
 * products. codes / scale / offset point at panel p0's; `next_*` at the next unit's (NULL: last
 * unit), fetched a line per line consumed; `save` (or NULL) takes the decoded pairs [2][K2][32]
 * for the rows after these. Sums in pb_micro's order: the same bits as pb_micro over the
 * decoded panels. */
static inline __attribute__((always_inline)) void gb_micro(
    const int MR, const uint16_t *x, int bits, const uint8_t *codes, const uint16_t *scale,
    const uint16_t *offset, uint16_t *y, int N, int K, int p0, int np, const char *next_codes,
    const char *next_scale, const char *next_offset, uint16_t *save) {
    const int K2 = K / 2, KB = K / GRID_BLOCK, pair_bytes = bits == 4 ? 16 : 32;
    const uint8_t *c1 = np > 1 ? codes + (int64_t)K2 * pair_bytes : codes;
    const int64_t scale1 = np > 1 ? (int64_t)KB * PANEL : 0;
    __m512 acc[PB_MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        const gb_scales s0 = gb_block(scale + kb * PANEL, offset ? offset + kb * PANEL : NULL);
        const gb_scales s1 = gb_block(scale + scale1 + kb * PANEL,
                                      offset ? offset + scale1 + kb * PANEL : NULL);
        if (next_scale) {
            __builtin_prefetch(next_scale + (int64_t)kb * 2 * PANEL * 2);
            if (next_offset) __builtin_prefetch(next_offset + (int64_t)kb * 2 * PANEL * 2);
        }
        for (int kp = kb * (GRID_BLOCK / 2); kp < (kb + 1) * (GRID_BLOCK / 2); kp++) {
            if (next_codes && ((int64_t)kp * 2 * pair_bytes) % 64 == 0)
                __builtin_prefetch(next_codes + (int64_t)kp * 2 * pair_bytes);
            const __m512bh a = gb_decode(bits, codes + (int64_t)kp * pair_bytes, &s0);
            const __m512bh b = gb_decode(bits, c1 + (int64_t)kp * pair_bytes, &s1);
            if (save) { /* the decoded unit, for the rows after these (pb_rows) */
                _mm512_storeu_si512(save + (int64_t)kp * 32, (__m512i)a);
                _mm512_storeu_si512(save + ((int64_t)K2 + kp) * 32, (__m512i)b);
            }
            for (int m = 0; m < MR; m++) {
                int32_t pair; /* two bf16 of x (K is even), broadcast as one 32-bit lane */
                memcpy(&pair, x + (int64_t)m * K + 2 * kp, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, a);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, b);
            }
        }
    }
    pb_store(MR, acc, y, N, p0, np);
}

/* one panel's codes -> its packed bf16 pairs [K2][32] at `out` (ppr_pack_bf16's layout) */
static void gb_unpack(int bits, const uint8_t *codes, const uint16_t *scale,
                      const uint16_t *offset, int K, uint16_t *out) {
    const int pair_bytes = bits == 4 ? 16 : 32;
    for (int kb = 0; kb < K / GRID_BLOCK; kb++) {
        const gb_scales s = gb_block(scale + kb * PANEL, offset ? offset + kb * PANEL : NULL);
        for (int kp = kb * (GRID_BLOCK / 2); kp < (kb + 1) * (GRID_BLOCK / 2); kp++)
            _mm512_storeu_si512(out + (int64_t)kp * 32,
                                (__m512i)gb_decode(bits, codes + (int64_t)kp * pair_bytes, &s));
    }
}
#endif

/* y[M, N] = x[M, K] @ W[N, K]^T in bf16 for W held as grid codes (layout above; bits 4 or 8).
 * Per unit of two panels, the first PB_MR rows decode each pair straight into their products;
 * with more rows, the decoded unit also goes to a per-thread buffer, and the other rows are
 * multiplied by it as ppr_linear_bf16 multiplies the packed panels (pb_rows). Returns -1
 * without AVX512_BF16, for a K that is not a multiple of 32, or if a buffer could not be
 * allocated. */
int ppr_linear_grid_bf16(const uint16_t *x, const uint8_t *codes, const uint16_t *scale,
                         const uint16_t *offset, uint16_t *y, int M, int N, int K, int bits) {
#ifdef HAVE_BF16_DOT
    if (K % GRID_BLOCK || (bits != 4 && bits != 8)) return -1;
    if (M <= 0) return 0;
    const int num_panels = (N + 15) / 16, num_units = (num_panels + 1) / 2;
    const int64_t panel_codes = (int64_t)K / 2 * (bits == 4 ? 16 : 32);
    const int64_t panel_scales = (int64_t)K / GRID_BLOCK * PANEL;
    const int buffered = M > PB_MR;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *buf = buffered ? aligned_alloc(64, (size_t)2 * K * 32) : NULL; /* 2 x K2 x 32 */
        if (buffered && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(guided, 2)
        for (int u = 0; u < num_units; u++) {
            const int np = num_panels - 2 * u < 2 ? num_panels - 2 * u : 2, p0 = 2 * u;
            const uint8_t *c = codes + p0 * panel_codes;
            const uint16_t *d = scale + p0 * panel_scales;
            const uint16_t *m = offset ? offset + p0 * panel_scales : NULL;
            const int has_next = u + 1 < num_units;
            if (buffered && !buf) continue;
            const char *nc = has_next ? (const char *)(c + 2 * panel_codes) : NULL;
            const char *nd = has_next ? (const char *)(d + 2 * panel_scales) : NULL;
            const char *nm = has_next && m ? (const char *)(m + 2 * panel_scales) : NULL;
            /* the first rows decode the unit (into buf, where more rows follow) */
            switch (M < PB_MR ? M : PB_MR) {
            case 1: gb_micro(1, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 2: gb_micro(2, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 3: gb_micro(3, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 4: gb_micro(4, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 5: gb_micro(5, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 6: gb_micro(6, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 7: gb_micro(7, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 8: gb_micro(8, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 9: gb_micro(9, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 10: gb_micro(10, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            case 11: gb_micro(11, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            default: gb_micro(12, x, bits, c, d, m, y, N, K, p0, np, nc, nd, nm, buf); break;
            }
            if (buffered) /* the rest from the decoded unit, as ppr_linear_bf16 from panels */
                pb_rows(x + (int64_t)PB_MR * K, buf, y + (int64_t)PB_MR * N, M - PB_MR, N, K, p0,
                        np, NULL);
        }
        free(buf);
    }
    return failed ? -1 : 0;
#else
    (void)x, (void)codes, (void)scale, (void)offset, (void)y, (void)M, (void)N, (void)K,
        (void)bits;
    return -1;
#endif
}

/* The packed bf16 pairs [P, K2, 16, 2] the codes stand for (what ppr_pack_bf16 makes of the
 * bf16 weight): the stage checks them against that bit for bit before it trusts the codes. */
int ppr_unpack_grid_bf16(const uint8_t *codes, const uint16_t *scale, const uint16_t *offset,
                         uint16_t *panels, int N, int K, int bits) {
#ifdef HAVE_BF16_DOT
    if (K % GRID_BLOCK || (bits != 4 && bits != 8)) return -1;
    const int num_panels = (N + 15) / 16;
    const int64_t panel_codes = (int64_t)K / 2 * (bits == 4 ? 16 : 32);
    const int64_t panel_scales = (int64_t)K / GRID_BLOCK * PANEL;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < num_panels; p++)
        gb_unpack(bits, codes + p * panel_codes, scale + p * panel_scales,
                  offset ? offset + p * panel_scales : NULL, K, panels + (int64_t)p * K / 2 * 32);
    return 0;
#else
    (void)codes, (void)scale, (void)offset, (void)panels, (void)N, (void)K, (void)bits;
    return -1;
#endif
}

/* ---- grid codes x int8 activations (vpdpbusd) ----
 *
 * What llama.cpp does for its Q4_1 and Q8_0 matmuls on a CPU: each row of x is quantized to int8
 * per block of 32 (dx = max |x| / 127, xq = round(x / dx)), and the codes multiply it in
 * integers, 64 products a vpdpbusd, summed exactly in int32 per block; the block's sum is then
 * scaled in fp32. For Q4_1, w = d q + m:
 *   sum_k w_k x_k ~ sum_blocks (d dx) * sum(q xq) + m * dx * sum(xq)
 * the offset term over the quantized x too (llama.cpp's q8_1 keeps dx sum(xq)), so that x's
 * rounding error e meets the weights as they are, sum (d q + m) e, centred on zero. (With the
 * exact sum(x) there instead, e met d q alone, always positive: 2.2-2.5x the error of a matmul,
 * and the default model's KL divergence from fp32 12.9x transformers-bf16's, not 3.6x.) For Q8_0, w = d q, the codes are stored as
 * q + 128 (vpdpbusd takes one operand unsigned) and 128 sum(xq) is taken back off the integer
 * sum, which leaves sum(q xq) exactly. Each y is rounded to bf16 once.
 *
 * One such pass leaves x ~8 bits a block, and a block holding one of the few large channels of
 * a normed hidden state far fewer for the rest: the default model's KL divergence from fp32
 * was 3.6x transformers-bf16's (bench quality, 8 windows: 0.0038 against 0.00107). So by default
 * x is quantized in two passes (PPR_GRID_A8), the second over what the first missed (at most
 * dx / 2 a value): x ~ dx1 xq1 + dx2 xq2, each pass a quantized row of its own, multiplied as
 * any row is and summed before y is rounded: 0.96x transformers-bf16's KL divergence (4
 * windows). The second pass doubles the integer work, which costs little where the weight
 * stream binds and up to 2x where vpdpbusd does (all of SmolLM2's matmuls, random codes, 2
 * threads, Xeon with AMX, 6 alternated rounds, medians, ms, one pass / two: 1 row 2.16 / 2.45,
 * 4 rows 3.23 / 4.92, 32 rows 14.6 / 28.7, 64 rows 27.8 / 52.5). PPR_GRID_A8_1 is one pass,
 * llama.cpp's, for those who trade that accuracy for the speed (PPRING_GRID_ACTIVATIONS=int8). Unlike ppr_linear_grid_bf16 the results are not bit for bit those of
 * the bf16 panels (x loses bits to the int8 grid), but a row's result still depends on that row
 * alone, whatever it is batched with, and the work per weight is a quarter: one vpdpbusd per 64
 * products where the bf16 decode spends eight vector operations per 32 weights before its
 * vdpbf16ps. All of SmolLM2's matmuls, 2 threads, Zen 4 EPYC, random codes of the same shapes,
 * 9 alternated rounds, medians, against ppr_linear_bf16 over bf16 panels: 1 row 3.7 / 8.9 ms
 * (codes at ~26 GB/s), 16 rows 10.3 / 13.1, 32 rows 18.5 / 22.7, 128 rows 62 / 88; one thread,
 * 16 rows, 21.2 / 23.5.
 *
 * Layout, per panel of 16 output channels (P panels, K a multiple of 32), lanes = channels:
 *   codes  Q4_1 [P, K / 8, 64] bytes: byte 4 c + j of group g = q[16p + c][8g + j]
 *                                                             | q[16p + c][8g + 4 + j] << 4
 *          Q8_0 [P, K / 4, 64] bytes: byte 4 c + j of group g = q[16p + c][4g + j] + 128
 *   scale  [P, K / 32, 16] fp16 (d), offset (Q4_1 only) [P, K / 32, 16] fp16 (m), as GridPairs */
#if defined(HAVE_BF16_DOT) && defined(__AVX512VNNI__)
#define HAVE_A8_DOT
#define A8_MR 4 /* quantized rows per micro-kernel call: 4 x 2 panels x (int32 + fp32 sums) = 16
                  registers */
#define A8_MAX_PASSES 2 /* quantized rows per row of x at most (a8_quantize_row) */

/* One block of 32 values (lo, hi: its first and last 16) -> xq [32] int8: dx = max |x| / 127,
 * xq = round(x / dx) (nearest even); *dx, *sx = dx sum(xq) and *sq = sum(xq) set, and lo, hi
 * left holding what xq misses, x - dx xq (at most dx / 2 a value). */
static inline void a8_quantize_block(__m512 *lo, __m512 *hi, int8_t *xq, float *dx, float *sx,
                                     int32_t *sq) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(*lo), _mm512_abs_ps(*hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(*lo, inv)); /* nearest even */
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(*hi, inv));
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtepi32_epi8(qlo)); /* |x / dx| <= 127 */
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtepi32_epi8(qhi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    const float d = amax / 127.0f;
    *dx = d, *sq = sum, *sx = d * (float)sum;
    const __m512 vd = _mm512_set1_ps(d);
    *lo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), vd, *lo);
    *hi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), vd, *hi);
}

/* One row of x [K] bf16 -> `passes` (1 or 2) rows of int8, x ~ dx1 xq1 (+ dx2 xq2) per block
 * of 32: the first pass quantizes x, the second what the first missed. Into xq [passes, K] (rows
 * `row_stride` apart) and, per pass and block, dx, dx sum(xq) and sum(xq) ([passes, K / 32]
 * each, rows `block_stride` apart). */
static void a8_quantize_row(const uint16_t *x, int K, int passes, int8_t *xq, int64_t row_stride,
                            float *dx, float *sx, int32_t *sq, int64_t block_stride) {
    for (int b = 0; b < K / GRID_BLOCK; b++) {
        const __m512i raw = _mm512_loadu_si512(x + (int64_t)b * GRID_BLOCK); /* 32 bf16 */
        __m512 lo = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        __m512 hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        for (int pass = 0; pass < passes; pass++) {
            const int64_t at = pass * block_stride + b;
            a8_quantize_block(&lo, &hi, xq + pass * row_stride + (int64_t)b * GRID_BLOCK,
                              dx + at, sx + at, sq + at);
        }
    }
}

/* 16 fp16 numbers (a block's d or m for one panel's channels) as fp32 */
static inline __m512 fp16x16_load(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* group g's line of both panels of the unit at `next` (panels `stride` bytes apart), into L2 */
static inline __attribute__((always_inline)) void a8_fetch(const uint8_t *next, int64_t stride,
                                                           int g) {
    _mm_prefetch((const char *)(next + (int64_t)g * 64), _MM_HINT_T1);
    _mm_prefetch((const char *)(next + stride + (int64_t)g * 64), _MM_HINT_T1);
}

/* the scales (and Q4_1 offsets) of the unit whose first scale is at `d` (`m`), `bytes` each,
 * into L2, before the unit before it starts: the codes' prefetch (a8_fetch) leaves these to the
 * hardware, whose streams restart at each unit. All of SmolLM2's matmuls, C harness, 2
 * threads, alternated rounds, medians of this against none: 1 row 0.90-0.97x (4 runs), 4 rows
 * 0.96x, 16 rows 0.97x, 32 rows 0.98x; one thread, 16 rows, 0.99x. In whole decode steps
 * (StageRunner.run, 6 s each, alternated): 1 row 4.63 -> 4.49 ms (medians of 8, each pair
 * faster), but 32 rows 37.0 -> 38.4 (5 of 8 pairs slower): so only below 8 rows, where the
 * weight stream is the cost. */
static inline void a8_fetch_scales(const uint16_t *d, const uint16_t *m, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) {
        _mm_prefetch((const char *)d + b, _MM_HINT_T1);
        if (m) _mm_prefetch((const char *)m + b, _MM_HINT_T1);
    }
}

/* Quantized rows [0, MR) (MR / PASSES rows of y: PASSES quantized rows a row of x, summed at
 * the end) x panels p0, p0 + 1 (np; with one, c1 = c0 and its sums are not stored). PF (a
 * constant, so the other calls compile as if it were not there): the next unit's codes, at
 * `next` and `next + next_stride`, are fetched into L2 a line per line read here (a prefetch
 * past the end of the codes is harmless: prefetches do not fault). */
static inline __attribute__((always_inline)) void a8_micro(
    const int MR, const int PF, const int PASSES, int bits, const int8_t *xq, const float *dx, const float *sx,
    const int32_t *sq, const uint8_t *c0, const uint8_t *c1, const uint16_t *d0, const uint16_t *d1,
    const uint16_t *m0, const uint16_t *m1, uint16_t *y, int N, int K, int p0, int np,
    const uint8_t *next, int64_t next_stride) {
    const int KB = K / GRID_BLOCK;
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 f[A8_MR][2];
    for (int m = 0; m < MR; m++) f[m][0] = f[m][1] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        __m512i a[A8_MR][2];
        for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm512_setzero_si512();
        if (bits == 4) {
            for (int o = 0; o < 4; o++) { /* group g holds 8 k */
                const int g = 4 * kb + o;
                if (PF) a8_fetch(next, next_stride, g);
                const __m512i v0 = _mm512_loadu_si512(c0 + (int64_t)g * 64);
                const __m512i v1 = _mm512_loadu_si512(c1 + (int64_t)g * 64);
                const __m512i l0 = _mm512_and_si512(v0, nibble);
                const __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble);
                const __m512i l1 = _mm512_and_si512(v1, nibble);
                const __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble);
                for (int m = 0; m < MR; m++) {
                    int32_t xa, xb; /* x[8g .. 8g + 3] and x[8g + 4 .. 8g + 7] */
                    memcpy(&xa, xq + (int64_t)m * K + 8 * g, 4);
                    memcpy(&xb, xq + (int64_t)m * K + 8 * g + 4, 4);
                    const __m512i A = _mm512_set1_epi32(xa), B = _mm512_set1_epi32(xb);
                    a[m][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[m][0], l0, A), h0, B);
                    a[m][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[m][1], l1, A), h1, B);
                }
            }
        } else {
            for (int o = 0; o < 8; o++) { /* group g holds 4 k */
                const int g = 8 * kb + o;
                if (PF) a8_fetch(next, next_stride, g);
                const __m512i v0 = _mm512_loadu_si512(c0 + (int64_t)g * 64);
                const __m512i v1 = _mm512_loadu_si512(c1 + (int64_t)g * 64);
                for (int m = 0; m < MR; m++) {
                    int32_t xa;
                    memcpy(&xa, xq + (int64_t)m * K + 4 * g, 4);
                    const __m512i A = _mm512_set1_epi32(xa);
                    a[m][0] = _mm512_dpbusd_epi32(a[m][0], v0, A);
                    a[m][1] = _mm512_dpbusd_epi32(a[m][1], v1, A);
                }
            }
        }
        const __m512 s0 = fp16x16_load(d0 + kb * PANEL), s1 = fp16x16_load(d1 + kb * PANEL);
        if (bits == 4) {
            const __m512 o0 = fp16x16_load(m0 + kb * PANEL), o1 = fp16x16_load(m1 + kb * PANEL);
            for (int m = 0; m < MR; m++) {
                const __m512 rdx = _mm512_set1_ps(dx[m * KB + kb]);
                const __m512 rsx = _mm512_set1_ps(sx[m * KB + kb]);
                f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][0]), _mm512_mul_ps(s0, rdx),
                                          _mm512_fmadd_ps(o0, rsx, f[m][0]));
                f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][1]), _mm512_mul_ps(s1, rdx),
                                          _mm512_fmadd_ps(o1, rsx, f[m][1]));
            }
        } else {
            for (int m = 0; m < MR; m++) {
                const __m512 rdx = _mm512_set1_ps(dx[m * KB + kb]);
                const __m512i bias = _mm512_set1_epi32(128 * sq[m * KB + kb]);
                f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[m][0], bias)),
                                          _mm512_mul_ps(s0, rdx), f[m][0]);
                f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[m][1], bias)),
                                          _mm512_mul_ps(s1, rdx), f[m][1]);
            }
        }
    }
    if (PASSES == 2) /* a row of x: its passes' rows summed */
        for (int m = 0; m < MR / 2; m++)
            for (int j = 0; j < 2; j++) f[m][j] = _mm512_add_ps(f[2 * m][j], f[2 * m + 1][j]);
    pb_store(MR / PASSES, f, y, N, p0, np);
}
#endif

/* 1 where this build has ppr_linear_grid_a8 (AVX512_BF16 and AVX512_VNNI) */
int ppr_has_a8_dot(void) {
#ifdef HAVE_A8_DOT
    return 1;
#else
    return 0;
#endif
}

/* Whether ppr_linear_grid_a8 and ppr_grid_a8_rows take this weight: K a multiple of 32, bits 4
 * (with offsets) or 8, in a build with AVX512_BF16 and VNNI. */
static inline int a8_weight_ok(int K, int bits, const void *offset) {
#ifdef HAVE_A8_DOT
    return K % GRID_BLOCK == 0 && (bits == 4 || bits == 8) && (bits == 8 || offset);
#else
    (void)K, (void)bits, (void)offset;
    return 0;
#endif
}

/* Rows ids [T] of a weight held in the layout above, decoded to bf16 rows out [T, K]: d * q,
 * then + m (two fp32 roundings, as stages/grid.py quad_rows and the checkpoint's converter
 * compute them: no FMA here), rounded to bf16. A tied lm_head's embedding lookup: the same as
 * quad_rows(...).to(bfloat16), bit for bit, in about a microsecond a row instead of ~50 us of
 * torch ops (a single stream's step spent that much on its one token). Returns -1 for an id
 * outside [0, N), without AVX512_BF16 and VNNI, or for a K that is not a multiple of 32. */
__attribute__((optimize("fp-contract=off"))) int ppr_grid_a8_rows(
    const uint8_t *codes, const uint16_t *scale, const uint16_t *offset, const int64_t *ids,
    uint16_t *out, int T, int N, int K, int bits) {
#ifdef HAVE_A8_DOT
    if (!a8_weight_ok(K, bits, offset)) return -1;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    const int KB = K / GRID_BLOCK, per_group = bits == 4 ? 8 : 4;
    const int64_t panel_codes = (int64_t)K * PANEL * bits / 8;
    for (int t = 0; t < T; t++) {
        const int64_t p = ids[t] / PANEL;
        const int c = (int)(ids[t] % PANEL);
        const uint8_t *panel = codes + p * panel_codes;
        for (int k = 0; k < K; k++) {
            const int g = k / per_group, j = k % per_group;
            const uint8_t byte = panel[(int64_t)g * 64 + 4 * c + j % 4];
            const int q = bits == 4 ? (j < 4 ? byte & 15 : byte >> 4) : (int)byte - 128;
            const int64_t block = (p * KB + k / GRID_BLOCK) * PANEL + c;
            float v = (float)q * _cvtsh_ss(scale[block]);
            if (bits == 4) v = v + _cvtsh_ss(offset[block]);
            out[(int64_t)t * K + k] = bf16_store(v);
        }
    }
    return 0;
#else
    (void)codes, (void)scale, (void)offset, (void)ids, (void)out, (void)T, (void)N, (void)K,
        (void)bits;
    return -1;
#endif
}

#ifdef HAVE_A8_DOT
/* The quantized rows of one call of M rows of x (`passes` quantized rows each: row
 * passes m + pass): per quantized row and block of 32, dx, dx sum(xq) and sum(xq)
 * ([passes M, K / 32] each), then xq [passes M, K] int8, cut from one buffer of
 * a8_scratch_bytes(M, K) (which grows with K: a buffer for the largest K serves every smaller
 * one, and holds A8_MAX_PASSES passes). */
typedef struct {
    float *dx, *sx;
    int32_t *sq;
    int8_t *xq;
    int passes;
} A8Rows;

static size_t a8_scratch_bytes(int M, int K) {
    const size_t rows = (size_t)A8_MAX_PASSES * M;
    return rows * (K / GRID_BLOCK) * (sizeof(float) * 2 + sizeof(int32_t)) + rows * K;
}

static A8Rows a8_rows_at(char *scratch, int M, int K, int passes) {
    const size_t per_block = (size_t)passes * M * (K / GRID_BLOCK);
    A8Rows r;
    r.passes = passes;
    r.dx = (float *)scratch;
    r.sx = r.dx + per_block;
    r.sq = (int32_t *)(r.sx + per_block);
    r.xq = (int8_t *)(r.sq + per_block);
    return r;
}

/* row m of x [., K] bf16 quantized into rows r.passes m, ... of r */
static inline void a8_quantize_into(const uint16_t *x, int m, int K, A8Rows r) {
    const int KB = K / GRID_BLOCK;
    const int64_t q = (int64_t)r.passes * m;
    a8_quantize_row(x + (int64_t)m * K, K, r.passes, r.xq + q * K, K, r.dx + q * KB,
                    r.sx + q * KB, r.sq + q * KB, KB);
}

/* x [M, K] bf16 quantized into r, the rows shared by the team this runs in (orphaned) */
static void a8_quantize_rows(const uint16_t *x, int M, int K, A8Rows r) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) a8_quantize_into(x, m, K, r);
}

/* y [M, N] from the quantized rows r, the units of two panels shared by the team (orphaned) */
static void a8_units(A8Rows rows, const uint8_t *codes, const uint16_t *scale,
                     const uint16_t *offset, uint16_t *y, int M, int N, int K, int bits) {
    const int KB = K / GRID_BLOCK, num_panels = (N + 15) / 16, num_units = (num_panels + 1) / 2;
    const int64_t panel_codes = (int64_t)K * PANEL * bits / 8, panel_scales = (int64_t)KB * PANEL;
#pragma omp for schedule(guided, 2)
    for (int u = 0; u < num_units; u++) {
        const int p0 = 2 * u, np = num_panels - p0 < 2 ? 1 : 2;
        const uint8_t *c0 = codes + p0 * panel_codes;
        const uint8_t *c1 = np > 1 ? c0 + panel_codes : c0;
        const uint16_t *d0 = scale + p0 * panel_scales;
        const uint16_t *d1 = np > 1 ? d0 + panel_scales : d0;
        const uint16_t *m0 = bits == 4 ? offset + p0 * panel_scales : NULL;
        const uint16_t *m1 = bits == 4 && np > 1 ? m0 + panel_scales : m0;
        if (M < 8 && u + 1 < num_units) /* the next unit's scales (and offsets) */
            a8_fetch_scales(d0 + 2 * panel_scales, m0 ? m0 + 2 * panel_scales : NULL,
                            2 * panel_scales * (int64_t)sizeof(uint16_t));
        const int passes = rows.passes, quantized = passes * M;
        for (int r = 0; r < quantized; r += A8_MR) {
            const int8_t *xr = rows.xq + (int64_t)r * K;
            const float *dr = rows.dx + (int64_t)r * KB, *sr = rows.sx + (int64_t)r * KB;
            const int32_t *qr = rows.sq + (int64_t)r * KB;
            uint16_t *yr = y + (int64_t)(r / passes) * N;
#define A8_CALL(MR, PF, PASSES)                                                                 \
    a8_micro(MR, PF, PASSES, bits, xr, dr, sr, qr, c0, c1, d0, d1, m0, m1, yr, N, K, p0, np,      \
             c0 + 2 * panel_codes, panel_codes)
            /* the first rows fetch the next unit: all of SmolLM2's matmuls, 2 threads, 15
             * alternated rounds, medians, ms: 1 row 4.0-4.8 -> 3.3-4.1, 4 rows 5.6 -> 4.3, 16
             * rows 10.6-11.0 -> 9.4-9.5, 32 21.7 -> 20.6, 128 level; one thread, 16 rows 21.1 ->
             * 17.2. With `next` a runtime pointer instead of PF, the compiler versioned the
             * loops and 128 rows lost 8-12%. */
            const int pf = r == 0 && u + 1 < num_units;
            const int mr = quantized - r < A8_MR ? quantized - r : A8_MR;
            switch (passes == 2 ? 10 * mr + pf : mr + 4 * pf) {
            case 1: A8_CALL(1, 0, 1); break;
            case 2: A8_CALL(2, 0, 1); break;
            case 3: A8_CALL(3, 0, 1); break;
            case 4: A8_CALL(4, 0, 1); break;
            case 5: A8_CALL(1, 1, 1); break;
            case 6: A8_CALL(2, 1, 1); break;
            case 7: A8_CALL(3, 1, 1); break;
            case 8: A8_CALL(4, 1, 1); break;
            case 20: A8_CALL(2, 0, 2); break; /* the last row of an odd M */
            case 21: A8_CALL(2, 1, 2); break;
            case 40: A8_CALL(4, 0, 2); break;
            default: A8_CALL(4, 1, 2); break;
            }
#undef A8_CALL
        }
    }
}
#endif

/* y[M, N] bf16 = x[M, K] bf16 @ W[N, K]^T for W held as grid codes in the layout above (bits 4
 * or 8), x quantized to int8 per block of 32 first. Threads share the rows' quantization, then
 * the units of two panels (each unit's rows A8_MR at a time, its codes reused from cache).
 * Returns -1 without AVX512_BF16 and VNNI, for a K that is not a multiple of 32, or if the
 * quantized rows could not be allocated. */
int ppr_linear_grid_a8(const uint16_t *x, const uint8_t *codes, const uint16_t *scale,
                       const uint16_t *offset, uint16_t *y, int M, int N, int K, int bits,
                       int passes) {
#ifdef HAVE_A8_DOT
    if (!a8_weight_ok(K, bits, offset) || passes < 1 || passes > A8_MAX_PASSES) return -1;
    if (M <= 0) return 0;
    char *scratch = malloc(a8_scratch_bytes(M, K));
    if (!scratch) return -1;
    const A8Rows rows = a8_rows_at(scratch, M, K, passes);
#pragma omp parallel
    {
        a8_quantize_rows(x, M, K, rows);
        a8_units(rows, codes, scale, offset, y, M, N, K, bits);
    }
    free(scratch);
    return 0;
#else
    (void)x, (void)codes, (void)scale, (void)offset, (void)y, (void)M, (void)N, (void)K,
        (void)bits, (void)passes;
    return -1;
#endif
}

/* ---- A whole decoder layer in one call ----------------------------------------------------
 * The same kernels, in the same order, on the same buffers as stages/llama.py's DecoderLayer
 * calls them one by one from Python, so the results are bit for bit the same; what goes is
 * the Python around nine kernel calls a layer (module calls, torch.empty, checks, ctypes:
 * ~70 us a layer, most of a single stream's step after its matmuls). stages/fused_layer.py
 * fills these structs once at load and calls ppr_decoder_layers (every layer) once a step. */

enum {
    PPR_F32 = 1, PPR_GRID_F32 = 2, PPR_BF16 = 3, PPR_GRID_BF16 = 4, PPR_INT8 = 5, PPR_GRID_A8 = 6,
    PPR_INT8_QUADS = 7, PPR_GRID_A8_1 = 8 /* PPR_GRID_A8 with one pass over x (a8_quantize_row) */
};

/* quantized rows per row of x for a grid-a8 kind */
static inline int a8_passes(int kind) { return kind == PPR_GRID_A8_1 ? 1 : 2; }

/* One weight matrix [N, K] as its module holds it. f32, bf16: a = panels; grid (and grid a8):
 * a = codes, b = scale, c = offset (NULL for Q8_0); int8 (rows or quads): a = the weight, b = its
 * fp32 scales. */
typedef struct {
    int32_t kind, n, k, bits;
    const void *a, *b, *c;
    /* PPR_GRID_BF16 held both ways (stages/linear.py GridBf16Linear): calls of more than
     * code_rows rows multiply the bf16 panels instead, for the same results; NULL: codes only */
    const void *panels;
    int32_t code_rows;
} ppr_linear_t;

/* What a layer holds: its four matrices, two norm weights [d] and its shape. */
typedef struct {
    ppr_linear_t qkv, o, gate_up, down;
    const void *input_norm, *post_attn_norm;
    float eps;
    int32_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
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
} ppr_step_t;

static int run_linear(const ppr_linear_t *w, int elem_bytes, const void *x, void *y, int M) {
    switch (w->kind) {
    case PPR_F32:
        if (elem_bytes != 4) return -1;
        ppr_linear_f32(x, w->a, y, M, w->n, w->k);
        return 0;
    case PPR_GRID_F32:
        return elem_bytes == 4 ? ppr_linear_grid(x, w->a, w->b, w->c, y, M, w->n, w->k, w->bits)
                               : -1;
    case PPR_BF16:
        return elem_bytes == 2 ? ppr_linear_bf16(x, w->a, y, M, w->n, w->k) : -1;
    case PPR_GRID_BF16:
        if (elem_bytes != 2) return -1;
        if (w->panels && M > w->code_rows)
            return ppr_linear_bf16(x, w->panels, y, M, w->n, w->k);
        return ppr_linear_grid_bf16(x, w->a, w->b, w->c, y, M, w->n, w->k, w->bits);
    case PPR_INT8:
        ppr_linear_int8(elem_bytes, x, w->a, w->b, y, M, w->n, w->k);
        return 0;
    case PPR_INT8_QUADS:
        return ppr_linear_int8_quads(elem_bytes, x, w->a, w->b, y, M, w->n, w->k);
    case PPR_GRID_A8:
    case PPR_GRID_A8_1:
        if (elem_bytes != 2) return -1;
        return ppr_linear_grid_a8(x, w->a, w->b, w->c, y, M, w->n, w->k, w->bits,
                                  a8_passes(w->kind));
    }
    return -1;
}

/* Whether a step's indices stay inside the sizes it gives: its rows within the scratch's
 * max_tokens, every slot inside the cache, every position inside the rotary tables (where
 * positions are given), and the attention metadata (attention_indices_check). Checked once a
 * call, before the first layer writes anything. 0, or a PPR_BAD_*. */
static int step_check(const ppr_step_t *s) {
    if (s->num_tokens < 0 || s->num_tokens > s->max_tokens) return PPR_BAD_ROWS;
    const int bad = slots_positions_check(s->num_tokens, s->slot_mapping, s->num_slots,
                                          s->positions, s->rope_rows);
    if (bad) return bad;
    return attention_indices_check(s->num_tokens, s->num_seqs, s->q_start, s->q_len, s->ctx_len,
                                   s->block_table, s->table_stride, s->num_slots);
}

/* h_in [T, d] (read only: it may be a received frame), residual_in [T, d] or NULL (the first
 * layer of the first stage), kv [2, slots, Hkv, D] this layer's cache. Writes residual_out
 * [T, d] (it may be residual_in itself) and h_out [T, d] (it may be h_in). Returns 0, or -1
 * when a kernel refused (a kind this build lacks, or no memory for a buffer). */
static int ppr_decoder_layer(const ppr_layer_t *L, const ppr_step_t *s, const void *h_in,
                             const void *residual_in, void *residual_out, void *kv,
                             void *h_out) {
    const int T = s->num_tokens, eb = s->elem_bytes, D = L->head_dim;
    const int64_t qkv_row = (int64_t)(L->num_heads + 2 * L->num_kv_heads) * D;
    ppr_add_rms_norm(eb, h_in, residual_in, L->input_norm, residual_out, s->x, T, L->hidden,
                     L->eps);
    if (run_linear(&L->qkv, eb, s->x, s->qkv, T)) return -1;
    rope_store(eb, s->qkv, qkv_row, s->q, s->cos, s->sin, s->positions, s->slot_mapping, kv,
               s->num_slots, T, L->num_heads, L->num_kv_heads, D);
    if (paged_attention(eb, s->q, kv, s->attn, s->num_seqs, s->q_start, s->q_len, s->ctx_len,
                        s->block_table, s->table_stride, s->num_slots, L->num_heads,
                        L->num_kv_heads, D, s->scale))
        return -1;
    if (run_linear(&L->o, eb, s->attn, s->h, T)) return -1;
    ppr_add_rms_norm(eb, s->h, residual_out, L->post_attn_norm, residual_out, s->x, T, L->hidden,
                     L->eps);
    if (run_linear(&L->gate_up, eb, s->x, s->gate_up, T)) return -1;
    ppr_silu_mul(eb, s->gate_up, (const char *)s->gate_up + (int64_t)L->intermediate * eb,
                 2 * (int64_t)L->intermediate, s->act, T, L->intermediate);
    return run_linear(&L->down, eb, s->act, h_out, T);
}

#ifdef HAVE_A8_DOT
/* ---- The whole stack in one team ----------------------------------------------------------
 * Each kernel above opens and joins its own parallel region: on the 2-core Zen 4 VM an empty
 * region costs ~2.4 us (the team woken, then joined) against ~0.75 us for a barrier inside one,
 * and a single stream's step opened 151 (five a layer, and the lm_head). Where every matrix of
 * the stage is grid codes for vpdpbusd (the default on such a CPU), the layers run in one
 * region instead: the same kernels' loops, work-shared (orphaned `omp for`) by one team, the
 * implicit barrier after each loop where the next needs its results. The arithmetic of every
 * row is what the layer-by-layer calls do. Default model, 2 threads, decode steps
 * (StageRunner.run) in one process, blocks of steps alternated between the two paths, medians:
 * 1 row at context 512 4.98 -> 4.80 ms (faster in 72 of 100 block pairs); 16 rows at context
 * 100, layers 0-13 6.20 -> 5.86 (150 of 169), layers 14-29 and the lm_head 9.13 -> 8.83 (79 of
 * 111); 32 rows, all layers, 31.1 -> 30.5 (44 of 64). A norm (or silu_mul) sharing its loop
 * with the next matmul's quantization, against a loop each: 16 rows 0.976x and 0.991x, 32 rows
 * 0.997x, 1 row 1.002x. */

/* y = x @ W^T for a grid-a8 weight, by the team: x's rows quantized into the shared scratch
 * (a barrier), then the units */
static void a8_linear_in_team(const ppr_linear_t *w, const void *x, void *y, int M,
                              char *scratch) {
    const A8Rows rows = a8_rows_at(scratch, M, w->k, a8_passes(w->kind));
    a8_quantize_rows(x, M, w->k, rows);
    a8_units(rows, w->a, w->b, w->c, y, M, w->n, w->k, w->bits);
}

/* a grid-a8 matrix of the stack's kind (every matrix of the stack quantizes its rows alike) */
static int a8_in_team_ok(const ppr_linear_t *w, int kind) {
    return (kind == PPR_GRID_A8 || kind == PPR_GRID_A8_1) && w->kind == kind &&
           a8_weight_ok(w->k, w->bits, w->c);
}

/* Whether the stack runs in one team: bf16, every matrix grid-a8, and every layer's attention
 * of one shape (one plan serves them all). */
static int stack_in_team_ok(const ppr_layer_t *layers, int n, const ppr_step_t *s) {
    if (s->elem_bytes != 2 || s->num_tokens <= 0 || n <= 0) return 0;
    for (int i = 0; i < n; i++) {
        const ppr_layer_t *L = &layers[i];
        const int kind = layers[0].qkv.kind;
        if (!a8_in_team_ok(&L->qkv, kind) || !a8_in_team_ok(&L->o, kind) ||
            !a8_in_team_ok(&L->gate_up, kind) || !a8_in_team_ok(&L->down, kind) ||
            !attention_shapes_ok(2, L->num_heads, L->num_kv_heads))
            return 0;
        if (L->num_heads != layers[0].num_heads || L->num_kv_heads != layers[0].num_kv_heads ||
            L->head_dim != layers[0].head_dim)
            return 0;
        if (L->qkv.k != L->hidden || L->gate_up.k != L->hidden || L->down.k != L->intermediate ||
            L->gate_up.n != 2 * L->intermediate || L->o.k != L->num_heads * L->head_dim)
            return 0;
    }
    return 1;
}

/* A norm and the next matmul's quantization of its rows, in one loop: one barrier, not two.
 * `rows` is cut for K = d. */
static void norm_quantize_in_team(const void *h, const void *residual, const void *weight,
                                  void *residual_out, void *x_out, int T, int d, float eps,
                                  A8Rows rows) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        add_rms_norm_row(2, h, residual, weight, residual_out, x_out, t, d, eps);
        a8_quantize_into(x_out, t, d, rows);
    }
}

/* silu(gate) * up into act [T, I], and the down matmul's quantization of its rows (K = I) */
static void silu_quantize_in_team(const void *gate_up, void *act, int T, int I, A8Rows rows) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        silu_mul_row(2, gate_up, (const uint16_t *)gate_up + I, 2 * (int64_t)I, act, t, I);
        a8_quantize_into(act, t, I, rows);
    }
}

/* ppr_decoder_layer's steps, by the team this runs in (every thread calls it): ten loops, ten
 * barriers (a norm or silu_mul and the next matmul's quantization share a loop). */
static void decoder_layer_in_team(const ppr_layer_t *L, const ppr_step_t *s, const void *h_in,
                                  const void *residual_in, void *residual_out, void *kv,
                                  void *h_out, const Task *tasks, int num_tasks, char *a8,
                                  float *attention_scratch) {
    const int T = s->num_tokens, D = L->head_dim, d = L->hidden, I = L->intermediate;
    const int64_t qkv_row = (int64_t)(L->num_heads + 2 * L->num_kv_heads) * D;
    const int passes = a8_passes(L->qkv.kind); /* (stack_in_team_ok: every matrix's) */
    const A8Rows x_rows = a8_rows_at(a8, T, d, passes), act_rows = a8_rows_at(a8, T, I, passes);
    norm_quantize_in_team(h_in, residual_in, L->input_norm, residual_out, s->x, T, d, L->eps,
                          x_rows);
    a8_units(x_rows, L->qkv.a, L->qkv.b, L->qkv.c, s->qkv, T, L->qkv.n, d, L->qkv.bits);
    rope_store_rows(2, s->qkv, qkv_row, s->q, s->cos, s->sin, s->positions, s->slot_mapping, kv,
                    s->num_slots, T, L->num_heads, L->num_kv_heads, D);
    attention_run(tasks, num_tasks, 2, s->q, kv, s->attn, s->q_start, s->q_len, s->ctx_len,
                  s->block_table, s->table_stride, s->num_slots, L->num_heads, L->num_kv_heads,
                  D, s->scale, attention_scratch);
    a8_linear_in_team(&L->o, s->attn, s->h, T, a8);
    norm_quantize_in_team(s->h, residual_out, L->post_attn_norm, residual_out, s->x, T, d, L->eps,
                          x_rows);
    a8_units(x_rows, L->gate_up.a, L->gate_up.b, L->gate_up.c, s->gate_up, T, L->gate_up.n, d,
             L->gate_up.bits);
    silu_quantize_in_team(s->gate_up, s->act, T, I, act_rows);
    a8_units(act_rows, L->down.a, L->down.b, L->down.c, h_out, T, L->down.n, I, L->down.bits);
}

/* ppr_decoder_layers in one team (stack_in_team_ok): the scratch the kernels would allocate
 * call by call, allocated once (quantized rows for the largest K, a thread's attention
 * scratch per thread, one attention plan). Returns -1 if that allocation failed. */
static int decoder_layers_in_team(const ppr_layer_t *layers, int n, const ppr_step_t *s,
                                  const void *h_in, const void *residual_in, void *residual_out,
                                  void *kv, int64_t kv_stride, void *h_out) {
    const int T = s->num_tokens, H = layers[0].num_heads, Hkv = layers[0].num_kv_heads;
    const int D = layers[0].head_dim, num_threads = omp_get_max_threads();
    int k_max = 0;
    for (int i = 0; i < n; i++) {
        const ppr_linear_t *w[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up,
                                    &layers[i].down};
        for (int j = 0; j < 4; j++) k_max = w[j]->k > k_max ? w[j]->k : k_max;
    }
    const int num_tasks =
        attention_plan(2, s->num_seqs, s->q_len, s->ctx_len, H, Hkv, D, num_threads, NULL);
    const size_t per_thread = attention_scratch_floats(D);
    char *a8 = malloc(a8_scratch_bytes(T, k_max));
    Task *tasks = malloc(sizeof(Task) * (num_tasks > 0 ? num_tasks : 1));
    float *attention_scratch = malloc(sizeof(float) * per_thread * num_threads);
    const int ok = a8 && tasks && attention_scratch;
    if (ok) {
        attention_plan(2, s->num_seqs, s->q_len, s->ctx_len, H, Hkv, D, num_threads, tasks);
#pragma omp parallel num_threads(num_threads)
        {
            float *mine = attention_scratch + per_thread * omp_get_thread_num();
            const void *h = h_in, *residual = residual_in;
            for (int i = 0; i < n; i++) {
                decoder_layer_in_team(&layers[i], s, h, residual, residual_out,
                                      (char *)kv + (int64_t)i * kv_stride, h_out, tasks,
                                      num_tasks, a8, mine);
                h = h_out;
                residual = residual_out;
            }
        }
    }
    free(a8);
    free(tasks);
    free(attention_scratch);
    return ok ? 0 : -1;
}
#endif

/* A stage's n layers in one call (layers: n structs back to back): layer i reads and writes
 * its cache at kv + i * kv_stride bytes. The first reads h_in and residual_in (NULL: the
 * model's first layer); the rest work in place on h_out and residual_out, as the layer-by-layer
 * path does. One call instead of one per layer: a ctypes call and its Python cost 3-5 us, and
 * a single stream's step makes 30. Returns 0, or -1 when a layer failed (its kernels said). */
int ppr_decoder_layers(const ppr_layer_t *layers, int n, const ppr_step_t *s, const void *h_in,
                       const void *residual_in, void *residual_out, void *kv, int64_t kv_stride,
                       void *h_out) {
    const int bad = step_check(s);
    if (bad) return bad;
#ifdef HAVE_A8_DOT
    if (stack_in_team_ok(layers, n, s))
        return decoder_layers_in_team(layers, n, s, h_in, residual_in, residual_out, kv,
                                      kv_stride, h_out);
#endif
    for (int i = 0; i < n; i++) {
        if (ppr_decoder_layer(&layers[i], s, h_in, residual_in, residual_out,
                              (char *)kv + (int64_t)i * kv_stride, h_out))
            return -1;
        h_in = h_out;
        residual_in = residual_out;
    }
    return 0;
}

/* A greedy finish of a batch whose every row samples greedily, in one call: the kernels
 * stages/runner.py otherwise calls one at a time (add_rms_norm, the lm_head's matmul,
 * row_argmax, the comparison of a split lm_head's two maxima), in the same order on the same
 * values, so the tokens are the same.
 *
 * With `residual` (the last stage): x = rmsnorm(h + residual) * norm_weight per row, then its
 * logits; without (NULL: the first stage's half of a split lm_head, h already normed), h's
 * logits. Each row's first maximal index plus `token_base` (the stage's first vocabulary row)
 * goes to out [N]; with `best` [N] (NULL: not wanted) that maximal logit too, in the element
 * type. With `their_best` [N] and `their_token` [N] (the other half's maxima, whose ids are
 * all higher), a row whose their_best is greater takes their_token: a tie goes to the lower
 * id, as an argmax over the whole row would.
 *
 * scratch holds 2 max_rows d + max_rows V elements (h + residual, x, the logits), and every
 * row buffer max_rows rows; with `x_out` [N, d] (non-NULL) x goes there instead, for the caller
 * to keep. Returns 0; PPR_BAD_ROWS for N outside [0, max_rows] or d not the lm_head's K; -1
 * where the lm_head's kind is one this build lacks. */
int ppr_greedy_head(const ppr_linear_t *head, int elem_bytes, const void *h, const void *residual,
                    const void *norm_weight, float eps, int N, int max_rows, int d, void *scratch,
                    void *x_out, int64_t token_base, int64_t *out, void *best,
                    const void *their_best, const int64_t *their_token) {
    if (N < 0 || N > max_rows || d != head->k) return PPR_BAD_ROWS;
    char *sum = scratch, *x = x_out ? x_out : sum + (int64_t)N * d * elem_bytes;
    char *logits = sum + 2 * (int64_t)N * d * elem_bytes;
    const void *rows = h;
    if (residual) {
        ppr_add_rms_norm(elem_bytes, h, residual, norm_weight, sum, x, N, d, eps);
        rows = x;
    }
    if (run_linear(head, elem_bytes, rows, logits, N)) return -1;
    ppr_row_argmax(elem_bytes, logits, head->n, out, N, head->n);
    for (int n = 0; n < N; n++) {
        const int64_t at = (int64_t)n * head->n + out[n];
        float own, theirs = 0.0f;
        if (elem_bytes == 4) {
            own = ((const float *)logits)[at];
            if (best) ((float *)best)[n] = own;
            if (their_best) theirs = ((const float *)their_best)[n];
        } else {
            own = bf16_load(((const uint16_t *)logits)[at]);
            if (best) ((uint16_t *)best)[n] = ((const uint16_t *)logits)[at];
            if (their_best) theirs = bf16_load(((const uint16_t *)their_best)[n]);
        }
        out[n] = their_best && theirs > own ? their_token[n] : out[n] + token_base;
    }
    return 0;
}

/* sizeof each struct stages/fused_layer.py mirrors in ctypes (0 ppr_linear_t, 1 ppr_layer_t,
 * 2 ppr_step_t; else 0): checked at load, so a field added on one side alone is caught. */
int64_t ppr_struct_size(int which) {
    switch (which) {
    case 0: return sizeof(ppr_linear_t);
    case 1: return sizeof(ppr_layer_t);
    case 2: return sizeof(ppr_step_t);
    }
    return 0;
}

/* The layer's four matmuls alone, as ppr_decoder_layer runs them, at M rows: what `ppring bench
 * step` times as the compute floor of a step (x_hidden [M, d], x_attn [M, H D], x_act [M, I],
 * y at least [M, max N]; their values do not matter). */
int ppr_layer_matmuls(const ppr_layer_t *L, int elem_bytes, int M, const void *x_hidden,
                      const void *x_attn, const void *x_act, void *y) {
    return run_linear(&L->qkv, elem_bytes, x_hidden, y, M) ||
           run_linear(&L->o, elem_bytes, x_attn, y, M) ||
           run_linear(&L->gate_up, elem_bytes, x_hidden, y, M) ||
           run_linear(&L->down, elem_bytes, x_act, y, M);
}
