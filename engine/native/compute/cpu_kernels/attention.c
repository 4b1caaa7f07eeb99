/* Decode attention straight from the paged KV pool: one query token per request.
 *
 * q [num_seqs, num_heads, head_dim]; caches [num_slots, num_kv_heads, head_dim] with slot =
 * block * block_size + offset; block_tables [num_seqs, max_blocks]; context_lens [num_seqs];
 * out [num_seqs, num_heads, head_dim]. The SDPA path of engine/native/compute/attention.py is the reference.
 *
 * Each context is cut into chunks of CHUNK keys. For a chunk and every KV head, the kernel
 * computes the scores of the head's group of query heads (each key row read where it lies in
 * the pool, no gather), their softmax within the chunk and the weighted sum of the value rows,
 * kept as the chunk's maximum, sum and partial output; a second loop merges each query head's
 * chunks in order. Chunks balance the threads (one sequence has only num_kv_heads heads:
 * SmolLM2's 3 on 2 threads): each thread takes one contiguous stretch of them and prefetches
 * its next chunk while it computes the current one. Rows over one context (a verification's)
 * run together, so a chunk is read from memory once for all of them. A row's chunks depend only
 * on its own context length, so its result is the same in any batch and on any thread count.
 *
 * A KV head's key and value rows are read once for its whole group of query heads: scores take
 * four keys by up to four query heads at a time (their sums in registers, each key vector
 * loaded and widened once for all), value sums a few vectors of the output by up to four query
 * heads. Each (query head, key) sum and each output element adds its terms in the order it
 * would alone, so grouping the heads does not change a bit.
 */
#include <omp.h>
#include <stdlib.h>

#include "internal.h"
#include "vector.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define CHUNK 64  /* keys per task */

/* Floats of the chunks' partial results: per task, for each query head, max, sum, output. */
size_t attention_partials(int num_seqs, int num_heads, int head_dim, int64_t longest) {
    return (size_t)num_seqs * num_heads * ((longest + CHUNK - 1) / CHUNK) * (head_dim + 2);
}

/* The next chunk's slots, and a KV head's part of them in one cache (`rows`: the cache plus the
 * head's offset), prefetched into L2 a key at a time while the thread computes the same key of
 * the current chunk: the prefetches spread over the arithmetic (all of a chunk's lines
 * prefetched at its start are no faster than none at all). */
typedef struct {
    size_t slots[CHUNK];
    int count;
} Ahead;

typedef struct {
    const char *rows;
    const size_t *slots;
    size_t row_bytes, bytes;  /* a slot's row in the cache; the head's part of it */
    int count;
} Prefetch;

static inline void prefetch_row(const Prefetch *p, int t) {
    if (t >= p->count) return;
    const char *row = p->rows + p->slots[t] * p->row_bytes;
    for (size_t offset = 0; offset < p->bytes; offset += 64) __builtin_prefetch(row + offset, 0, 2);
}

/* Rows [first, end) of a step over one context: `keys` keys in the blocks of `table` (its last
 * and longest row's). */
typedef struct {
    int first, end;
    const int64_t *table;
    int64_t keys;
} Run;

static inline int run_chunks(const Run *run) { return (int)((run->keys + CHUNK - 1) / CHUNK); }

/* Chunk c of a run: its rows' slots. */
static void chunk_rows(Ahead *a, const Run *run, int c, int block_size) {
    int64_t first = (int64_t)c * CHUNK;
    const int64_t *table = run->table;
    a->count = run->keys - first < CHUNK ? (int)(run->keys - first) : CHUNK;
    for (int t = 0; t < a->count; t++) {
        int64_t p = first + t;
        a->slots[t] = (size_t)table[p / block_size] * block_size + p % block_size;
    }
}

typedef float vec4 __attribute__((vector_size(16)));

/* The sums of acc[0..3]'s lanes: the lanes added in pairs as reduce_add adds them (AVX-512: lanes
 * i and i + 8, then i + 4, i + 2, i + 1), four vectors in each shuffle. */
static inline vec4 sum4(const vecf *acc) {
#if defined(__AVX512F__)
    __m512 a = (__m512)acc[0], b = (__m512)acc[1], c = (__m512)acc[2], d = (__m512)acc[3];
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4e));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xb1));
    s = _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s);
    return (vec4)_mm512_castps512_ps128(s);
