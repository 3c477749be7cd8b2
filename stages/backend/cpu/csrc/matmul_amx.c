/* bf16 matmuls on AMX tiles (Sapphire Rapids and later Xeons), over the very panels
 * ppr_pack_bf16 packs for vdpbf16ps (matmul_bf16.c): no second copy of a weight.
 *
 * Why the same panels serve: an AMX B tile of TDPBF16PS is 16 rows of K pairs, each row 16
 * output channels x 2 bf16 (64 bytes) -- "VNNI" order -- and a panel holds exactly that,
 * panels[p][kp][j][e] = w[16 p + j][2 kp + e], so 16 consecutive pairs of one panel (1 KB,
 * one run of memory) are one B tile. An A tile is 16 rows of x, 32 bf16 each, read in place
 * with x's row stride; a C tile is 16 x 16 fp32 sums. TDPBF16PS multiplies bf16 pairs exactly
 * and sums in fp32, as vdpbf16ps does, 16 x 16 x 32 products an instruction: 16 times the work
 * of one vdpbf16ps, which is what a decode batch of 16 rows or more, and every prefill chunk,
 * was bound by (vdpbf16ps at one a cycle a core; issue 49 measured ppring's panels at 6.6 ms
 * against oneDNN's AMX 3.4 ms for a [16384, 2048] matrix at 16 rows, on 2 threads).
 *
 * Work: pairs of panels (32 output channels, a "unit", as ppr_linear_bf16 splits it) over the
 * threads; for each unit, the rows of x two tiles (32 rows) at a time, four C tiles (2 x 2),
 * two A and two B tiles: the eight tile registers. A unit's panels (K x 64 bytes) are read from
 * memory by the first block of rows and from L2 by the rest.
 *
 * The results: each output is a sum in fp32 rounded to bf16 once, as ppr_linear_bf16's; the
 * order of the additions inside the hardware may differ from vdpbf16ps's, so the two paths
 * may differ in the last bit of a sum (tests/stages/test_amx.py measures how far). Which path
 * a matrix takes for a number of rows is the stage's choice (backend/cpu/linear.py amx_rows),
 * made once: the same rows always take the same path. */
#include "ppring.h"

#ifdef HAVE_AMX_BF16
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* linux/arch/x86/include/uapi/asm/prctl.h */
#define XFEATURE_XTILEDATA 18

/* 16 rows x 16 channels of fp32 sums (a stored C tile) -> y's rows [m0, m0 + rows) and
 * channels [16 p, 16 p + 16) (those past N left alone), each rounded to bf16 once */
static inline void amx_store(const float *sums, uint16_t *y, int N, int p, int m0, int rows) {
    for (int r = 0; r < rows; r++)
        bf16_store16(y + (int64_t)(m0 + r) * N, N, p, _mm512_loadu_ps(sums + 16 * r));
}

/* Tiles (ppring.h amx_configure_tiles): 0-3 the C blocks (16 x 16 fp32), 4-5 x's rows (A),
 * 6-7 the panels' pairs (B).
 *
 * y rows [m0, m0 + 16 * mt) x panels p0, p0 + 1 (np of them: 1 or 2) at `unit` (each panel
 * K2 pairs of 64 bytes), x rows at `x` with `x_stride` bytes a row (padded to whole tiles:
 * `rows_left` of them are y's). mt: 1 or 2 tiles of rows. */
