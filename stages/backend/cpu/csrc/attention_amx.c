/* A long prefill chunk's attention on AMX tiles (ppr_prefill_attention_amx), over the paged
 * bf16 cache in its pairs layout (ppring.h kv_as_pairs), one sequence a call.
 *
 * Why: ppr_paged_attention scores a query row at a time against each 16-key page with
 * vdpbf16ps. A prefill chunk of hundreds of rows is bound by that arithmetic: the default model's
 * 1,500-token prompt spent ~840 ms of its 1.08 s to the first token in attention on the 2-core
 * Xeon. Here 32 query rows of one head meet two pages (32 keys) at a time as matrices:
 *
 *   S [32 x 32] = Q [32 x D] K^T: 4 C tiles, Q as A tiles (16 rows x 32 of D), and each page's
 *       keys straight from the cache as B tiles: a page holds a head's keys as [D / 2][16][2]
 *       (dimension pair, key, element), which is a B tile's layout (16 dimension pairs x 16
 *       keys x 2) with no copy;
 *   online softmax of S's rows in fp32 vectors (as the paged kernel's), P rounded to bf16;
 *   O += P [32 x 32 keys] V [32 keys x D]: a page holds a head's values as [8][D][2] (key pair,
 *       dimension, element), so the two pages copied back to back (4 KB at D = 64, zeroed
 *       past the context: a stale slot may hold NaN, and 0 x NaN is NaN) are B tiles of 16 key
 *       pairs x 16 dimensions x 2, D / 16 of them.
 *
 * The running output stays in fp32 memory (acc [32][D]), rescaled by the softmax's correction
 * a row at a time: tiles cannot be scaled in place. Work: (head, block of 32 rows) tasks over
 * the threads, the latest rows (the most keys) first. Query row i of the chunk sits at position
 * ctx_len - q_len + i and sees keys 0..that position, as in ppr_paged_attention. */
#include "ppring.h"

#ifdef HAVE_AMX_BF16
#define ATT_ROWS 32 /* query rows a task */
#define ATT_MAX_D 256

/* one thread's buffers */
typedef struct {
    uint16_t q[ATT_ROWS * ATT_MAX_D];     /* the task's query rows, zero past its rows */
    uint16_t p[ATT_ROWS * 32];            /* probabilities, bf16, a row 32 keys */
    uint16_t v[32 * ATT_MAX_D];           /* two pages' values: [16 key pairs][D][2] */
    uint16_t zero_k[16 * ATT_MAX_D];      /* the keys of a page past the context: zeros */
    float s[ATT_ROWS * 32];               /* scores */
    float o[16 * 16];                     /* one stored O tile */
    float acc[ATT_ROWS * ATT_MAX_D];      /* the running output */
    float m[ATT_ROWS], l[ATT_ROWS];       /* running max and sum */
} att_scratch;

/* S = Qb Kpair^T for two pages (k0, k1: each a head's [D / 2][16][2]) into s [32][32] */
static inline void att_scores(const uint16_t *qb, const uint16_t *k0, const uint16_t *k1, int D,
                              float *s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int dc = 0; dc < D / 32; dc++) {
        _tile_loadd(4, qb + dc * 32, D * 2);
        _tile_loadd(5, qb + 16 * D + dc * 32, D * 2);
        _tile_loadd(6, k0 + dc * 512, 64); /* 16 dimension pairs of 16 keys x 2 */
        _tile_loadd(7, k1 + dc * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, s, 128);
    _tile_stored(1, s + 16, 128);
    _tile_stored(2, s + 16 * 32, 128);
    _tile_stored(3, s + 16 * 32 + 16, 128);
}

