/* bf16 matmuls with vdpbf16ps, where the CPU has AVX512_BF16: over packed panels
 * (ppr_linear_bf16) and over grid codes (ppr_linear_grid_bf16). */
#include "ppring.h"

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
 * at load anyway, backend/cpu/linear.py).
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
