/* A stage's decoder layers in one call (ppr_decoder_layers), the greedy lm_head
 * (ppr_greedy_head) and what backend/cpu/fused_layer.py checks its struct mirrors against. */
#include "ppring.h"

/* ---- A whole decoder layer in one call ----------------------------------------------------
 * The same kernels, in the same order, on the same buffers as models/blocks.py's DecoderLayer
 * calls them one by one from Python, so the results are bit for bit the same; what goes is
 * the Python around nine kernel calls a layer (module calls, torch.empty, checks, ctypes:
 * ~70 us a layer, most of a single stream's step after its matmuls). backend/cpu/fused_layer.py
 * fills these structs once at load and calls ppr_decoder_layers (every layer) once a step. */

/* whether a call of M rows takes the AMX tiles (ppr_linear_t amx_rows) */
static inline int amx_call(const ppr_linear_t *w, int M) {
    return w->amx_rows > 0 && M >= w->amx_rows;
}

static int run_linear(const ppr_linear_t *w, int elem_bytes, const void *x, void *y, int M) {
    /* on the tiles where the stage chose them; a refusal (a shape they do not take, no memory)
     * falls through to the kernel below */
    if (elem_bytes == 2 && amx_call(w, M)) {
        if ((w->kind == PPR_BF16 || (w->kind == PPR_GRID_BF16 && w->panels)) &&
            ppr_linear_bf16_amx(x, w->kind == PPR_BF16 ? w->a : w->panels, y, M, w->n, w->k) == 0)
            return 0;
        if ((w->kind == PPR_GRID_A8 || w->kind == PPR_GRID_A8_1) &&
            ppr_linear_grid_a8_amx(x, w->a, w->b, w->c, y, M, w->n, w->k, w->bits) == 0)
            return 0;
    }
    switch (w->kind) {
    case PPR_F32:
        if (elem_bytes != 4) return -1;
        ppr_linear_f32(x, w->a, y, M, w->n, w->k);
        return 0;
    case PPR_GRID_F32:
        return elem_bytes == 4 ? ppr_linear_grid(x, w->a, w->b, w->c, y, M, w->n, w->k, w->bits)
                               : -1;
    case PPR_BF16:
        return elem_bytes == 2 ? ppr_linear_bf16(x, w->a, y, M, w->n, w->k) : -1;
    case PPR_GRID_BF16:
        if (elem_bytes != 2) return -1;
        if (w->panels && M > w->code_rows)
            return ppr_linear_bf16(x, w->panels, y, M, w->n, w->k);
        return ppr_linear_grid_bf16(x, w->a, w->b, w->c, y, M, w->n, w->k, w->bits);
    case PPR_INT8:
        ppr_linear_int8(elem_bytes, x, w->a, w->b, y, M, w->n, w->k);
        return 0;
    case PPR_INT8_QUADS:
        return ppr_linear_int8_quads(elem_bytes, x, w->a, w->b, y, M, w->n, w->k);
    case PPR_GRID_A8:
    case PPR_GRID_A8_1:
        if (elem_bytes != 2) return -1;
        return ppr_linear_grid_a8(x, w->a, w->b, w->c, y, M, w->n, w->k, w->bits,
                                  a8_passes(w->kind));
    }
    return -1;
}

/* Whether a step's cache is a kind the kernels take (kv_kind_ok) and its indices stay inside
 * the sizes it gives: its rows within the scratch's
 * max_tokens, every slot inside the cache, every position inside the rotary tables (where
 * positions are given), and the attention metadata (attention_indices_check). Checked once a
 * call, before the first layer writes anything. 0, or a PPR_BAD_*. */
static int step_check(const ppr_step_t *s) {
    if (s->num_tokens < 0 || s->num_tokens > s->max_tokens) return PPR_BAD_ROWS;
    if (!kv_kind_ok(s->elem_bytes, s->kv_bytes, s->num_slots)) return PPR_REFUSED;
    const int bad = slots_positions_check(s->num_tokens, s->slot_mapping, s->num_slots,
                                          s->positions, s->rope_rows);
    if (bad) return bad;
    return attention_indices_check(s->num_tokens, s->num_seqs, s->q_start, s->q_len, s->ctx_len,
                                   s->block_table, s->table_stride, s->num_slots);
}