#elif defined(__AVX2__) && H == 2
    __m256 h01 = _mm256_hadd_ps((__m256)acc[0], (__m256)acc[1]), h23 = _mm256_hadd_ps((__m256)acc[2], (__m256)acc[3]);
    __m256 h = _mm256_hadd_ps(h01, h23);
    return (vec4)_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#else
    return (vec4){reduce_add(acc[0]), reduce_add(acc[1]), reduce_add(acc[2]), reduce_add(acc[3])};
#endif
}

/* Query heads per pass over the keys or values (their sums in registers): KEYS keys by SCORE_HEADS
 * heads of scores, VALUE_VECS vectors of the output by VALUE_HEADS heads of value sums. */
#define KEYS 4
#if H == 1
#define SCORE_HEADS 4
#define VALUE_HEADS 4
#define VALUE_VECS 4
#else
#define SCORE_HEADS 2
#define VALUE_HEADS 3
#define VALUE_VECS 2
#endif

/* scores[g][t] = q[g] . keys[t] * scale for `heads` query heads, KEYS keys at a time: each key
 * vector loaded (and widened) once for all the heads, each (head, key) its own sum. */
static inline __attribute__((always_inline)) void score_heads(const float *q, int heads, const void *const *keys,
                                                              int count, int head_dim, float scale,
                                                              float *scores, const Prefetch *ahead, int half) {
    int whole = head_dim / LANES * LANES;
    for (int t = 0; t < count; t += KEYS) {
        const void *row[KEYS];
        _Pragma("GCC unroll 4") for (int j = 0; j < KEYS; j++) {
            row[j] = keys[t + j < count ? t + j : count - 1];  /* past the end: the last key again, unused */
            prefetch_row(ahead, t + j);
        }
        vecf acc[SCORE_HEADS][KEYS];
        _Pragma("GCC unroll 4") for (int g = 0; g < heads; g++)
            _Pragma("GCC unroll 4") for (int j = 0; j < KEYS; j++) acc[g][j] = (vecf){0};
        for (int d = 0; d < whole; d += LANES) {
            vecf k[KEYS];
            _Pragma("GCC unroll 4") for (int j = 0; j < KEYS; j++) k[j] = load_kv(row[j], d, half);
            _Pragma("GCC unroll 4") for (int g = 0; g < heads; g++) {
                vecf qv = loadv_f32(q + (size_t)g * head_dim + d);
                _Pragma("GCC unroll 4") for (int j = 0; j < KEYS; j++) acc[g][j] += qv * k[j];
            }
        }
        _Pragma("GCC unroll 4") for (int g = 0; g < heads; g++) {
            vec4 sums = sum4(acc[g]);
            for (int d = whole; d < head_dim; d++)
                for (int j = 0; j < KEYS; j++) sums[j] += q[(size_t)g * head_dim + d] * kv_at(row[j], d, half);
            sums *= scale;
            memcpy(scores + g * CHUNK + t, &sums, sizeof sums);
        }
    }
}

/* scores [group][CHUNK]: those of the group's query heads q [group, head_dim] over `count` keys;
 * the first ceil(count / KEYS) * KEYS of each written. */
static void chunk_scores(const float *q, int group, const void *const *keys, int count, int head_dim,
                         float scale, float *scores, const Prefetch *ahead, int half) {
    for (int g = 0; g < group; g += SCORE_HEADS) {
        const float *qg = q + (size_t)g * head_dim;
        float *sg = scores + g * CHUNK;
        switch (group - g < SCORE_HEADS ? group - g : SCORE_HEADS) {
#if SCORE_HEADS > 3
        case 4: score_heads(qg, 4, keys, count, head_dim, scale, sg, ahead, half); break;
#endif
        case 3: score_heads(qg, 3, keys, count, head_dim, scale, sg, ahead, half); break;
        case 2: score_heads(qg, 2, keys, count, head_dim, scale, sg, ahead, half); break;
        default: score_heads(qg, 1, keys, count, head_dim, scale, sg, ahead, half); break;
        }
    }
}

/* out[g][d .. d + vecs * LANES) = the sum over t of weights[g][t] * values[t][d ..] for `heads`
 * query heads: each value vector loaded (and widened) once for all of them. */
