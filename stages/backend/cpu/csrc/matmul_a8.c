/* bf16 matmuls over grid codes with int8-quantized activations (vpdpbusd, where the CPU has
 * AVX512_BF16 and AVX512_VNNI): ppr_linear_grid_a8, and ppr_grid_a8_rows. */
#include "ppring.h"

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
 *   scale  [P, K / 32, 16] fp16 (d), offset (Q4_1 only) [P, K / 32, 16] fp16 (m), as GridPairs
 * and the k-quants (GRID_K4, K5, K6, KM; backend/cpu/codes.py KQuads), w = d q + m (Q6_K:
 * d (q - 32)), q unsigned in 4 to 6 bits:
 *   codes  [P, K * 8 + K / 8 * 16 * planes] bytes: the low nibbles as Q4_1's, then per group g
 *          a 64-bit mask per plane (bit 4, bit 5) and half (k 8g..8g+3, 8g+4..8g+7): bit 4 c + j
 *          of mask [plane][half] = bit 4 + plane of q[16p + c][8g + 4 half + j]
 *   scale  [P, K / 32, 16] fp32 (Q6_K, KM: [P, K / 16, 16]), offset [P, K / 32, 16] fp32
 *          (KM: [P, K / 16, 16]; Q6_K: none) */
#ifdef HAVE_A8_DOT
#define A8_MR 4 /* quantized rows per micro-kernel call: 4 x 2 panels x (int32 + fp32 sums) = 16
                  registers */
#define A8_MAX_PASSES 2 /* quantized rows per row of x at most (a8_quantize_row) */

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

/* a group's 64 bytes of nibbles as bytes: lo its k 8g..8g+3 (low nibbles), hi 8g+4..8g+7 */
static inline __attribute__((always_inline)) void a8_nibbles(__m512i v, __m512i *lo, __m512i *hi) {
    const __m512i nibble = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(v, nibble);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
}

/* quantized rows [0, MR) of xq (K apart) times group g (8 k) of both panels' codes, bytes lo0,
 * hi0 and lo1, hi1 (k 0-3, 4-7), summed into a[m][panel] */
static inline __attribute__((always_inline)) void a8_group8(const int MR, const int8_t *xq, int K,
                                                            int g, __m512i lo0, __m512i hi0,
                                                            __m512i lo1, __m512i hi1,
                                                            __m512i (*a)[2]) {
    for (int m = 0; m < MR; m++) {
        int32_t xa, xb; /* x[8g .. 8g + 3] and x[8g + 4 .. 8g + 7] */
        memcpy(&xa, xq + (int64_t)m * K + 8 * g, 4);
        memcpy(&xb, xq + (int64_t)m * K + 8 * g + 4, 4);
        const __m512i A = _mm512_set1_epi32(xa), B = _mm512_set1_epi32(xb);
        a[m][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[m][0], lo0, A), hi0, B);
        a[m][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[m][1], lo1, A), hi1, B);
    }
}

/* f += a block's integer sums a scaled, w = d q + m: (d dx) sum(q xq) + m dx sum(xq), per
 * row m (dx[m], sx[m] = dx sum(xq) `stride` apart) and panel (d s0/s1, m o0/o1) */
static inline __attribute__((always_inline)) void a8_scale_offset(
    const int MR, __m512i (*a)[2], __m512 (*f)[2], __m512 s0, __m512 s1, __m512 o0, __m512 o1,
    const float *dx, const float *sx, int stride) {
    for (int m = 0; m < MR; m++) {
        const __m512 rdx = _mm512_set1_ps(dx[m * stride]);
        const __m512 rsx = _mm512_set1_ps(sx[m * stride]);
        f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][0]), _mm512_mul_ps(s0, rdx),
                                  _mm512_fmadd_ps(o0, rsx, f[m][0]));
        f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][1]), _mm512_mul_ps(s1, rdx),
                                  _mm512_fmadd_ps(o1, rsx, f[m][1]));
    }
}