/* After the qkv matmul, row by row, each where the layer has it: its bias (Qwen2), then the
 * RMSNorm of every q head and of every k head (Qwen3), before the rotary reads them. The
 * arithmetic of ppr_add_bias and ppr_rms_norm_heads (the layer-by-layer path's calls), in one
 * loop of the team this runs in (orphaned): all three are row-local. Not inlined: a Llama
 * layer has none of them, and inlined into the one-team stack this code (cold there) grew its
 * loop body from 5.9 to 9.7 KB, and one decode step of the default model by 0.4-0.9% (15 us of
 * 3.2 ms, in-process A/B of the stack alone, 2 threads, 3 runs); out of line, level with no
 * features at all (0.998x, 1.001x). */
static __attribute__((noinline)) void qkv_bias_norm_rows(const ppr_layer_t *L, int elem_bytes,
                                                         void *qkv, int64_t qkv_row, int T) {
    const int H = L->num_heads, Hkv = L->num_kv_heads, D = L->head_dim;
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        char *row = (char *)qkv + (int64_t)t * qkv_row * elem_bytes;
        if (L->qkv_bias) add_bias_row(elem_bytes, row, L->qkv_bias, (int)qkv_row);
        if (L->qk_norm_whole) { /* one "head" of H D, then one of Hkv D (Hkv divides H) */
            if (L->q_norm) rms_norm_heads_row(elem_bytes, row, 0, 1, H * D, L->q_norm, L->eps);
            if (L->k_norm)
                rms_norm_heads_row(elem_bytes, row, H / Hkv, 1, Hkv * D, L->k_norm, L->eps);
            continue;
        }
        if (L->q_norm) rms_norm_heads_row(elem_bytes, row, 0, H, D, L->q_norm, L->eps);
        if (L->k_norm) rms_norm_heads_row(elem_bytes, row, H, Hkv, D, L->k_norm, L->eps);
    }
}

/* whether the layer has anything for qkv_bias_norm_rows to do */
static inline int qkv_bias_norm(const ppr_layer_t *L) {
    return L->qkv_bias || L->q_norm || L->k_norm;
}

/* h_in [T, d] (read only: it may be a received frame), residual_in [T, d] or NULL (the first
 * layer of the first stage), kv [2, slots, Hkv, D] this layer's cache. Writes residual_out
 * [T, d] (it may be residual_in itself) and h_out [T, d] (it may be h_in). Returns 0, or -1
 * when a kernel refused (a kind this build lacks, or no memory for a buffer). */
