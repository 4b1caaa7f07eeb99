/* The whole decode forward, and greedy draft steps made of it.
 *
 * A decode-type step of a small model spends more time between kernels than in them: each
 * decoder layer is about fifteen torch ops and module calls around its four products.
 * `ragspeed_decode_forward` runs every layer of such a step in one call: norms, products, Q/K
 * norm, rotation, the K/V write into the paged pool, attention, SiLU-gated MLP, over the model
 * kernels.h's `Model` describes. The products, norms and attention are the layer-by-layer path's
 * own kernels (gemv.c, gemv_gguf.c, attention.c, rowwise.c); the rotation, Q/K norm and SiLU
 * agree with torch's to float rounding. Each row is computed alike whatever the number of rows,
 * except that a prefill chunk's rows (spans, below) attend in the prefill kernel.
 */
#include <omp.h>
#include <stdlib.h>

#include "gemv.h"
#include "internal.h"
#include "vector.h"

/* Row `id` of the embeddings into x [hidden]; Q8_0: step * q, as gguf's dequantize. */
static void embed_row(const Model *model, int64_t id, float *x) {
    int hidden = model->hidden;
    if (model->embed) {
        memcpy(x, model->embed + (size_t)id * hidden, sizeof(float) * hidden);
        return;
    }
    const uint8_t *block = model->embed_q8 + (size_t)id * (hidden / 32) * 34;
    for (int b = 0; b < hidden / 32; b++, block += 34) {
        f16 d;
        memcpy(&d, block, sizeof d);
        float step = f16_to_f32(d);
        for (int i = 0; i < 32; i++) x[b * 32 + i] = step * (float)(int8_t)block[2 + i];
    }
}

/* A Linear's product, split across the threads of the enclosing parallel region. */
static void linear_team(const Linear *l, const float *x, float *y, int m) {
    switch (l->kind) {
    case WEIGHT_INT8: gemv_i8_team((const int8_t *)l->w, l->scale, l->bias, x, y, m, l->n, l->k); break;
    case WEIGHT_Q4: gemv_q4_team((const uint8_t *)l->w, l->scale, l->bias, x, y, m, l->n, l->k); break;
    case WEIGHT_Q4K: gemv_q4k_team((const uint8_t *)l->w, l->scale, l->bias, x, y, m, l->n, l->k); break;
    case WEIGHT_Q6K: gemv_q6k_team((const int8_t *)l->w, l->scale, l->bias, x, y, m, l->n, l->k); break;
    case WEIGHT_KMIX: gemv_kmix_team((const int8_t *)l->w, l->scale, l->bias, x, y, m, l->n, l->k); break;
    default: gemv_f32_team((const float *)l->w, NULL, l->bias, x, y, m, l->n, l->k); break;
    }
}

/* Bytes of one block of 16 output columns of a Linear: its weights and its scales. */
static void block_bytes(const Linear *l, size_t *weights, size_t *scales) {
    size_t k = (size_t)l->k, groups = (k + GROUP - 1) / GROUP, pairs = (k + 1) / 2;
    switch (l->kind) {
    case WEIGHT_INT8: *weights = pairs * 2 * BLOCK, *scales = groups * BLOCK * sizeof(f16); break;
    case WEIGHT_Q4: *weights = k / 2 * BLOCK, *scales = groups * 2 * BLOCK * sizeof(f16); break;
    case WEIGHT_Q4K: *weights = k / 2 * BLOCK, *scales = groups * 2 * BLOCK * sizeof(float); break;
    case WEIGHT_Q6K: *weights = pairs * 2 * BLOCK, *scales = k / STEP * BLOCK * sizeof(float); break;
    case WEIGHT_KMIX: *weights = pairs * 2 * BLOCK, *scales = groups * 3 * BLOCK * sizeof(float); break;
    default: *weights = k * BLOCK * sizeof(float), *scales = 0; break;
    }
}

/* This thread's blocks of a Linear (those its `omp for schedule(static)` gives it) prefetched
 * into its L2: while the thread computes something else (attention), memory brings in the
 * product after it. */