/* acc [32][D] += P [32][32 keys] V [32 keys][D] (vb: [16 key pairs][D][2]) */
static inline void att_values(att_scratch *w, int D) {
    _tile_loadd(4, w->p, 64);
    _tile_loadd(5, w->p + 16 * 32, 64);
    for (int dt = 0; dt < D / 16; dt += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(6, w->v + dt * 32, D * 4);
        _tile_loadd(7, w->v + (dt + 1) * 32, D * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        for (int t = 0; t < 4; t++) {
            const int r0 = t < 2 ? 0 : 16, d0 = (dt + (t & 1)) * 16;
            switch (t) { /* a tile's number is an immediate */
            case 0: _tile_stored(0, w->o, 64); break;
            case 1: _tile_stored(1, w->o, 64); break;
            case 2: _tile_stored(2, w->o, 64); break;
            default: _tile_stored(3, w->o, 64); break;
            }
            for (int r = 0; r < 16; r++) {
                float *a = w->acc + (int64_t)(r0 + r) * D + d0;
                const __m512 o = _mm512_loadu_ps(w->o + 16 * r);
                _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), o));
            }
        }
    }
}

/* the first `seen` of 16 keys (all, none, or a prefix) */
static inline __mmask16 att_seen_mask(int seen) {
    if (seen >= 16) return (__mmask16)0xffff;
    return seen <= 0 ? (__mmask16)0 : (__mmask16)((1u << seen) - 1);
}

/* one task: query rows [r0, r0 + rows) of head h (KV head g) */
static void att_task(const uint16_t *q, const uint16_t *kv, uint16_t *out, int q_start, int q_len,
                     int ctx_len, const int32_t *table, int64_t num_slots, int H, int Hkv, int D,
                     float scale, int h, int r0, att_scratch *w) {
    const int g = h / (H / Hkv), rows = q_len - r0 < ATT_ROWS ? q_len - r0 : ATT_ROWS;
    const int64_t page = (int64_t)PAGE * Hkv * D; /* elements of a page, all heads */
    const uint16_t *k_half = kv, *v_half = kv + num_slots * Hkv * D;
    for (int i = 0; i < ATT_ROWS; i++) {
        uint16_t *dst = w->q + (int64_t)i * D;
        if (i < rows)
            memcpy(dst, q + ((int64_t)(q_start + r0 + i) * H + h) * D, (size_t)D * 2);
        else
            memset(dst, 0, (size_t)D * 2);
        w->m[i] = -INFINITY, w->l[i] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * ATT_ROWS * D);
    const int first_pos = ctx_len - q_len + r0, last_pos = first_pos + rows - 1;
    const int num_pages = last_pos / PAGE + 1;
    for (int p0 = 0; p0 < num_pages; p0 += 2) {
        const int has1 = p0 + 1 < num_pages;
        const uint16_t *k0 = k_half + table[p0] * page + (int64_t)g * PAGE * D;
        const uint16_t *k1 = has1 ? k_half + table[p0 + 1] * page + (int64_t)g * PAGE * D
                                  : w->zero_k;
        att_scores(w->q, k0, k1, D, w->s);
        /* the two pages' values back to back, zero past the context */
        for (int j = 0; j < 2; j++) {
            uint16_t *dst = w->v + (int64_t)j * 16 * D;
            const int key0 = (p0 + j) * PAGE, valid = ctx_len - key0;
            if (j == 1 && !has1) {
                memset(dst, 0, (size_t)16 * D * 2);
                continue;
            }
            memcpy(dst, v_half + table[p0 + j] * page + (int64_t)g * PAGE * D, (size_t)16 * D * 2);
            for (int slot = valid < 0 ? 0 : valid; slot < PAGE; slot++)
                for (int d = 0; d < D; d++) dst[(slot / 2) * D * 2 + d * 2 + slot % 2] = 0;
        }
        const int key0 = p0 * PAGE;
        for (int i = 0; i < ATT_ROWS; i++) {
            uint16_t *prow = w->p + i * 32;
            if (i >= rows) {
                memset(prow, 0, 64);
                continue;
            }
            const int seen = first_pos + i - key0 + 1; /* keys of these 32 this row sees */
            const __mmask16 v0 = att_seen_mask(seen), v1 = att_seen_mask(seen - 16);
            const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
            const __m512 s0 =
                _mm512_mask_blend_ps(v0, ninf, _mm512_mul_ps(_mm512_loadu_ps(w->s + i * 32), sc));
            const __m512 s1 = _mm512_mask_blend_ps(
                v1, ninf, _mm512_mul_ps(_mm512_loadu_ps(w->s + i * 32 + 16), sc));
            const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            if (block_max > w->m[i]) {
                const float correction =
                    w->m[i] == -INFINITY ? 0.0f : exp_nonpositive(w->m[i] - block_max);
                w->l[i] *= correction;
                float *a = w->acc + (int64_t)i * D;
                const __m512 c = _mm512_set1_ps(correction);
                for (int d = 0; d < D; d += 16)
                    _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), c));
                w->m[i] = block_max;
            }
            const __m512 mx = _mm512_set1_ps(w->m[i]);
            const __m512 e0 = _mm512_maskz_mov_ps(v0, exp16_nonpositive(_mm512_sub_ps(s0, mx)));
            const __m512 e1 = _mm512_maskz_mov_ps(v1, exp16_nonpositive(_mm512_sub_ps(s1, mx)));
            w->l[i] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
            _mm512_storeu_si512(prow, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        att_values(w, D);
    }
    for (int i = 0; i < rows; i++) {
        uint16_t *dst = out + ((int64_t)(q_start + r0 + i) * H + h) * D;
        const float inv = 1.0f / w->l[i];
        for (int d = 0; d < D; d++) dst[d] = bf16_store(w->acc[(int64_t)i * D + d] * inv);
    }
}
#endif