static int ppr_decoder_layer(const ppr_layer_t *L, const ppr_step_t *s, const void *h_in,
                             const void *residual_in, void *residual_out, void *kv,
                             void *h_out) {
    const int T = s->num_tokens, eb = s->elem_bytes, D = L->head_dim, d = L->hidden;
    const int64_t qkv_row = (int64_t)(L->num_heads + 2 * L->num_kv_heads) * D;
    /* what attention reads: the normed stream, or (no input norm) the stream itself */
    const void *attn_in = residual_out;
    if (L->input_norm) {
        ppr_add_rms_norm(eb, h_in, residual_in, L->input_norm, residual_out, s->x, T, d, L->eps);
        attn_in = s->x;
    } else if (ppr_add(eb, h_in, residual_in, residual_out, T, d)) {
        return -1;
    }
    if (run_linear(&L->qkv, eb, attn_in, s->qkv, T)) return -1;
    if (qkv_bias_norm(L)) {
#pragma omp parallel if (T >= 8)
        qkv_bias_norm_rows(L, eb, s->qkv, qkv_row, T);
    }
    const int local = L->rope_local && s->cos_local;
    rope_store(eb, s->kv_bytes, s->qkv, qkv_row, s->q, local ? s->cos_local : s->cos,
               local ? s->sin_local : s->sin, s->positions, s->slot_mapping, kv, s->num_slots, T,
               L->num_heads, L->num_kv_heads, D);
    if (L->window || L->softcap) {
        if (paged_attention_window(eb, s->kv_bytes, s->q, kv, s->attn, s->num_seqs, s->q_start, s->q_len,
                                   s->ctx_len, s->block_table, s->table_stride, s->num_slots,
                                   L->num_heads, L->num_kv_heads, D, s->scale, L->window,
                                   L->softcap))
            return -1;
    } else if (paged_attention(eb, s->kv_bytes, s->q, kv, s->attn, s->num_seqs, s->q_start, s->q_len,
                               s->ctx_len, s->block_table, s->table_stride, s->num_slots,
                               L->num_heads, L->num_kv_heads, D, s->scale)) {
        return -1;
    }
    if (run_linear(&L->o, eb, s->attn, s->h, T)) return -1;
    if (L->o_bias) ppr_add_bias(eb, s->h, d, L->o_bias, T, d);
    if (L->attn_out_norm) /* in place: add_rms_norm_row allows x_out == h */
        ppr_add_rms_norm(eb, s->h, NULL, L->attn_out_norm, s->h, s->h, T, d, L->eps);
    const void *mlp_in = residual_out;
    if (L->post_attn_norm) {
        ppr_add_rms_norm(eb, s->h, residual_out, L->post_attn_norm, residual_out, s->x, T, d,
                         L->eps);
        mlp_in = s->x;
    } else if (ppr_add(eb, s->h, residual_out, residual_out, T, d)) {
        return -1;
    }
    if (run_linear(&L->gate_up, eb, mlp_in, s->gate_up, T)) return -1;
    (L->gelu ? ppr_gelu_tanh_mul : ppr_silu_mul)(
        eb, s->gate_up, (const char *)s->gate_up + (int64_t)L->intermediate * eb,
        2 * (int64_t)L->intermediate, s->act, T, L->intermediate);
    if (run_linear(&L->down, eb, s->act, h_out, T)) return -1;
    if (L->mlp_out_norm) ppr_add_rms_norm(eb, h_out, NULL, L->mlp_out_norm, h_out, h_out, T, d,
                                          L->eps);
    return 0;
}

#ifdef HAVE_A8_DOT
/* ---- The whole stack in one team ----------------------------------------------------------
 * Each kernel above opens and joins its own parallel region: on the 2-core Zen 4 VM an empty
 * region costs ~2.4 us (the team woken, then joined) against ~0.75 us for a barrier inside one,
 * and a single stream's step opened 151 (five a layer, and the lm_head). Where every matrix of
 * the stage is grid codes for vpdpbusd (the default on such a CPU), the layers run in one
 * region instead: the same kernels' loops, work-shared (orphaned `omp for`) by one team, the
 * implicit barrier after each loop where the next needs its results. The arithmetic of every
 * row is what the layer-by-layer calls do. Default model, 2 threads, decode steps
 * (StageRunner.run) in one process, blocks of steps alternated between the two paths, medians:
 * 1 row at context 512 4.98 -> 4.80 ms (faster in 72 of 100 block pairs); 16 rows at context
 * 100, layers 0-13 6.20 -> 5.86 (150 of 169), layers 14-29 and the lm_head 9.13 -> 8.83 (79 of
 * 111); 32 rows, all layers, 31.1 -> 30.5 (44 of 64). A norm (or silu_mul) sharing its loop
 * with the next matmul's quantization, against a loop each: 16 rows 0.976x and 0.991x, 32 rows
 * 0.997x, 1 row 1.002x. */

/* y = x @ W^T for a grid-a8 weight, by the team: x's rows quantized into the shared scratch
 * (a barrier), then the units */
static void a8_linear_in_team(const ppr_linear_t *w, const void *x, void *y, int M,
                              char *scratch) {
    const A8Rows rows = a8_rows_at(scratch, M, w->k, a8_passes(w->kind));
    a8_quantize_rows(x, M, w->k, rows);
    a8_units(rows, w->a, w->b, w->c, y, M, w->n, w->k, w->bits);
}

/* a grid-a8 matrix of the stack's kind (every matrix of the stack quantizes its rows alike) */
static int a8_in_team_ok(const ppr_linear_t *w, int kind, int T) {
    return (kind == PPR_GRID_A8 || kind == PPR_GRID_A8_1) && w->kind == kind &&
           a8_weight_ok(w->k, w->bits, w->c) && !amx_call(w, T);
}