static void prefetch_share(const Linear *l) {
    int num_blocks = (l->n + BLOCK - 1) / BLOCK, threads = omp_get_num_threads(), t = omp_get_thread_num();
    int q = num_blocks / threads, extra = num_blocks % threads;
    int first = t * q + (t < extra ? t : extra), count = q + (t < extra);
    size_t weights, scales;
    block_bytes(l, &weights, &scales);
    const char *ranges[2] = {(const char *)l->w + first * weights, (const char *)l->scale + first * scales};
    size_t lengths[2] = {count * weights, l->scale ? count * scales : 0};
    for (int i = 0; i < 2; i++)
        for (size_t offset = 0; offset < lengths[i]; offset += 64) __builtin_prefetch(ranges[i] + offset, 0, 2);
}

/* The same in a parallel region of its own. */
static void linear(const Linear *l, const float *x, float *y, int m, int num_threads) {
    _Pragma("omp parallel num_threads(num_threads)")
    linear_team(l, x, y, m);
}

/* x [dim] / rms(x) * weight, in place. */
static void rms_norm_inplace(float *x, const float *weight, int dim, float eps) {
    float sum = 0.0f;
    for (int d = 0; d < dim; d++) sum += x[d] * x[d];
    float inverse = 1.0f / __builtin_sqrtf(sum / dim + eps);
    for (int d = 0; d < dim; d++) x[d] = x[d] * inverse * weight[d];
}

/* Pairs (2j, 2j + 1) of `src` rotated by the complex rotation[j] (cos, sin) into `dst`. */
static void rotate(const float *src, float *dst, const float *rotation, int head_dim) {
    for (int j = 0; j < head_dim / 2; j++) {
        float a = src[2 * j], b = src[2 * j + 1], c = rotation[2 * j], s = rotation[2 * j + 1];
        dst[2 * j] = a * c - b * s;
        dst[2 * j + 1] = a * s + b * c;
    }
}

/* act [m, inter] = silu(gate) * up for gate_up [m, 2 * inter]: sigmoid(g) from e = e^-|g|,
 * 1 / (1 + e) for g >= 0 and e / (1 + e) below. */
static void silu_mul(const float *gate_up, float *act, int m, int inter) {
    const veci sign = (veci){0} + (int32_t)0x80000000;
    for (int r = 0; r < m; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        float *a = act + (size_t)r * inter;
        int i = 0;
        for (; i + LANES <= inter; i += LANES) {
            vecf x = loadv_f32(g + i);
            vecf e = exp_nonpositive((vecf)((veci)x | sign));
            vecf inverse = 1.0f / (1.0f + e);
            veci negative = x < 0;
            vecf sigmoid = (vecf)(((veci)inverse & ~negative) | ((veci)(e * inverse) & negative));
            storev_f32(a + i, x * sigmoid * loadv_f32(u + i));
        }
        for (; i < inter; i++) {
            float x = g[i], e = __builtin_expf(-__builtin_fabsf(x)), inverse = 1.0f / (1.0f + e);
            a[i] = x * (x >= 0 ? inverse : e * inverse) * u[i];
        }
    }
}

/* Batches of at most this many rows run the steps between products on every thread (below). */
#define EACH_THREAD_ROWS 2
/* Batches of at most this many rows prefetch each thread's share of the attention output's
 * weight while they compute attention, whose arithmetic leaves memory idle: the product after
 * it then reads from L2. Only that product's: a larger share (gate_up's too) evicts what the
 * step still reads. */
#define PREFETCH_ROWS 2
/* A step between products: on every thread where each_thread, else on one and then a barrier. */
#define BETWEEN_PRODUCTS(each_thread, STEP)                                                      \
    do {                                                                                        \
        if ((each_thread) || omp_get_thread_num() == 0) { STEP; }                               \
        if (!(each_thread)) { _Pragma("omp barrier") }                                          \
    } while (0)

/* Scratch for `floats` floats, 64-byte aligned, whole cache lines. */
static float *scratch(size_t floats) {
    return aligned_alloc(64, sizeof(float) * ((floats + 15) & ~(size_t)15));
}