/* out rows [q_start, q_start + q_len) of q [num_tokens, H, D] bf16 (RoPE applied): one
 * sequence's chunk attending causally to its ctx_len keys, which lie in the pages `table`
 * [table_len] names of kv [2, num_slots, Hkv, D] (bf16, pairs: kv_as_pairs). Every index is
 * checked before anything is read: PPR_BAD_ROWS for rows outside q, PPR_BAD_CONTEXT for a
 * context shorter than the chunk or past the table, PPR_BAD_BLOCK for a page outside the cache.
 * PPR_REFUSED where this build or process has no AMX-BF16, the cache is not pairs (D % 64), D
 * is over 256, H is not a multiple of Hkv, or a thread's buffers could not be allocated; the
 * caller then takes another path. */
int ppr_prefill_attention_amx(const uint16_t *q, const uint16_t *kv, uint16_t *out, int num_tokens,
                              int q_start, int q_len, int ctx_len, const int32_t *table,
                              int table_len, int64_t num_slots, int H, int Hkv, int D,
                              float scale) {
#ifdef HAVE_AMX_BF16
    if (!ppr_has_amx_bf16() || !kv_as_pairs(2, D) || D > ATT_MAX_D || Hkv <= 0 || H % Hkv)
        return PPR_REFUSED;
    if (q_start < 0 || q_len <= 0 || q_len > num_tokens - q_start) return PPR_BAD_ROWS;
    if (ctx_len < q_len || (ctx_len + PAGE - 1) / PAGE > table_len) return PPR_BAD_CONTEXT;
    for (int p = 0; p < (ctx_len + PAGE - 1) / PAGE; p++)
        if (table[p] < 0 || table[p] >= num_slots / PAGE) return PPR_BAD_BLOCK;
    const int blocks = (q_len + ATT_ROWS - 1) / ATT_ROWS, num_tasks = H * blocks;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        att_scratch *w = aligned_alloc(64, (sizeof(att_scratch) + 63) / 64 * 64);
        failed = !w;
        if (w) {
            memset(w->zero_k, 0, sizeof w->zero_k);
            amx_configure_tiles();
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = num_tasks - 1; task >= 0; task--) { /* the latest rows, most keys, first */
            if (!w) continue;
            att_task(q, kv, out, q_start, q_len, ctx_len, table, num_slots, H, Hkv, D, scale,
                     task % H, (task / H) * ATT_ROWS, w);
        }
        if (w) _tile_release();
        free(w);
    }
    return failed ? PPR_REFUSED : 0;
#else
    (void)q, (void)kv, (void)out, (void)num_tokens, (void)q_start, (void)q_len, (void)ctx_len,
        (void)table, (void)table_len, (void)num_slots, (void)H, (void)Hkv, (void)D, (void)scale;
    return PPR_REFUSED;
#endif
}