static inline __attribute__((always_inline)) void amx_block(const int mt, const int np,
                                                            const uint16_t *x, int64_t x_stride,
                                                            const uint16_t *unit, int K,
                                                            uint16_t *y, int N, int p0, int m0,
                                                            int rows_left, float *sums) {
    const int K2 = K / 2; /* K % 32 == 0 (amx_shape_ok) */
    const char *b0 = (const char *)unit, *b1 = b0 + (int64_t)K2 * 64;
    const char *a0 = (const char *)x + (int64_t)m0 * x_stride, *a1 = a0 + 16 * x_stride;
    _tile_zero(0);
    if (np > 1) _tile_zero(1);
    if (mt > 1) {
        _tile_zero(2);
        if (np > 1) _tile_zero(3);
    }
    for (int kc = 0; kc < K / 32; kc++) {
        _tile_loadd(4, a0 + (int64_t)kc * 64, x_stride);
        _tile_loadd(6, b0 + (int64_t)kc * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (mt > 1) {
            _tile_loadd(5, a1 + (int64_t)kc * 64, x_stride);
            _tile_dpbf16ps(2, 5, 6);
        }
        if (np > 1) {
            _tile_loadd(7, b1 + (int64_t)kc * 1024, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (mt > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    const int first = rows_left < 16 ? rows_left : 16;
    _tile_stored(0, sums, 64);
    amx_store(sums, y, N, p0, m0, first);
    if (np > 1) {
        _tile_stored(1, sums, 64);
        amx_store(sums, y, N, p0 + 1, m0, first);
    }
    if (mt > 1 && rows_left > 16) {
        const int second = rows_left - 16 < 16 ? rows_left - 16 : 16;
        _tile_stored(2, sums, 64);
        amx_store(sums, y, N, p0, m0 + 16, second);
        if (np > 1) {
            _tile_stored(3, sums, 64);
            amx_store(sums, y, N, p0 + 1, m0 + 16, second);
        }
    }
}

/* every row of x (M of them, padded to whole tiles) against panels p0, p0 + 1 (np) at `unit` */
static void amx_rows(const uint16_t *x, int64_t x_stride, int M, const uint16_t *unit, int K,
                     uint16_t *y, int N, int p0, int np, float *sums) {
    for (int m0 = 0; m0 < M; m0 += 32) {
        const int left = M - m0;
        if (left > 16) {
            if (np > 1) amx_block(2, 2, x, x_stride, unit, K, y, N, p0, m0, left, sums);
            else amx_block(2, 1, x, x_stride, unit, K, y, N, p0, m0, left, sums);
        } else {
            if (np > 1) amx_block(1, 2, x, x_stride, unit, K, y, N, p0, m0, left, sums);
            else amx_block(1, 1, x, x_stride, unit, K, y, N, p0, m0, left, sums);
        }
    }
}
#endif

/* 1 where this build has AMX-BF16 and the kernel let this process use the tile data (asked
 * once: arch_prctl(ARCH_REQ_XCOMP_PERM), which Linux requires since 5.16 before a first tile
 * instruction; without it that instruction is a SIGILL). backend/cpu/native.py asks at load,
 * before any matmul. */
int ppr_has_amx_bf16(void) {
#ifdef HAVE_AMX_BF16
    static int granted = 0; /* 0: not asked yet, 1: yes, -1: no */
    if (!granted)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return granted == 1;
#else
    return 0;
#endif
}

#ifdef HAVE_AMX_BF16
/* the shapes the tiles take: K a whole number of 32-wide tiles (so a row of x is read to its
 * end and no further), and sizes whose byte offsets fit */
static int amx_shape_ok(int M, int N, int K) {
    return M > 0 && N > 0 && K > 0 && K % 32 == 0 && K <= (1 << 20);
}

/* ---- grid codes (matmul_a8.c's layout) decoded a unit at a time into panels ----
 * A prefill chunk multiplies each weight by hundreds of rows: there the tiles' 16x work per
 * instruction outweighs decoding the codes, so each thread decodes a unit's two panels of codes
 * into the bf16 pairs ppr_pack_bf16 would have stored (a buffer of its own, 64 K bytes: L2) and
 * multiplies every row of x by them there. The weights are the codes' exact values, rounded to
 * bf16 once (round to nearest even), as GridA8Linear.rows gives them: x is not quantized. */

/* idx[2 c] = c, idx[2 c + 1] = 16 + c: _mm512_cvtne2ps_pbh(w1, w0)'s two halves interleaved
 * into pairs, lane c = (w0[c], w1[c]) */
static inline __m512i amx_pair_index(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                            22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

/* 16 channels' k and k + 1 weights (w0, w1) -> one 64-byte row of pairs */
static inline void amx_put_pair(uint16_t *row, __m512 w0, __m512 w1, __m512i idx) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
    _mm512_storeu_si512(row, _mm512_permutexvar_epi16(idx, both));
}

/* one panel of codes (Q4_1: K / 8 groups of 64 bytes; Q8_0: K / 4), its scales d and (Q4_1)
 * offsets m [K / 32, 16] fp16 -> its K / 2 pairs [K / 2][16][2] bf16 */
static void amx_decode_panel(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int K,
                             int bits, uint16_t *pairs) {
    const __m512i idx = amx_pair_index();
    for (int b = 0; b < K / GRID_BLOCK; b++) {
        const __m512 db = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 16 * b)));
        if (bits == 4) {
            /* byte j of channel c's lane: q[8 g + j] low, q[8 g + 4 + j] high; pair s of the
             * group's four takes the nibbles at these shifts (and 8 more) */
            static const int shift[4] = {0, 16, 4, 20};
            const __m512 mb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + 16 * b)));
            const __m512i mask = _mm512_set1_epi32(15);
            for (int g = 4 * b; g < 4 * b + 4; g++) {
                const __m512i v = _mm512_loadu_si512(codes + (int64_t)g * 64);
                for (int s = 0; s < 4; s++) {
                    const __m512i q0 = _mm512_and_si512(_mm512_srli_epi32(v, shift[s]), mask);
                    const __m512i q1 = _mm512_and_si512(_mm512_srli_epi32(v, shift[s] + 8), mask);
                    amx_put_pair(pairs + ((int64_t)4 * g + s) * 32,
                                 _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), db, mb),
                                 _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), db, mb), idx);
                }
            }
        } else {
            /* byte j of channel c's lane: q[4 g + j] + 128 */
            const __m512i mask = _mm512_set1_epi32(255), bias = _mm512_set1_epi32(128);
            for (int g = 8 * b; g < 8 * b + 8; g++) {
                const __m512i v = _mm512_loadu_si512(codes + (int64_t)g * 64);
                for (int s = 0; s < 2; s++) {
                    const __m512i q0 = _mm512_sub_epi32(
                        _mm512_and_si512(_mm512_srli_epi32(v, 16 * s), mask), bias);
                    const __m512i q1 = _mm512_sub_epi32(
                        _mm512_and_si512(_mm512_srli_epi32(v, 16 * s + 8), mask), bias);
                    amx_put_pair(pairs + ((int64_t)2 * g + s) * 32,
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(q0), db),
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(q1), db), idx);
                }
            }
        }
    }
}