/* the rows of y: a row of x's passes summed (PASSES 2), each rounded to bf16 once */
static inline __attribute__((always_inline)) void a8_store(const int MR, const int PASSES,
                                                           __m512 (*f)[2], uint16_t *y, int N,
                                                           int p0, int np) {
    if (PASSES == 2)
        for (int m = 0; m < MR / 2; m++)
            for (int j = 0; j < 2; j++) f[m][j] = _mm512_add_ps(f[2 * m][j], f[2 * m + 1][j]);
    pb_store(MR / PASSES, f, y, N, p0, np);
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
    __m512 f[A8_MR][2];
    for (int m = 0; m < MR; m++) f[m][0] = f[m][1] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        __m512i a[A8_MR][2];
        for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm512_setzero_si512();
        if (bits == 4) {
            for (int o = 0; o < 4; o++) { /* group g holds 8 k */
                const int g = 4 * kb + o;
                if (PF) a8_fetch(next, next_stride, g);
                __m512i l0, h0, l1, h1;
                a8_nibbles(_mm512_loadu_si512(c0 + (int64_t)g * 64), &l0, &h0);
                a8_nibbles(_mm512_loadu_si512(c1 + (int64_t)g * 64), &l1, &h1);
                a8_group8(MR, xq, K, g, l0, h0, l1, h1, a);
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
            a8_scale_offset(MR, a, f, s0, s1, o0, o1, dx + kb, sx + kb, KB);
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
    a8_store(MR, PASSES, f, y, N, p0, np);
}

/* 64 bytes of nibbles with the high bits of their codes set where masks `at` [planes] (bit 4,
 * then bit 5) say: a k-quant's codes, 0..31 (Q5_K) or 0..63 (Q6_K), for vpdpbusd */
static inline __attribute__((always_inline)) __m512i kq_high(__m512i q, const uint64_t *at,
                                                             const int PLANES) {
    if (PLANES >= 1) q = _mm512_mask_add_epi8(q, _cvtu64_mask64(at[0]), q, _mm512_set1_epi8(16));
    if (PLANES >= 2) q = _mm512_mask_add_epi8(q, _cvtu64_mask64(at[2]), q, _mm512_set1_epi8(32));
    return q;
}

/* a8_micro for the k-quants (FMT GRID_K4, GRID_K5, GRID_K6, GRID_KM): the same nibbles and
 * vpdpbusd, the high bits added from their masks, fp32 scales (and offsets); Q6_K's scales are
 * per 16, so its integer sums are scaled every two groups, less 32 sum(xq) over those 16 (its
 * codes are q + 32, unsigned for vpdpbusd); GRID_KM's d and m are per 16, its offset term
 * m dx sum(xq) over the 16. */
static inline __attribute__((always_inline)) void kq_micro(
    const int MR, const int PF, const int PASSES, const int FMT, const int8_t *xq,
    const float *dx, const float *sx, const int32_t *sq16, const uint8_t *c0, const uint8_t *c1,
    const float *d0, const float *d1, const float *m0, const float *m1, uint16_t *y, int N, int K,
    int p0, int np, const uint8_t *next, int64_t next_stride) {
    const int KB = K / GRID_BLOCK, PLANES = grid_k_planes(FMT), H = 2 * PLANES;
    const uint64_t *h0 = (const uint64_t *)(c0 + (int64_t)K * 8);
    const uint64_t *h1 = (const uint64_t *)(c1 + (int64_t)K * 8);
    __m512 f[A8_MR][2];
    for (int m = 0; m < MR; m++) f[m][0] = f[m][1] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        __m512i a[A8_MR][2];
        for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm512_setzero_si512();
        for (int o = 0; o < 4; o++) { /* group g holds 8 k */
            const int g = 4 * kb + o;
            if (PF) {
                a8_fetch(next, next_stride, g);
                if (PLANES && (g * PLANES) % 4 == 0) /* a line of masks holds 4 / PLANES groups' */
                    a8_fetch(next + (int64_t)K * 8, next_stride, g * PLANES / 4);
            }
            __m512i l0, u0, l1, u1;
            a8_nibbles(_mm512_loadu_si512(c0 + (int64_t)g * 64), &l0, &u0);
            a8_nibbles(_mm512_loadu_si512(c1 + (int64_t)g * 64), &l1, &u1);
            if (PLANES) { /* masks of group g: [plane][half] */
                l0 = kq_high(l0, h0 + (int64_t)g * H, PLANES);
                u0 = kq_high(u0, h0 + (int64_t)g * H + 1, PLANES);
                l1 = kq_high(l1, h1 + (int64_t)g * H, PLANES);
                u1 = kq_high(u1, h1 + (int64_t)g * H + 1, PLANES);
            }
            a8_group8(MR, xq, K, g, l0, u0, l1, u1, a);
            if (FMT == GRID_KM && (o & 1)) { /* the end of 16 k: their d and m j */
                const int j = 2 * kb + (o >> 1);
                const __m512 s0 = _mm512_loadu_ps(d0 + j * PANEL);
                const __m512 s1 = _mm512_loadu_ps(d1 + j * PANEL);
                const __m512 o0 = _mm512_loadu_ps(m0 + j * PANEL);
                const __m512 o1 = _mm512_loadu_ps(m1 + j * PANEL);
                for (int m = 0; m < MR; m++) {
                    const float dxm = dx[m * KB + kb];
                    const __m512 rdx = _mm512_set1_ps(dxm);
                    const __m512 rsx = _mm512_set1_ps(dxm * (float)sq16[m * 2 * KB + j]);
                    f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][0]), _mm512_mul_ps(s0, rdx),
                                              _mm512_fmadd_ps(o0, rsx, f[m][0]));
                    f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][1]), _mm512_mul_ps(s1, rdx),
                                              _mm512_fmadd_ps(o1, rsx, f[m][1]));
                    a[m][0] = a[m][1] = _mm512_setzero_si512();
                }
            }
            if (FMT == GRID_K6 && (o & 1)) { /* the end of 16 k: their scale j */
                const int j = 2 * kb + (o >> 1);
                const __m512 s0 = _mm512_loadu_ps(d0 + j * PANEL);
                const __m512 s1 = _mm512_loadu_ps(d1 + j * PANEL);
                for (int m = 0; m < MR; m++) {
                    const __m512 rdx = _mm512_set1_ps(dx[m * KB + kb]);
                    const __m512i bias = _mm512_set1_epi32(32 * sq16[m * 2 * KB + j]);
                    f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[m][0], bias)),
                                              _mm512_mul_ps(s0, rdx), f[m][0]);
                    f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[m][1], bias)),
                                              _mm512_mul_ps(s1, rdx), f[m][1]);
                    a[m][0] = a[m][1] = _mm512_setzero_si512();
                }
            }
        }
        if (FMT == GRID_K4 || FMT == GRID_K5)
            a8_scale_offset(MR, a, f, _mm512_loadu_ps(d0 + kb * PANEL),
                            _mm512_loadu_ps(d1 + kb * PANEL), _mm512_loadu_ps(m0 + kb * PANEL),
                            _mm512_loadu_ps(m1 + kb * PANEL), dx + kb, sx + kb, KB);
    }
    a8_store(MR, PASSES, f, y, N, p0, np);
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

