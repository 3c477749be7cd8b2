/* Attention over the paged cache for a layer with a sliding window or a soft cap on its scores
 * (Mistral's and Phi-3-mini-4k's windows, Gemma 2's and 3's local layers and Gemma 2's cap).
 *
 * A query at position p sees keys (p - window, p] (transformers' sliding_window_overlay: key
 * j visible where j > p - window; window 0: all of [0, p]), and a score s = scale q.k becomes
 * cap tanh(s / cap) before the softmax where cap > 0 (Gemma 2's attn_logit_softcapping). Pages
 * wholly before a query's window are never read: the scheduler gives the blocks behind every
 * layer's window back to the pool (ring/scheduler.py), and their table entries then name blocks
 * another sequence may hold.
 *
 * Plainer than attention.c's kernel, which stays Llama's: a task is one sequence and one KV
 * group, every query row of it and every head of the group; a page's visible keys are scored
 * into a row of scratch, then one online-softmax update a page. The cache's layout is the
 * stage's (rows, or bf16 pairs where kv_as_pairs: ops.c rope_store_rows writes both). */
#include "ppring.h"

/* K[j][d] and V[j][d] of slot j of page `block`, head g, of an 8-bit cache (ppring.h), as fp32 */
static inline float key_at8(const void *kv, int64_t num_slots, int Hkv, int D, int64_t block,
                            int g, int j, int d) {
    const int8_t code = ((const int8_t *)kv)[kv8_key_page(block, g, Hkv, D) + kv8_key_at(j, d)];
    const uint8_t e = ((const uint8_t *)kv)[kv8_k_scale_at(num_slots, Hkv, D) +
                                            (block * Hkv + g) * D + d];
    return (float)code * kv8_scale(e);
}

static inline float value_at8(const void *kv, int64_t num_slots, int Hkv, int D, int64_t block,
                              int g, int j, int d) {
    const int8_t code =
        ((const int8_t *)kv)[kv8_value_page(num_slots, block, g, Hkv, D) + kv8_value_at(j, d, D)];
    const uint16_t *v_scale =
        (const uint16_t *)((const char *)kv + kv8_v_scale_at(num_slots, Hkv, D));
    return (float)code * bf16_load(v_scale[(block * Hkv + g) * PAGE + j]);
}

/* K[j][d] and V[j][d] of slot j of a page, head g, as fp32 (the page's layout, see above) */
static inline float key_at(int elem_bytes, int pairs, const void *kv, int64_t page_base,
                           int64_t head_base, int64_t row_stride, int j, int d) {
    if (elem_bytes == 4) return ((const float *)kv)[page_base + head_base + j * row_stride + d];
    const uint16_t *k = (const uint16_t *)kv;
    if (pairs) return bf16_load(k[page_base + head_base * PAGE + (d / 2) * 2 * PAGE + j * 2 + d % 2]);
    return bf16_load(k[page_base + head_base + j * row_stride + d]);
}

static inline float value_at(int elem_bytes, int pairs, const void *kv, int64_t v_offset,
                             int64_t page_base, int64_t head_base, int64_t row_stride, int D,
                             int j, int d) {
    if (elem_bytes == 4)
        return ((const float *)kv)[v_offset + page_base + head_base + j * row_stride + d];
    const uint16_t *v = (const uint16_t *)kv + v_offset;
    if (pairs) return bf16_load(v[page_base + head_base * PAGE + (j / 2) * 2 * D + 2 * d + j % 2]);
    return bf16_load(v[page_base + head_base + j * row_stride + d]);
}

/* One query vector qv [D] (scaled) of position p over its sequence's keys in the window:
 * acc [D] (scratch) and scores [PAGE]; writes the output row (elem type) at out_row. */
