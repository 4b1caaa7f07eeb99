/* Prefill attention straight from the paged KV pool: a chunk of queries over its whole context,
 * causal, in the blocked form of flash attention.
 *
 * q [n, num_heads, head_dim] are the last n positions of a context of num_cached + n keys; the
 * keys and values are in caches [num_slots, num_kv_heads, head_dim] (fp32, or fp16 where `half`)
 * at the slots of `block_table`; out [n, num_heads, head_dim]. Query i sees keys 0 ..
 * num_cached + i. chunk_attention (SDPA's flash kernel; engine/native/compute/attention.py) is
 * the reference.
 *
 * First the context is packed per KV head, fp32, in tiles of KEY_TILE keys: the keys transposed
 * ([head_dim][KEY_TILE], so scores are outer products of a query element and a vector of keys)
 * and the values as rows. Then each task, one KV head over a tile of query positions (the rows:
 * every position by the head's group of query heads, which share its keys), runs over the key
 * tiles up to its last row's position: the tile's scores (rows by keys, the rows MR at a time
 * with their sums in registers), each row's running maximum, sum and rescaled output (online
 * softmax), and the output's sum of the tile's values weighted by the exponentials. Only the
 * tiles that reach past a row's position are masked; the padding past the context is masked
 * with them (its values are zeros, never garbage times zero).
 *
 * A task's result depends only on its rows' context, not on the thread that runs it, nor on the
 * chunking into tasks: each score and output element adds its terms in one fixed order.
 */
#include <omp.h>
#include <stdlib.h>

#include "internal.h"
#include "vector.h"

#define KEY_TILE 64
#define ROW_TILE 48 /* rows of a task at most: positions times the group's query heads */
#define MAX_HEAD_DIM 256
#define MR 6 /* rows whose sums stay in registers together */
/* Vectors of keys (scores) or of the output's elements (values) per row in the registers:
 * AVX-512, 6 x 4 sums of 32 registers; AVX2, 6 x 2 of 16. */
#define VECS (H == 1 ? 4 : 2)

/* Tile `tile` of KV head h: keys_t [head_dim][KEY_TILE] and values [KEY_TILE][head_dim], fp32,
 * zeros past the context's `keys`. */
static void pack_tile(const void *k_cache, const void *v_cache, const int64_t *block_table, int block_size,
                      int64_t keys, int tile, int h, int num_kv_heads, int head_dim, int half, float *keys_t,
                      float *values) {
    size_t element = half ? sizeof(f16) : sizeof(float), row = (size_t)num_kv_heads * head_dim;
    float key[MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int t = 0; t < KEY_TILE; t++) {
        int64_t p = (int64_t)tile * KEY_TILE + t;
        float *value = values + (size_t)t * head_dim;
        if (p >= keys) {
            for (int d = 0; d < head_dim; d++) keys_t[(size_t)d * KEY_TILE + t] = value[d] = 0.0f;
            continue;
        }
        size_t offset = ((size_t)block_table[p / block_size] * block_size + p % block_size) * row + (size_t)h * head_dim;
        const char *k_row = (const char *)k_cache + offset * element, *v_row = (const char *)v_cache + offset * element;
        for (int d = 0; d < head_dim; d += LANES) { /* head_dim is whole vectors */
            storev_f32(key + d, load_kv(k_row, d, half));
            storev_f32(value + d, load_kv(v_row, d, half));
        }
        for (int d = 0; d < head_dim; d++) keys_t[(size_t)d * KEY_TILE + t] = key[d];
    }
}

/* s [mr][KEY_TILE] = q [mr][head_dim] . keys_t: for each vector of keys, each query element
 * broadcast once and multiplied into every key of it. */
static inline __attribute__((always_inline)) void tile_scores(const float *q, int mr, const float *keys_t,
                                                              int head_dim, float *s) {
    for (int n = 0; n < KEY_TILE; n += VECS * LANES) {
        vecf acc[MR][VECS];
        _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) acc[m][v] = (vecf){0};
        for (int d = 0; d < head_dim; d++) {
            vecf k[VECS];
            _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) k[v] = loadv_f32(keys_t + (size_t)d * KEY_TILE + n + v * LANES);
            _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++) {
                vecf b = splat(q[(size_t)m * head_dim + d]);
                _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) acc[m][v] += b * k[v];
            }
        }
        _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) storev_f32(s + m * KEY_TILE + n + v * LANES, acc[m][v]);
    }
}

