/* Paged attention (ppr_paged_attention): every query row of a packed batch against its
 * sequence's context, read in place where the block table says it lies (shapes: ppring.h). */
#include "ppring.h"

int ppr_block_size(void) { return PAGE; }

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

#ifdef HAVE_AVX2_ATTENTION
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

#ifdef HAVE_AVX512_ATTENTION
/* A page of 16 keys is one AVX-512 vector of scores. The heads of a KV group that share a query
 * row share each page's keys, so they take the page together: each K and V row is loaded (and
 * widened from bf16) once for all of them, not once per head. The AVX2 path walks one query
 * vector at a time; on a Zen 5 EPYC it was compute-bound, not memory-bound (a layer's bf16 cache
 * in L3 took as long per layer as 30 layers' from DRAM: 0.72 against 0.63 ms at 32 decodes of
 * context 512, 2 threads). */
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


/* ---- an 8-bit cache (ppring.h), read in place ----------------------------------------------- */

/* Page `block` of an 8-bit cache, KV head g, decoded to fp32: kbuf and vbuf [PAGE, D], code
 * times its scale, the values the torch path's dequantization gives (one rounding each). Every
 * slot of the page (an int8 code and a finite scale: nothing a slot past the context holds is
 * NaN). For a stage that computes in fp32, and where kv8_group_page_i16 does not run. */
static void kv8_page_to_f32(const void *kv, int64_t block, int g, int64_t num_slots, int Hkv,
                            int D, float *kbuf, float *vbuf) {
    const int8_t *k = (const int8_t *)kv + kv8_key_page(block, g, Hkv, D);
    const int8_t *v = (const int8_t *)kv + kv8_value_page(num_slots, block, g, Hkv, D);
    const uint8_t *k_scale =
        (const uint8_t *)kv + kv8_k_scale_at(num_slots, Hkv, D) + (block * Hkv + g) * D;
    const uint16_t *v_scale =
        (const uint16_t *)((const char *)kv + kv8_v_scale_at(num_slots, Hkv, D)) +
        (block * Hkv + g) * PAGE;
    float ks[D];
    for (int d = 0; d < D; d++) ks[d] = kv8_scale(k_scale[d]);
    for (int j = 0; j < PAGE; j++) {
        const float vs = bf16_load(v_scale[j]);
        for (int d = 0; d < D; d++) {
            kbuf[j * D + d] = (float)k[kv8_key_at(j, d)] * ks[d];
            vbuf[j * D + d] = (float)v[kv8_value_at(j, d, D)] * vs;
        }
    }
}

#if defined(HAVE_AVX512_ATTENTION) && defined(__AVX512VNNI__)
/* A bf16 stage reads the codes where they lie, as int16 pairs multiplied by vpdpwssd: per
 * page, each query times the page's channel scales (fp32) is rounded to int16 at a scale of its
 * own (its largest product at 32767), so a 32-byte load of 16 slots' codes of two channels
 * widened to int16 scores them against every head of the KV group with one vpdpwssd a head,
 * into 16 exact int32 sums (|sum| <= 64 x 32767 x 127 per pair of channels, 256 channels at
 * most: < 2^31). Likewise the values: each slot's probability times its scale, as int16 at one
 * scale for the page (its largest V scale at 32767: a probability is at most 1), against 16
 * channels of two slots a load. The rounding is the query's and the probabilities' to 15 bits
 * of their largest value (a bf16 stage's own q has 8 bits of mantissa, and the bf16 cache's
 * kernel rounds probabilities to bf16); fp32 stages keep fp32 products (kv8_page_to_f32).
 * Default model, 64 decodes at context 2,048, 30 layers' attention alone, 2 threads, AMX Xeon:
 * the bf16 cache's kernel 147-154 ms; fp32 FMAs over channel-major codes ~110; these int16
 * pairs 92; with whole lines fetched per group (kv8_prefetch, 2 pages ahead) instead of
 * prefetch_slice's slices, whose arithmetic per line cost as much as a page's scores, 78-82. */

/* NH queries q [NH, D] (fp32) times the page's channel scales s [D], each as int16 pairs
 * (32-bit words: channel 2i low, 2i + 1 high) at a scale of its own, qscale[h] (its largest
 * product at 32767; 0: all zero). The heads' products, maxima and roundings are independent
 * chains, interleaved. */
