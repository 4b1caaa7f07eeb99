/* ragspeed's CPU decode kernels: products of a few rows with a weight in column blocks,
 * decode attention over the paged KV pool, and the residual add with RMSNorm.
 *
 * Products. A step of a few tokens reads every weight once, so its products are bound by memory
 * bandwidth. The weight W [n, k] is stored as blocks of 16 output columns, [n/16][k][16]:
 * one block is a contiguous stream that the kernel reads once, front to back, multiplying
 * each 16-wide row by one broadcast input element. Read this way a product streams at close
 * to the machine's read bandwidth; oneDNN's and MKL's one-row products read at about half of it
 * (`ragspeed bench engine` measures both).
 *
 * Every input row is accumulated the same way whatever the number of rows (two partial sums
 * over each group of inputs, added at its end), so a token's result does not depend on the
 * batch it ran in: speculative verification and batched decoding give the bits plain decoding gives.
 *
 * GCC vector extensions (and intrinsics for widening int8): -march=native picks AVX-512, AVX2
 * or SSE.
 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kernels_common.h"

/* Rows per pass over a block: a verification of 1 + 4 rows reads each block once (in passes of
 * four, 1 + 4 rows took 1.46x the time of 4 rows on an AVX-512 CPU; in one pass 1.14x). */
#define ROWS 6

/* The kernels' vectors: one register each. A block's 16 columns are H of them (AVX-512: one of
 * 16 floats; AVX2 and others: two of 8). GCC's generic 16-float vectors would work too, but on
 * AVX2 it moves them through the stack: decode attention took 6x as long in them. */
#if defined(__AVX512F__)
typedef float vecf __attribute__((vector_size(64)));
#define H 1
#else
typedef float vecf __attribute__((vector_size(32)));
#define H 2
#endif
#define LANES (BLOCK / H)
typedef int32_t veci __attribute__((vector_size(sizeof(vecf))));  /* masks of vecf's lanes */
/* Partial sums per row and vector in the fp32 products (more hide the FMA's latency; every row
 * of a pass has the same, so a row gets the same bits whatever the pass). ROWS rows of them fit
 * the registers: AVX-512, 6 x 2 x 1 of 32; AVX2, 6 x 1 x 2 of 16, beside a weight and an input. */
#if H == 1
#define SUMS 2
#else
#define SUMS 1
#endif

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
static void put_kv(void *cache, size_t offset, const float *src, int count, int half) {
    if (!half) {
        memcpy((float *)cache + offset, src, sizeof(float) * count);
        return;
    }
    f16 *dst = (f16 *)cache + offset;
    int d = 0;
    for (; d + LANES <= count; d += LANES) storev_f16(dst + d, loadv_f32(src + d));
    for (; d < count; d++) dst[d] = f32_to_f16(src[d]);
}

/* dst [n] = src [n] rounded to fp16 as the KV writes round (their test). */
void ragspeed_to_f16(const float *src, f16 *dst, int n) { put_kv(dst, 0, src, n, 1); }

static inline void store(float *y, const vecf *sums, const float *bias, int first, int n) {
    int count = n - first < BLOCK ? n - first : BLOCK;
    for (int h = 0; h < H; h++) {
        vecf v = sums[h];
        if (bias) v += loadv_f32(bias + first + h * LANES);
        for (int i = 0; i < LANES && h * LANES + i < count; i++) y[first + h * LANES + i] = v[i];
    }
}

/* Rows r0..r0+R-1 of x times one fp32 block (16 columns): R is a compile-time constant, so the
 * R x SUMS partial sums (of H vectors each) live in registers; input j goes to sum j % SUMS. */
#define F32_ROWS(NAME, R)                                                                        \
    static inline void NAME(const float *block, const float *x, float *y, const float *bias,    \
                            int first, int n, int k) {                                          \
        vecf acc[R][SUMS][H], total[R][H];                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                     \
            for (int s = 0; s < SUMS; s++)                                                      \
                for (int h = 0; h < H; h++) acc[r][s][h] = (vecf){0};                           \
        for (int j = 0; j < k; j += SUMS)                                                       \
            for (int s = 0; s < SUMS && j + s < k; s++) {                                       \
                const float *p = block + (size_t)(j + s) * BLOCK;                               \
                vecf w[H];                                                                      \
                for (int h = 0; h < H; h++) w[h] = loadv_f32(p + h * LANES);                    \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                           \
                    float xr = x[(size_t)r * k + j + s];                                        \
                    for (int h = 0; h < H; h++) acc[r][s][h] += w[h] * xr;                      \
                }                                                                               \
            }                                                                                   \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                   \
            for (int h = 0; h < H; h++) {                                                       \
                total[r][h] = acc[r][0][h];                                                     \
                for (int s = 1; s < SUMS; s++) total[r][h] += acc[r][s][h];                     \
            }                                                                                   \
            store(y + (size_t)r * n, total[r], bias, first, n);                                 \
        }                                                                                       \
    }

/* int8 products. int8 weights carry one fp16 scale per GROUP consecutive inputs of each output
 * column, a block's scales [ceil(k / GROUP)][16]. The input rows are quantized per GROUP too,
 * to int16 with one fp32 scale each (max |x| / 32767): an error of a 65,534th of the group's
 * range, far below the weights' own (a 254th), so the products keep the answers of fp32
 * activations. A group's products are summed exactly in int32 (vpmaddwd adds pairs of int16
 * products; 32 x 128 x 32767 < 2^31) and scaled once, by the weight's scale times the row's,
 * into the fp32 sum. Widening int8 to fp32 took three AVX2 instructions per 8 weights before
 * the FMA; here two inputs times 16 columns are two widenings, two multiply-adds and two adds.
 *
 * Layout: a block's inputs in pairs, [ceil(k / 2)][16][2] (inputs 2j and 2j + 1 of a column
 * side by side, as vpmaddwd pairs them), an odd k padded with a zero weight. */
