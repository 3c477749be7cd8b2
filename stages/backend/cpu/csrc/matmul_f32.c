/* fp32 matmuls: over weights packed in panels (ppr_linear_f32) and over the integer codes of
 * a per-block grid (ppr_linear_grid), with the packing, the codes' search and their decoding. */
#include "ppring.h"

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
 * w = d * q (Q8_0: q in -127..127). backend/cpu/grid.py finds such a matrix and hands its
 * codes here; each panel is turned back into the very same fp32 values (d * q rounded, then + m rounded, as
 * the converter computed them: never fused into one FMA) in a per-thread buffer, and multiplied
 * by panel_block / panel_row exactly as ppr_linear_f32 multiplies the fp32 panel. The results
 * are bit-identical; a decode step reads 5.3x (Q4_1) or 3.6x (Q8_0) fewer weight bytes.
 *
 * Layout, per panel of 16 output channels (P panels, K a multiple of 32):
 *   codes  Q4_1 [P, K, 8] bytes: byte i of row k = q[16p + i][k] | q[16p + 8 + i][k] << 4
 *          Q8_0 [P, K, 16] int8:  q[16p + j][k]
 *   scale  [P, K / 32, 16] fp32 (d), offset (Q4_1 only) [P, K / 32, 16] fp32 (m). */
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

/* The codes of w [N, K] on a grid (backend/cpu/grid.py): for each block of 32 weights along a row
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