/* one panel of a k-quant's codes (FMT GRID_K4/K5/K6: nibbles, then masks of high bits), its
 * fp32 scales d [K / 32 or K / 16, 16] and offsets m [K / 32, 16] (none for Q6_K) -> its K / 2
 * pairs, each weight as ppr_grid_a8_rows computes it (d q + m in two roundings; Q6_K's
 * d (q - 32)) rounded to bf16 */
static void amx_decode_kpanel(const uint8_t *codes, const float *d, const float *m, int K,
                              int bits, uint16_t *pairs) {
    const __m512i idx = amx_pair_index(), nibble = _mm512_set1_epi8(15);
    const __m512i byte = _mm512_set1_epi32(255), zero = _mm512_set1_epi32(32);
    const int planes = grid_k_planes(bits);
    const uint64_t *masks = (const uint64_t *)(codes + (int64_t)K * 8);
    for (int g = 0; g < K / 8; g++) {
        const __m512i v = _mm512_loadu_si512(codes + (int64_t)g * 64);
        __m512i half[2] = {_mm512_and_si512(v, nibble),
                           _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)};
        for (int h = 0; h < 2; h++)
            for (int plane = 0; plane < planes; plane++)
                half[h] = _mm512_mask_add_epi8(
                    half[h], _cvtu64_mask64(masks[(int64_t)g * 2 * planes + 2 * plane + h]),
                    half[h], _mm512_set1_epi8((char)(16 << plane)));
        for (int s = 0; s < 4; s++) { /* k = 8 g + 2 s and + 1: bytes 2 (s % 2), + 1 of half s / 2 */
            const int k = 8 * g + 2 * s;
            const __m512i from = half[s / 2];
            __m512i q0 = _mm512_and_si512(_mm512_srli_epi32(from, 16 * (s % 2)), byte);
            __m512i q1 = _mm512_and_si512(_mm512_srli_epi32(from, 16 * (s % 2) + 8), byte);
            __m512 w0, w1;
            if (bits == GRID_K6) {
                const __m512 dk = _mm512_loadu_ps(d + (k / 16) * PANEL);
                w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q0, zero)), dk);
                w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q1, zero)), dk);
            } else { /* per 32 (Q4_K, Q5_K) or per 16 (GRID_KM) */
                const int at = (k / grid_scale_group(bits)) * PANEL;
                const __m512 dk = _mm512_loadu_ps(d + at);
                const __m512 mk = _mm512_loadu_ps(m + at);
                w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q0), dk), mk);
                w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q1), dk), mk);
            }
            amx_put_pair(pairs + (int64_t)(k / 2) * 32, w0, w1, idx);
        }
    }
}

/* x's rows in whole tiles: x itself where M is a multiple of 16, else a zero-padded copy
 * (*padded, for the caller to free). NULL when that allocation failed. */
static const uint16_t *amx_padded_rows(const uint16_t *x, int M, int K, uint16_t **padded) {
    *padded = NULL;
    if (M % 16 == 0) return x;
    const int M_tiles = (M + 15) / 16;
    *padded = aligned_alloc(64, (size_t)M_tiles * 16 * K * 2);
    if (!*padded) return NULL;
    memcpy(*padded, x, (size_t)M * K * 2);
    memset(*padded + (int64_t)M * K, 0, (size_t)(M_tiles * 16 - M) * K * 2);
    return *padded;
}
#endif