#define PAIRS (GROUP / 2)
int ragspeed_int8_group(void) { return GROUP; }


/* Rows r0..r0+R-1 (quantized: xq, xs) times one int8 block: the R x 16 int32 sums of a group in
 * registers (AVX2: two vectors of 8 columns a row), its fp32 totals updated once a group. */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define I8_ROWS(NAME, R)                                                                         \
    static inline void NAME(const int8_t *block, const int16_t *xq, const float *xs,             \
                            const f16 *scales, float *y, const float *bias, int first, int n,   \
                            int k) {                                                            \
        int groups = (k + GROUP - 1) / GROUP, pairs = (k + 1) / 2;                              \
        __m256 total[R][2];                                                                     \
        for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();           \
        for (int g = 0; g < groups; g++) {                                                      \
            __m256i acc[R][2];                                                                  \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                 \
                acc[r][0] = acc[r][1] = _mm256_setzero_si256();                                 \
            int end = (g + 1) * PAIRS < pairs ? (g + 1) * PAIRS : pairs;                        \
            _Pragma("GCC unroll 2") for (int j = g * PAIRS; j < end; j++) {                     \
                const int8_t *p = block + (size_t)j * 2 * BLOCK;                                \
                /* 32 bytes a pair: the hardware prefetcher falls behind */                    \
                __builtin_prefetch(p + 48 * 2 * BLOCK);                                         \
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));         \
                __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));  \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                           \
                    int32_t pair;                                                               \
                    memcpy(&pair, xq + (size_t)r * groups * GROUP + 2 * j, sizeof pair);        \
                    __m256i xb = _mm256_set1_epi32(pair);                                       \
                    acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));         \
                    acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));         \
                }                                                                               \
            }                                                                                   \
            const f16 *sc = scales + (size_t)g * BLOCK;                                         \
            __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));                 \
            __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 8)));           \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                               \
                __m256 sx = _mm256_set1_ps(xs[(size_t)r * groups + g]);                         \
                total[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(s0, sx), total[r][0]); \
                total[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(s1, sx), total[r][1]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm256_storeu_ps(sums, total[r][0]);                                                \
            _mm256_storeu_ps(sums + 8, total[r][1]);                                            \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#else /* the same sums in plain C */
#define I8_ROWS(NAME, R)                                                                         \
    static inline void NAME(const int8_t *block, const int16_t *xq, const float *xs,             \
                            const f16 *scales, float *y, const float *bias, int first, int n,   \
                            int k) {                                                            \
        int groups = (k + GROUP - 1) / GROUP, pairs = (k + 1) / 2;                              \
        float total[R][BLOCK] = {{0}};                                                          \
        for (int g = 0; g < groups; g++) {                                                      \
            int32_t acc[R][BLOCK] = {{0}};                                                      \
            int end = (g + 1) * PAIRS < pairs ? (g + 1) * PAIRS : pairs;                        \
            for (int j = g * PAIRS; j < end; j++) {                                             \
                const int8_t *p = block + (size_t)j * 2 * BLOCK;                                \
                for (int r = 0; r < R; r++) {                                                   \
                    const int16_t *xr = xq + (size_t)r * groups * GROUP + 2 * j;                \
                    for (int c = 0; c < BLOCK; c++)                                             \
                        acc[r][c] += p[2 * c] * xr[0] + p[2 * c + 1] * xr[1];                   \
                }                                                                               \
            }                                                                                   \
            for (int r = 0; r < R; r++)                                                         \
                for (int c = 0; c < BLOCK; c++)                                                 \
                    total[r][c] += (float)acc[r][c] * (f16_to_f32(scales[(size_t)g * BLOCK + c]) * xs[(size_t)r * groups + g]); \
        }                                                                                       \
        for (int r = 0; r < R; r++) store_sums(y + (size_t)r * n, total[r], bias, first, n);   \
    }
#endif

/* 4-bit products: GGUF's Q4_0 and Q4_1 blocks as the file stores them, and its Q4_K blocks
 * unpacked (engine.quant.k_quants). A group of GROUP inputs of an output column holds 4-bit q in
 * 0..15, its step d and offset m: w = d * q + m (Q4_0: m = -8 d), fp16 (Q4_x) or fp32 (Q4_K,
 * whose d and m are products of two scales: exact in fp32, not in fp16). The input rows are
 * quantized per group to int16 as for int8, so sum x w = xs * (d * sum xq q) + m * (xs * sum xq):
 * the first sum exact in int32 (vpmaddwd of the widened nibbles, 32 x 15 x 32767 < 2^31), the
 * second the row's group sum (quantize_rows).
 *
 * Layout: a block's inputs in pairs as int8's, [k / 2][16][2], two values a byte: pair j is 16
 * bytes, byte i holding value i (columns 0-7) in its low nibble and value 16 + i (columns 8-15)
 * in its high one, so one mask and one shift give the two vectors int8 loads. A block's steps
 * and offsets [k / GROUP][2][16]: the group's 16 d, then its 16 m. k is a multiple of GROUP
 * (a GGUF block is GROUP inputs). */
/* S##X16, S##X8, S##X1: 16, 8 or 1 steps or offsets of type S (F16 or F32) as fp32. */
#define F16X1(v) f16_to_f32(v)
#define F32X1(v) (v)
#if defined(__AVX2__) && defined(__F16C__)
#define F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define F32X8(p) _mm256_loadu_ps(p)
#endif
#if defined(__AVX512F__)
#define F16X16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define F32X16(p) _mm512_loadu_ps(p)
#endif
#if defined(__AVX512BW__) && defined(__AVX512F__)
/* AVX-512: two pairs a load. Their 32 bytes widened to 16 bits are, masked, columns 0-7 of both
 * pairs and, shifted, columns 8-15; two shuffles of 128-bit lanes make each pair one vector of
 * its 16 columns' two values, so a row's input pair is one broadcast (folded into the
 * multiply-add) and one multiply-add a pair sums all 16 columns. The shuffles are shared by
 * every row of the pass, so a row costs its two multiply-adds a pair and their broadcasts: the
 * batched steps and prefill chunks, which are bound by arithmetic, ran 18-20% faster a row than
 * with each row's inputs permuted into place (SmolLM2's shapes, 6 to 64 rows, AMD EPYC). */
/* VNNI fuses the multiply-add and the add into one instruction: as fast for one row, and 14%
 * faster from three rows on (the batched steps, where the products are compute-bound). */
#if defined(__AVX512VNNI__)
#define MADD_ADD512(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#else
#define MADD_ADD512(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif
static inline __m512i input_pair(const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(pair);
}
#define Q4_ROWS_OF(NAME, R, STYPE, S)                                                            \
    static inline void NAME(const uint8_t *block, const int16_t *xq, const float *xs,            \
                            const float *xsum, const STYPE *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        const __m512i nibble = _mm512_set1_epi16(0x0f);                                         \
        __m512 total[R];                                                                        \
        for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();                             \
        for (int g = 0; g < groups; g++) {                                                      \
            __m512i acc[R], acc1[R]; /* two chains a row, for the multiply-add's latency */     \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                 \
                acc[r] = acc1[r] = _mm512_setzero_si512();                                      \
            _Pragma("GCC unroll 8") for (int t = 0; t < PAIRS / 2; t++) {                       \
                int j = g * PAIRS + 2 * t;                                                      \
                const uint8_t *p = block + (size_t)j * BLOCK;                                   \
                __builtin_prefetch(p + 96 * BLOCK);                                             \
                __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));      \
                __m512i low = _mm512_and_si512(v, nibble), high = _mm512_srli_epi16(v, 4);      \
                __m512i w0 = _mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(1, 0, 1, 0));          \
                __m512i w1 = _mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(3, 2, 3, 2));          \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                           \
                    const int16_t *xr = xq + (size_t)r * groups * GROUP + 2 * j;                \
                    acc[r] = MADD_ADD512(acc[r], w0, input_pair(xr));                           \
                    acc1[r] = MADD_ADD512(acc1[r], w1, input_pair(xr + 2));                     \
                }                                                                               \
            }                                                                                   \
            const STYPE *sc = scales + (size_t)g * 2 * BLOCK;                                   \
            __m512 d = S##X16(sc), m = S##X16(sc + 16);                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                __m512 sx = _mm512_set1_ps(xs[(size_t)r * groups + g]);                         \
                __m512i sum = _mm512_add_epi32(acc[r], acc1[r]);                                \
                total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[(size_t)r * groups + g]), total[r]); \
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, sx), total[r]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm512_storeu_ps(sums, total[r]);                                                   \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define MADD_ADD(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#define Q4_ROWS_OF(NAME, R, STYPE, S)                                                            \
    static inline void NAME(const uint8_t *block, const int16_t *xq, const float *xs,            \
                            const float *xsum, const STYPE *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        const __m128i nibble = _mm_set1_epi8(0x0f);                                             \
        __m256 total[R][2];                                                                     \
        for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();           \
        for (int g = 0; g < groups; g++) {                                                      \
            __m256i acc[R][2];                                                                  \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                 \
                acc[r][0] = acc[r][1] = _mm256_setzero_si256();                                 \
            _Pragma("GCC unroll 4") for (int j = g * PAIRS; j < (g + 1) * PAIRS; j++) {         \
                const uint8_t *p = block + (size_t)j * BLOCK;                                   \
                __builtin_prefetch(p + 96 * BLOCK);                                             \
                __m128i v = _mm_loadu_si128((const __m128i *)p);                                \
                __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(v, nibble));                    \
                __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nibble)); \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                           \
                    int32_t pair;                                                               \
                    memcpy(&pair, xq + (size_t)r * groups * GROUP + 2 * j, sizeof pair);        \
                    __m256i xb = _mm256_set1_epi32(pair);                                       \
                    acc[r][0] = MADD_ADD(acc[r][0], w0, xb);                                    \
                    acc[r][1] = MADD_ADD(acc[r][1], w1, xb);                                    \
                }                                                                               \
            }                                                                                   \
            const STYPE *sc = scales + (size_t)g * 2 * BLOCK;                                   \
            __m256 d0 = S##X8(sc), d1 = S##X8(sc + 8), m0 = S##X8(sc + 16), m1 = S##X8(sc + 24); \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                               \
                __m256 sx = _mm256_set1_ps(xs[(size_t)r * groups + g]);                         \
                __m256 sm = _mm256_set1_ps(xsum[(size_t)r * groups + g]);                       \
                total[r][0] = _mm256_fmadd_ps(m0, sm, total[r][0]);                             \
                total[r][1] = _mm256_fmadd_ps(m1, sm, total[r][1]);                             \
                total[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(d0, sx), total[r][0]); \
                total[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(d1, sx), total[r][1]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm256_storeu_ps(sums, total[r][0]);                                                \
            _mm256_storeu_ps(sums + 8, total[r][1]);                                            \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#else /* the same sums in plain C */
#define Q4_ROWS_OF(NAME, R, STYPE, S)                                                            \
    static inline void NAME(const uint8_t *block, const int16_t *xq, const float *xs,            \
                            const float *xsum, const STYPE *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        float total[R][BLOCK] = {{0}};                                                          \
        for (int g = 0; g < groups; g++) {                                                      \
            int32_t acc[R][BLOCK] = {{0}};                                                      \
            for (int j = g * PAIRS; j < (g + 1) * PAIRS; j++) {                                 \
                const uint8_t *p = block + (size_t)j * BLOCK;                                   \
                for (int r = 0; r < R; r++) {                                                   \
                    const int16_t *xr = xq + (size_t)r * groups * GROUP + 2 * j;                \
                    for (int c = 0; c < BLOCK; c++) {                                           \
                        /* value 2c + s of the pair: byte (2c + s) % 16, high nibble past 15 */ \
                        int i = 2 * c, shift = i < BLOCK ? 0 : 4;                               \
                        int q0 = (p[i % BLOCK] >> shift) & 15, q1 = (p[(i + 1) % BLOCK] >> shift) & 15; \
                        acc[r][c] += q0 * xr[0] + q1 * xr[1];                                   \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            const STYPE *sc = scales + (size_t)g * 2 * BLOCK;                                   \
            for (int r = 0; r < R; r++)                                                         \
                for (int c = 0; c < BLOCK; c++) {                                               \
                    total[r][c] += S##X1(sc[BLOCK + c]) * xsum[(size_t)r * groups + g];         \
                    total[r][c] += (float)acc[r][c] * (S##X1(sc[c]) * xs[(size_t)r * groups + g]); \
                }                                                                               \
        }                                                                                       \
        for (int r = 0; r < R; r++) store_sums(y + (size_t)r * n, total[r], bias, first, n);   \
    }
#endif
#define Q4_ROWS(NAME, R) Q4_ROWS_OF(NAME, R, f16, F16)
#define Q4K_ROWS(NAME, R) Q4_ROWS_OF(NAME, R, float, F32)

/* Q6_K products: GGUF's Q6_K blocks unpacked (engine.quant.k_quants), q - 32 in -32..31 as
 * int8 in int8's layout of pairs, with one fp32 step per STEP inputs of an output column (a
 * block's steps [k / STEP][16]); k a multiple of GROUP. The input rows are quantized per GROUP
 * as for int8; the products of each STEP inputs are summed exactly in int32 and scaled once, by
 * the step times the row's scale. AVX-512 CPUs run the AVX2 kernel, as for int8. */
#define STEP 16
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define Q6K_ROWS(NAME, R)                                                                        \
    static inline void NAME(const int8_t *block, const int16_t *xq, const float *xs,             \
                            const float *steps, float *y, const float *bias, int first, int n,  \
                            int k) {                                                            \
        int groups = k / GROUP;                                                                 \
        __m256 total[R][2];                                                                     \
        for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();           \
        for (int s = 0; s < k / STEP; s++) {                                                    \
            __m256i acc[R][2];                                                                  \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                 \
                acc[r][0] = acc[r][1] = _mm256_setzero_si256();                                 \
            _Pragma("GCC unroll 8") for (int j = s * STEP / 2; j < (s + 1) * STEP / 2; j++) {   \
                const int8_t *p = block + (size_t)j * 2 * BLOCK;                                \
                __builtin_prefetch(p + 48 * 2 * BLOCK);                                         \
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));         \
                __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));  \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                           \
                    int32_t pair;                                                               \
                    memcpy(&pair, xq + (size_t)r * groups * GROUP + 2 * j, sizeof pair);        \
                    __m256i xb = _mm256_set1_epi32(pair);                                       \
                    acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));         \
                    acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));         \
                }                                                                               \
            }                                                                                   \
            __m256 s0 = _mm256_loadu_ps(steps + (size_t)s * BLOCK);                             \
            __m256 s1 = _mm256_loadu_ps(steps + (size_t)s * BLOCK + 8);                         \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                               \
                __m256 sx = _mm256_set1_ps(xs[(size_t)r * groups + s * STEP / GROUP]);          \
                total[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(s0, sx), total[r][0]); \
                total[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(s1, sx), total[r][1]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm256_storeu_ps(sums, total[r][0]);                                                \
            _mm256_storeu_ps(sums + 8, total[r][1]);                                            \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#else /* the same sums in plain C */
#define Q6K_ROWS(NAME, R)                                                                        \
    static inline void NAME(const int8_t *block, const int16_t *xq, const float *xs,             \
                            const float *steps, float *y, const float *bias, int first, int n,  \
                            int k) {                                                            \
        int groups = k / GROUP;                                                                 \
        float total[R][BLOCK] = {{0}};                                                          \
        for (int s = 0; s < k / STEP; s++) {                                                    \
            int32_t acc[R][BLOCK] = {{0}};                                                      \
            for (int j = s * STEP / 2; j < (s + 1) * STEP / 2; j++) {                           \
                const int8_t *p = block + (size_t)j * 2 * BLOCK;                                \
                for (int r = 0; r < R; r++) {                                                   \
                    const int16_t *xr = xq + (size_t)r * groups * GROUP + 2 * j;                \
                    for (int c = 0; c < BLOCK; c++)                                             \
                        acc[r][c] += p[2 * c] * xr[0] + p[2 * c + 1] * xr[1];                   \
                }                                                                               \
            }                                                                                   \
            for (int r = 0; r < R; r++)                                                         \
                for (int c = 0; c < BLOCK; c++)                                                 \
                    total[r][c] += (float)acc[r][c] * (steps[(size_t)s * BLOCK + c] * xs[(size_t)r * groups + s * STEP / GROUP]); \
        }                                                                                       \
        for (int r = 0; r < R; r++) store_sums(y + (size_t)r * n, total[r], bias, first, n);   \
    }
#endif

/* Mixed products: one projection whose rows come in several GGUF types (Q4_K_M's fused QKV: Q
 * and K Q4_K, V Q6_K), each converted exactly to one form (engine.quant.gguf_blocks.as_mixed):
 * int8 values in int8's layout of pairs, an fp32 step per STEP inputs and an fp32 offset per
 * GROUP, w = step q + offset (Q4_K: its q in 0..15, its step and offset per GROUP on both
 * STEPs; Q6_K: q - 32 and offset 0; Q8_0 and Q4_x: their fp16 d and m widened). The products
 * of each STEP inputs are summed exactly in int32 (16 x 128 x 32767 < 2^31) and scaled once by
 * the step times the row's scale; the offset multiplies the row's group sum, as for 4-bit. A
 * block's scales [k / GROUP][3][16]: the group's first STEP's 16 steps, its second's, its 16
 * offsets. k a multiple of GROUP. */
#if defined(__AVX512BW__) && defined(__AVX512F__)
/* AVX-512: a pair's 32 bytes widened to 16 bits are its 16 columns' two inputs, so one
 * multiply-add of them with the row's input pair sums all 16 columns. */
#define KMIX_ROWS(NAME, R)                                                                       \
    static inline void NAME(const int8_t *block, const int16_t *xq, const float *xs,             \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        __m512 total[R];                                                                        \
        for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();                             \
        for (int g = 0; g < groups; g++) {                                                      \
            const float *sc = scales + (size_t)g * 3 * BLOCK;                                   \
            for (int h = 0; h < 2; h++) {                                                       \
                __m512i acc[R];                                                                 \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512(); \
                int start = g * PAIRS + h * STEP / 2;                                           \
                _Pragma("GCC unroll 8") for (int j = start; j < start + STEP / 2; j++) {        \
                    const int8_t *p = block + (size_t)j * 2 * BLOCK;                            \
                    __builtin_prefetch(p + 48 * 2 * BLOCK);                                     \
                    __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));   \
                    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                       \
                        int32_t pair;                                                           \
                        memcpy(&pair, xq + (size_t)r * groups * GROUP + 2 * j, sizeof pair);    \
                        acc[r] = MADD_ADD512(acc[r], w, _mm512_set1_epi32(pair));               \
                    }                                                                           \
                }                                                                               \
                __m512 s = _mm512_loadu_ps(sc + h * BLOCK);                                     \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                           \
                    __m512 sx = _mm512_set1_ps(xs[(size_t)r * groups + g]);                     \
                    total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(s, sx), total[r]); \
                }                                                                               \
            }                                                                                   \
            __m512 offset = _mm512_loadu_ps(sc + 2 * BLOCK);                                    \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                 \
                total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[(size_t)r * groups + g]), total[r]); \
        }                                                                                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm512_storeu_ps(sums, total[r]);                                                   \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KMIX_ROWS(NAME, R)                                                                       \
    static inline void NAME(const int8_t *block, const int16_t *xq, const float *xs,             \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        __m256 total[R][2];                                                                     \
        for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();           \
        for (int g = 0; g < groups; g++) {                                                      \
            const float *sc = scales + (size_t)g * 3 * BLOCK;                                   \
            for (int h = 0; h < 2; h++) {                                                       \
                __m256i acc[R][2];                                                              \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                             \
                    acc[r][0] = acc[r][1] = _mm256_setzero_si256();                             \
                int start = g * PAIRS + h * STEP / 2;                                           \
                _Pragma("GCC unroll 8") for (int j = start; j < start + STEP / 2; j++) {        \
                    const int8_t *p = block + (size_t)j * 2 * BLOCK;                            \
                    __builtin_prefetch(p + 48 * 2 * BLOCK);                                     \
                    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));     \
                    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16))); \
                    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                       \
                        int32_t pair;                                                           \
                        memcpy(&pair, xq + (size_t)r * groups * GROUP + 2 * j, sizeof pair);    \
                        __m256i xb = _mm256_set1_epi32(pair);                                   \
                        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));     \
                        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));     \
                    }                                                                           \
                }                                                                               \
                __m256 s0 = _mm256_loadu_ps(sc + h * BLOCK), s1 = _mm256_loadu_ps(sc + h * BLOCK + 8); \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                           \
                    __m256 sx = _mm256_set1_ps(xs[(size_t)r * groups + g]);                     \
                    total[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(s0, sx), total[r][0]); \
                    total[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(s1, sx), total[r][1]); \
                }                                                                               \
            }                                                                                   \
            __m256 m0 = _mm256_loadu_ps(sc + 2 * BLOCK), m1 = _mm256_loadu_ps(sc + 2 * BLOCK + 8); \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                               \
                __m256 xm = _mm256_set1_ps(xsum[(size_t)r * groups + g]);                       \
                total[r][0] = _mm256_fmadd_ps(m0, xm, total[r][0]);                             \
                total[r][1] = _mm256_fmadd_ps(m1, xm, total[r][1]);                             \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm256_storeu_ps(sums, total[r][0]);                                                \
            _mm256_storeu_ps(sums + 8, total[r][1]);                                            \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#else /* the same sums in plain C */
