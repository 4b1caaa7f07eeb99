/* The kernels' vectors and what every source does with them: fp32 and fp16 loads and stores
 * (the int8 weights' scales, the KV pool's rows), a KV row's write, the sum of a vector's lanes,
 * e^x, the larger of two vectors, rounding to integers and a broadcast. All `static inline`, so each source compiles them into its own loops:
 * nothing here is exported (build.py binds kernels.h's functions).
 *
 * GCC vector extensions, with intrinsics where the generic code is slow: -march=native picks
 * AVX-512, AVX2 or SSE.
 */
#ifndef RAGSPEED_VECTOR_H
#define RAGSPEED_VECTOR_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "kernels_common.h"

/* The kernels' vectors: one register each. A block's 16 columns are H of them (AVX-512: one of
 * 16 floats; AVX2 and others: two of 8). GCC's generic 16-float vectors would work too, but on
 * AVX2 it moves them through the stack, several times slower. */
#if defined(__AVX512F__)
typedef float vecf __attribute__((vector_size(64)));
#define H 1
#else
typedef float vecf __attribute__((vector_size(32)));
#define H 2
#endif
#define LANES (BLOCK / H)
typedef int32_t veci __attribute__((vector_size(sizeof(vecf))));  /* masks of vecf's lanes */

static inline vecf loadv_f32(const float *p) {
    vecf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void storev_f32(float *p, vecf v) { memcpy(p, &v, sizeof v); }
/* fp16 values (their bits) widened to fp32: the int8 weights' group scales. */
static inline float f16_to_f32(f16 h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float magnitude;
    if (exponent == 0) /* zero or subnormal: mantissa * 2^-24 */
        magnitude = (float)mantissa * (1.0f / 16777216.0f);
    else if (exponent == 31) /* inf or NaN */
        magnitude = mantissa ? __builtin_nanf("") : __builtin_inff();
    else {
        uint32_t bits = ((exponent + 112) << 23) | (mantissa << 13);
        memcpy(&magnitude, &bits, sizeof magnitude);
    }
    uint32_t bits;
    memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
    memcpy(&magnitude, &bits, sizeof bits);
    return magnitude;
}
static inline vecf loadv_f16(const f16 *p) {
#if defined(__AVX512F__)
    return (vecf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__F16C__)
    return (vecf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vecf v;
    for (int i = 0; i < LANES; i++) v[i] = f16_to_f32(p[i]);
    return v;
#endif
}
/* fp32 to fp16 bits, rounded to nearest even (as F16C's conversion). */
static inline f16 f32_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000, magnitude = bits & 0x7fffffff;
    if (magnitude > 0x7f800000) return (f16)(sign | 0x7e00); /* NaN */
    if (magnitude >= 0x477ff000) return (f16)(sign | 0x7c00); /* 65520 and up round to inf */
    if (magnitude < 0x38800000) { /* below 2^-14: a subnormal, mantissa * 2^-24 */
        float m;
        memcpy(&m, &magnitude, sizeof m);
        return (f16)(sign | (uint32_t)__builtin_rintf(m * 16777216.0f));
    }
    uint32_t rounded = magnitude + 0xfff + ((magnitude >> 13) & 1);
    return (f16)(sign | ((rounded - 0x38000000) >> 13));
}
static inline void storev_f16(f16 *p, vecf v) {
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__AVX2__) && defined(__F16C__)
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int i = 0; i < LANES; i++) p[i] = f32_to_f16(v[i]);
#endif
}

/* KV cache rows: fp32, or fp16 where `half` (the pool's dtype, chosen at start-up). */
static inline vecf load_kv(const void *row, int d, int half) {
    return half ? loadv_f16((const f16 *)row + d) : loadv_f32((const float *)row + d);
}
static inline float kv_at(const void *row, int d, int half) {
    return half ? f16_to_f32(((const f16 *)row)[d]) : ((const float *)row)[d];
}
/* src [count] into the row at element `offset` of a cache. */
static inline void put_kv(void *cache, size_t offset, const float *src, int count, int half) {
    if (!half) {
        memcpy((float *)cache + offset, src, sizeof(float) * count);
        return;
    }
    f16 *dst = (f16 *)cache + offset;
    int d = 0;
    for (; d + LANES <= count; d += LANES) storev_f16(dst + d, loadv_f32(src + d));
    for (; d < count; d++) dst[d] = f32_to_f16(src[d]);
}