/* o [mr][head_dim] += p [mr][KEY_TILE] . values [KEY_TILE][head_dim], over the first `count`
 * keys: for each vector of the output, each weight broadcast once. */
static inline __attribute__((always_inline)) void tile_values(const float *p, int mr, const float *values,
                                                              int count, int head_dim, float *o) {
    int d = 0;
    for (; d + VECS * LANES <= head_dim; d += VECS * LANES) {
        vecf acc[MR][VECS];
        _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) acc[m][v] = loadv_f32(o + (size_t)m * head_dim + d + v * LANES);
        for (int t = 0; t < count; t++) {
            vecf x[VECS];
            _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) x[v] = loadv_f32(values + (size_t)t * head_dim + d + v * LANES);
            _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++) {
                vecf w = splat(p[m * KEY_TILE + t]);
                _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) acc[m][v] += w * x[v];
            }
        }
        _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) storev_f32(o + (size_t)m * head_dim + d + v * LANES, acc[m][v]);
    }
    for (; d < head_dim; d += LANES) { /* head_dim is whole vectors (prefill_kernel_applies) */
        vecf acc[MR];
        _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++) acc[m] = loadv_f32(o + (size_t)m * head_dim + d);
        for (int t = 0; t < count; t++) {
            vecf x = loadv_f32(values + (size_t)t * head_dim + d);
            _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++) acc[m] += splat(p[m * KEY_TILE + t]) * x;
        }
        _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++) storev_f32(o + (size_t)m * head_dim + d, acc[m]);
    }
}

/* The rows MR at a time, the last few as many as are left (a constant in each copy). */
#define BY_ROWS(rows, call)                                          \
    for (int m0 = 0; m0 < (rows); m0 += MR) {                        \
        switch ((rows) - m0 < MR ? (rows) - m0 : MR) {               \
        case 6: call(m0, 6); break;                                  \
        case 5: call(m0, 5); break;                                  \
        case 4: call(m0, 4); break;                                  \
        case 3: call(m0, 3); break;                                  \
        case 2: call(m0, 2); break;                                  \
        default: call(m0, 1); break;                                 \
        }                                                            \
    }

/* Softmax's running state over one tile's scores s (base 2: the queries carry log2(e)) of a row
 * that sees keys up to `limit` (an index within the tile, KEY_TILE - 1 or more: none masked): the
 * scores become the weights, the row's maximum and sums (a vector, added up at the end) move on,
 * and its output is rescaled to the new maximum. */
static void online_softmax(float *s, int limit, float *top, vecf *sum, float *o, int head_dim) {
    for (int t = limit + 1 < 0 ? 0 : limit + 1; t < KEY_TILE; t++) s[t] = -__builtin_inff();
    vecf tops = loadv_f32(s);
    for (int t = LANES; t < KEY_TILE; t += LANES) {
        vecf x = loadv_f32(s + t);
        veci larger = x > tops;
        tops = (vecf)(((veci)x & larger) | ((veci)tops & ~larger));
    }
    float next = reduce_max(tops);
    next = next > *top ? next : *top;
    vecf total = {0}, shift = splat(next);
    for (int t = 0; t < KEY_TILE; t += LANES) {
        vecf e = exp2_nonpositive(loadv_f32(s + t) - shift);
        storev_f32(s + t, e);
        total += e;
    }
    if (next > *top) { /* the first tile (top = -inf) has key 0, never masked: next is finite */
        vecf factor = splat(__builtin_exp2f(*top - next));
        for (int d = 0; d < head_dim; d += LANES) storev_f32(o + d, loadv_f32(o + d) * factor);
        *sum *= factor;
    }
    *sum += total;
    *top = next;
}

