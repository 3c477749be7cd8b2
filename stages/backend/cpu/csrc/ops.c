/* The small ops of a layer: RMSNorm (with the residual add), RoPE and the KV cache store,
 * SiLU times up, a row's argmax, a matmul's bias and the per-head norms of q and k. */
#include "ppring.h"

/* ---- the small ops around the matmuls: one call each instead of five to ten torch ops ---- */

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

/* one head row x [D] of the stage dtype rotated into o [D] (fp32 or bf16, as x), o != x */
static inline void rope_row(int elem_bytes, const void *x, const float *c, const float *s,
                            void *o, int D) {
    if (elem_bytes == 2) {
        rope_row_bf16(x, c, s, o, D);
        return;
    }
    const float *xf = x;
    float *of = o;
    const int half = D / 2;
#pragma omp simd
    for (int i = 0; i < half; i++) of[i] = xf[i] * c[i] + xf[i + half] * s[i];
#pragma omp simd
    for (int i = half; i < D; i++) of[i] = xf[i] * c[i] + xf[i - half] * s[i];
}

static inline float elem_load(int elem_bytes, const void *x, int64_t i) {
    return elem_bytes == 4 ? ((const float *)x)[i] : bf16_load(((const uint16_t *)x)[i]);
}

#if defined(HAVE_AVX512_ATTENTION) && defined(__AVX512VL__)
#define HAVE_KV8_STORE16
/* kv8_code of 16 values x / s: rounded to nearest even, clamped to [-127, 127], NaN to 0 */
static inline __m128i kv8_codes16(__m512 x, __m512 s) {
    const __m512 q = _mm512_div_ps(x, s);
    __m512 c = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(_mm512_max_ps(c, _mm512_set1_ps(-KV8_CODE_MAX)), _mm512_set1_ps(KV8_CODE_MAX));
    c = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(q, q, _CMP_ORD_Q), c);
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c));
}

/* the largest |x| of 16 lanes of each of n rows (`stride` elements apart, the stage dtype) into
 * amax[16], NaN where a lane saw one (as the scalar loops: a NaN is kept) */
static inline void kv8_amax16(int elem_bytes, const void *x, int64_t stride, int n, float *amax) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int j = 0; j < n; j++) {
        const __m512 v = f32x16_load((const char *)x + j * stride * elem_bytes, elem_bytes == 2);
        m = _mm512_max_ps(m, _mm512_abs_ps(v));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    _mm512_storeu_ps(amax, _mm512_mask_blend_ps(nan, m, _mm512_set1_ps(NAN)));
}
#endif

/* One run of an 8-bit cache's keys: rows [o0, o1) of one page (slot `page_slot` its first),
 * head g, from rotated keys k0 (the run's first, of the stage dtype, `row` elements a token).
 * A channel's scale is the page's unless the run needs more (o0 == 0: the page is new, its old
 * scale is nobody's); rows [0, o0) are rounded again where it grew. */
