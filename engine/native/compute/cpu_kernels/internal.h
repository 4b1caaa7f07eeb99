/* The functions one kernel source defines and another calls (decoder.c runs the products,
 * attention, norm and argmax of the other sources inside its own parallel region). Hidden: the
 * library exports only kernels.h's functions, and calls to these within the library are direct.
 */
#ifndef RAGSPEED_INTERNAL_H
#define RAGSPEED_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#define INTERNAL __attribute__((visibility("hidden")))

/* gemv.c, gemv_gguf.c: y [m, n] = x [m, k] @ W.T + bias (each its kernels.h function's
 * arguments), the blocks split across the threads of the enclosing parallel region, ending in
 * its barrier. */
INTERNAL void gemv_f32_team(const float *w, const f16 *scale, const float *bias, const float *x,
                            float *y, int m, int n, int k);
INTERNAL void gemv_i8_team(const int8_t *w, const f16 *scale, const float *bias, const float *x,
                           float *y, int m, int n, int k);
INTERNAL void gemv_q4_team(const uint8_t *w, const f16 *scale, const float *bias, const float *x,
                           float *y, int m, int n, int k);
INTERNAL void gemv_q4k_team(const uint8_t *w, const float *scale, const float *bias, const float *x,
                            float *y, int m, int n, int k);
INTERNAL void gemv_q6k_team(const int8_t *w, const float *scale, const float *bias, const float *x,
                            float *y, int m, int n, int k);
INTERNAL void gemv_kmix_team(const int8_t *w, const float *scale, const float *bias, const float *x,
                             float *y, int m, int n, int k);

/* attention.c: ragspeed_paged_decode_attention's tasks split across the threads of the enclosing
 * parallel region (each_thread: every thread merges every row into its own `out`, no barrier
 * after), with `partials` of attention_partials(...) floats shared by the team and `longest`
 * the longest_context of context_lens. */
INTERNAL size_t attention_partials(int num_seqs, int num_heads, int head_dim, int64_t longest);
INTERNAL int64_t longest_context(const int64_t *context_lens, int num_seqs);
INTERNAL void paged_decode_attention_team(const float *q, const void *k_cache, const void *v_cache,
                                          const int64_t *block_tables, const int64_t *context_lens,
                                          float *out, int num_seqs, int num_heads, int num_kv_heads,
                                          int head_dim, int max_blocks, int block_size, float scale,
                                          int64_t longest, float *partials, int half, int each_thread);

/* prefill_attention.c: ragspeed_prefill_attention's packing and tasks split across the threads
 * of the enclosing parallel region, with `packed` of prefill_attention_floats(num_cached + n,
 * ...) floats shared by the team. */
INTERNAL size_t prefill_attention_floats(int64_t keys, int num_kv_heads, int head_dim);
INTERNAL void prefill_attention_team(const float *q, const void *k_cache, const void *v_cache,
                                     const int64_t *block_table, float *out, int n, int64_t num_cached,
                                     int num_heads, int num_kv_heads, int head_dim, int block_size,
                                     float scale, int half, int int16, float *packed);

/* rowwise.c: row r of ragspeed_add_rms_norm; ragspeed_argmax of one row. */
INTERNAL void add_rms_norm_row(float *x, const float *residual, const float *weight, float *out,
                               int r, int dim, float eps);
INTERNAL int64_t argmax_row(const float *x, int n);

#endif