/* One task: KV head h over query positions [first, first + positions) of the chunk. */
static void attend_rows(const float *q, float *out, const float *packed, int first, int positions,
                        int64_t num_cached, int h, int group, int num_heads, int head_dim, float scale,
                        int tiles) {
    float queries[ROW_TILE * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float o[ROW_TILE * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float s[ROW_TILE * KEY_TILE] __attribute__((aligned(64)));
    float top[ROW_TILE];
    vecf sum[ROW_TILE];
    int rows = positions * group;
    for (int r = 0; r < rows; r++) { /* row r: position first + r / group, query head r % group */
        const float *row = q + ((size_t)(first + r / group) * num_heads + (size_t)h * group + r % group) * head_dim;
        for (int d = 0; d < head_dim; d++) queries[r * head_dim + d] = row[d] * (scale * 1.44269504f);
        for (int d = 0; d < head_dim; d++) o[r * head_dim + d] = 0.0f;
        top[r] = -__builtin_inff(), sum[r] = (vecf){0};
    }
    const float *head = packed + (size_t)h * tiles * 2 * KEY_TILE * head_dim;
    int64_t last = num_cached + first + positions - 1; /* the last row's last key */
    for (int tile = 0; tile <= last / KEY_TILE; tile++) {
        const float *keys_t = head + (size_t)tile * 2 * KEY_TILE * head_dim, *values = keys_t + KEY_TILE * head_dim;
        int64_t start = (int64_t)tile * KEY_TILE;
        int count = last - start + 1 < KEY_TILE ? (int)(last - start + 1) : KEY_TILE;
#define SCORES(m0, mr) tile_scores(queries + (m0) * head_dim, mr, keys_t, head_dim, s + (m0) * KEY_TILE)
        BY_ROWS(rows, SCORES)
        for (int r = 0; r < rows; r++) {
            int64_t limit = num_cached + first + r / group - start;
            online_softmax(s + r * KEY_TILE, limit < KEY_TILE ? (int)limit : KEY_TILE, top + r, sum + r,
                           o + r * head_dim, head_dim);
        }
#define VALUES(m0, mr) tile_values(s + (m0) * KEY_TILE, mr, values, count, head_dim, o + (m0) * head_dim)
        BY_ROWS(rows, VALUES)
    }
    for (int r = 0; r < rows; r++) {
        float *row = out + ((size_t)(first + r / group) * num_heads + (size_t)h * group + r % group) * head_dim;
        float total = reduce_add(sum[r]);
        for (int d = 0; d < head_dim; d++) row[d] = o[r * head_dim + d] / total;
    }
}

/* Floats of the packed context of `keys` keys (every KV head's tiles). */
size_t prefill_attention_floats(int64_t keys, int num_kv_heads, int head_dim) {
    return (size_t)num_kv_heads * ((keys + KEY_TILE - 1) / KEY_TILE) * 2 * KEY_TILE * head_dim;
}

/* The packing and the tasks split across the threads of the enclosing parallel region, each
 * ending in its barrier; packed: prefill_attention_floats(num_cached + n, ...) floats, 64-byte
 * aligned, shared by the team. */
void prefill_attention_team(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                            float *out, int n, int64_t num_cached, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, int half, float *packed) {
    int64_t keys = num_cached + n;
    int tiles = (int)((keys + KEY_TILE - 1) / KEY_TILE), group = num_heads / num_kv_heads;
    int positions = ROW_TILE / group < 1 ? 1 : ROW_TILE / group;
    int per_head = (n + positions - 1) / positions, tasks = num_kv_heads * per_head;
    _Pragma("omp for schedule(static)") for (int i = 0; i < num_kv_heads * tiles; i++) {
        float *tile = packed + (size_t)i * 2 * KEY_TILE * head_dim;
        pack_tile(k_cache, v_cache, block_table, block_size, keys, i % tiles, i / tiles, num_kv_heads, head_dim,
                  half, tile, tile + KEY_TILE * head_dim);
    }
    /* The longest tasks (the last positions) first, so the threads end together. */
    _Pragma("omp for schedule(dynamic, 1)") for (int i = 0; i < tasks; i++) {
        int h = i % num_kv_heads, first = (per_head - 1 - i / num_kv_heads) * positions;
        int count = n - first < positions ? n - first : positions;
        attend_rows(q, out, packed, first, count, num_cached, h, group, num_heads, head_dim, scale, tiles);
    }
}

void ragspeed_prefill_attention(const float *q, const void *k_cache, const void *v_cache,
                                const int64_t *block_table, float *out, int n, int64_t num_cached,
                                int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                                int half, int num_threads) {
    float *packed = aligned_alloc(64, sizeof(float) * prefill_attention_floats(num_cached + n, num_kv_heads, head_dim));
    if (!packed) abort(); /* out of memory */
    _Pragma("omp parallel num_threads(num_threads)")
    prefill_attention_team(q, k_cache, v_cache, block_table, out, n, num_cached, num_heads, num_kv_heads, head_dim,
                           block_size, scale, half, packed);
    free(packed);
}