/* Whether the stack runs in one team: bf16, every matrix grid-a8 at a row count below its
 * tiles' (those open a team of their own), and every layer's attention of one shape (one plan
 * serves them all). */
static int stack_in_team_ok(const ppr_layer_t *layers, int n, const ppr_step_t *s) {
    if (s->elem_bytes != 2 || s->num_tokens <= 0 || n <= 0) return 0;
    for (int i = 0; i < n; i++) {
        const ppr_layer_t *L = &layers[i];
        const int kind = layers[0].qkv.kind;
        if (!a8_in_team_ok(&L->qkv, kind, s->num_tokens) ||
            !a8_in_team_ok(&L->o, kind, s->num_tokens) ||
            !a8_in_team_ok(&L->gate_up, kind, s->num_tokens) ||
            !a8_in_team_ok(&L->down, kind, s->num_tokens) ||
            !attention_shapes_ok(2, L->num_heads, L->num_kv_heads))
            return 0;
        if (L->num_heads != layers[0].num_heads || L->num_kv_heads != layers[0].num_kv_heads ||
            L->head_dim != layers[0].head_dim)
            return 0;
        /* the team's loops are Llama's norms (the default model's); others take the calls */
        if (!L->input_norm || !L->post_attn_norm || L->attn_out_norm || L->mlp_out_norm ||
            L->qk_norm_whole || L->window || L->softcap || L->gelu || L->rope_local)
            return 0;
        if (L->qkv.k != L->hidden || L->gate_up.k != L->hidden || L->down.k != L->intermediate ||
            L->gate_up.n != 2 * L->intermediate || L->o.k != L->num_heads * L->head_dim)
            return 0;
    }
    return 1;
}

/* A norm and the next matmul's quantization of its rows, in one loop: one barrier, not two.
 * `rows` is cut for K = d. */
static void norm_quantize_in_team(const void *h, const void *residual, const void *weight,
                                  void *residual_out, void *x_out, int T, int d, float eps,
                                  A8Rows rows) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        add_rms_norm_row(2, h, residual, weight, residual_out, x_out, t, d, eps);
        a8_quantize_into(x_out, t, d, rows);
    }
}

/* silu(gate) * up into act [T, I], and the down matmul's quantization of its rows (K = I) */
static void silu_quantize_in_team(const void *gate_up, void *act, int T, int I, A8Rows rows) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        silu_mul_row(2, gate_up, (const uint16_t *)gate_up + I, 2 * (int64_t)I, act, t, I);
        a8_quantize_into(act, t, I, rows);
    }
}

/* ppr_decoder_layer's steps, by the team this runs in (every thread calls it): ten loops, ten
 * barriers (a norm or silu_mul and the next matmul's quantization share a loop), and one more
 * each for a qkv bias or q/k norms and for an o bias, where the layer has them. */
static void decoder_layer_in_team(const ppr_layer_t *L, const ppr_step_t *s, const void *h_in,
                                  const void *residual_in, void *residual_out, void *kv,
                                  void *h_out, const Task *tasks, int num_tasks, char *a8,
                                  float *attention_scratch) {
    const int T = s->num_tokens, D = L->head_dim, d = L->hidden, I = L->intermediate;
    const int64_t qkv_row = (int64_t)(L->num_heads + 2 * L->num_kv_heads) * D;
    const int passes = a8_passes(L->qkv.kind); /* (stack_in_team_ok: every matrix's) */
    const A8Rows x_rows = a8_rows_at(a8, T, d, passes), act_rows = a8_rows_at(a8, T, I, passes);
    norm_quantize_in_team(h_in, residual_in, L->input_norm, residual_out, s->x, T, d, L->eps,
                          x_rows);
    a8_units(x_rows, L->qkv.a, L->qkv.b, L->qkv.c, s->qkv, T, L->qkv.n, d, L->qkv.bits);
    if (qkv_bias_norm(L)) qkv_bias_norm_rows(L, 2, s->qkv, qkv_row, T);
    rope_store_rows(2, s->kv_bytes, s->qkv, qkv_row, s->q, s->cos, s->sin, s->positions, s->slot_mapping, kv,
                    s->num_slots, T, L->num_heads, L->num_kv_heads, D);
    attention_run(tasks, num_tasks, 2, s->kv_bytes, s->q, kv, s->attn, s->q_start, s->q_len, s->ctx_len,
                  s->block_table, s->table_stride, s->num_slots, L->num_heads, L->num_kv_heads,
                  D, s->scale, attention_scratch);
    a8_linear_in_team(&L->o, s->attn, s->h, T, a8);
    if (L->o_bias) add_bias_rows(2, s->h, d, L->o_bias, T, d);
    norm_quantize_in_team(s->h, residual_out, L->post_attn_norm, residual_out, s->x, T, d, L->eps,
                          x_rows);
    a8_units(x_rows, L->gate_up.a, L->gate_up.b, L->gate_up.c, s->gate_up, T, L->gate_up.n, d,
             L->gate_up.bits);
    silu_quantize_in_team(s->gate_up, s->act, T, I, act_rows);
    a8_units(act_rows, L->down.a, L->down.b, L->down.c, h_out, T, L->down.n, I, L->down.bits);
}

