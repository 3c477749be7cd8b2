/* Weight-only int8 matmuls (ppr_linear_int8, ppr_linear_int8_quads) and the rounding of
 * their input rows to int16 (ppr_quantize_rows_q16). */
#include "ppring.h"

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
 * four rows' 32 bytes back to back ([N / 4, K / 32, 4, 32]; backend/cpu/linear.py pack_int8_quads).
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