static inline __attribute__((always_inline)) void kv8_int16_queries(
    const int NH, const float *q, const float *s, int D, float (*qs)[ATT_KV8_MAX_D],
    int32_t (*pairs)[ATT_KV8_MAX_D / 2], float *qscale) {
    __m512 m[4];
    for (int h = 0; h < NH; h++) m[h] = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 16) {
        const __m512 sc = _mm512_loadu_ps(s + c);
        for (int h = 0; h < NH; h++) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q + h * D + c), sc);
            _mm512_storeu_ps(qs[h] + c, x);
            m[h] = _mm512_max_ps(m[h], _mm512_abs_ps(x));
        }
    }
    __m512 inv[4];
    for (int h = 0; h < NH; h++) {
        const float amax = _mm512_reduce_max_ps(m[h]);
        qscale[h] = amax / 32767.0f;
        inv[h] = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    }
    for (int c = 0; c < D; c += 16)
        for (int h = 0; h < NH; h++) /* 16 int16, in order: 8 pairs of channels */
            _mm256_storeu_si256(
                (__m256i *)(pairs[h] + c / 2),
                _mm512_cvtsepi32_epi16(
                    _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qs[h] + c), inv[h]))));
}

/* 2^(e / 8) of 16 scale bytes (kv8_scale, vectorized): the fraction from a table of 8, the
 * exponent added to its bits */
static inline __m512 kv8_scale16(const uint8_t *bytes) {
    const __m512i e = _mm512_sub_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes)), _mm512_set1_epi32(128));
    const __m512 frac = _mm512_castsi512_ps(_mm512_setr_epi32(
        0x3f800000, 0x3f8b95c2, 0x3f9837f0, 0x3fa5fed7, 0x3fb504f3, 0x3fc5672a, 0x3fd744fd,
        0x3feac0c7, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m512 f = _mm512_permutexvar_ps(_mm512_and_si512(e, _mm512_set1_epi32(7)), frac);
    return _mm512_castsi512_ps(_mm512_add_epi32(
        _mm512_castps_si512(f), _mm512_slli_epi32(_mm512_srai_epi32(e, 3), 23)));
}

static inline __m512i kv8_widen32(const int8_t *codes) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)codes));
}

/* The scores of NH queries (q16: each D / 2 int16 pairs, at scale qscale[h]) against one
 * page's keys of one KV head (kc: [D / 2][16][2]) */
static inline __attribute__((always_inline)) void kv8_page_scores_i16(
    const int NH, const int32_t (*q16)[ATT_KV8_MAX_D / 2], const float *qscale, const int8_t *kc,
    int D, __m512 *out) {
    __m512i a[4][2]; /* per head, two sums in flight (pair rows even and odd) */
    for (int h = 0; h < NH; h++) a[h][0] = a[h][1] = _mm512_setzero_si512();
    for (int c = 0; c < D / 2; c += 2)
        for (int i = 0; i < 2; i++) {
            const __m512i k = kv8_widen32(kc + (c + i) * 2 * PAGE);
            for (int h = 0; h < NH; h++)
                a[h][i] = _mm512_dpwssd_epi32(a[h][i], k, _mm512_set1_epi32(q16[h][c + i]));
        }
    for (int h = 0; h < NH; h++)
        out[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a[h][0], a[h][1])),
                               _mm512_set1_ps(qscale[h]));
}

/* acc[h] += sum_j p[h][j] V[j] over one page's values of one KV head (vc: [8][D][2], vs its 16
 * scales), p 0 past the slots a row sees */