#ifdef HAVE_A8_DOT
/* Weight k of channel c of one panel of codes (`panel`) in format `bits`, as the layout above
 * holds it: d q + m (two fp32 roundings: no FMA, as the converters compute it), Q8_0's d q,
 * Q6_K's d (q - 32). d and m: the panel's scales and offsets. */
__attribute__((optimize("fp-contract=off"))) static float grid_weight(
    const uint8_t *panel, const void *d, const void *m, int K, int bits, int c, int k) {
    const int block = k / GRID_BLOCK;
    if (bits == GRID_Q8) {
        const int q = (int)panel[(int64_t)(k / 4) * 64 + 4 * c + k % 4] - 128;
        return (float)q * _cvtsh_ss(((const uint16_t *)d)[block * PANEL + c]);
    }
    const int g = k / 8, j = k % 8;
    const uint8_t byte = panel[(int64_t)g * 64 + 4 * c + j % 4];
    int q = j < 4 ? byte & 15 : byte >> 4;
    if (bits == GRID_Q4)
        return (float)q * _cvtsh_ss(((const uint16_t *)d)[block * PANEL + c]) +
               _cvtsh_ss(((const uint16_t *)m)[block * PANEL + c]);
    const uint64_t *masks = (const uint64_t *)(panel + (int64_t)K * 8);
    const int planes = grid_k_planes(bits), bit = 4 * c + j % 4;
    for (int plane = 0; plane < planes; plane++)
        q |= (int)((masks[(int64_t)g * 2 * planes + 2 * plane + j / 4] >> bit) & 1) << (4 + plane);
    if (bits == GRID_K6)
        return (float)(q - 32) * ((const float *)d)[(k / 16) * PANEL + c];
    const int at = (k / grid_scale_group(bits)) * PANEL + c;
    return (float)q * ((const float *)d)[at] + ((const float *)m)[at];
}
#endif