#define KMIX_ROWS(NAME, R)                                                                       \
    static inline void NAME(const int8_t *block, const int16_t *xq, const float *xs,             \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        float total[R][BLOCK] = {{0}};                                                          \
        for (int g = 0; g < groups; g++) {                                                      \
            const float *sc = scales + (size_t)g * 3 * BLOCK;                                   \
            for (int h = 0; h < 2; h++) {                                                       \
                int32_t acc[R][BLOCK] = {{0}};                                                  \
                int start = g * PAIRS + h * STEP / 2;                                           \
                for (int j = start; j < start + STEP / 2; j++) {                                \
                    const int8_t *p = block + (size_t)j * 2 * BLOCK;                            \
                    for (int r = 0; r < R; r++) {                                               \
                        const int16_t *xr = xq + (size_t)r * groups * GROUP + 2 * j;            \
                        for (int c = 0; c < BLOCK; c++)                                         \
                            acc[r][c] += p[2 * c] * xr[0] + p[2 * c + 1] * xr[1];               \
                    }                                                                           \
                }                                                                               \
                for (int r = 0; r < R; r++)                                                     \
                    for (int c = 0; c < BLOCK; c++)                                             \
                        total[r][c] += (float)acc[r][c] * (sc[h * BLOCK + c] * xs[(size_t)r * groups + g]); \
            }                                                                                   \
            for (int r = 0; r < R; r++)                                                         \
                for (int c = 0; c < BLOCK; c++)                                                 \
                    total[r][c] += sc[2 * BLOCK + c] * xsum[(size_t)r * groups + g];            \
        }                                                                                       \
        for (int r = 0; r < R; r++) store_sums(y + (size_t)r * n, total[r], bias, first, n);   \
    }
