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
 * With `int16` (an approximation: the engine's quality gate clears it per model) both products
 * are integer dot products at twice fp32's rate (VNNI's vpdpwssd, AVX2's vpmaddwd): each key,
 * each query (scaled) and each value rounded to int16 per vector, and each row's softmax weights
 * times its values' steps rounded per tile at the largest of them; pairs of int16s are
 * multiplied and added into int32 lanes, then scaled back by the steps. No int16 exceeds
 * qk_limit of its dot product's length, so the sums never leave int32 and are exact: about 12.5
 * bits at head_dim 64 and KEY_TILE 64, against the fp16 KV pool's 11-bit significands. The
 * softmax's sums stay fp32. Every step is that of a key, a query or a row's visible weights.
 *
 * A task's result depends only on its rows' context, not on the thread that runs it, nor on the
 * chunking into tasks: each score and output element adds its terms in one fixed order.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "vector.h"

#define KEY_TILE 64
#define ROW_TILE 48 /* rows of a task at most: positions times the group's query heads */
#define MAX_HEAD_DIM 256
#define MR 6 /* rows whose sums stay in registers together */
/* Vectors of keys (scores) or of the output's elements (values) per row in the registers:
 * AVX-512, 6 x 4 sums of 32 registers; AVX2, 6 x 2 of 16. */
#define VECS (H == 1 ? 4 : 2)

/* The largest magnitude of the int16s of a dot product of `length` pairs that stays within int32. */
static inline float qk_limit(int length) { return floorf(sqrtf(2147483647.0f / (float)length)); }

/* x [count] (whole vectors) rounded to int16 at limit / its largest magnitude, to nearest (ties
 * to even); returns the step, largest / limit (0 for a zero vector, all of whose values are 0). */
static float round_vector(const float *x, int count, float limit, int16_t *out) {
    vecf top = (vecf){0};
    for (int d = 0; d < count; d += LANES) top = larger(top, magnitude(loadv_f32(x + d)));
    float largest = reduce_max(top), inverse = largest > 0.0f ? limit / largest : 0.0f;
    for (int d = 0; d < count; d += LANES) {
        veci r = round_to_int(loadv_f32(x + d) * inverse);
        for (int i = 0; i < LANES; i++) out[d + i] = (int16_t)r[i];
    }
    return largest / limit;
}

/* Tile `tile` of KV head h: keys_t [head_dim][KEY_TILE] and values [KEY_TILE][head_dim], fp32,
 * zeros past the context's `keys`. With int16, keys_t holds instead the keys as int16 pairs,
 * [head_dim / 2][KEY_TILE] (elements 2j and 2j + 1 of a key in one 32-bit lane), then each key's
 * step and each value's step (KEY_TILE floats each), and values the values as int16 pairs,
 * [KEY_TILE / 2][head_dim] (element d of keys 2j and 2j + 1 in one lane). Every step is its own
 * vector's: a row's result depends on no key it does not see. */
static void pack_tile(const void *k_cache, const void *v_cache, const int64_t *block_table, int block_size,
                      int64_t keys, int tile, int h, int num_kv_heads, int head_dim, int half, int int16,
                      float *keys_t, float *values) {
    int32_t *pairs = (int32_t *)keys_t;
    float *steps = (float *)(pairs + (size_t)KEY_TILE * head_dim / 2), *value_steps = steps + KEY_TILE;
    float limit = qk_limit(head_dim), value_limit = qk_limit(KEY_TILE);
    size_t element = half ? sizeof(f16) : sizeof(float), row = (size_t)num_kv_heads * head_dim;
    float key[MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int t = 0; t < KEY_TILE; t++) {
        int64_t p = (int64_t)tile * KEY_TILE + t;
        float *value = values + (size_t)t * head_dim;
        if (p >= keys) {
            for (int d = 0; d < head_dim; d++) keys_t[(size_t)d * KEY_TILE + t] = value[d] = 0.0f;
            if (int16) steps[t] = 0.0f;
            continue;
        }
        size_t offset = ((size_t)block_table[p / block_size] * block_size + p % block_size) * row + (size_t)h * head_dim;
        const char *k_row = (const char *)k_cache + offset * element, *v_row = (const char *)v_cache + offset * element;
        for (int d = 0; d < head_dim; d += LANES) { /* head_dim is whole vectors */
            storev_f32(key + d, load_kv(k_row, d, half));
            storev_f32(value + d, load_kv(v_row, d, half));
        }
        if (int16) {
            int16_t rounded[MAX_HEAD_DIM];
            steps[t] = round_vector(key, head_dim, limit, rounded);
            for (int j = 0; j < head_dim / 2; j++) memcpy(pairs + (size_t)j * KEY_TILE + t, rounded + 2 * j, 4);
        } else
            for (int d = 0; d < head_dim; d++) keys_t[(size_t)d * KEY_TILE + t] = key[d];
    }
    if (int16) /* the values in place as int16 pairs of keys 2j and 2j + 1 */
        for (int j = 0; j < KEY_TILE / 2; j++) {
            const float *a = values + (size_t)(2 * j) * head_dim, *b = a + head_dim;
            float inverse[2];
            for (int i = 0; i < 2; i++) {
                vecf top = (vecf){0};
                for (int d = 0; d < head_dim; d += LANES) top = larger(top, magnitude(loadv_f32((i ? b : a) + d)));
                float largest = reduce_max(top);
                inverse[i] = largest > 0.0f ? value_limit / largest : 0.0f;
                value_steps[2 * j + i] = largest / value_limit;
            }
            for (int d = 0; d < head_dim; d += LANES) { /* row j's place: rows j and under are read */
                veci pair = (round_to_int(loadv_f32(a + d) * inverse[0]) & 0xffff) |
                            (round_to_int(loadv_f32(b + d) * inverse[1]) << 16);
                memcpy((int32_t *)values + (size_t)j * head_dim + d, &pair, sizeof pair);
            }
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

/* acc += the pairwise products of q's and k's int16 pairs, added a pair at a time into each
 * int32 lane (exact: qk_limit); asm where GCC would copy the accumulator (kernels_common.h). */
#if defined(__AVX512VNNI__) && H == 1
#define DOT_PAIRS(acc, q, k) DPWSSD_512(acc, q, k)
#elif defined(__AVX512BW__) && H == 1
#define DOT_PAIRS(acc, q, k) acc += (veci)_mm512_madd_epi16((__m512i)(q), (__m512i)(k))
#elif defined(__AVXVNNI__) && H == 2
#define DOT_PAIRS(acc, q, k) __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(q), "x"(k))
#elif defined(__AVX2__) && H == 2
#define DOT_PAIRS(acc, q, k) acc += (veci)_mm256_madd_epi16((__m256i)(q), (__m256i)(k))
#else
#define DOT_PAIRS(acc, q, k) acc += ((q) << 16 >> 16) * ((k) << 16 >> 16) + ((q) >> 16) * ((k) >> 16)
#endif

/* tile_scores in integers: the queries' int16 pairs q [head_dim / 2][ROW_TILE] (the pairs of a
 * row in a column, so that a row's broadcast is a fixed offset) with their steps qs [mr], the
 * keys' pairs and steps as pack_tile puts them. */
static inline __attribute__((always_inline)) void tile_scores_int(const int32_t *q, const float *qs, int mr,
                                                                  const int32_t *pairs, int head_dim, float *s) {
    const float *steps = (const float *)(pairs + (size_t)KEY_TILE * head_dim / 2);
    for (int n = 0; n < KEY_TILE; n += VECS * LANES) {
        veci acc[MR][VECS];
        _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) acc[m][v] = (veci){0};
        for (int j = 0; j < head_dim / 2; j++) {
            veci k[VECS];
            _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) memcpy(&k[v], pairs + (size_t)j * KEY_TILE + n + v * LANES, sizeof k[v]);
            _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++) {
                veci b = (veci){0} + q[(size_t)j * ROW_TILE + m];
                _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) DOT_PAIRS(acc[m][v], b, k[v]);
            }
        }
        _Pragma("GCC unroll 4") for (int v = 0; v < VECS; v++) {
            vecf step = loadv_f32(steps + n + v * LANES);
            _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++)
                storev_f32(s + m * KEY_TILE + n + v * LANES, __builtin_convertvector(acc[m][v], vecf) * (step * qs[m]));
        }
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