static inline __attribute__((always_inline)) void kv8_page_values_i16(
    const int NH, const float (*p)[PAGE], const int8_t *vc, const uint16_t *vs, int lim, int D,
    float *acc) {
    /* p s_j at one scale for every head: p <= 1, so p s_j <= the page's largest s_j */
    const __m512 s = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)vs)), 16));
    const float smax = _mm512_reduce_max_ps(s); /* >= 0 */
    const float pscale = smax / 32767.0f;
    const __m512 to16 = _mm512_mul_ps(s, _mm512_set1_ps(smax > 0.0f ? 32767.0f / smax : 0.0f));
    int32_t p16[4][PAGE / 2]; /* per head, the slot pairs' int16 probabilities */
    for (int h = 0; h < NH; h++)
        _mm256_storeu_si256(
            (__m256i *)p16[h],
            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p[h]), to16))));
    const int num_pairs = (lim + 1) / 2;
    for (int c = 0; c < D; c += 64) {
        __m512i o[4][4];
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) o[h][i] = _mm512_setzero_si512();
        for (int jp = 0; jp < num_pairs; jp++) {
            __m512i vv[4];
            for (int i = 0; i < 4; i++) vv[i] = kv8_widen32(vc + ((int64_t)jp * D + c + 16 * i) * 2);
            for (int h = 0; h < NH; h++) {
                const __m512i ph = _mm512_set1_epi32(p16[h][jp]);
                for (int i = 0; i < 4; i++) o[h][i] = _mm512_dpwssd_epi32(o[h][i], vv[i], ph);
            }
        }
        for (int h = 0; h < NH; h++) {
            const __m512 ps = _mm512_set1_ps(pscale);
            for (int i = 0; i < 4; i++) {
                float *a = acc + h * D + c + 16 * i;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(o[h][i]), ps,
                                                    _mm512_loadu_ps(a)));
            }
        }
    }
}

/* `bytes` from `at` into L2, a line at a time (the empty asm: see prefetch_slice) */
static inline void kv8_prefetch(const void *at, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch((const char *)at + b, 0, 2);
        __asm__ volatile("");
    }
}

/* nq query vectors (the heads of one KV group on one row: q [nq, D], fp32, scaled) over one page
 * of an 8-bit cache, with the online-softmax update of each one's m, l and acc [nq, D] */
static inline void kv8_group_page_i16(const float *q, const int8_t *kc, const float *ks,
                                      const int8_t *vc, const uint16_t *vs, int lim, int D, int nq,
                                      float *m, float *l, float *acc, const int8_t *next_k,
                                      const int8_t *next_v) {
    const __mmask16 valid = lim >= PAGE ? (__mmask16)0xffff : (__mmask16)((1u << lim) - 1);
    int32_t q16[4][ATT_KV8_MAX_D / 2];
    float qs[4][ATT_KV8_MAX_D], qscale[4], p[4][PAGE];
    for (int h0 = 0; h0 < nq; h0 += 4) {
        const int nh = nq - h0 < 4 ? nq - h0 : 4;
        const float *qh = q + h0 * D;
        if (next_k && h0 == 0) kv8_prefetch(next_k, (int64_t)D * PAGE);
        __m512 sc[4];
        switch (nh) {
        case 1:
            kv8_int16_queries(1, qh, ks, D, qs, q16, qscale);
            kv8_page_scores_i16(1, q16, qscale, kc, D, sc);
            break;
        case 2:
            kv8_int16_queries(2, qh, ks, D, qs, q16, qscale);
            kv8_page_scores_i16(2, q16, qscale, kc, D, sc);
            break;
        case 3:
            kv8_int16_queries(3, qh, ks, D, qs, q16, qscale);
            kv8_page_scores_i16(3, q16, qscale, kc, D, sc);
            break;
        default:
            kv8_int16_queries(4, qh, ks, D, qs, q16, qscale);
            kv8_page_scores_i16(4, q16, qscale, kc, D, sc);
            break;
        }
        for (int h = 0; h < nh; h++) {
            float correction;
            _mm512_storeu_ps(p[h], page_softmax(sc[h], valid, &m[h0 + h], &l[h0 + h], &correction));
            if (correction != 1.0f) scale_row(acc + (h0 + h) * D, D, correction);
        }
        if (next_v && h0 == 0) kv8_prefetch(next_v, (int64_t)D * PAGE);
        float *a = acc + h0 * D;
        switch (nh) {
        case 1: kv8_page_values_i16(1, p, vc, vs, lim, D, a); break;
        case 2: kv8_page_values_i16(2, p, vc, vs, lim, D, a); break;
        case 3: kv8_page_values_i16(3, p, vc, vs, lim, D, a); break;
        default: kv8_page_values_i16(4, p, vc, vs, lim, D, a); break;
        }
    }
}

/* pages ahead a task fetches (1 and 3 measured level with 2, within the host's noise) */
#define KV8_AHEAD 2

/* attend_task's pages over an 8-bit cache on a bf16 stage: every page of the task's context,
 * its KV groups one after another, each row of the task that sees the page (qv, pos, m, l, acc
 * as attend_task's); the page KV8_AHEAD on fetched meanwhile. */
