/* An 8-bit cache's pages (ppring.h "The 8-bit cache") as a bf16 cache in its pairs layout
 * (ppring.h kv_as_pairs): what the AMX tiles of a long prefill chunk read (attention_amx.c).
 *
 * Why a copy: a tile multiplies bf16 pairs, and a chunk's 16-row query blocks each read every
 * page of the context, so converting a page once a chunk and layer (code times its scale,
 * rounded to bf16: one rounding, as a bf16 cache's own keys and values had) costs a small part
 * of what the tiles then do. Decode steps read the codes in place (attention.c). */
#include "ppring.h"

#ifdef HAVE_BF16_DOT
/* 16 fp32 lanes alternating a, b: the scales of a pair's two elements */
static inline __m512 scale_pairs(float a, float b) {
    return _mm512_castsi512_ps(_mm512_unpacklo_epi32(_mm512_castps_si512(_mm512_set1_ps(a)),
                                                     _mm512_castps_si512(_mm512_set1_ps(b))));
}

static inline __m512 widen16(const int8_t *codes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
}
#endif

/* Pages table[0..n) of an 8-bit cache kv [num_slots slots] as pages 0..n of a bf16 pairs cache
 * out [2, n * PAGE, Hkv, D]: each code times its scale, rounded to nearest even. Returns 0, PPR_BAD_BLOCK for a page outside the cache, or
 * PPR_REFUSED where this build holds no bf16 pairs (no AVX512_BF16, or D not a multiple of
 * 64) or num_slots is not whole pages. */
int ppr_kv8_pairs(const void *kv, int64_t num_slots, int Hkv, int D, const int32_t *table, int n,
                  uint16_t *out) {
    if (!kv_as_pairs(2, D) || Hkv <= 0 || n < 0 || num_slots % PAGE) return PPR_REFUSED;
    for (int p = 0; p < n; p++)
        if (table[p] < 0 || table[p] >= num_slots / PAGE) return PPR_BAD_BLOCK;
#ifdef HAVE_BF16_DOT
    const int64_t row_stride = (int64_t)Hkv * D, out_v = (int64_t)n * PAGE * row_stride;
    const int8_t *codes = kv;
    const uint8_t *k_scale = (const uint8_t *)kv + kv8_k_scale_at(num_slots, Hkv, D);
    const uint16_t *v_scale =
        (const uint16_t *)((const char *)kv + kv8_v_scale_at(num_slots, Hkv, D));
#pragma omp parallel for schedule(static) if (n * Hkv >= 8)
    for (int64_t task = 0; task < (int64_t)n * Hkv; task++) {
        const int p = (int)(task / Hkv), g = (int)(task % Hkv);
        const int64_t block = table[p];
        /* the same layouts, bf16 for bytes: K [D / 2][16][2], V [8][D][2] */
        uint16_t *kt = out + ((int64_t)p * PAGE * Hkv + (int64_t)g * PAGE) * D;
        uint16_t *vt = kt + out_v;
        const int8_t *kc = codes + kv8_key_page(block, g, Hkv, D);
        const int8_t *vc = codes + kv8_value_page(num_slots, block, g, Hkv, D);
        const uint8_t *ks = k_scale + (block * Hkv + g) * D;
        const uint16_t *vs = v_scale + (block * Hkv + g) * PAGE;
        for (int c = 0; c < D; c += 2) { /* 16 slots of channels c, c + 1 */
            const __m512 s = scale_pairs(kv8_scale(ks[c]), kv8_scale(ks[c + 1]));
            const int8_t *at = kc + (int64_t)c * PAGE;
            const __m512 a = _mm512_mul_ps(widen16(at), s), b = _mm512_mul_ps(widen16(at + 16), s);
            _mm512_storeu_si512(kt + (int64_t)c * PAGE, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
        for (int j = 0; j < PAGE; j += 2) { /* 16 channels at a time of slots j, j + 1 */
            const __m512 s = scale_pairs(bf16_load(vs[j]), bf16_load(vs[j + 1]));
            for (int c = 0; c < D; c += 16) {
                const int8_t *at = vc + ((int64_t)(j / 2) * D + c) * 2;
                const __m512 a = _mm512_mul_ps(widen16(at), s);
                const __m512 b = _mm512_mul_ps(widen16(at + 16), s);
                _mm512_storeu_si512(vt + ((int64_t)(j / 2) * D + c) * 2,
                                    (__m512i)_mm512_cvtne2ps_pbh(b, a));
            }
        }
    }
    return 0;
#else
    (void)kv, (void)out;
    return PPR_REFUSED;
#endif
}