/* x [m, hidden]: the step's embeddings (or, given ids [m], their token ids, looked up into x
 * here), overwritten with the residual stream; out [m, hidden]: the final norm of the stream;
 * logits [m, lm_head.n], unless NULL: the LM head's product of it. rotations [m, head_dim/2] (cos, sin) pairs; slots [m] where
 * each row's K/V goes; block_tables [m, max_blocks] and context_lens [m]: each row's context.
 * k_caches / v_caches: one [num_slots, num_kv_heads, head_dim] pool per layer, fp32 or (kv_half)
 * fp16. The last rows may be num_spans prefill chunks of span_rows[i] rows each (positions in
 * order after their context's cached keys, all with its block table): their attention runs in
 * the prefill kernel (prefill_attention.c, its scores in integers where int16), whose tiles
 * of keys serve all of a chunk's rows, and the rows before them in the decode kernel, a row at a
 * time (decodes and verifications, whose rows must be computed as a plain decode computes them). */
void ragspeed_decode_forward(const Model *model, void *const *k_caches, void *const *v_caches,
                             const int64_t *ids, float *x, float *out, float *logits,
                             const float *rotations, const int64_t *slots,
                             const int64_t *block_tables, const int64_t *context_lens,
                             int max_blocks, int block_size, int m, int num_spans, const int32_t *span_rows,
                             int int16, int kv_half, int num_threads) {
    int hidden = model->hidden, num_heads = model->num_heads, num_kv_heads = model->num_kv_heads;
    int head_dim = model->head_dim, inter = model->inter, half = head_dim / 2;
    int q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    int qkv_size = q_size + 2 * kv_size, widest = qkv_size > 2 * inter ? qkv_size : 2 * inter;
    float eps = model->eps;
    float *normed = scratch((size_t)m * hidden), *h = scratch((size_t)m * hidden);
    float *wide = scratch((size_t)m * widest), *q = scratch((size_t)m * q_size);
    float *mid = scratch((size_t)m * (q_size > inter ? q_size : inter)), *key = scratch(kv_size);
    int64_t longest = longest_context(context_lens, m);
    float *partials = scratch(attention_partials(m, num_heads, head_dim, longest));
    int row_rows = m; /* the rows before the spans: the decode kernel's */
    size_t packed_floats = 0;
    for (int i = num_spans - 1, end = m; i >= 0; end -= span_rows[i--]) {
        row_rows = end - span_rows[i];
        size_t floats = prefill_attention_floats(context_lens[end - 1], num_kv_heads, head_dim);
        packed_floats = floats > packed_floats ? floats : packed_floats;
    }
    float *packed = packed_floats ? scratch(packed_floats) : NULL;
    if (ids)
        for (int r = 0; r < m; r++) embed_row(model, ids[r], x + (size_t)r * hidden);
    /* One parallel region for the whole stack and the head: the products and attention split
     * across its threads, a barrier after each (a fork and join per product would cost more than
     * the barrier). The steps between them (the norms with the residual add, SiLU, the merge of
     * attention's chunks) run on one thread with a barrier after each; for a batch of at most
     * EACH_THREAD_ROWS rows every thread runs them itself on its own copy of the residual stream
     * and of their outputs, the same bits, which saves four barriers a layer: a barrier costs its
     * wait for the slower thread, a share of a small step's time. */
    int each_thread = m <= EACH_THREAD_ROWS && !num_spans; /* a span's tasks split across the team */
    _Pragma("omp parallel num_threads(num_threads)")
    {
    float *xs = x, *ns = normed, *ms = mid; /* the residual stream, normed rows, SiLU / attention */
    if (each_thread) {
        xs = scratch((size_t)m * hidden), ns = scratch((size_t)m * hidden);
        ms = scratch((size_t)m * (q_size > inter ? q_size : inter));
        memcpy(xs, x, sizeof(float) * m * hidden);
    }
    for (int l = 0; l < model->num_layers; l++) {
        const Layer *layer = model->layers + l;
        BETWEEN_PRODUCTS(each_thread, for (int r = 0; r < m; r++)
                         add_rms_norm_row(xs, l ? h : NULL, layer->input_norm, ns, r, hidden, eps));
        linear_team(&layer->qkv, ns, wide, m);
        _Pragma("omp single")
        for (int r = 0; r < m; r++) {
            float *row = wide + (size_t)r * qkv_size;
            const float *rotation = rotations + (size_t)r * half * 2;
            size_t slot = (size_t)slots[r];
            if (layer->qk_norm)
                for (int hd = 0; hd < num_heads + num_kv_heads; hd++)
                    rms_norm_inplace(row + (size_t)hd * head_dim, layer->qk_norm + (size_t)hd * head_dim, head_dim, eps);
            for (int hd = 0; hd < num_heads; hd++)
                rotate(row + (size_t)hd * head_dim, q + (size_t)r * q_size + (size_t)hd * head_dim, rotation, head_dim);
            for (int hd = 0; hd < num_kv_heads; hd++)
                rotate(row + q_size + (size_t)hd * head_dim, key + (size_t)hd * head_dim, rotation, head_dim);
            put_kv(k_caches[l], slot * kv_size, key, kv_size, kv_half);
            put_kv(v_caches[l], slot * kv_size, row + q_size + kv_size, kv_size, kv_half);
        }
        if (m <= PREFETCH_ROWS) prefetch_share(&layer->o);
        if (row_rows)
            paged_decode_attention_team(q, k_caches[l], v_caches[l], block_tables, context_lens, ms, row_rows,
                                        num_heads, num_kv_heads, head_dim, max_blocks, block_size, model->scale,
                                        longest, partials, kv_half, each_thread);
        for (int i = 0, first = row_rows; i < num_spans; first += span_rows[i++])
            prefill_attention_team(q + (size_t)first * q_size, k_caches[l], v_caches[l],
                                   block_tables + (size_t)first * max_blocks, ms + (size_t)first * q_size, span_rows[i],
                                   context_lens[first] - 1, num_heads, num_kv_heads, head_dim, block_size,
                                   model->scale, kv_half, int16, packed);
        linear_team(&layer->o, ms, h, m);
        BETWEEN_PRODUCTS(each_thread, for (int r = 0; r < m; r++)
                         add_rms_norm_row(xs, h, layer->post_norm, ns, r, hidden, eps));
        linear_team(&layer->gate_up, ns, wide, m);
        BETWEEN_PRODUCTS(each_thread, silu_mul(wide, ms, m, inter));
        linear_team(&layer->down, ms, h, m);
    }
    BETWEEN_PRODUCTS(each_thread, for (int r = 0; r < m; r++)
                     add_rms_norm_row(xs, model->num_layers ? h : NULL, model->final_norm, ns, r, hidden, eps));
    if (omp_get_thread_num() == 0) {
        if (xs != x) memcpy(x, xs, sizeof(float) * m * hidden);
        memcpy(out, ns, sizeof(float) * m * hidden);
    }
    if (logits) linear_team(&model->lm_head, ns, logits, m);
    if (each_thread) { /* read by their own thread alone */
        free(xs); free(ns); free(ms);
    }
    }
    free(normed); free(wide); free(q); free(mid); free(h); free(partials); free(key); free(packed);
}