static void kv8_task_pages(const Task *task, const void *kv, const int32_t *blocks,
                           int64_t num_slots, int Hkv, int D, const float *qv, const int *pos,
                           int num_pages, int last_pos, float *m, float *l,
                           float *acc) {
    const int num_groups = task->g1 - task->g0, nh = task->nh;
    const int8_t *codes = kv;
    const uint8_t *k_scale = (const uint8_t *)kv + kv8_k_scale_at(num_slots, Hkv, D);
    const uint16_t *v_scale =
        (const uint16_t *)((const char *)kv + kv8_v_scale_at(num_slots, Hkv, D));
    float ks[ATT_KV8_MAX_D];
    for (int page = 0; page < num_pages; page++) {
        const int key0 = page * PAGE;
        const int nk = last_pos + 1 - key0 < PAGE ? last_pos + 1 - key0 : PAGE;
        /* the page KV8_AHEAD on: its scales now, each group's keys and values by the first
         * row that reads this page's (a line at a time: the pages lie anywhere) */
        const int64_t next = page + KV8_AHEAD < num_pages ? blocks[page + KV8_AHEAD] : -1;
        if (next >= 0) {
            kv8_prefetch(k_scale + (next * Hkv + task->g0) * D, (int64_t)num_groups * D);
            kv8_prefetch(v_scale + (next * Hkv + task->g0) * PAGE, (int64_t)num_groups * PAGE * 2);
        }
        const int64_t block = blocks[page];
        for (int g = task->g0; g < task->g1; g++) {
            const int8_t *kc = codes + kv8_key_page(block, g, Hkv, D);
            const int8_t *vc = codes + kv8_value_page(num_slots, block, g, Hkv, D);
            const uint16_t *vs = v_scale + (block * Hkv + g) * PAGE;
            for (int c = 0; c < D; c += 16)
                _mm512_storeu_ps(ks + c, kv8_scale16(k_scale + (block * Hkv + g) * D + c));
            int fetched = next < 0;
            for (int i = 0; i < task->nrows; i++) {
                const int r = (i * num_groups + (g - task->g0)) * nh; /* its first head */
                int lim = pos[r] + 1 - key0;
                if (lim <= 0) continue;
                if (lim > nk) lim = nk;
                kv8_group_page_i16(qv + r * D, kc, ks, vc, vs, lim, D, nh, &m[r], &l[r],
                                   acc + r * D, fetched ? NULL : codes + kv8_key_page(next, g, Hkv, D),
                                   fetched ? NULL : codes + kv8_value_page(num_slots, next, g, Hkv, D));
                fetched = 1;
            }
        }
    }
}
#define HAVE_KV8_I16
#endif

