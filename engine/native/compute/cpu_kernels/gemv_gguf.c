/* Decode products on GGUF's blocks: Q4_0 and Q4_1 as the file stores them, Q4_K and Q6_K unpacked
 * (engine.native.compute.quant.k_quants), and projections whose rows mix GGUF types. y [m, n] = x [m, k] @ W.T +
 * bias for the few rows of a step, W in blocks of 16 output columns (gemv.h). */
#include "gemv.h"

/* 4-bit products: GGUF's Q4_0 and Q4_1 blocks as the file stores them, and its Q4_K blocks
 * unpacked (engine.native.compute.quant.k_quants). A group of GROUP inputs of an output column holds 4-bit q in
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
 * every row of the pass, so a row costs its two multiply-adds a pair and their broadcasts, fewer
 * instructions than permuting each row's inputs into place: it counts in the batched steps and
 * prefill chunks, which are bound by arithmetic. */
/* VNNI fuses the multiply-add and the add into one instruction: the same for one row, faster
 * where the products are compute-bound (three rows and more). */
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

/* Q6_K products: GGUF's Q6_K blocks unpacked (engine.native.compute.quant.k_quants), q - 32 in -32..31 as
 * int8 in int8's layout of pairs, with one fp32 step per STEP inputs of an output column (a
 * block's steps [k / STEP][16]); k a multiple of GROUP. The input rows are quantized per GROUP
 * as for int8; the products of each STEP inputs are summed exactly in int32 and scaled once, by
 * the step times the row's scale. AVX-512 CPUs run the AVX2 kernel, as for int8. */

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
 * and K Q4_K, V Q6_K), each converted exactly to one form (engine.native.compute.quant.gguf_blocks.as_mixed):
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

/* 4-bit: block b is [k / 2][16] bytes, its steps and offsets [groups][2][16] (Q4_PREPARE: gemv.h). */
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

/* y [m, n] = x [m, k] @ W.T + bias, as ragspeed_gemv_f32, with 4-bit weights (GGUF's Q4_0 /
 * Q4_1) in blocks [ceil(n/16)][k/2][16] bytes and their steps and offsets S
 * [ceil(n/16)][k/GROUP][2][16] (zero-padded); k a multiple of GROUP. */
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