static void kv8_store_keys(int elem_bytes, const void *k0, int64_t row, int o0, int o1,
                           int64_t page_slot, int g, int8_t *codes, uint8_t *k_scale, int Hkv,
                           int D) {
    int8_t *page = codes + kv8_key_page(page_slot / PAGE, g, Hkv, D); /* [D / 2][PAGE][2] */
    uint8_t *scale = k_scale + (page_slot / PAGE * Hkv + g) * D;
#ifdef HAVE_KV8_STORE16
    if (D % 16 == 0) { /* 16 channels at a time: the same codes, a vector's worth per token */
        for (int c = 0; c < D; c += 16) {
            float amax[16], s_new[16];
            kv8_amax16(elem_bytes, (const char *)k0 + (int64_t)c * elem_bytes, row, o1 - o0, amax);
            for (int i = 0; i < 16; i++) {
                const int d = c + i, e_old = (int)scale[d] - 128;
                const int e = o0 > 0 && amax[i] <= KV8_CODE_MAX * kv8_scale_of(e_old)
                                  ? e_old
                                  : kv8_exponent(amax[i]);
                s_new[i] = kv8_scale_of(e);
                if (o0 > 0 && e > e_old) {
                    const float s_old = kv8_scale_of(e_old);
                    for (int j = 0; j < o0; j++)
                        page[kv8_key_at(j, d)] =
                            kv8_code((float)page[kv8_key_at(j, d)] * s_old, s_new[i]);
                }
                scale[d] = (uint8_t)(e + 128);
            }
            const __m512 s = _mm512_loadu_ps(s_new);
            for (int j = o0; j < o1; j++) {
                const __m512 x = f32x16_load(
                    (const char *)k0 + ((int64_t)(j - o0) * row + c) * elem_bytes, elem_bytes == 2);
                int16_t pairs[8]; /* channels c + 2p, c + 2p + 1 of slot j */
                _mm_storeu_si128((__m128i *)pairs, kv8_codes16(x, s));
                for (int p = 0; p < 8; p++) memcpy(page + kv8_key_at(j, c + 2 * p), &pairs[p], 2);
            }
        }
        return;
    }
#endif
    for (int d = 0; d < D; d++) {
        float amax = 0.0f;
        for (int j = o0; j < o1; j++) {
            const float x = fabsf(elem_load(elem_bytes, k0, (int64_t)(j - o0) * row + d));
            amax = x > amax || x != x ? x : amax;
        }
        const int e_old = (int)scale[d] - 128;
        /* where the page's scale holds the run already (a decode's token, mostly),
         * kv8_exponent would give e_old or less: the page keeps e_old; else the run needs more
         * (or the page is new) */
        const int e = o0 > 0 && amax <= KV8_CODE_MAX * kv8_scale_of(e_old) ? e_old
                                                                           : kv8_exponent(amax);
        const float s_new = kv8_scale_of(e);
        if (o0 > 0 && e > e_old) {
            const float s_old = kv8_scale_of(e_old);
            for (int j = 0; j < o0; j++)
                page[kv8_key_at(j, d)] = kv8_code((float)page[kv8_key_at(j, d)] * s_old, s_new);
        }
        scale[d] = (uint8_t)(e + 128);
        for (int j = o0; j < o1; j++)
            page[kv8_key_at(j, d)] =
                kv8_code(elem_load(elem_bytes, k0, (int64_t)(j - o0) * row + d), s_new);
    }
}

/* rope_store_rows into an 8-bit cache (ppring.h): q rotated into q_out, each token's values
 * quantized with their own scale, and its keys rotated in place in qkv (this store's scratch);
 * then, after the loop's barrier, each run of consecutive slots in one page (a decode's token,
 * a prefill's page) takes its keys into the page at once (kv8_store_keys). */
