/* Products of a few rows with a weight in column blocks: ragspeed's CPU decode kernels.
 *
 * A step of a few tokens reads every weight once, so its products are bound by memory
 * bandwidth. The weight W [n, k] is stored as blocks of 16 output columns, [n/16][k][16]:
 * one block is a contiguous stream that the kernel reads once, front to back, multiplying
 * each 16-wide row by one broadcast input element. Read this way a product streams at the
 * machine's read bandwidth; oneDNN's and MKL's one-row products read at about half of it on
 * the 2-core development CPU (see engine/cpu_kernels/__init__.py).
 *
 * Every input row is accumulated the same way whatever the number of rows (four partial sums
 * over k, added pairwise at the end), so a token's result does not depend on the batch it ran
 * in: speculative verification and batched decoding give the bits plain decoding gives.
 *
 * GCC vector extensions (and intrinsics for widening int8): -march=native picks AVX-512, AVX2
 * or SSE.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));

#define BLOCK 16
#define ROWS 4 /* rows per pass: 4 rows x 4 partial sums = 16 of AVX-512's 32 registers */

static inline f32x16 load_f32(const float *p) { return *(const f32x16 *)p; }
/* 16 int8 weights widened to fp32 (GCC's generic conversion of a vector of int8 is scalar). */
static inline f32x16 load_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
    f32x16 v;
    memcpy(&v, halves, sizeof v);
    return v;
#else
    return __builtin_convertvector(*(const i8x16 *)p, f32x16);
#endif
}

/* y[first:first+16] = acc * scale + bias (scale and bias padded to whole blocks), the last
 * block only up to n. */
static inline void store(float *y, f32x16 acc, const float *scale, const float *bias, int first, int n) {
    if (scale) acc *= load_f32(scale + first);
    if (bias) acc += load_f32(bias + first);
    int count = n - first < BLOCK ? n - first : BLOCK;
    for (int i = 0; i < count; i++) y[first + i] = acc[i];
}

/* Rows r0..r0+R-1 of x times one block (16 columns): R is a compile-time constant, so the
 * R x 4 partial sums live in registers. */
#define BLOCK_ROWS(NAME, WTYPE, LOAD, R)                                                        \
    static inline void NAME(const WTYPE *block, const float *x, float *y, const float *scale,  \
                            const float *bias, int first, int n, int k) {                      \
        f32x16 acc[R][4];                                                                       \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                     \
            acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = (f32x16){0};                        \
        int j = 0;                                                                              \
        for (; j + 4 <= k; j += 4) {                                                            \
            const WTYPE *p = block + (size_t)j * BLOCK;                                         \
            f32x16 w0 = LOAD(p), w1 = LOAD(p + BLOCK), w2 = LOAD(p + 2 * BLOCK), w3 = LOAD(p + 3 * BLOCK); \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                               \
                const float *xr = x + (size_t)r * k + j;                                        \
                acc[r][0] += w0 * xr[0]; acc[r][1] += w1 * xr[1];                               \
                acc[r][2] += w2 * xr[2]; acc[r][3] += w3 * xr[3];                               \
            }                                                                                   \
        }                                                                                       \
        for (; j < k; j++) {                                                                    \
            f32x16 wj = LOAD(block + (size_t)j * BLOCK);                                        \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[r][j & 3] += wj * x[(size_t)r * k + j]; \
        }                                                                                       \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                     \
            store(y + (size_t)r * n, (acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]), scale, bias, first, n); \
    }

/* The product for one weight type: blocks split across threads, rows in passes of ROWS. */
#define GEMV(NAME, WTYPE, LOAD)                                                                 \
    BLOCK_ROWS(NAME##_1, WTYPE, LOAD, 1)                                                        \
    BLOCK_ROWS(NAME##_2, WTYPE, LOAD, 2)                                                        \
    BLOCK_ROWS(NAME##_3, WTYPE, LOAD, 3)                                                        \
    BLOCK_ROWS(NAME##_4, WTYPE, LOAD, 4)                                                        \
    static void NAME(const WTYPE *w, const float *scale, const float *bias, const float *x,    \
                     float *y, int m, int n, int k, int num_threads) {                         \
        int num_blocks = (n + BLOCK - 1) / BLOCK;                                               \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                  \
        for (int b = 0; b < num_blocks; b++) {                                                  \
            const WTYPE *block = w + (size_t)b * k * BLOCK;                                     \
            for (int r = 0; r < m; r += ROWS) {                                                 \
                const float *xr = x + (size_t)r * k;                                            \
                float *yr = y + (size_t)r * n;                                                  \
                switch (m - r < ROWS ? m - r : ROWS) {                                          \
                case 1: NAME##_1(block, xr, yr, scale, bias, b * BLOCK, n, k); break;           \
                case 2: NAME##_2(block, xr, yr, scale, bias, b * BLOCK, n, k); break;           \
                case 3: NAME##_3(block, xr, yr, scale, bias, b * BLOCK, n, k); break;           \
                default: NAME##_4(block, xr, yr, scale, bias, b * BLOCK, n, k); break;          \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

GEMV(gemv_f32, float, load_f32)
GEMV(gemv_i8, int8_t, load_i8)

/* y [m, n] = x [m, k] @ W.T + bias; w: W in blocks [ceil(n/16)][k][16] (zero-padded), fp32. */
void ragspeed_gemv_f32(const float *w, const float *bias, const float *x, float *y,
                       int m, int n, int k, int num_threads) {
    gemv_f32(w, NULL, bias, x, y, m, n, k, num_threads);
}

/* The same with int8 weights and one fp32 scale per output column (scale padded to blocks):
 * y = (x @ Q.T) * scale + bias, activations kept in fp32 (weight-only quantization). */
void ragspeed_gemv_i8(const int8_t *w, const float *scale, const float *bias, const float *x,
                      float *y, int m, int n, int k, int num_threads) {
    gemv_i8(w, scale, bias, x, y, m, n, k, num_threads);
}
