/* The kernels' exported functions, and the structs and enum their Python callers fill in: every
 * source includes this header, so the compiler checks each definition against its prototype, and
 * build.py reads from it the ctypes signatures (`signatures`) and the ctypes structures and enum
 * values (`structures`, `enums`) that engine/native/compute/cpu_kernels/decoder.py passes.
 *
 * Its fixed style (what build.py's parser reads): one prototype per declaration, ending in `);`,
 * its return type `void` or `int`, each parameter a pointer or one of `int`, `int64_t`, `float`;
 * a struct as `typedef struct { fields } Name;`, each field declaration `type a, *b;` of a scalar
 * (`int`, `float`), pointers, or a struct declared above; an enum as `enum Name { A, B = 2 };`.
 */
#ifndef RAGSPEED_KERNELS_H
#define RAGSPEED_KERNELS_H

#include <stdint.h>

typedef uint16_t f16; /* fp16 values (their bits) */
/* A Linear's kind: the product that runs it. */
enum WeightKind { WEIGHT_FP32, WEIGHT_INT8, WEIGHT_Q4, WEIGHT_Q4K, WEIGHT_Q6K, WEIGHT_KMIX };

/* One projection, y [m, n] = x [m, k] @ W.T + bias, in the blocks of its kind. */
typedef struct {
    const void *w;      /* the blocks of its kind: ragspeed_gemv_f32, _i8, _q4, _q4k, _q6k or _kmix */
    const void *scale;  /* int8: group scales; 4-bit: steps and offsets (fp16; Q4_K fp32);
                           Q6_K: fp32 steps; mixed: fp32 steps and offsets; fp32: NULL */
    const float *bias;  /* padded to blocks, or NULL */
    int n, k, kind;     /* kind: a WeightKind */
} Linear;

/* A decoder layer: its norms' weights and its four projections. */
typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *qk_norm;                /* [num_heads + num_kv_heads, head_dim], or NULL */
    Linear qkv, o, gate_up, down;
} Layer;

/* The decoder stack that ragspeed_decode_forward and ragspeed_greedy_steps run. */
typedef struct {
    const Layer *layers; /* [num_layers] */
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps, scale;
    const float *final_norm; /* [hidden] */
    /* Token embeddings [vocab rows, hidden], looked up in the kernels (greedy steps, and a
     * forward given token ids): fp32 rows, or a GGUF file's Q8_0 rows (embed_q8, hidden / 32
     * blocks of an fp16 step and 32 int8 each); both NULL where Python looks them up. */
    const float *embed;
    const uint8_t *embed_q8;
    Linear lm_head; /* greedy steps and the forward's logits; zero where neither runs */
} Model;

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
void ragspeed_prefill_attention(const float *q, const void *k_cache, const void *v_cache,
                                const int64_t *block_table, float *out, int n, int64_t num_cached,
                                int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                                int half, int int16, int num_threads);
void ragspeed_add_rms_norm(float *x, const float *residual, const float *weight, float *out,
                           int rows, int dim, float eps, int num_threads);
void ragspeed_argmax(const float *x, int m, int n, int stride, int64_t *out);
void ragspeed_write_kv(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
                       void *k_cache, void *v_cache, int n, int row, int half, int num_threads);
void ragspeed_place_kv(const f16 *kv, const float *rotation, const int64_t *slots, void *pool,
                       int num_layers, int n, int num_kv_heads, int head_dim, int64_t num_slots,
                       int half, int num_threads);
void ragspeed_decode_forward(const Model *model, void *const *k_caches, void *const *v_caches,
                             const int64_t *ids, float *x, float *out, float *logits,
                             const float *rotations, const int64_t *slots,
                             const int64_t *block_tables, const int64_t *context_lens,
                             int max_blocks, int block_size, int m, int num_spans, const int32_t *span_rows,
                             int int16, int kv_half, int num_threads);
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