#endif

/* The products of one weight type (WTYPE values, STYPE scales): blocks split across the threads
 * of the enclosing parallel region (NAME##_team, ending in its barrier), rows in passes of ROWS;
 * NAME opens a region.
 * PREPARE runs on each thread before its blocks, FINISH after; PASS(KERNEL) is one pass of rows. */
#define GEMV(NAME, WTYPE, STYPE, KERNEL, PREPARE, PASS, FINISH)                                 \
    KERNEL(NAME##_1, 1) KERNEL(NAME##_2, 2) KERNEL(NAME##_3, 3)                                 \
    KERNEL(NAME##_4, 4) KERNEL(NAME##_5, 5) KERNEL(NAME##_6, 6)                                 \
    static void NAME##_team(const WTYPE *w, const STYPE *scale, const float *bias,             \
                            const float *x, float *y, int m, int n, int k) {                   \
        int num_blocks = (n + BLOCK - 1) / BLOCK;                                               \
        PREPARE                                                                                 \
        _Pragma("omp for schedule(static)")                                                     \
        for (int b = 0; b < num_blocks; b++)                                                    \
            for (int r = 0; r < m; r += ROWS) {                                                 \
                float *yr = y + (size_t)r * n;                                                  \
                switch (m - r < ROWS ? m - r : ROWS) {                                          \
                case 1: PASS(NAME##_1); break;                                                  \
                case 2: PASS(NAME##_2); break;                                                  \
                case 3: PASS(NAME##_3); break;                                                  \
                case 4: PASS(NAME##_4); break;                                                  \
                case 5: PASS(NAME##_5); break;                                                  \
                default: PASS(NAME##_6); break;                                                 \
                }                                                                               \
            }                                                                                   \
        FINISH                                                                                  \
    }                                                                                           \
    static void NAME(const WTYPE *w, const STYPE *scale, const float *bias, const float *x,    \
                     float *y, int m, int n, int k, int num_threads) {                         \
        _Pragma("omp parallel num_threads(num_threads)")                                        \
        NAME##_team(w, scale, bias, x, y, m, n, k);                                             \
    }

/* fp32: block b is [k][16] */
#define F32_PASS(KERNEL) KERNEL(w + (size_t)b * k * BLOCK, x + (size_t)r * k, yr, bias, b * BLOCK, n, k)
GEMV(gemv_f32, float, f16, F32_ROWS, (void)scale;, F32_PASS, )

/* int8: each thread quantizes every row for itself (no barrier before the products); block b
 * is [ceil(k / 2)][16][2], its scales [groups][16]. */
#define I8_PREPARE                                                                              \
    int groups = (k + GROUP - 1) / GROUP;                                                       \
    size_t row = (size_t)groups * GROUP;                                                        \
    int16_t *xq = malloc(sizeof(int16_t) * m * row + sizeof(float) * m * groups);               \
    float *xs = (float *)(xq + m * row);                                                        \
    quantize_rows(x, m, k, xq, xs, NULL);
#define I8_PASS(KERNEL)                                                                         \
    KERNEL(w + (size_t)b * ((k + 1) / 2) * 2 * BLOCK, xq + r * row, xs + (size_t)r * groups,     \
           scale + (size_t)b * groups * BLOCK, yr, bias, b * BLOCK, n, k)
GEMV(gemv_i8, int8_t, f16, I8_ROWS, I8_PREPARE, I8_PASS, free(xq);)

/* 4-bit: as int8, with the rows' group sums; block b is [k / 2][16] bytes, its steps and
 * offsets [groups][2][16]. */
#define Q4_PREPARE                                                                              \
    int groups = k / GROUP;                                                                     \
    size_t row = (size_t)groups * GROUP;                                                        \
    int16_t *xq = malloc(sizeof(int16_t) * m * row + 2 * sizeof(float) * m * groups);           \
    float *xs = (float *)(xq + m * row), *xsum = xs + (size_t)m * groups;                       \
    quantize_rows(x, m, k, xq, xs, xsum);
#define Q4_PASS(KERNEL)                                                                         \
    KERNEL(w + (size_t)b * (k / 2) * BLOCK, xq + r * row, xs + (size_t)r * groups,              \
           xsum + (size_t)r * groups, scale + (size_t)b * groups * 2 * BLOCK, yr, bias,         \
           b * BLOCK, n, k)
GEMV(gemv_q4, uint8_t, f16, Q4_ROWS, Q4_PREPARE, Q4_PASS, free(xq);)
GEMV(gemv_q4k, uint8_t, float, Q4K_ROWS, Q4_PREPARE, Q4_PASS, free(xq);)

/* Q6_K: as int8, with a step per STEP inputs; block b is [k / 2][16][2], its steps [k / STEP][16]. */
#define Q6K_PASS(KERNEL)                                                                        \
    KERNEL(w + (size_t)b * (k / 2) * 2 * BLOCK, xq + r * row, xs + (size_t)r * groups,          \
           scale + (size_t)b * (k / STEP) * BLOCK, yr, bias, b * BLOCK, n, k)
GEMV(gemv_q6k, int8_t, float, Q6K_ROWS, I8_PREPARE, Q6K_PASS, free(xq);)

/* Mixed: as 4-bit, with the rows' group sums; block b is [k / 2][16][2], its steps and offsets
 * [groups][3][16]. */
#define KMIX_PASS(KERNEL)                                                                       \
    KERNEL(w + (size_t)b * (k / 2) * 2 * BLOCK, xq + r * row, xs + (size_t)r * groups,          \
           xsum + (size_t)r * groups, scale + (size_t)b * groups * 3 * BLOCK, yr, bias,         \
           b * BLOCK, n, k)
GEMV(gemv_kmix, int8_t, float, KMIX_ROWS, Q4_PREPARE, KMIX_PASS, free(xq);)

/* y [m, n] = x [m, k] @ W.T + bias; w: W in blocks [ceil(n/16)][k][16] (zero-padded), fp32. */
void ragspeed_gemv_f32(const float *w, const float *bias, const float *x, float *y,
                       int m, int n, int k, int num_threads) {
    gemv_f32(w, NULL, bias, x, y, m, n, k, num_threads);
}

/* The same with int8 weights Q in blocks [ceil(n/16)][ceil(k/2)][16][2] and their group scales
 * S [ceil(n/16)][ceil(k/GROUP)][16] (zero-padded): y = x @ (Q * S).T + bias, x quantized per
 * group to int16 (above). */
void ragspeed_gemv_i8(const int8_t *w, const f16 *scale, const float *bias, const float *x,
                      float *y, int m, int n, int k, int num_threads) {
    gemv_i8(w, scale, bias, x, y, m, n, k, num_threads);
}

/* The same with 4-bit weights (GGUF's Q4_0 / Q4_1) in blocks [ceil(n/16)][k/2][16] bytes and
 * their steps and offsets S [ceil(n/16)][k/GROUP][2][16] (zero-padded); k a multiple of GROUP. */
void ragspeed_gemv_q4(const uint8_t *w, const f16 *scale, const float *bias, const float *x,
                      float *y, int m, int n, int k, int num_threads) {
    gemv_q4(w, scale, bias, x, y, m, n, k, num_threads);
}

/* The same with Q4_K's fp32 steps and offsets, S [ceil(n/16)][k/GROUP][2][16]. */
void ragspeed_gemv_q4k(const uint8_t *w, const float *scale, const float *bias, const float *x,
                       float *y, int m, int n, int k, int num_threads) {
    gemv_q4k(w, scale, bias, x, y, m, n, k, num_threads);
}

/* The same with Q6_K's int8 q - 32 in int8's blocks [ceil(n/16)][k/2][16][2] and their fp32
 * steps S [ceil(n/16)][k/STEP][16] (zero-padded); k a multiple of GROUP. */
void ragspeed_gemv_q6k(const int8_t *w, const float *scale, const float *bias, const float *x,
                       float *y, int m, int n, int k, int num_threads) {
    gemv_q6k(w, scale, bias, x, y, m, n, k, num_threads);
}

/* The same with a projection of mixed types converted to int8 values in int8's blocks
 * [ceil(n/16)][k/2][16][2] with fp32 steps per STEP and offsets per GROUP, S
 * [ceil(n/16)][k/GROUP][3][16] (zero-padded); k a multiple of GROUP. */
void ragspeed_gemv_kmix(const int8_t *w, const float *scale, const float *bias, const float *x,
                        float *y, int m, int n, int k, int num_threads) {
    gemv_kmix(w, scale, bias, x, y, m, n, k, num_threads);
}

/* Decode attention straight from the paged KV pool: one query token per request.
 *
 * q [num_seqs, num_heads, head_dim]; caches [num_slots, num_kv_heads, head_dim] with slot =
 * block * block_size + offset; block_tables [num_seqs, max_blocks]; context_lens [num_seqs];
 * out [num_seqs, num_heads, head_dim]. The SDPA path of engine/attention.py is the reference.
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
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define CHUNK 64  /* keys per task */

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

/* Floats of the chunks' partial results: per task, for each query head, max, sum, output. */
static size_t attention_partials(int num_seqs, int num_heads, int head_dim, int64_t longest) {
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
        float top = -__builtin_inff();
        for (int i = 0; i < LANES; i++) top = tops[i] > top ? tops[i] : top;
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
 * (t + 1) / threads of all keys. Split by count of chunks instead, 400 keys on 2 threads went
 * 256 | 144 (the last chunk partial; now 192 | 208): in a batch-1 step the threads spent 0.66
 * and 0.55 ms in attention's chunks. */
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
static void paged_decode_attention_team(const float *q, const void *k_cache, const void *v_cache,
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

static int64_t longest_context(const int64_t *context_lens, int num_seqs) {
    int64_t longest = 1;
    for (int s = 0; s < num_seqs; s++) longest = context_lens[s] > longest ? context_lens[s] : longest;
    return longest;
}

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

/* The residual stream's add and RMSNorm in one pass per row: x [rows, dim] becomes x + residual
 * (when residual is not NULL), out [rows, dim] = that / sqrt(mean of its squares + eps) * weight.
 * Replaces the add and the six ops torch's rms_norm runs on a CPU. */
static void add_rms_norm_row(float *x, const float *residual, const float *weight, float *out,
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
static int64_t argmax_row(const float *x, int n) {
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

/* ------------------------------------------------------------------ stored document KV, placed
 *
 * A document's stored KV, fp16 kv [2][layers][n][row] (row = kv_heads * head_dim, pairs
 * adjacent, keys rotated at their stored position), into the pool's rows (fp32, or fp16 where
 * `half`)
 * pool [2 * layers][num_slots][row] at `slots`, each key rotated on the way by the position
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

/* ------------------------------------------------------------------ the whole decode forward
 *
 * A decode-type step of a small model spends more time between kernels than in them: each
 * decoder layer is about fifteen torch ops and module calls around its four products (the
 * demo model: 2.2 ms a step, of which its products take 1.0). `ragspeed_decode_forward` runs
 * every layer of such a step in one call: norms, products, Q/K norm, rotation, the K/V write
 * into the paged pool, attention, SiLU-gated MLP, with the kernels above. The products, norms
 * and attention are the layer-by-layer path's own kernels; the rotation, Q/K norm and SiLU agree
 * with torch's to float rounding. Each row is computed alike whatever the number of rows. */

enum { WEIGHT_F32, WEIGHT_I8, WEIGHT_Q4, WEIGHT_Q4K, WEIGHT_Q6K, WEIGHT_KMIX };  /* a Linear's kind: its product above */
typedef struct {
    const void *w;      /* the blocks of its kind: ragspeed_gemv_f32, _i8, _q4, _q4k, _q6k or _kmix */
    const void *scale;  /* int8: group scales; 4-bit: steps and offsets (fp16; Q4_K fp32);
                           Q6_K: fp32 steps; mixed: fp32 steps and offsets; fp32: NULL */
    const float *bias;  /* padded to blocks, or NULL */
    int n, k, kind;
} Linear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *qk_norm;                /* [num_heads + num_kv_heads, head_dim], or NULL */
    Linear qkv, o, gate_up, down;
} Layer;

struct Model {
    const Layer *layers;
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps, scale;
    const float *final_norm; /* [hidden] */
    /* Token embeddings [vocab rows, hidden], looked up in the kernels (greedy steps, and a
     * forward given token ids): fp32 rows, or a GGUF file's Q8_0 rows (embed_q8, hidden / 32
     * blocks of an fp16 step and 32 int8 each); both NULL where Python looks them up. */
    const float *embed;
    const uint8_t *embed_q8;
    Linear lm_head;     /* greedy steps and the forward's logits; zero where neither runs */
};

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
    case WEIGHT_I8: gemv_i8_team((const int8_t *)l->w, l->scale, l->bias, x, y, m, l->n, l->k); break;
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
    case WEIGHT_I8: *weights = pairs * 2 * BLOCK, *scales = groups * BLOCK * sizeof(f16); break;
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
 * it then reads from L2 (a batch-1 step of SmolLM2-135M on its Q4_1 blocks, 2 threads: the
 * prefetch, attention and that product 1.13 -> 1.04 ms a step; adding half of gate_up's share
 * made the step slower). */
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
 * fp16. */
void ragspeed_decode_forward(const Model *model, void *const *k_caches, void *const *v_caches,
                             const int64_t *ids, float *x, float *out, float *logits,
                             const float *rotations, const int64_t *slots,
                             const int64_t *block_tables, const int64_t *context_lens,
                             int max_blocks, int block_size, int m, int kv_half, int num_threads) {
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
    if (ids)
        for (int r = 0; r < m; r++) embed_row(model, ids[r], x + (size_t)r * hidden);
    /* One parallel region for the whole stack and the head: the products and attention split
     * across its threads, a barrier after each (fork and join per product cost a sixth of a
     * SmolLM2-135M int8 step on 2 threads). The steps between them (the norms with the residual
     * add, SiLU, the merge of attention's chunks) run on one thread with a barrier after each;
     * for a batch of at most EACH_THREAD_ROWS rows every thread runs them itself on its own copy
     * of the residual stream and of their outputs, the same bits, which saves four barriers a
     * layer: ten more barriers a layer cost 0.75 ms of a batch-1 step on 2 threads (AMD EPYC),
     * 2.5 us each with the wait for the slower thread (a barrier alone, in a tight loop: 0.28 us). */
    int each_thread = m <= EACH_THREAD_ROWS;
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
        paged_decode_attention_team(q, k_caches[l], v_caches[l], block_tables, context_lens, ms, m,
                                    num_heads, num_kv_heads, head_dim, max_blocks, block_size, model->scale,
                                    longest, partials, kv_half, each_thread);
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
    free(normed); free(wide); free(q); free(mid); free(h); free(partials); free(key);
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
                                max_blocks, block_size, a, kv_half, num_threads);
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