static inline __attribute__((always_inline)) void value_heads(const float *weights, int heads, int vecs,
                                                              const void *const *values, int count, int d,
                                                              float *out, size_t out_stride, const Prefetch *ahead,
                                                              int half) {
    vecf acc[VALUE_HEADS][VALUE_VECS];
    _Pragma("GCC unroll 4") for (int g = 0; g < heads; g++)
        _Pragma("GCC unroll 4") for (int j = 0; j < vecs; j++) acc[g][j] = (vecf){0};
    for (int t = 0; t < count; t++) {
        if (ahead) prefetch_row(ahead, t);
        vecf v[VALUE_VECS];
        _Pragma("GCC unroll 4") for (int j = 0; j < vecs; j++) v[j] = load_kv(values[t], d + j * LANES, half);
        _Pragma("GCC unroll 4") for (int g = 0; g < heads; g++) {
            vecf w = splat(weights[g * CHUNK + t]);
            _Pragma("GCC unroll 4") for (int j = 0; j < vecs; j++) acc[g][j] += w * v[j];
        }
    }
    _Pragma("GCC unroll 4") for (int g = 0; g < heads; g++)
        _Pragma("GCC unroll 4") for (int j = 0; j < vecs; j++) storev_f32(out + g * out_stride + d + j * LANES, acc[g][j]);
}

static inline __attribute__((always_inline)) void value_vecs(const float *weights, int heads, const void *const *values,
                                                             int count, int head_dim, float *out, size_t out_stride,
                                                             const Prefetch *ahead, int half) {
    int d = 0;
    for (; d + VALUE_VECS * LANES <= head_dim; d += VALUE_VECS * LANES)
        value_heads(weights, heads, VALUE_VECS, values, count, d, out, out_stride, d ? NULL : ahead, half);
    for (; d + LANES <= head_dim; d += LANES)
        value_heads(weights, heads, 1, values, count, d, out, out_stride, d ? NULL : ahead, half);
    for (; d < head_dim; d++)
        for (int g = 0; g < heads; g++) {
            float a = 0.0f;
            for (int t = 0; t < count; t++) a += weights[g * CHUNK + t] * kv_at(values[t], d, half);
            out[g * out_stride + d] = a;
        }
}

/* out[g][d] = the sum over t of weights[g][t] * values[t][d] for the group's query heads
 * (weights [group][CHUNK]; out's heads out_stride floats apart). */
static void chunk_values(const float *weights, int group, const void *const *values, int count, int head_dim,
                         float *out, size_t out_stride, const Prefetch *ahead, int half) {
    for (int g = 0; g < group; g += VALUE_HEADS) {
        const float *wg = weights + g * CHUNK;
        float *og = out + g * out_stride;
        switch (group - g < VALUE_HEADS ? group - g : VALUE_HEADS) {
#if VALUE_HEADS > 3
        case 4: value_vecs(wg, 4, values, count, head_dim, og, out_stride, ahead, half); break;
#endif
        case 3: value_vecs(wg, 3, values, count, head_dim, og, out_stride, ahead, half); break;
        case 2: value_vecs(wg, 2, values, count, head_dim, og, out_stride, ahead, half); break;
        default: value_vecs(wg, 1, values, count, head_dim, og, out_stride, ahead, half); break;
        }
    }
}

/* KV head h over one chunk's `count` slots, for the head's `group` query heads q [group,
 * head_dim]: their partials [group][2 + head_dim] (max, sum, unnormalised output). */