/* Rows ids [T] of a weight held in the layout above, decoded to bf16 rows out [T, K]
 * (grid_weight, each rounded to bf16). A tied lm_head's embedding lookup: the same as
 * quad_rows(...).to(bfloat16), bit for bit, in about a microsecond a row instead of ~50 us of
 * torch ops (a single stream's step spent that much on its one token). Returns -1 for an id
 * outside [0, N), without AVX512_BF16 and VNNI, or for a weight a8_weight_ok refuses. */
int ppr_grid_a8_rows(const uint8_t *codes, const void *scale, const void *offset,
                     const int64_t *ids, uint16_t *out, int T, int N, int K, int bits) {
#ifdef HAVE_A8_DOT
    if (!a8_weight_ok(K, bits, offset)) return -1;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    const int64_t panel_codes = grid_panel_code_bytes(K, bits);
    const int64_t panel_scales = (int64_t)(K / grid_scale_group(bits)) * PANEL;
    const int64_t panel_offsets = (int64_t)(K / grid_offset_group(bits)) * PANEL;
    const int wide = grid_is_k(bits) ? 4 : 2; /* bytes per scale */
    for (int t = 0; t < T; t++) {
        const int64_t p = ids[t] / PANEL;
        const int c = (int)(ids[t] % PANEL);
        const char *d = (const char *)scale + p * panel_scales * wide;
        const char *m = offset ? (const char *)offset + p * panel_offsets * wide : NULL;
        for (int k = 0; k < K; k++)
            out[(int64_t)t * K + k] =
                bf16_store(grid_weight(codes + p * panel_codes, d, m, K, bits, c, k));
    }
    return 0;
#else
    (void)codes, (void)scale, (void)offset, (void)ids, (void)out, (void)T, (void)N, (void)K,
        (void)bits;
    return -1;
#endif
}

#ifdef HAVE_A8_DOT
size_t a8_scratch_bytes(int M, int K) {
    const size_t rows = (size_t)A8_MAX_PASSES * M;
    return rows * (K / GRID_BLOCK) * (sizeof(float) * 2 + 3 * sizeof(int32_t)) + rows * K;
}

A8Rows a8_rows_at(char *scratch, int M, int K, int passes) {
    const size_t per_block = (size_t)passes * M * (K / GRID_BLOCK);
    A8Rows r;
    r.passes = passes;
    r.dx = (float *)scratch;
    r.sx = r.dx + per_block;
    r.sq = (int32_t *)(r.sx + per_block);
    r.sq16 = r.sq + per_block;
    r.xq = (int8_t *)(r.sq16 + 2 * per_block);
    return r;
}

/* x [M, K] bf16 quantized into r, the rows shared by the team this runs in (orphaned) */
void a8_quantize_rows(const uint16_t *x, int M, int K, A8Rows r) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) a8_quantize_into(x, m, K, r);
}

/* one unit's quantized rows [r, r + mr) of a k-quant (FMT) x its panels c0, c1 */
static void kq_rows(const int FMT, A8Rows rows, int r, int mr, int pf, const uint8_t *c0,
                    const uint8_t *c1, const float *d0, const float *d1, const float *m0,
                    const float *m1, uint16_t *y, int N, int K, int p0, int np,
                    const uint8_t *next, int64_t next_stride) {
    const int KB = K / GRID_BLOCK, passes = rows.passes;
    const int8_t *xr = rows.xq + (int64_t)r * K;
    const float *dr = rows.dx + (int64_t)r * KB, *sr = rows.sx + (int64_t)r * KB;
    const int32_t *qr = rows.sq16 + (int64_t)r * 2 * KB;
    uint16_t *yr = y + (int64_t)(r / passes) * N;
#define KQ_CALL(MR, PF, PASSES)                                                                 \
    kq_micro(MR, PF, PASSES, FMT, xr, dr, sr, qr, c0, c1, d0, d1, m0, m1, yr, N, K, p0, np, next, \
             next_stride)
    switch (passes == 2 ? 10 * mr + pf : mr + 4 * pf) {
    case 1: KQ_CALL(1, 0, 1); break;
    case 2: KQ_CALL(2, 0, 1); break;
    case 3: KQ_CALL(3, 0, 1); break;
    case 4: KQ_CALL(4, 0, 1); break;
    case 5: KQ_CALL(1, 1, 1); break;
    case 6: KQ_CALL(2, 1, 1); break;
    case 7: KQ_CALL(3, 1, 1); break;
    case 8: KQ_CALL(4, 1, 1); break;
    case 20: KQ_CALL(2, 0, 2); break;
    case 21: KQ_CALL(2, 1, 2); break;
    case 40: KQ_CALL(4, 0, 2); break;
    default: KQ_CALL(4, 1, 2); break;
    }
#undef KQ_CALL
}