/* ppr_decoder_layers in one team (stack_in_team_ok): the scratch the kernels would allocate
 * call by call, allocated once (quantized rows for the largest K, a thread's attention
 * scratch per thread, one attention plan). Returns -1 if that allocation failed. */
static int decoder_layers_in_team(const ppr_layer_t *layers, int n, const ppr_step_t *s,
                                  const void *h_in, const void *residual_in, void *residual_out,
                                  void *kv, int64_t kv_stride, void *h_out) {
    const int T = s->num_tokens, H = layers[0].num_heads, Hkv = layers[0].num_kv_heads;
    const int D = layers[0].head_dim, num_threads = omp_get_max_threads();
    int k_max = 0;
    for (int i = 0; i < n; i++) {
        const ppr_linear_t *w[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up,
                                    &layers[i].down};
        for (int j = 0; j < 4; j++) k_max = w[j]->k > k_max ? w[j]->k : k_max;
    }
    const int num_tasks =
        attention_plan(s->kv_bytes, s->num_seqs, s->q_len, s->ctx_len, H, Hkv, D, num_threads,
                       NULL);
    const size_t per_thread = attention_scratch_floats(D);
    char *a8 = malloc(a8_scratch_bytes(T, k_max));
    Task *tasks = malloc(sizeof(Task) * (num_tasks > 0 ? num_tasks : 1));
    float *attention_scratch = malloc(sizeof(float) * per_thread * num_threads);
    const int ok = a8 && tasks && attention_scratch;
    if (ok) {
        attention_plan(s->kv_bytes, s->num_seqs, s->q_len, s->ctx_len, H, Hkv, D, num_threads,
                       tasks);
#pragma omp parallel num_threads(num_threads)
        {
            float *mine = attention_scratch + per_thread * omp_get_thread_num();
            const void *h = h_in, *residual = residual_in;
            for (int i = 0; i < n; i++) {
                decoder_layer_in_team(&layers[i], s, h, residual, residual_out,
                                      (char *)kv + (int64_t)i * kv_stride, h_out, tasks,
                                      num_tasks, a8, mine);
                h = h_out;
                residual = residual_out;
            }
        }
    }
    free(a8);
    free(tasks);
    free(attention_scratch);
    return ok ? 0 : -1;
}
#endif

/* A stage's n layers in one call (layers: n structs back to back): layer i reads and writes
 * its cache at kv + i * kv_stride bytes. The first reads h_in and residual_in (NULL: the
 * model's first layer); the rest work in place on h_out and residual_out, as the layer-by-layer
 * path does. One call instead of one per layer: a ctypes call and its Python cost 3-5 us, and
 * a single stream's step makes 30. Returns 0, or -1 when a layer failed (its kernels said). */
int ppr_decoder_layers(const ppr_layer_t *layers, int n, const ppr_step_t *s, const void *h_in,
                       const void *residual_in, void *residual_out, void *kv, int64_t kv_stride,
                       void *h_out) {
    const int bad = step_check(s);
    if (bad) return bad;
#ifdef HAVE_A8_DOT
    if (stack_in_team_ok(layers, n, s))
        return decoder_layers_in_team(layers, n, s, h_in, residual_in, residual_out, kv,
                                      kv_stride, h_out);
#endif
    for (int i = 0; i < n; i++) {
        if (ppr_decoder_layer(&layers[i], s, h_in, residual_in, residual_out,
                              (char *)kv + (int64_t)i * kv_stride, h_out))
            return -1;
        h_in = h_out;
        residual_in = residual_out;
    }
    return 0;
}