static void attention_chunk(const float *q, const void *k_cache, const void *v_cache,
                            const size_t *slots, int count, int h, int group, int num_kv_heads,
                            int head_dim, float scale, float *partials, const Ahead *ahead, int half) {
    size_t element = half ? sizeof(f16) : sizeof(float), row_bytes = element * num_kv_heads * head_dim;
    Prefetch next_keys = {(const char *)k_cache + element * h * head_dim, ahead->slots, row_bytes,
                          element * head_dim, ahead->count};
    Prefetch next_values = next_keys;
    next_values.rows = (const char *)v_cache + element * h * head_dim;
    const void *keys[CHUNK], *values[CHUNK];
    for (int t = 0; t < count; t++) {
        keys[t] = (const char *)k_cache + slots[t] * row_bytes + element * h * head_dim;
        values[t] = (const char *)v_cache + slots[t] * row_bytes + element * h * head_dim;
    }
    int padded = (count + LANES - 1) / LANES * LANES;
    float scores[MAX_GROUP * CHUNK] __attribute__((aligned(64)));  /* [group][CHUNK] */
    chunk_scores(q, group, keys, count, head_dim, scale, scores, &next_keys, half);
    for (int g = 0; g < group; g++) {  /* each head's softmax within the chunk */
        float *partial = partials + (size_t)g * (head_dim + 2), *s = scores + g * CHUNK;
        for (int t = count; t < padded; t++) s[t] = -__builtin_inff();
        vecf tops = loadv_f32(s);  /* count >= 1 */
        for (int t = LANES; t < padded; t += LANES) {
            vecf x = loadv_f32(s + t);
            veci larger = x > tops;
            tops = (vecf)(((veci)x & larger) | ((veci)tops & ~larger));
        }
        float top = reduce_max(tops);
        vecf sum = {0};
        for (int t = 0; t < padded; t += LANES) {
            vecf e = exp_nonpositive(loadv_f32(s + t) - top);
            storev_f32(s + t, e);
            sum += e;
        }
        partial[0] = top;
        partial[1] = reduce_add(sum);
    }
    chunk_values(scores, group, values, count, head_dim, partials + 2, head_dim + 2, &next_values, half);
}

/* Keys read in chunk c of a run: each of its rows reads its own keys of the chunk. */
static int64_t chunk_keys(const Run *run, const int64_t *context_lens, int c) {
    int64_t keys = 0, first = (int64_t)c * CHUNK;
    for (int r = run->first; r < run->end; r++) {
        int64_t left = context_lens[r] - first;
        keys += left <= 0 ? 0 : left < CHUNK ? left : CHUNK;
    }
    return keys;
}

/* The index, over the runs' chunks in order, of the chunk boundary whose keys before it come
 * nearest `goal`. Thread t's stretch runs between the boundaries nearest t / threads and
 * (t + 1) / threads of all keys: split by keys, not by count of chunks, since a context's last
 * chunk is partial and the threads would otherwise wait for the one with more keys. */
static int stretch_boundary(const Run *runs, int num_runs, const int64_t *context_lens, int64_t goal) {
    int64_t before = 0;
    int index = 0;
    for (int u = 0; u < num_runs; u++)
        for (int c = 0; c < run_chunks(runs + u); c++, index++) {
            int64_t keys = chunk_keys(runs + u, context_lens, c);
            if (goal < before + keys) return goal - before <= before + keys - goal ? index : index + 1;
            before += keys;
        }
    return index;
}

/* The tasks split across the threads of the enclosing parallel region, ending in its barrier;
 * partials: attention_partials(...) floats, shared by the team. */