static void attend_row(int elem_bytes, int kv_bytes, int pairs, const float *qv, const void *kv,
                       const int32_t *blocks, int64_t num_slots, int Hkv, int D, int g, int p,
                       int window, float softcap, float *acc, float *scores, void *out_row) {
    const int64_t row_stride = (int64_t)Hkv * D, v_offset = num_slots * row_stride;
    /* rows layout: slot j of head g at (block * PAGE + j) * Hkv * D + g * D; pairs: head g's
     * PAGE * D elements start g * PAGE * D into the page (key_at, value_at) */
    const int64_t head_base = (int64_t)g * D;
    const int lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
    float m = -INFINITY, l = 0.0f;
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    for (int page = lo / PAGE; page <= p / PAGE; page++) {
        const int key0 = page * PAGE;
        const int a = lo > key0 ? lo - key0 : 0, b = p + 1 - key0 < PAGE ? p + 1 - key0 : PAGE;
        const int64_t page_base = (int64_t)blocks[page] * PAGE * row_stride;
        float page_max = -INFINITY;
        for (int j = a; j < b; j++) {
            float s = 0.0f;
            for (int d = 0; d < D; d++)
                s += qv[d] * (kv_bytes == 1 ? key_at8(kv, num_slots, Hkv, D, blocks[page], g, j, d)
                                            : key_at(elem_bytes, pairs, kv, page_base, head_base,
                                                     row_stride, j, d));
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            scores[j] = s;
            page_max = s > page_max ? s : page_max;
        }
        const float m_new = page_max > m ? page_max : m;
        const float c = expf(m - m_new); /* 0 on the first page: m is -inf */
        l *= c;
        for (int d = 0; d < D; d++) acc[d] *= c;
        for (int j = a; j < b; j++) {
            const float w = expf(scores[j] - m_new);
            l += w;
            for (int d = 0; d < D; d++)
                acc[d] += w * (kv_bytes == 1
                                   ? value_at8(kv, num_slots, Hkv, D, blocks[page], g, j, d)
                                   : value_at(elem_bytes, pairs, kv, v_offset, page_base,
                                              head_base, row_stride, D, j, d));
        }
        m = m_new;
    }
    const float inv = 1.0f / l;
    if (elem_bytes == 4) {
        float *o = out_row;
        for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
    } else {
        uint16_t *o = out_row;
        for (int d = 0; d < D; d++) o[d] = bf16_store(acc[d] * inv);
    }
}

/* Every query row of the packed batch, its metadata already checked (attention_indices_check):
 * q and out [T, H, D], the cache [2, num_slots, Hkv, D] in the stage's layout. window 0: no
 * window; softcap 0: no cap. Returns 0, PPR_REFUSED for a shape this kernel does not take or
 * -1 when scratch cannot be allocated. */
int paged_attention_window(int elem_bytes, int kv_bytes, const void *q, const void *kv, void *out,
                           int num_seqs,
                           const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                           const int32_t *table, int table_stride, int64_t num_slots, int H,
                           int Hkv, int D, float scale, int window, float softcap) {
    if (!kv_kind_ok(elem_bytes, kv_bytes, num_slots) || Hkv <= 0 || H % Hkv || D <= 0 ||
        window < 0 || !(softcap >= 0.0f))
        return PPR_REFUSED;
    const int G = H / Hkv, pairs = kv_as_pairs(kv_bytes, D);
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (2 * (size_t)D + PAGE));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < (int64_t)num_seqs * Hkv; task++) {
            if (!scratch) continue;
            const int s = (int)(task / Hkv), g = (int)(task % Hkv);
            const int first_pos = ctx_len[s] - q_len[s];
            const int32_t *blocks = table + (int64_t)s * table_stride;
            float *qv = scratch, *acc = scratch + D, *scores = scratch + 2 * D;
            for (int i = 0; i < q_len[s]; i++) {
                const int64_t t = (int64_t)q_start[s] + i;
                for (int h = g * G; h < (g + 1) * G; h++) {
                    const int64_t off = (t * H + h) * D;
                    for (int d = 0; d < D; d++)
                        qv[d] = (elem_bytes == 4 ? ((const float *)q)[off + d]
                                                 : bf16_load(((const uint16_t *)q)[off + d])) *
                                scale;
                    attend_row(elem_bytes, kv_bytes, pairs, qv, kv, blocks, num_slots, Hkv, D, g,
                               first_pos + i, window, softcap, acc, scores,
                               (char *)out + off * elem_bytes);
                }
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* paged_attention_window for a caller from outside, as ppr_paged_attention: the metadata is
 * checked against the sizes given first. */
int ppr_paged_attention_window(int elem_bytes, int kv_bytes, const void *q, const void *kv,
                               void *out,
                               int num_tokens, int num_seqs, const int32_t *q_start,
                               const int32_t *q_len, const int32_t *ctx_len,
                               const int32_t *table, int table_stride, int64_t num_slots, int H,
                               int Hkv, int D, float scale, int window, float softcap) {
    const int bad = attention_indices_check(num_tokens, num_seqs, q_start, q_len, ctx_len, table,
                                            table_stride, num_slots);
    if (bad) return bad;
    return paged_attention_window(elem_bytes, kv_bytes, q, kv, out, num_seqs, q_start, q_len, ctx_len,
                                  table, table_stride, num_slots, H, Hkv, D, scale, window,
                                  softcap);
}