static void kv8_rope_store_rows(int elem_bytes, void *qkv, int64_t row, void *q_out,
                                const float *cos, const float *sin, const int64_t *positions,
                                const int64_t *slots, void *kv, int64_t num_slots, int T, int H,
                                int Hkv, int D) {
    int8_t *codes = kv;
    uint8_t *k_scale = (uint8_t *)kv + kv8_k_scale_at(num_slots, Hkv, D);
    uint16_t *v_scale = (uint16_t *)((char *)kv + kv8_v_scale_at(num_slots, Hkv, D));
    const int eb = elem_bytes;
#pragma omp for schedule(guided, 4)
    for (int t = 0; t < T; t++) {
        const int64_t at = (positions ? positions[t] : t) * D;
        const float *c = cos + at, *s = sin + at;
        for (int h = 0; h < H + Hkv; h++) {
            char *x = (char *)qkv + ((int64_t)t * row + (int64_t)h * D) * eb;
            if (h < H) {
                rope_row(eb, x, c, s, (char *)q_out + ((int64_t)t * H + h) * D * eb, D);
                continue;
            }
            float key[D]; /* big enough for D elements of either dtype */
            rope_row(eb, x, c, s, key, D);
            memcpy(x, key, (size_t)D * eb);
        }
        for (int g = 0; g < Hkv; g++) {
            const char *x = (const char *)qkv + ((int64_t)t * row + (int64_t)(H + Hkv + g) * D) * eb;
            float amax = 0.0f;
#ifdef HAVE_KV8_STORE16
            if (D % 16 == 0) {
                float lanes[16];
                for (int d = 0; d < D; d += 16) {
                    kv8_amax16(eb, x + (int64_t)d * eb, 0, 1, lanes);
                    for (int i = 0; i < 16; i++)
                        amax = lanes[i] > amax || lanes[i] != lanes[i] ? lanes[i] : amax;
                }
            } else
#endif
            for (int d = 0; d < D; d++) {
                const float a = fabsf(elem_load(eb, x, d));
                amax = a > amax || a != a ? a : amax;
            }
            const uint16_t scale_bf16 = bf16_store(amax / KV8_CODE_MAX);
            const float scale = bf16_load(scale_bf16);
            const int64_t block = slots[t] / PAGE;
            const int j = (int)(slots[t] % PAGE);
            v_scale[(block * Hkv + g) * PAGE + j] = scale_bf16;
            int8_t *dst = codes + kv8_value_page(num_slots, block, g, Hkv, D); /* [8][D][2] */
#ifdef HAVE_KV8_STORE16
            if (D % 16 == 0) { /* 16 channels' codes into every other byte (the pairs of slots) */
                const __m512 s = _mm512_set1_ps(scale);
                for (int d = 0; d < D; d += 16) {
                    const __m128i q =
                        scale > 0.0f
                            ? kv8_codes16(f32x16_load(x + (int64_t)d * eb, eb == 2), s)
                            : _mm_setzero_si128();
                    __m256i w = _mm256_cvtepu8_epi16(q);
                    if (j % 2) w = _mm256_slli_epi16(w, 8);
                    _mm256_mask_storeu_epi8(dst + kv8_value_at(j & ~1, d, D),
                                            (__mmask32)(0x55555555u << (j % 2)), w);
                }
                continue;
            }
#endif
            for (int d = 0; d < D; d++)
                dst[kv8_value_at(j, d, D)] = scale > 0.0f ? kv8_code(elem_load(eb, x, d), scale) : 0;
        }
    }
    /* (the barrier above: every key rotated) runs start where a token's slot does not follow
     * the previous token's in the same page */
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < T; t++) {
        if (t > 0 && slots[t] == slots[t - 1] + 1 && slots[t] % PAGE != 0) continue;
        int t1 = t + 1;
        while (t1 < T && slots[t1] == slots[t1 - 1] + 1 && slots[t1] % PAGE != 0) t1++;
        const int o0 = (int)(slots[t] % PAGE);
        const int64_t page_slot = slots[t] - o0;
        for (int g = 0; g < Hkv; g++)
            kv8_store_keys(eb, (const char *)qkv + ((int64_t)t * row + (int64_t)(H + g) * D) * eb,
                           row, o0, o0 + (t1 - t), page_slot, g, codes, k_scale, Hkv, D);
    }
}

/* RoPE (rotate-half) on q and k, and this step's K and V stored at their cache slots. q, k and v
 * are column blocks of one fused [T, row] qkv matmul output: q [T, H, D] at column 0, k and v
 * [T, Hkv, D] at columns H*D and (H+Hkv)*D. The rotated q goes to q_out [T, H, D] (contiguous,
 * what attention reads); cos and signed sin are fp32 (the sine's first half negated):
 * out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i], row t's at row t of cos and sin [T, D],
 * or with `positions` [T] (non-NULL) at row positions[t] of tables [P, D] that cover them.
 * K and V land in rows of the cache, or as pairs where kv_as_pairs. */