void paged_decode_attention_team(const float *q, const void *k_cache, const void *v_cache,
                                        const int64_t *block_tables, const int64_t *context_lens,
                                        float *out, int num_seqs, int num_heads, int num_kv_heads,
                                        int head_dim, int max_blocks, int block_size, float scale,
                                        int64_t longest, float *partials, int half, int each_thread) {
    int group = num_heads / num_kv_heads, chunks = (int)((longest + CHUNK - 1) / CHUNK);
    size_t task_floats = (size_t)group * (head_dim + 2);
    /* Runs of rows over one context (a verification's rows: each row's context the previous
     * row's and more, over the same blocks): a chunk's keys and values are read from memory once
     * for all of them, and each row computes what it computes alone. */
    Run *runs = malloc(sizeof(Run) * num_seqs);
    int num_runs = 0, total = 0;
    for (int r = 0; r < num_seqs; r++) {
        const int64_t *table = block_tables + (size_t)r * max_blocks;
        int joins = r > 0 && context_lens[r] >= context_lens[r - 1] &&
                    !memcmp(table - max_blocks, table, sizeof(int64_t) * ((context_lens[r - 1] + block_size - 1) / block_size));
        if (!joins) runs[num_runs++].first = r;
        Run *run = runs + num_runs - 1;  /* its context: its last row's, the longest */
        run->end = r + 1, run->table = table, run->keys = context_lens[r];
    }
    for (int u = 0; u < num_runs; u++) total += run_chunks(runs + u);
    /* The runs' chunks, in order, in one contiguous stretch per thread (while it computes a
     * chunk, a thread prefetches its next), the stretches about equal in keys read. */
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t all = 0;  /* keys read: each row reads its whole context */
    for (int r = 0; r < num_seqs; r++) all += context_lens[r];
    int begin = stretch_boundary(runs, num_runs, context_lens, all * t / threads);
    int end = t + 1 == threads ? total : stretch_boundary(runs, num_runs, context_lens, all * (t + 1) / threads);
    int u = 0, c = begin;  /* chunk `begin`: run u's chunk c */
    while (u < num_runs && c >= run_chunks(runs + u)) c -= run_chunks(runs + u++);
    Ahead ahead[2];  /* chunk i's rows: ahead[i % 2]; none until chunk_rows fills one */
    ahead[0].count = ahead[1].count = 0;
    if (begin < end) chunk_rows(ahead + begin % 2, runs + u, c, block_size);
    for (int i = begin; i < end; i++) {
        Ahead *current = ahead + i % 2, *next = ahead + (i + 1) % 2;
        const Run *run = runs + u;
        int chunk = c;
        for (c++; u < num_runs && c >= run_chunks(runs + u); c = 0) u++;  /* the next chunk */
        next->count = 0;  /* the stretch's last chunk: nothing to prefetch */
        if (i + 1 < end) chunk_rows(next, runs + u, c, block_size);
        for (int r = run->first; r < run->end; r++) {
            int64_t left = context_lens[r] - (int64_t)chunk * CHUNK;  /* this row's keys in the chunk */
            if (left <= 0) continue;
            for (int h = 0; h < num_kv_heads; h++)
                attention_chunk(q + ((size_t)r * num_heads + (size_t)h * group) * head_dim, k_cache, v_cache,
                                current->slots, left < CHUNK ? (int)left : CHUNK, h, group, num_kv_heads,
                                head_dim, scale, partials + ((size_t)(r * num_kv_heads + h) * chunks + chunk) * task_floats, next, half);
        }
    }
    free(runs);
    _Pragma("omp barrier")
    /* Merge each query head's chunks: split across the threads, or (each_thread) every row by
     * each thread into its own `out`, which saves the barrier after the merge. */
    int rows = num_seqs * num_heads, share = each_thread ? rows : (rows + threads - 1) / threads;
    int first_row = each_thread ? 0 : omp_get_thread_num() * share;
    int last_row = first_row + share < rows ? first_row + share : rows;
    for (int row = first_row; row < last_row; row++) {
        int s = row / num_heads, h = row % num_heads / group, g = row % group;
        int used = (int)((context_lens[s] + CHUNK - 1) / CHUNK);
        const float *first = partials + ((size_t)(s * num_kv_heads + h) * chunks) * task_floats + (size_t)g * (head_dim + 2);
        float top = -__builtin_inff(), total = 0.0f, *o = out + (size_t)row * head_dim;
        for (int c = 0; c < used; c++) top = first[c * task_floats] > top ? first[c * task_floats] : top;
        for (int d = 0; d < head_dim; d++) o[d] = 0.0f;
        for (int c = 0; c < used; c++) {
            const float *p = first + c * task_floats;
            float weight = __builtin_expf(p[0] - top);
            total += weight * p[1];
            for (int d = 0; d < head_dim; d++) o[d] += weight * p[2 + d];
        }
        for (int d = 0; d < head_dim; d++) o[d] /= total;
    }
    if (!each_thread) {
        _Pragma("omp barrier")
    }
}

/* The longest of the contexts (at least 1): the chunks each row's partials have room for. */
int64_t longest_context(const int64_t *context_lens, int num_seqs) {
    int64_t longest = 1;
    for (int s = 0; s < num_seqs; s++) longest = context_lens[s] > longest ? context_lens[s] : longest;
    return longest;
}

/* Decode attention (above) in a parallel region of its own, with partials of its own. */
void ragspeed_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                                     const int64_t *block_tables, const int64_t *context_lens,
                                     float *out, int num_seqs, int num_heads, int num_kv_heads,
                                     int head_dim, int max_blocks, int block_size, float scale,
                                     int half, int num_threads) {
    int64_t longest = longest_context(context_lens, num_seqs);
    float *partials = malloc(sizeof(float) * attention_partials(num_seqs, num_heads, head_dim, longest));
    _Pragma("omp parallel num_threads(num_threads)")
    paged_decode_attention_team(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs,
                                num_heads, num_kv_heads, head_dim, max_blocks, block_size, scale,
                                longest, partials, half, 0);
    free(partials);
}