/* A greedy finish of a batch whose every row samples greedily, in one call: the kernels
 * stages/runner.py otherwise calls one at a time (add_rms_norm, the lm_head's matmul,
 * row_argmax, the comparison of a split lm_head's two maxima), in the same order on the same
 * values, so the tokens are the same.
 *
 * With `residual` (the last stage): x = rmsnorm(h + residual) * norm_weight per row, then its
 * logits; without (NULL: the first stage's half of a split lm_head, h already normed), h's
 * logits. Each row's first maximal index plus `token_base` (the stage's first vocabulary row)
 * goes to out [N]; with `best` [N] (NULL: not wanted) that maximal logit too, in the element
 * type. With `their_best` [N] and `their_token` [N] (the other half's maxima, whose ids are
 * all higher), a row whose their_best is greater takes their_token: a tie goes to the lower
 * id, as an argmax over the whole row would.
 *
 * scratch holds 2 max_rows d + max_rows V elements (h + residual, x, the logits), and every
 * row buffer max_rows rows; with `x_out` [N, d] (non-NULL) x goes there instead, for the caller
 * to keep. Returns 0; PPR_BAD_ROWS for N outside [0, max_rows] or d not the lm_head's K; -1
 * where the lm_head's kind is one this build lacks. */
int ppr_greedy_head(const ppr_linear_t *head, int elem_bytes, const void *h, const void *residual,
                    const void *norm_weight, float eps, int N, int max_rows, int d, void *scratch,
                    void *x_out, int64_t token_base, int64_t *out, void *best,
                    const void *their_best, const int64_t *their_token) {
    if (N < 0 || N > max_rows || d != head->k) return PPR_BAD_ROWS;
    char *sum = scratch, *x = x_out ? x_out : sum + (int64_t)N * d * elem_bytes;
    char *logits = sum + 2 * (int64_t)N * d * elem_bytes;
    const void *rows = h;
    if (residual) {
        ppr_add_rms_norm(elem_bytes, h, residual, norm_weight, sum, x, N, d, eps);
        rows = x;
    }
    if (run_linear(head, elem_bytes, rows, logits, N)) return -1;
    ppr_row_argmax(elem_bytes, logits, head->n, out, N, head->n);
    for (int n = 0; n < N; n++) {
        const int64_t at = (int64_t)n * head->n + out[n];
        float own, theirs = 0.0f;
        if (elem_bytes == 4) {
            own = ((const float *)logits)[at];
            if (best) ((float *)best)[n] = own;
            if (their_best) theirs = ((const float *)their_best)[n];
        } else {
            own = bf16_load(((const uint16_t *)logits)[at]);
            if (best) ((uint16_t *)best)[n] = ((const uint16_t *)logits)[at];
            if (their_best) theirs = bf16_load(((const uint16_t *)their_best)[n]);
        }
        out[n] = their_best && theirs > own ? their_token[n] : out[n] + token_base;
    }
    return 0;
}

/* sizeof each struct backend/cpu/fused_layer.py mirrors in ctypes (0 ppr_linear_t, 1 ppr_layer_t,
 * 2 ppr_step_t; else 0): checked at load, so a field added on one side alone is caught. */
int64_t ppr_struct_size(int which) {
    switch (which) {
    case 0: return sizeof(ppr_linear_t);
    case 1: return sizeof(ppr_layer_t);
    case 2: return sizeof(ppr_step_t);
    }
    return 0;
}

/* offsetof field `field` (0-based, in declaration order; a nested struct counts as one field)
 * of struct `which` (0 ppr_linear_t, 1 ppr_layer_t, 2 ppr_step_t, as ppr_struct_size), -1 past
 * the last field or for another `which`: backend/cpu/fused_layer.py checks every field of its
 * mirrors against these at load, so a field moved, retyped or added on one side alone is
 * caught where the sizes alone might agree. */
