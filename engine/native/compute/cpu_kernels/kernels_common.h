/* What the kernel sources share (gemv.c, gemv_gguf.c: decode products; gemm_int8.c: prefill
 * products on the file's blocks): the column block, the input group, a block's store,
 * and the rounding of input rows to int16 per group. Internal: no exported function here
 * (build.py binds those of kernels.h).
 */
#ifndef RAGSPEED_KERNELS_COMMON_H
#define RAGSPEED_KERNELS_COMMON_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stddef.h>
#include <stdint.h>

#define BLOCK 16 /* output columns of a weight block */
#define GROUP 32 /* inputs that share one step (weights' and rows' rounding) */

#if defined(__AVX512VNNI__)
/* acc += vpdpwssd(a, b): the pairwise products of a's and b's int16 pairs added into acc's int32
 * lanes. GCC 12 copies the accumulator of _mm512_dpwssd_epi32 in and out of its register around
 * every call once the accumulators fill the registers (0.72x); asm keeps it there. */
#define DPWSSD_512(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#endif

/* y[first:first+16] = sums + bias (bias padded to whole blocks), the last block only up to n. */
static inline void store_sums(float *y, const float *sums, const float *bias, int first, int n) {
    int count = n - first < BLOCK ? n - first : BLOCK;
    for (int i = 0; i < count; i++) y[first + i] = sums[i] + (bias ? bias[first + i] : 0.0f);
}

/* One whole group of GROUP inputs to int16 at `inverse` (32767 / its largest magnitude): the
 * rounded values into q, their sum returned. The vector versions round as rintf does (to nearest,
 * ties to even: the default rounding mode) and sum exactly, so every version gives the same. */
#if defined(__AVX512F__)
static inline float group_amax(const float *x) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 a = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(x), magnitude),
                             _mm512_and_ps(_mm512_loadu_ps(x + 16), magnitude));
    return _mm512_reduce_max_ps(a);
}
static inline int32_t group_round(const float *x, float inverse, int16_t *q) {
    __m512 scale = _mm512_set1_ps(inverse);
    __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), scale));
    __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), scale));
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtepi32_epi16(a));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtepi32_epi16(b));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}
#endif
/* The same over the first `count` inputs of a group, in plain C (the last group of an odd-sized
 * row, and every group without AVX-512). */
static inline float inputs_amax(const float *x, int count) {
    float amax = 0.0f;
    for (int i = 0; i < count; i++) {
        float a = __builtin_fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}
static inline int32_t inputs_round(const float *x, float inverse, int16_t *q, int count) {
    int32_t sum = 0;
    for (int i = 0; i < count; i++) sum += q[i] = (int16_t)__builtin_rintf(x[i] * inverse);
    return sum;
}
#if !defined(__AVX512F__)
static inline float group_amax(const float *x) { return inputs_amax(x, GROUP); }
static inline int32_t group_round(const float *x, float inverse, int16_t *q) { return inputs_round(x, inverse, q, GROUP); }
#endif

/* x [m, k] per group: xq [m][groups * GROUP] int16 (zero beyond k), xs [m][groups] fp32;
 * xsum [m][groups] (unless NULL) each group's sum of xq times its xs, for the 4-bit products. */
static inline void quantize_rows(const float *x, int m, int k, int16_t *xq, float *xs, float *xsum) {
    int groups = (k + GROUP - 1) / GROUP;
    for (int r = 0; r < m; r++)
        for (int g = 0; g < groups; g++) {
            const float *xg = x + (size_t)r * k + g * GROUP;
            int16_t *qg = xq + ((size_t)r * groups + g) * GROUP;
            int count = k - g * GROUP < GROUP ? k - g * GROUP : GROUP;
            int whole = count == GROUP;
            float amax = whole ? group_amax(xg) : inputs_amax(xg, count);
            float inverse = amax > 0.0f ? 32767.0f / amax : 0.0f;
            int32_t sum = whole ? group_round(xg, inverse, qg) : inputs_round(xg, inverse, qg, count);
            for (int i = count; i < GROUP; i++) qg[i] = 0;
            xs[(size_t)r * groups + g] = amax / 32767.0f;
            if (xsum) xsum[(size_t)r * groups + g] = (float)sum * (amax / 32767.0f);
        }
}

#endif