/* Greedy decoding of m sequences in one call: a draft model's drafts. Sequence i first feeds
 * its num_fed[i] tokens (fed, one after another over the sequences) from positions[i] on,
 * then, num_steps[i] times, takes the argmax of the first `vocab` logits after its last fed
 * token as its next token and feeds that; it stops early after an argmax whose softmax
 * probability is below min_confidence (that token is kept). Each step is one
 * `ragspeed_decode_forward` over every token fed (each its own attention row, its context up
 * to itself) and one LM-head product over each sequence's last row: the kernels, in the order,
 * of the model's own steps. rotation_table: [positions, head_dim/2] (cos, sin) pairs;
 * block_tables [m, max_blocks] must hold every position fed. drafts [m, max_steps] receives
 * each sequence's tokens, counts [m] how many. d2t [lm_head rows] (NULL: identity) maps a
 * sub-vocabulary head's argmax row to the token id it scores: that id is the draft and is what
 * the next step feeds (the embedding covers the whole vocabulary). */
void ragspeed_greedy_steps(const Model *model, const float *rotation_table, int vocab,
                           const int64_t *d2t, void *const *k_caches, void *const *v_caches,
                           const int64_t *block_tables, int max_blocks, int block_size, int kv_half, int m,
                           const int64_t *fed, const int32_t *num_fed, const int64_t *positions,
                           const int32_t *num_steps, float min_confidence, int64_t *drafts,
                           int32_t *counts, int max_steps, int num_threads) {
    int hidden = model->hidden, half = model->head_dim / 2, vocab_rows = model->lm_head.n;
    int total_fed = 0;
    for (int i = 0; i < m; i++) total_fed += num_fed[i];
    int rows_max = total_fed > m ? total_fed : m;
    int *going = malloc(sizeof(int) * m), *seqs = malloc(sizeof(int) * m);
    int *last_row = malloc(sizeof(int) * m);
    int64_t *next = malloc(sizeof(int64_t) * m), *position = malloc(sizeof(int64_t) * m);
    int64_t *slots = malloc(sizeof(int64_t) * rows_max), *lens = malloc(sizeof(int64_t) * rows_max);
    int64_t *tables = malloc(sizeof(int64_t) * rows_max * max_blocks);
    float *x = scratch((size_t)rows_max * hidden), *out = scratch((size_t)rows_max * hidden);
    float *last = scratch((size_t)m * hidden), *rotations = scratch((size_t)rows_max * half * 2);
    float *logits = scratch((size_t)m * vocab_rows);
    for (int i = 0; i < m; i++) {
        going[i] = num_steps[i] > 0 && num_fed[i] > 0;
        position[i] = positions[i];
        counts[i] = 0;
    }
    for (int step = 0; step < max_steps; step++) {
        int a = 0, n = 0; /* rows fed, sequences sampled (each from its last row) */
        const int64_t *fed_i = fed;
        for (int i = 0; i < m; i++) {
            int count = step ? 1 : num_fed[i];
            const int64_t *tokens = step ? next + i : fed_i;
            fed_i += num_fed[i];
            if (!going[i] || step >= num_steps[i]) continue;
            const int64_t *table = block_tables + (size_t)i * max_blocks;
            for (int t = 0; t < count; t++, a++) {
                int64_t p = position[i]++;
                embed_row(model, tokens[t], x + (size_t)a * hidden);
                memcpy(rotations + (size_t)a * half * 2, rotation_table + (size_t)p * half * 2, sizeof(float) * half * 2);
                memcpy(tables + (size_t)a * max_blocks, table, sizeof(int64_t) * max_blocks);
                slots[a] = table[p / block_size] * block_size + p % block_size;
                lens[a] = p + 1;
            }
            seqs[n] = i;
            last_row[n++] = a - 1;
        }
        if (!n) break;
        ragspeed_decode_forward(model, k_caches, v_caches, NULL, x, out, NULL, rotations, slots, tables, lens,
                                max_blocks, block_size, a, 0, NULL, 0, kv_half, num_threads);
        for (int r = 0; r < n; r++)
            memcpy(last + (size_t)r * hidden, out + (size_t)last_row[r] * hidden, sizeof(float) * hidden);
        linear(&model->lm_head, last, logits, n, num_threads);
        for (int r = 0; r < n; r++) {
            const float *l = logits + (size_t)r * vocab_rows;
            int64_t best = argmax_row(l, vocab);
            int i = seqs[r];
            /* a sub-vocabulary head's row -> the token id it scores (fed back, and the draft) */
            drafts[(size_t)i * max_steps + counts[i]++] = next[i] = d2t ? d2t[best] : best;
            if (min_confidence > 0.0f) {
                float total = 0.0f;
                for (int t = 0; t < vocab; t++) total += __builtin_expf(l[t] - l[best]);
                going[i] = 1.0f / total >= min_confidence;
            }
        }
    }
    free(going); free(seqs); free(last_row); free(next); free(position); free(slots); free(lens); free(tables);
    free(x); free(out); free(last); free(rotations); free(logits);
}
