/* Kernels that take each row of their input on its own: the residual add with RMSNorm, the argmax
 * of logits, a step's KV written into the pool, a document's stored KV placed into it, and the
 * fp16 rounding of the KV writes.
 */
#include <omp.h>

#include "internal.h"
#include "vector.h"

/* dst [n] = src [n] rounded to fp16 as the KV writes round (their test). */
void ragspeed_to_f16(const float *src, f16 *dst, int n) { put_kv(dst, 0, src, n, 1); }

/* The residual stream's add and RMSNorm in one pass per row: x [rows, dim] becomes x + residual
 * (when residual is not NULL), out [rows, dim] = that / sqrt(mean of its squares + eps) * weight.
 * Replaces the add and the six ops torch's rms_norm runs on a CPU. */
void add_rms_norm_row(float *x, const float *residual, const float *weight, float *out,
                             int r, int dim, float eps) {
    float *xr = x + (size_t)r * dim, *outr = out + (size_t)r * dim;
    if (residual) {
        const float *res = residual + (size_t)r * dim;
        for (int d = 0; d < dim; d++) xr[d] += res[d];
    }
    vecf squares = {0};
    int d = 0;
    for (; d + LANES <= dim; d += LANES) {
        vecf v = loadv_f32(xr + d);
        squares += v * v;
    }
    float sum = reduce_add(squares);
    for (; d < dim; d++) sum += xr[d] * xr[d];
    float inverse = 1.0f / __builtin_sqrtf(sum / dim + eps);
    for (d = 0; d < dim; d++) outr[d] = xr[d] * inverse * weight[d];
}

void ragspeed_add_rms_norm(float *x, const float *residual, const float *weight, float *out,
                           int rows, int dim, float eps, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(rows >= 64)")
    for (int r = 0; r < rows; r++) add_rms_norm_row(x, residual, weight, out, r, dim, eps);
}

/* The index of the largest of x[0:n], the first of equals (as torch.argmax): each lane keeps
 * its largest and where it was, then the lanes' first index among their largest wins. */
int64_t argmax_row(const float *x, int n) {
    int i = 0;
    float best_value = x[0];
    int64_t best = 0;
    if (n >= LANES) {
        vecf top = loadv_f32(x);
        veci at = {0}, lane = {0};
        for (int l = 0; l < LANES; l++) at[l] = lane[l] = l;
        for (i = LANES; i + LANES <= n; i += LANES) {
            vecf v = loadv_f32(x + i);
            veci larger = v > top;
            top = (vecf)(((veci)v & larger) | ((veci)top & ~larger));
            at = ((lane + i) & larger) | (at & ~larger);
        }
        best_value = top[0], best = at[0];
        for (int l = 1; l < LANES; l++)
            if (top[l] > best_value || (top[l] == best_value && at[l] < best)) best_value = top[l], best = at[l];
    }
    for (; i < n; i++)
        if (x[i] > best_value) best_value = x[i], best = i;
    return best;
}

/* out[r] = argmax_row of row r of x [m, stride], over its first n values. */
void ragspeed_argmax(const float *x, int m, int n, int stride, int64_t *out) {
    for (int r = 0; r < m; r++) out[r] = argmax_row(x + (size_t)r * stride, n);
}

/* A step's keys and values, rows of `row` floats (k's rows k_stride floats apart, v's v_stride),
 * into the pool's rows at `slots` (fp32, or fp16 where `half`, rounded as torch rounds): torch's
 * index_copy_ into an fp16 pool converts and copies one element at a time. */
void ragspeed_write_kv(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
                       void *k_cache, void *v_cache, int n, int row, int half, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(n >= 64)")
    for (int t = 0; t < n; t++) {
        put_kv(k_cache, (size_t)slots[t] * row, k + t * k_stride, row, half);
        put_kv(v_cache, (size_t)slots[t] * row, v + t * v_stride, row, half);
    }
}

/* A document's stored KV, fp16 kv [2][layers][n][row] (row = kv_heads * head_dim, pairs
 * adjacent, keys rotated at their stored position), into the pool's rows (fp32, or fp16 where
 * `half`) pool [2 * layers][num_slots][row] at `slots`, each key rotated on the way by the position
 * delta whose (cos, sin) per pair is rotation [head_dim / 2][2]: the store read once and the pool
 * written once (torch takes five passes: widen, rotate, widen the values, join, scatter). */
void ragspeed_place_kv(const f16 *kv, const float *rotation, const int64_t *slots, void *pool,
                       int num_layers, int n, int num_kv_heads, int head_dim, int64_t num_slots,
                       int half, int num_threads) {
    int row = num_kv_heads * head_dim;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) collapse(2)")
    for (int plane = 0; plane < 2 * num_layers; plane++)
        for (int t = 0; t < n; t++) {
            const f16 *src = kv + ((size_t)plane * n + t) * row;
            size_t offset = ((size_t)plane * num_slots + (size_t)slots[t]) * row;
            if (half && plane >= num_layers) {  /* values go as they are */
                memcpy((f16 *)pool + offset, src, sizeof(f16) * row);
                continue;
            }
            float widened[row];
            float *dst = half ? widened : (float *)pool + offset;
            int d = 0;
            for (; d + LANES <= row; d += LANES) storev_f32(dst + d, loadv_f16(src + d));
            for (; d < row; d++) dst[d] = f16_to_f32(src[d]);
            if (plane < num_layers)
                for (int h = 0; h < num_kv_heads; h++) {
                    float *pairs = dst + (size_t)h * head_dim;
                    for (int j = 0; j < head_dim / 2; j++) {
                        float x = pairs[2 * j], y = pairs[2 * j + 1], c = rotation[2 * j], s = rotation[2 * j + 1];
                        pairs[2 * j] = x * c - y * s;
                        pairs[2 * j + 1] = x * s + y * c;
                    }
                }
            if (half) put_kv(pool, offset, widened, row, 1);
        }
}
