/* Decode products with fp32 and int8 weights: y [m, n] = x [m, k] @ W.T + bias for the few rows
 * of a step, W in blocks of 16 output columns (gemv.h). */
#include "gemv.h"

/* Partial sums per row and vector in the fp32 products (more hide the FMA's latency; every row
 * of a pass has the same, so a row gets the same bits whatever the pass). ROWS rows of them fit
 * the registers: AVX-512, 6 x 2 x 1 of 32; AVX2, 6 x 1 x 2 of 16, beside a weight and an input. */
#if H == 1
#define SUMS 2
#else
#define SUMS 1
#endif

/* y[first:first+16] of one row = the H vectors of its sums + bias, the last block only up to n. */
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
 * into the fp32 sum. Widening int8 to fp32 would take three AVX2 instructions per 8 weights before
 * the FMA; here two inputs times 16 columns are two widenings, two multiply-adds and two adds.
 *
 * Layout: a block's inputs in pairs, [ceil(k / 2)][16][2] (inputs 2j and 2j + 1 of a column
 * side by side, as vpmaddwd pairs them), an odd k padded with a zero weight. */
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

/* fp32: block b is [k][16] */
#define F32_PASS(KERNEL) KERNEL(w + (size_t)b * k * BLOCK, x + (size_t)r * k, yr, bias, b * BLOCK, n, k)
GEMV(gemv_f32, float, f16, F32_ROWS, (void)scale;, F32_PASS, )

/* int8: block b is [ceil(k / 2)][16][2], its scales [groups][16] (I8_PREPARE: gemv.h). */
#define I8_PASS(KERNEL)                                                                         \
    KERNEL(w + (size_t)b * ((k + 1) / 2) * 2 * BLOCK, xq + r * row, xs + (size_t)r * groups,     \
           scale + (size_t)b * groups * BLOCK, yr, bias, b * BLOCK, n, k)
GEMV(gemv_i8, int8_t, f16, I8_ROWS, I8_PREPARE, I8_PASS, free(xq);)

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