int ppr_kv_as_pairs(int elem_bytes, int D) { return kv_as_pairs(elem_bytes, D); }

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
static void attend_task(const Task *task, const Task *next_task, int elem_bytes, int kv_bytes,
                        const void *q,
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
    const int pairs = kv_as_pairs(kv_bytes, D);

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
    const int64_t span_bytes = (int64_t)num_groups * D * kv_bytes; /* a slot's task heads */
    PagePrefetch pf = {NULL, NULL, row_stride * kv_bytes, (int)((span_bytes + 63) / 64), 0};
    pf.lines = PAGE * pf.lines_per_row;
    const int first_row_pos = first_pos + task->row0;
#ifdef HAVE_KV8_I16
    if (kv_bytes == 1 && elem_bytes == 2 && use_avx512 && D <= ATT_KV8_MAX_D) {
        kv8_task_pages(task, kv, blocks, num_slots, Hkv, D, qv, pos, num_pages, last_pos, m, l,
                       acc);
    } else
#endif
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
                       kv_bytes;
            pf.v = pf.k + v_offset * kv_bytes;
        }
        int call = 0;
        for (int g = task->g0; g < task->g1; g++) {
            const int64_t base = ((int64_t)blocks[page] * PAGE * Hkv + g) * D;
#ifdef HAVE_AVX512_ATTENTION
            if (use_avx512 && kv_bytes == 1) { /* fp32 products of the decoded page */
                kv8_page_to_f32(kv, blocks[page], g, num_slots, Hkv, D, kbuf, vbuf);
                for (int i = 0; i < task->nrows; i++) {
                    const int r = (i * num_groups + (g - task->g0)) * nh;
                    int lim = pos[r] + 1 - key0;
                    if (lim <= 0) continue;
                    if (lim > nk) lim = nk;
                    group_page_avx512(0, qv + r * D, kbuf, vbuf, D, lim, D, nh, &m[r], &l[r],
                                      acc + r * D, NULL, &call, calls_per_page);
                }
                continue;
            }
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
            if (kv_bytes == 1) {
                kv8_page_to_f32(kv, blocks[page], g, num_slots, Hkv, D, kbuf, vbuf);
                kp = kbuf;
                vp = vbuf;
                kstride = D;
            } else if (elem_bytes == 4) {
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
int attention_plan(int kv_bytes, int num_seqs, const int32_t *q_len,
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
        if (num_seqs == 1 && kv_as_pairs(kv_bytes, D) && ctx_len[0] >= LONE_CONTEXT)
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
size_t attention_scratch_floats(int D) {
    return (size_t)2 * MAX_TILE_ROWS * D + 2 * PAGE * D;
}

/* The tasks dealt out over the team this runs in (an orphaned `omp for`: called outside a
 * parallel region, one thread takes them all), each thread with its own scratch (NULL: that
 * thread's tasks are skipped, and the caller reports the failure). */
void attention_run(const Task *tasks, int num_tasks, int elem_bytes, int kv_bytes, const void *q,
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
                        kv_bytes, q, kv, out, q_start, q_len, ctx_len, table, table_stride, num_slots, H,
                        Hkv, D, scale, scratch);
}

/* Whether ppr_paged_attention takes these shapes: H a multiple of Hkv, a KV group's heads in
 * one tile, fp32 or bf16. */
int attention_shapes_ok(int elem_bytes, int H, int Hkv) {
    return Hkv > 0 && H % Hkv == 0 && H / Hkv <= MAX_TILE_ROWS &&
           (elem_bytes == 4 || elem_bytes == 2);
}

/* Whether the attention metadata stays inside what the caller described: every sequence's
 * query rows inside [0, num_tokens), its context at least its queries and at most its block
 * table's pages, and every block id its context reads inside the pool. 0, or a PPR_BAD_*. */
int attention_indices_check(int num_tokens, int num_seqs, const int32_t *q_start,
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
int paged_attention(int elem_bytes, int kv_bytes, const void *q, const void *kv, void *out,
                    int num_seqs,
                    const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                    const int32_t *table, int table_stride, int64_t num_slots, int H,
                    int Hkv, int D, float scale) {
    if (!attention_shapes_ok(elem_bytes, H, Hkv) || D <= 0 ||
        !kv_kind_ok(elem_bytes, kv_bytes, num_slots))
        return PPR_REFUSED;
    const int num_threads = omp_get_max_threads();
    const int num_tasks =
        attention_plan(kv_bytes, num_seqs, q_len, ctx_len, H, Hkv, D, num_threads, NULL);
    Task *tasks = malloc(sizeof(Task) * (num_tasks > 0 ? num_tasks : 1));
    if (!tasks) return -1;
    attention_plan(kv_bytes, num_seqs, q_len, ctx_len, H, Hkv, D, num_threads, tasks);
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * attention_scratch_floats(D));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        attention_run(tasks, num_tasks, elem_bytes, kv_bytes, q, kv, out, q_start, q_len, ctx_len, table,
                      table_stride, num_slots, H, Hkv, D, scale, scratch);
        free(scratch);
    }
    free(tasks);
    return failed ? -1 : 0;
}

/* paged_attention for a caller from outside: q and out [num_tokens, H, D], the cache
 * [2, num_slots, Hkv, D]; the metadata is checked against those sizes first. */
int ppr_paged_attention(int elem_bytes, int kv_bytes, const void *q, const void *kv, void *out,
                        int num_tokens,
                        int num_seqs, const int32_t *q_start, const int32_t *q_len,
                        const int32_t *ctx_len, const int32_t *table, int table_stride,
                        int64_t num_slots, int H, int Hkv, int D, float scale) {
    const int bad = attention_indices_check(num_tokens, num_seqs, q_start, q_len, ctx_len, table,
                                            table_stride, num_slots);
    if (bad) return bad;
    return paged_attention(elem_bytes, kv_bytes, q, kv, out, num_seqs, q_start, q_len, ctx_len,
                           table, table_stride, num_slots, H, Hkv, D, scale);
}
