/* The kernels' exported functions: every source (kernels.c, gemm_int8.c) includes this header, so
 * the compiler checks each definition against its prototype, and build.py reads the ctypes
 * signatures from it.
 *
 * Its fixed style (what build.py's parser reads): one prototype per declaration, ending in `);`,
 * its return type `void` or `int`, each parameter a pointer or one of `int`, `int64_t`, `float`.
 */
#ifndef RAGSPEED_KERNELS_H
#define RAGSPEED_KERNELS_H

#include <stdint.h>

typedef uint16_t f16; /* fp16 values (their bits) */
typedef struct Model Model;

void ragspeed_to_f16(const float *src, f16 *dst, int n);
int ragspeed_int8_group(void);
void ragspeed_gemv_f32(const float *w, const float *bias, const float *x, float *y,
                       int m, int n, int k, int num_threads);
void ragspeed_gemv_i8(const int8_t *w, const f16 *scale, const float *bias, const float *x,
                      float *y, int m, int n, int k, int num_threads);
void ragspeed_gemv_q4(const uint8_t *w, const f16 *scale, const float *bias, const float *x,
                      float *y, int m, int n, int k, int num_threads);
void ragspeed_gemv_q4k(const uint8_t *w, const float *scale, const float *bias, const float *x,
                       float *y, int m, int n, int k, int num_threads);
void ragspeed_gemv_q6k(const int8_t *w, const float *scale, const float *bias, const float *x,
                       float *y, int m, int n, int k, int num_threads);
void ragspeed_gemv_kmix(const int8_t *w, const float *scale, const float *bias, const float *x,
                        float *y, int m, int n, int k, int num_threads);
void ragspeed_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                                     const int64_t *block_tables, const int64_t *context_lens,
                                     float *out, int num_seqs, int num_heads, int num_kv_heads,
                                     int head_dim, int max_blocks, int block_size, float scale,
                                     int half, int num_threads);
void ragspeed_add_rms_norm(float *x, const float *residual, const float *weight, float *out,
                           int rows, int dim, float eps, int num_threads);
void ragspeed_argmax(const float *x, int m, int n, int stride, int64_t *out);
void ragspeed_place_kv(const f16 *kv, const float *rotation, const int64_t *slots, void *pool,
                       int num_layers, int n, int num_kv_heads, int head_dim, int64_t num_slots,
                       int half, int num_threads);
void ragspeed_decode_forward(const Model *model, void *const *k_caches, void *const *v_caches,
                             const int64_t *ids, float *x, float *out, float *logits,
                             const float *rotations, const int64_t *slots,
                             const int64_t *block_tables, const int64_t *context_lens,
                             int max_blocks, int block_size, int m, int kv_half, int num_threads);
void ragspeed_greedy_steps(const Model *model, const float *rotation_table, int vocab,
                           const int64_t *d2t, void *const *k_caches, void *const *v_caches,
                           const int64_t *block_tables, int max_blocks, int block_size, int kv_half, int m,
                           const int64_t *fed, const int32_t *num_fed, const int64_t *positions,
                           const int32_t *num_steps, float min_confidence, int64_t *drafts,
                           int32_t *counts, int max_steps, int num_threads);
void ragspeed_quantize_q8(const float *x, int m, int k, int8_t *xq, float *xs, float *xsum,
                          int num_threads);
void ragspeed_gemm_u4q8(const uint8_t *w, const float *scale, const float *bias, const int8_t *xq,
                        const float *xs, const float *xsum, float *y, int m, int n, int k,
                        int num_threads);
void ragspeed_gemm_u4f32(const uint8_t *w, const float *scale, const float *bias, const float *x,
                         float *y, int m, int n, int k, int num_threads);
void ragspeed_gemm_u4i16(const uint8_t *w, const float *scale, const float *bias, const float *x,
                         float *y, int m, int n, int k, int num_threads);
int ragspeed_u4q8_isa(void);

#endif