/* The sum of v's lanes, added in pairs (AVX2: the two halves, then within each). */
static inline float reduce_add(vecf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

/* The largest of v's lanes. */
static inline float reduce_max(vecf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX__)
    __m128 s = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
#else
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
#endif
}

/* e^x for x <= 0 (scores minus their maximum), a vector at a time: x = n ln2 + r, |r| <= ln2 / 2,
 * e^r by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n put in the exponent bits. */
static inline vecf exp_nonpositive(vecf x) {
    const vecf lowest = (vecf){0} - 87.0f;  /* e^-87 is near FLT_MIN; below, 0 */
    veci underflow = x < lowest;
    x = (vecf)(((veci)x & ~underflow) | ((veci)lowest & underflow));
    const vecf shifter = (vecf){0} + 12582912.0f;  /* 1.5 * 2^23: rounds to an integer */
    vecf n = (x * 1.44269504f + shifter) - shifter;
    vecf r = x - n * 0.693145752f - n * 1.42860677e-6f;
    vecf p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    veci two_n = (__builtin_convertvector(n, veci) + 127) << 23;
    return (vecf)((veci)(p * (vecf)two_n) & ~underflow);
}

/* 2^x for x <= 0 (base-2 scores minus their maximum), a vector at a time: x = n + r, |r| <= 1/2,
 * 2^r = e^(r ln2) by its degree-6 Taylor polynomial (relative error < 2e-7), times 2^n (AVX-512:
 * scalef, 0 below the smallest float; else n put in the exponent bits, 0 below 2^-126). */
static inline vecf exp2_nonpositive(vecf x) {
#if defined(__AVX512F__)
    __m512 n = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const vecf lowest = (vecf){0} - 126.0f;
    veci underflow = x < lowest;
    x = (vecf)(((veci)x & ~underflow) | ((veci)lowest & underflow));
    const vecf shifter = (vecf){0} + 12582912.0f; /* 1.5 * 2^23: rounds to an integer */
    vecf n = (x + shifter) - shifter;
#endif
    vecf r = x - (vecf)n;
    vecf p = 1.0f + r * (0.693147181f + r * (0.240226507f + r * (0.0555041087f + r * (0.00961812911f +
             r * (0.00133335581f + r * 0.000154035304f)))));
#if defined(__AVX512F__)
    return (vecf)_mm512_scalef_ps((__m512)p, n);
#else
    veci two_n = (__builtin_convertvector(n, veci) + 127) << 23;
    return (vecf)((veci)(p * (vecf)two_n) & ~underflow);
#endif
}

/* Each lane's larger of a and b (a where b is NaN), and |x|. */
static inline vecf larger(vecf a, vecf b) {
    veci b_larger = b > a;
    return (vecf)(((veci)b & b_larger) | ((veci)a & ~b_larger));
}
static inline vecf magnitude(vecf x) { return (vecf)((veci)x & 0x7fffffff); }

/* x rounded to the nearest integer (ties to even: the default rounding mode), in int32 lanes. */
static inline veci round_to_int(vecf x) {
#if defined(__AVX512F__)
    return (veci)_mm512_cvtps_epi32((__m512)x);
#elif defined(__AVX__)
    return (veci)_mm256_cvtps_epi32((__m256)x);
#else
    veci r;
    for (int i = 0; i < LANES; i++) r[i] = (int32_t)__builtin_rintf(x[i]);
    return r;
#endif
}

/* A vector of x in every lane. */
static inline vecf splat(float x) {
#if defined(__AVX512F__)
    return (vecf)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (vecf)_mm256_set1_ps(x);
#else
    vecf v;
    for (int i = 0; i < LANES; i++) v[i] = x;
    return v;
#endif
}

#endif