void rope_store_rows(int elem_bytes, int kv_bytes, void *qkv, int64_t row, void *q_out,
                     const float *cos, const float *sin, const int64_t *positions,
                     const int64_t *slots, void *kv, int64_t num_slots, int T, int H,
                     int Hkv, int D) {
    if (kv_bytes == 1) {
        kv8_rope_store_rows(elem_bytes, qkv, row, q_out, cos, sin, positions, slots, kv,
                            num_slots, T, H, Hkv, D);
        return;
    }
    const int pairs = kv_as_pairs(elem_bytes, D);
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
            rope_row(elem_bytes, (const char *)qkv + src * elem_bytes, c, s,
                     (char *)(h < H ? q_out : kv) + dst * elem_bytes, D);
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

void rope_store(int elem_bytes, int kv_bytes, void *qkv, int64_t row, void *q_out,
                const float *cos, const float *sin, const int64_t *positions,
                const int64_t *slots, void *kv, int64_t num_slots, int T, int H, int Hkv,
                int D) {
#pragma omp parallel if (T >= 8)
    rope_store_rows(elem_bytes, kv_bytes, qkv, row, q_out, cos, sin, positions, slots, kv,
                    num_slots, T, H, Hkv, D);
}

/* Whether every one of T rows' cache slot lies in [0, num_slots) and, with positions (NULL:
 * none), its position in [0, rope_rows). 0, or a PPR_BAD_*. */
int slots_positions_check(int T, const int64_t *slots, int64_t num_slots,
                          const int64_t *positions, int64_t rope_rows) {
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots) return PPR_BAD_SLOT;
        if (positions && (positions[t] < 0 || positions[t] >= rope_rows)) return PPR_BAD_POSITION;
    }
    return 0;
}

/* rope_store_rows over cos and sin [T, D]: q_out [T, H, D], k and v into the cache
 * [2, num_slots, Hkv, D] (kv_bytes 1: the 8-bit cache, ppring.h, whose store rotates qkv's keys
 * in place) at slots [T], each checked first. Returns 0, PPR_BAD_SLOT, or PPR_REFUSED for a
 * cache kind this build does not store (num_slots not whole pages for an 8-bit one). */
int ppr_rope_store(int elem_bytes, int kv_bytes, void *qkv, int64_t row, void *q_out,
                   const float *cos, const float *sin, const int64_t *slots, void *kv,
                   int64_t num_slots, int T, int H, int Hkv, int D) {
    if (T < 0) return PPR_BAD_ROWS;
    if (!kv_kind_ok(elem_bytes, kv_bytes, num_slots)) return PPR_REFUSED;
    const int bad = slots_positions_check(T, slots, num_slots, NULL, 0);
    if (bad) return bad;
    rope_store(elem_bytes, kv_bytes, qkv, row, q_out, cos, sin, NULL, slots, kv, num_slots, T, H,
               Hkv, D);
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

/* out[T, I] = gelu_tanh(gate) * up (Gemma's GeGLU; rows as ppr_silu_mul's), with torch's tanh
 * approximation 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in fp32; in bf16 the gelu
 * rounded to bf16 before the multiply, as torch's separate ops round it. Row t. */
static inline void gelu_tanh_mul_row(int elem_bytes, const void *gate, const void *up,
                                     int64_t row, void *out, int t, int I) {
    const int64_t src = (int64_t)t * row, dst = (int64_t)t * I;
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    if (elem_bytes == 4) {
        const float *g = (const float *)gate + src, *u = (const float *)up + src;
        float *o = (float *)out + dst;
        for (int i = 0; i < I; i++) {
            const float x = g[i];
            o[i] = 0.5f * x * (1.0f + tanhf(beta * (x + kappa * x * x * x))) * u[i];
        }
    } else {
        const uint16_t *g = (const uint16_t *)gate + src, *u = (const uint16_t *)up + src;
        uint16_t *o = (uint16_t *)out + dst;
        for (int i = 0; i < I; i++) {
            const float x = bf16_load(g[i]);
            const float act = 0.5f * x * (1.0f + tanhf(beta * (x + kappa * x * x * x)));
            o[i] = bf16_store(bf16_load(bf16_store(act)) * bf16_load(u[i]));
        }
    }
}

static void gelu_tanh_mul_rows(int elem_bytes, const void *gate, const void *up, int64_t row,
                               void *out, int T, int I) {
#pragma omp for schedule(guided, 4)
    for (int t = 0; t < T; t++) gelu_tanh_mul_row(elem_bytes, gate, up, row, out, t, I);
}

void ppr_gelu_tanh_mul(int elem_bytes, const void *gate, const void *up, int64_t row, void *out,
                       int T, int I) {
#pragma omp parallel if (T >= 8)
    gelu_tanh_mul_rows(elem_bytes, gate, up, row, out, T, I);
}

/* ppr_add_bias's rows, shared by the team this runs in (orphaned) */
void add_bias_rows(int elem_bytes, void *y, int64_t row_stride, const void *bias, int T, int N) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++)
        add_bias_row(elem_bytes, (char *)y + (int64_t)t * row_stride * elem_bytes, bias, N);
}