/* tile_values in integers over nv vectors of the output from element d: the rows' weights (times
 * their values' steps) as int16 pairs, each row's in its s (KEY_TILE floats apart), with their
 * steps ps [mr], and the values' pairs as pack_tile puts them. */
static inline __attribute__((always_inline)) void values_int(const float *p, const float *ps, int mr,
                                                             const int32_t *pairs, int count, int head_dim,
                                                             float *o, int d, int nv) {
    veci acc[MR][VECS];
    _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) acc[m][v] = (veci){0};
    for (int j = 0; j < (count + 1) / 2; j++) {
        veci x[VECS];
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) memcpy(&x[v], pairs + (size_t)j * head_dim + d + v * LANES, sizeof x[v]);
        _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++) {
            veci w = (veci){0} + ((const int32_t *)(p + m * KEY_TILE))[j];
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) DOT_PAIRS(acc[m][v], w, x[v]);
        }
    }
    _Pragma("GCC unroll 6") for (int m = 0; m < mr; m++) {
        vecf step = splat(ps[m]);
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
            float *out = o + (size_t)m * head_dim + d + v * LANES;
            storev_f32(out, loadv_f32(out) + __builtin_convertvector(acc[m][v], vecf) * step);
        }
    }
}
static inline __attribute__((always_inline)) void tile_values_int(const float *p, const float *ps, int mr,
                                                                  const int32_t *pairs, int count, int head_dim,
                                                                  float *o) {
    int d = 0;
    for (; d + VECS * LANES <= head_dim; d += VECS * LANES) values_int(p, ps, mr, pairs, count, head_dim, o, d, VECS);
    for (; d < head_dim; d += LANES) values_int(p, ps, mr, pairs, count, head_dim, o, d, 1);
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
 * and its output is rescaled to the new maximum. Given the keys' value_steps, the weights times
 * those become int16 pairs in the first half of s, rounded at *step (the largest / qk_limit). */
static void online_softmax(float *s, int limit, float *top, vecf *sum, float *o, int head_dim,
                           const float *value_steps, float *step) {
    for (int t = limit + 1 < 0 ? 0 : limit + 1; t < KEY_TILE; t++) s[t] = -__builtin_inff();
    vecf tops = loadv_f32(s);
    for (int t = LANES; t < KEY_TILE; t += LANES) tops = larger(tops, loadv_f32(s + t));
    float next = reduce_max(tops);
    next = next > *top ? next : *top;
    vecf total = {0}, shift = splat(next);
    if (value_steps) {
        vecf w[KEY_TILE / LANES], heaviest = {0};
        for (int t = 0; t < KEY_TILE / LANES; t++) {
            vecf e = exp2_nonpositive(loadv_f32(s + t * LANES) - shift);
            total += e;
            w[t] = e * loadv_f32(value_steps + t * LANES);
            heaviest = larger(heaviest, w[t]);
        }
        float largest = reduce_max(heaviest), weight_limit = qk_limit(KEY_TILE);
        vecf inverse = splat(largest > 0.0f ? weight_limit / largest : 0.0f);
        for (int t = 0; t < KEY_TILE / LANES; t++) {
            veci r = round_to_int(w[t] * inverse);
            for (int i = 0; i < LANES; i++) ((int16_t *)s)[t * LANES + i] = (int16_t)r[i];
        }
        *step = largest / weight_limit;
    } else
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
                        int tiles, int int16) {
    float queries[ROW_TILE * MAX_HEAD_DIM] __attribute__((aligned(64)));
    int32_t pairs[ROW_TILE * MAX_HEAD_DIM / 2] __attribute__((aligned(64)));
    float steps[ROW_TILE], weight_steps[ROW_TILE];
    float o[ROW_TILE * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float s[ROW_TILE * KEY_TILE] __attribute__((aligned(64)));
    float top[ROW_TILE];
    vecf sum[ROW_TILE];
    int rows = positions * group;
    for (int r = 0; r < rows; r++) { /* row r: position first + r / group, query head r % group */
        const float *row = q + ((size_t)(first + r / group) * num_heads + (size_t)h * group + r % group) * head_dim;
        for (int d = 0; d < head_dim; d++) queries[r * head_dim + d] = row[d] * (scale * 1.44269504f);
        if (int16) {
            int16_t rounded[MAX_HEAD_DIM];
            steps[r] = round_vector(queries + r * head_dim, head_dim, qk_limit(head_dim), rounded);
            for (int j = 0; j < head_dim / 2; j++) memcpy(pairs + j * ROW_TILE + r, rounded + 2 * j, 4);
        }
        for (int d = 0; d < head_dim; d++) o[r * head_dim + d] = 0.0f;
        top[r] = -__builtin_inff(), sum[r] = (vecf){0};
    }
    const float *head = packed + (size_t)h * tiles * 2 * KEY_TILE * head_dim;
    int64_t last = num_cached + first + positions - 1; /* the last row's last key */
    for (int tile = 0; tile <= last / KEY_TILE; tile++) {
        const float *keys_t = head + (size_t)tile * 2 * KEY_TILE * head_dim, *values = keys_t + KEY_TILE * head_dim;
        const float *value_steps = keys_t + KEY_TILE * head_dim / 2 + KEY_TILE; /* with int16: pack_tile */
        int64_t start = (int64_t)tile * KEY_TILE;
        int count = last - start + 1 < KEY_TILE ? (int)(last - start + 1) : KEY_TILE;
#define SCORES(m0, mr) tile_scores(queries + (m0) * head_dim, mr, keys_t, head_dim, s + (m0) * KEY_TILE)
#define INT_SCORES(m0, mr) \
    tile_scores_int(pairs + (m0), steps + (m0), mr, (const int32_t *)keys_t, head_dim, s + (m0) * KEY_TILE)
        if (int16)
            BY_ROWS(rows, INT_SCORES)
        else
            BY_ROWS(rows, SCORES)
        for (int r = 0; r < rows; r++) {
            int64_t limit = num_cached + first + r / group - start;
            online_softmax(s + r * KEY_TILE, limit < KEY_TILE ? (int)limit : KEY_TILE, top + r, sum + r,
                           o + r * head_dim, head_dim, int16 ? value_steps : NULL, weight_steps + r);
        }
#define VALUES(m0, mr) tile_values(s + (m0) * KEY_TILE, mr, values, count, head_dim, o + (m0) * head_dim)
#define INT_VALUES(m0, mr) \
    tile_values_int(s + (m0) * KEY_TILE, weight_steps + (m0), mr, (const int32_t *)values, count, head_dim, o + (m0) * head_dim)
        if (int16)
            BY_ROWS(rows, INT_VALUES)
        else
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
                            int block_size, float scale, int half, int int16, float *packed) {
    int64_t keys = num_cached + n;
    int tiles = (int)((keys + KEY_TILE - 1) / KEY_TILE), group = num_heads / num_kv_heads;
    int positions = ROW_TILE / group < 1 ? 1 : ROW_TILE / group;
    int per_head = (n + positions - 1) / positions, tasks = num_kv_heads * per_head;
    _Pragma("omp for schedule(static)") for (int i = 0; i < num_kv_heads * tiles; i++) {
        float *tile = packed + (size_t)i * 2 * KEY_TILE * head_dim;
        pack_tile(k_cache, v_cache, block_table, block_size, keys, i % tiles, i / tiles, num_kv_heads, head_dim,
                  half, int16, tile, tile + KEY_TILE * head_dim);
    }
    /* The longest tasks (the last positions) first, so the threads end together. */
    _Pragma("omp for schedule(dynamic, 1)") for (int i = 0; i < tasks; i++) {
        int h = i % num_kv_heads, first = (per_head - 1 - i / num_kv_heads) * positions;
        int count = n - first < positions ? n - first : positions;
        attend_rows(q, out, packed, first, count, num_cached, h, group, num_heads, head_dim, scale, tiles, int16);
    }
}

void ragspeed_prefill_attention(const float *q, const void *k_cache, const void *v_cache,
                                const int64_t *block_table, float *out, int n, int64_t num_cached,
                                int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                                int half, int int16, int num_threads) {
    float *packed = aligned_alloc(64, sizeof(float) * prefill_attention_floats(num_cached + n, num_kv_heads, head_dim));
    if (!packed) abort(); /* out of memory */
    _Pragma("omp parallel num_threads(num_threads)")
    prefill_attention_team(q, k_cache, v_cache, block_table, out, n, num_cached, num_heads, num_kv_heads, head_dim,
                           block_size, scale, half, int16, packed);
    free(packed);
}