/* y[M, N] = x[M, K] @ W^T in bf16 for W packed by ppr_pack_bf16, on AMX tiles. x is read in
 * whole tiles of 16 rows: where M is not a multiple of 16 its rows are first copied into a
 * zero-padded buffer (a few KB against a weight's MB), so no tile reads past x's end. Returns
 * PPR_REFUSED where this build or process has no AMX-BF16 (ppr_has_amx_bf16), K is not a
 * multiple of 32, or the padded copy could not be allocated; the caller then takes
 * ppr_linear_bf16, which accepts every shape. */
int ppr_linear_bf16_amx(const uint16_t *x, const uint16_t *panels, uint16_t *y, int M, int N,
                        int K) {
#ifdef HAVE_AMX_BF16
    if (!ppr_has_amx_bf16() || !amx_shape_ok(M, N, K)) return PPR_REFUSED;
    uint16_t *padded;
    const uint16_t *rows = amx_padded_rows(x, M, K, &padded);
    if (!rows) return PPR_REFUSED;
    const int num_panels = (N + 15) / 16, num_units = (num_panels + 1) / 2;
    const int64_t unit_elems = (int64_t)2 * (K / 2) * 32; /* two panels of K / 2 pairs */
#pragma omp parallel
    {
        float sums[256] __attribute__((aligned(64)));
        amx_configure_tiles();
#pragma omp for schedule(static)
        for (int u = 0; u < num_units; u++) {
            const int np = num_panels - 2 * u < 2 ? num_panels - 2 * u : 2;
            amx_rows(rows, (int64_t)K * 2, M, panels + u * unit_elems, K, y, N, 2 * u, np, sums);
        }
        _tile_release();
    }
    free(padded);
    return 0;
#else
    (void)x, (void)panels, (void)y, (void)M, (void)N, (void)K;
    return PPR_REFUSED;
#endif
}

/* y[M, N] = x[M, K] @ W^T in bf16 for W held as grid codes in matmul_a8.c's layout (codes,
 * scale, offset as ppr_linear_grid_a8 takes them), on AMX tiles: each unit's codes decoded into
 * bf16 pairs (amx_decode_panel), then multiplied as ppr_linear_bf16_amx multiplies panels.
 * Returns PPR_REFUSED as ppr_linear_bf16_amx does, and for a grid these kernels do not read
 * (a8_weight_ok) or a thread's buffer not allocated; the caller then takes ppr_linear_grid_a8. */
int ppr_linear_grid_a8_amx(const uint16_t *x, const uint8_t *codes, const void *scale,
                           const void *offset, uint16_t *y, int M, int N, int K, int bits) {
#ifdef HAVE_AMX_BF16
    if (!ppr_has_amx_bf16() || !amx_shape_ok(M, N, K) || !a8_weight_ok(K, bits, offset))
        return PPR_REFUSED;
    uint16_t *padded;
    const uint16_t *rows = amx_padded_rows(x, M, K, &padded);
    if (!rows) return PPR_REFUSED;
    const int num_panels = (N + 15) / 16, num_units = (num_panels + 1) / 2;
    const int64_t panel_codes = grid_panel_code_bytes(K, bits);
    const int64_t panel_scales = (int64_t)(K / grid_scale_group(bits)) * PANEL;
    const int64_t panel_offsets = (int64_t)(K / grid_offset_group(bits)) * PANEL;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float sums[256] __attribute__((aligned(64)));
        uint16_t *pairs = aligned_alloc(64, (size_t)2 * K * 32); /* two panels of K / 2 pairs */
        failed = !pairs;
        if (pairs) amx_configure_tiles();
#pragma omp for schedule(static)
        for (int u = 0; u < num_units; u++) {
            if (!pairs) continue;
            const int p0 = 2 * u, np = num_panels - p0 < 2 ? 1 : 2;
            for (int i = 0; i < np; i++) {
                const uint8_t *c = codes + (p0 + i) * panel_codes;
                uint16_t *into = pairs + (int64_t)i * K * 16;
                if (grid_is_k(bits))
                    amx_decode_kpanel(c, (const float *)scale + (p0 + i) * panel_scales,
                                      offset ? (const float *)offset + (p0 + i) * panel_offsets
                                             : NULL,
                                      K, bits, into);
                else
                    amx_decode_panel(c, (const uint16_t *)scale + (p0 + i) * panel_scales,
                                     bits == 4 ? (const uint16_t *)offset + (p0 + i) * panel_scales
                                               : NULL,
                                     K, bits, into);
            }
            amx_rows(rows, (int64_t)K * 2, M, pairs, K, y, N, p0, np, sums);
        }
        if (pairs) _tile_release();
        free(pairs);
    }
    free(padded);
    return failed ? PPR_REFUSED : 0;
#else
    (void)x, (void)codes, (void)scale, (void)offset, (void)y, (void)M, (void)N, (void)K,
        (void)bits;
    return PPR_REFUSED;
#endif
}