int64_t ppr_struct_offset(int which, int field) {
    static const int64_t linear[] = {
        offsetof(ppr_linear_t, kind), offsetof(ppr_linear_t, n),
        offsetof(ppr_linear_t, k),    offsetof(ppr_linear_t, bits),
        offsetof(ppr_linear_t, a),    offsetof(ppr_linear_t, b),
        offsetof(ppr_linear_t, c),    offsetof(ppr_linear_t, panels),
        offsetof(ppr_linear_t, code_rows), offsetof(ppr_linear_t, amx_rows),
    };
    static const int64_t layer[] = {
        offsetof(ppr_layer_t, qkv),          offsetof(ppr_layer_t, o),
        offsetof(ppr_layer_t, gate_up),      offsetof(ppr_layer_t, down),
        offsetof(ppr_layer_t, input_norm),   offsetof(ppr_layer_t, post_attn_norm),
        offsetof(ppr_layer_t, eps),          offsetof(ppr_layer_t, hidden),
        offsetof(ppr_layer_t, intermediate), offsetof(ppr_layer_t, num_heads),
        offsetof(ppr_layer_t, num_kv_heads), offsetof(ppr_layer_t, head_dim),
        offsetof(ppr_layer_t, qkv_bias),     offsetof(ppr_layer_t, o_bias),
        offsetof(ppr_layer_t, q_norm),       offsetof(ppr_layer_t, k_norm),
        offsetof(ppr_layer_t, attn_out_norm), offsetof(ppr_layer_t, mlp_out_norm),
        offsetof(ppr_layer_t, qk_norm_whole), offsetof(ppr_layer_t, window),
        offsetof(ppr_layer_t, softcap), offsetof(ppr_layer_t, gelu),
        offsetof(ppr_layer_t, rope_local),
    };
    static const int64_t step[] = {
        offsetof(ppr_step_t, elem_bytes),   offsetof(ppr_step_t, num_tokens),
        offsetof(ppr_step_t, num_seqs),     offsetof(ppr_step_t, table_stride),
        offsetof(ppr_step_t, num_slots),    offsetof(ppr_step_t, max_tokens),
        offsetof(ppr_step_t, rope_rows),    offsetof(ppr_step_t, cos),
        offsetof(ppr_step_t, sin),          offsetof(ppr_step_t, positions),
        offsetof(ppr_step_t, slot_mapping), offsetof(ppr_step_t, q_start),
        offsetof(ppr_step_t, q_len),        offsetof(ppr_step_t, ctx_len),
        offsetof(ppr_step_t, block_table),  offsetof(ppr_step_t, scale),
        offsetof(ppr_step_t, x),            offsetof(ppr_step_t, qkv),
        offsetof(ppr_step_t, q),            offsetof(ppr_step_t, attn),
        offsetof(ppr_step_t, h),            offsetof(ppr_step_t, gate_up),
        offsetof(ppr_step_t, act),          offsetof(ppr_step_t, cos_local),
        offsetof(ppr_step_t, sin_local),      offsetof(ppr_step_t, kv_bytes),
    };
    const int64_t *offsets;
    int count;
    switch (which) {
    case 0: offsets = linear, count = (int)(sizeof(linear) / sizeof(linear[0])); break;
    case 1: offsets = layer, count = (int)(sizeof(layer) / sizeof(layer[0])); break;
    case 2: offsets = step, count = (int)(sizeof(step) / sizeof(step[0])); break;
    default: return -1;
    }
    return field >= 0 && field < count ? offsets[field] : -1;
}

/* The layer's four matmuls alone, as ppr_decoder_layer runs them, at M rows: what `ppring bench
 * step` times as the compute floor of a step (x_hidden [M, d], x_attn [M, H D], x_act [M, I],
 * y at least [M, max N]; their values do not matter). */
int ppr_layer_matmuls(const ppr_layer_t *L, int elem_bytes, int M, const void *x_hidden,
                      const void *x_attn, const void *x_act, void *y) {
    return run_linear(&L->qkv, elem_bytes, x_hidden, y, M) ||
           run_linear(&L->o, elem_bytes, x_attn, y, M) ||
           run_linear(&L->gate_up, elem_bytes, x_hidden, y, M) ||
           run_linear(&L->down, elem_bytes, x_act, y, M);
}