/* y[t, j] += bias[j] in place, for rows t < T of y (row_stride elements apart: a column block
 * of a wider matmul output is fine) and columns j < N: a matmul's bias (Qwen2's on q, k and v),
 * add_bias_row's arithmetic. Returns 0; PPR_REFUSED for an elem_bytes other than 4 or 2;
 * PPR_BAD_ROWS for a negative T or N, or rows that would overlap (row_stride < N). */
int ppr_add_bias(int elem_bytes, void *y, int64_t row_stride, const void *bias, int T, int N) {
    if (elem_bytes != 4 && elem_bytes != 2) return PPR_REFUSED;
    if (T < 0 || N < 0 || row_stride < N) return PPR_BAD_ROWS;
#pragma omp parallel if (T >= 8)
    add_bias_rows(elem_bytes, y, row_stride, bias, T, N);
    return 0;
}

/* out = h + residual over rows [T, d] (h copied where residual is NULL); out may be h or
 * residual itself. The residual stream of a layer that reads it un-normed (OLMo 2): bf16 sums
 * rounded once, as torch's bf16 add (bit for bit). Returns 0; PPR_REFUSED for an elem_bytes
 * other than 4 or 2; PPR_BAD_ROWS for a negative T or d. */
int ppr_add(int elem_bytes, const void *h, const void *residual, void *out, int T, int d) {
    if (elem_bytes != 4 && elem_bytes != 2) return PPR_REFUSED;
    if (T < 0 || d < 0) return PPR_BAD_ROWS;
    const int64_t n = (int64_t)T * d;
    if (!residual) {
        if (out != h) memmove(out, h, (size_t)n * elem_bytes);
        return 0;
    }
    if (elem_bytes == 4) {
        const float *a = h, *b = residual;
        float *o = out;
#pragma omp parallel for simd if (T >= 8) schedule(static)
        for (int64_t i = 0; i < n; i++) o[i] = a[i] + b[i];
    } else {
        const uint16_t *a = h, *b = residual;
        uint16_t *o = out;
#pragma omp parallel for if (T >= 8) schedule(static)
        for (int64_t i = 0; i < n; i++) o[i] = bf16_store(bf16_load(a[i]) + bf16_load(b[i]));
    }
    return 0;
}

/* ppr_rms_norm_heads' rows, shared by the team this runs in (orphaned) */
static void rms_norm_heads_rows(int elem_bytes, void *x, int64_t row_stride, int first_head,
                                int num_heads, int D, const void *weight, float eps, int T) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++)
        rms_norm_heads_row(elem_bytes, (char *)x + (int64_t)t * row_stride * elem_bytes,
                           first_head, num_heads, D, weight, eps);
}

/* The RMSNorm of heads [first_head, first_head + num_heads) of every row of x [T, row_stride]
 * (head h of a row at column h D), in place, times weight [D]: rms_norm_heads_row (Qwen3's q
 * heads, then its k heads, of a qkv matmul's rows). Returns 0; PPR_REFUSED for an elem_bytes
 * other than 4 or 2; PPR_BAD_ROWS for a negative T, first_head or num_heads, a D below 1, or
 * heads that reach past a row. */
int ppr_rms_norm_heads(int elem_bytes, void *x, int64_t row_stride, int first_head,
                       int num_heads, int D, const void *weight, float eps, int T) {
    if (elem_bytes != 4 && elem_bytes != 2) return PPR_REFUSED;
    if (T < 0 || first_head < 0 || num_heads < 0 || D < 1 ||
        ((int64_t)first_head + num_heads) * D > row_stride)
        return PPR_BAD_ROWS;
#pragma omp parallel if (T >= 8)
    rms_norm_heads_rows(elem_bytes, x, row_stride, first_head, num_heads, D, weight, eps, T);
    return 0;
}