/* y [M, N] from the quantized rows r, the units of two panels shared by the team (orphaned) */
void a8_units(A8Rows rows, const uint8_t *codes, const void *scale, const void *offset,
              uint16_t *y, int M, int N, int K, int bits) {
    const int KB = K / GRID_BLOCK, num_panels = (N + 15) / 16, num_units = (num_panels + 1) / 2;
    const int64_t panel_codes = grid_panel_code_bytes(K, bits);
    const int64_t panel_scales = (int64_t)(K / grid_scale_group(bits)) * PANEL;
    const int64_t panel_offsets = (int64_t)(K / grid_offset_group(bits)) * PANEL;
    const int k_quant = grid_is_k(bits);
#pragma omp for schedule(guided, 2)
    for (int u = 0; u < num_units; u++) {
        const int p0 = 2 * u, np = num_panels - p0 < 2 ? 1 : 2;
        const uint8_t *c0 = codes + p0 * panel_codes;
        const uint8_t *c1 = np > 1 ? c0 + panel_codes : c0;
        const int passes = rows.passes, quantized = passes * M;
        if (k_quant) { /* fp32 scales (and offsets) */
            const float *d0 = (const float *)scale + p0 * panel_scales;
            const float *d1 = np > 1 ? d0 + panel_scales : d0;
            const float *m0 = offset ? (const float *)offset + p0 * panel_offsets : NULL;
            const float *m1 = m0 && np > 1 ? m0 + panel_offsets : m0;
            for (int r = 0; r < quantized; r += A8_MR) {
                const int pf = r == 0 && u + 1 < num_units;
                const int mr = quantized - r < A8_MR ? quantized - r : A8_MR;
                const uint8_t *next = c0 + 2 * panel_codes;
                if (bits == GRID_K4)
                    kq_rows(GRID_K4, rows, r, mr, pf, c0, c1, d0, d1, m0, m1, y, N, K, p0, np,
                            next, panel_codes);
                else if (bits == GRID_K5)
                    kq_rows(GRID_K5, rows, r, mr, pf, c0, c1, d0, d1, m0, m1, y, N, K, p0, np,
                            next, panel_codes);
                else if (bits == GRID_KM)
                    kq_rows(GRID_KM, rows, r, mr, pf, c0, c1, d0, d1, m0, m1, y, N, K, p0, np,
                            next, panel_codes);
                else
                    kq_rows(GRID_K6, rows, r, mr, pf, c0, c1, d0, d1, m0, m1, y, N, K, p0, np,
                            next, panel_codes);
            }
            continue;
        }
        const uint16_t *d0 = (const uint16_t *)scale + p0 * panel_scales;
        const uint16_t *d1 = np > 1 ? d0 + panel_scales : d0;
        const uint16_t *m0 = bits == 4 ? (const uint16_t *)offset + p0 * panel_scales : NULL;
        const uint16_t *m1 = bits == 4 && np > 1 ? m0 + panel_scales : m0;
        if (M < 8 && u + 1 < num_units) /* the next unit's scales (and offsets) */
            a8_fetch_scales(d0 + 2 * panel_scales, m0 ? m0 + 2 * panel_scales : NULL,
                            2 * panel_scales * (int64_t)sizeof(uint16_t));
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
int ppr_linear_grid_a8(const uint16_t *x, const uint8_t *codes, const void *scale,
                       const void *offset, uint16_t *y, int M, int N, int K, int bits,
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
