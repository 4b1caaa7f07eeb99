/* ragspeed's prefill products on a GGUF file's 4-bit blocks with integer multiply-adds
 * (engine.native.compute.cpu_kernels.int8_prefill), int8 or int16 activations; built with the decode kernels
 * (gemv.c, attention.c, ...) into one library (build.py), its exported functions declared in
 * kernels.h.
 *
 *
 * A prefill chunk's products are bound by arithmetic, and integer multiply-adds run at 2x
 * (AVX2 vpmaddubsw) to 4x (AVX-512 VNNI vpdpbusd) the fp32 rate. So, as llama.cpp does for
 * every CPU product (its Q8_1), each input row is rounded to int8 per group of GROUP inputs
 * (`quantize_q8`: a step s = max |x| / 127, q = rint(x / s), and the group's sum s * sum q)
 * and multiplied with the file's 4-bit values (Q4_0 and Q4_1: w = d * q + m, q in 0..15) in
 * integers:
 *
 *   sum x w = s * d * (sum_i xq_i q_i) + m * (s * sum_i xq_i)
 *
 * the first sum exact in int32, one fp32 multiply-add a group for each term.
 *
 * Layout (engine.native.compute.cpu_kernels.int8_prefill): the weight's 4-bit values one a byte, in blocks of
 * 16 output columns and quads of 4 inputs, [ceil(n / 16)][k / 4][16][4] (a quad of a column is
 * the 4 bytes vpdpbusd sums into one lane); each group's steps and offsets in fp32, [ceil(n /
 * 16)][k / GROUP][2][16]. k is a multiple of GROUP.
 *
 * Tiling: rows in chunks of Q8_CHUNK (their int8 activations stay in L2), each chunk's blocks
 * split across the threads, and a block read once for every pass of Q8_ROWS rows of the chunk:
 * a block's 16 columns of a 576-input weight are 9 KiB, in L1 across the passes. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kernels_common.h"

#define Q8_CHUNK 256
#define QUADS (GROUP / 4)

/* x [m, k] -> xq [m, k] int8, xs [m, k / GROUP] (each group's step), xsum [m, k / GROUP] (the
 * step times the group's sum of xq). rintf rounds to nearest, ties to even. */
void ragspeed_quantize_q8(const float *x, int m, int k, int8_t *xq, float *xs, float *xsum,
                          int num_threads) {
    int groups = k / GROUP;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(num_threads > 1 && m >= 16)")
    for (int r = 0; r < m; r++)
        for (int g = 0; g < groups; g++) {
            const float *xg = x + (size_t)r * k + g * GROUP;
            int8_t *qg = xq + (size_t)r * k + g * GROUP;
            float amax = 0.0f;
            for (int i = 0; i < GROUP; i++) {
                float a = __builtin_fabsf(xg[i]);
                amax = a > amax ? a : amax;
            }
            float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < GROUP; i++) {
                int32_t q = (int32_t)__builtin_rintf(xg[i] * inverse);
                qg[i] = (int8_t)q;
                sum += q;
            }
            float step = amax / 127.0f;
            xs[(size_t)r * groups + g] = step;
            xsum[(size_t)r * groups + g] = (float)sum * step;
        }
}

static inline int32_t quad_of(const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, sizeof quad);
    return quad;
}

/* Rows r0..r0+R-1 (xq with a row stride of k) times one block: per group, each row's 16 int32
 * sums in registers, then its fp32 totals updated once. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_ROWS 8
#define U4Q8_ROWS(NAME, R)                                                                       \
    static inline void NAME(const uint8_t *block, const int8_t *xq, const float *xs,             \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        __m512 total[R];                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();     \
        for (int g = 0; g < groups; g++) {                                                      \
            __m512i acc[R];                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512(); \
            _Pragma("GCC unroll 8") for (int t = 0; t < QUADS; t++) {                           \
                __m512i w = _mm512_loadu_si512(block + ((size_t)g * QUADS + t) * 4 * BLOCK);    \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                             \
                    acc[r] = _mm512_dpbusd_epi32(                                               \
                        acc[r], w, _mm512_set1_epi32(quad_of(xq + (size_t)r * k + g * GROUP + 4 * t))); \
            }                                                                                   \
            __m512 d = _mm512_loadu_ps(scales + (size_t)g * 2 * BLOCK);                         \
            __m512 m = _mm512_loadu_ps(scales + (size_t)g * 2 * BLOCK + BLOCK);                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[(size_t)r * groups + g]), total[r]); \
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),                           \
                                           _mm512_mul_ps(d, _mm512_set1_ps(xs[(size_t)r * groups + g])), total[r]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm512_storeu_ps(sums, total[r]);                                                   \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: vpmaddubsw multiplies the unsigned 4-bit values by the signed int8 inputs and adds
 * adjacent pairs into int16, |pair| <= 2 x 15 x 127 = 3,810; a group's 8 quads add in int16
 * (<= 30,480 < 32,767: no saturation) before one vpmaddwd by ones widens them to int32.
 * (AVX-VNNI's 256-bit vpdpbusd, where present, does both in one instruction.) */
#define Q8_ROWS 4
#if defined(__AVXVNNI__)
#define U4Q8_QUAD(acc16, w, xb) (acc16 = _mm256_dpbusd_avx_epi32(acc16, w, xb))
#define U4Q8_WIDEN(acc16) (acc16)
#else
#define U4Q8_QUAD(acc16, w, xb) (acc16 = _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, xb)))
#define U4Q8_WIDEN(acc16) _mm256_madd_epi16(acc16, _mm256_set1_epi16(1))
#endif
#define U4Q8_ROWS(NAME, R)                                                                       \
    static inline void NAME(const uint8_t *block, const int8_t *xq, const float *xs,             \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        __m256 total[R][2];                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                     \
            total[r][0] = total[r][1] = _mm256_setzero_ps();                                    \
        for (int g = 0; g < groups; g++) {                                                      \
            __m256i acc[R][2];                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                 \
                acc[r][0] = acc[r][1] = _mm256_setzero_si256();                                 \
            _Pragma("GCC unroll 8") for (int t = 0; t < QUADS; t++) {                           \
                const uint8_t *p = block + ((size_t)g * QUADS + t) * 4 * BLOCK;                 \
                __m256i w0 = _mm256_loadu_si256((const __m256i *)p);                            \
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 32));                     \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                           \
                    __m256i xb = _mm256_set1_epi32(quad_of(xq + (size_t)r * k + g * GROUP + 4 * t)); \
                    U4Q8_QUAD(acc[r][0], w0, xb);                                               \
                    U4Q8_QUAD(acc[r][1], w1, xb);                                               \
                }                                                                               \
            }                                                                                   \
            const float *sc = scales + (size_t)g * 2 * BLOCK;                                   \
            __m256 d0 = _mm256_loadu_ps(sc), d1 = _mm256_loadu_ps(sc + 8);                      \
            __m256 m0 = _mm256_loadu_ps(sc + 16), m1 = _mm256_loadu_ps(sc + 24);                \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                __m256 sx = _mm256_set1_ps(xs[(size_t)r * groups + g]);                         \
                __m256 sm = _mm256_set1_ps(xsum[(size_t)r * groups + g]);                       \
                total[r][0] = _mm256_fmadd_ps(m0, sm, total[r][0]);                             \
                total[r][1] = _mm256_fmadd_ps(m1, sm, total[r][1]);                             \
                total[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(U4Q8_WIDEN(acc[r][0])), _mm256_mul_ps(d0, sx), total[r][0]); \
                total[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(U4Q8_WIDEN(acc[r][1])), _mm256_mul_ps(d1, sx), total[r][1]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm256_storeu_ps(sums, total[r][0]);                                                \
            _mm256_storeu_ps(sums + 8, total[r][1]);                                            \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#else /* the same sums in plain C */
#define Q8_ROWS 4
#define U4Q8_ROWS(NAME, R)                                                                       \
    static inline void NAME(const uint8_t *block, const int8_t *xq, const float *xs,             \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        float total[R][BLOCK] = {{0}};                                                          \
        for (int g = 0; g < groups; g++) {                                                      \
            int32_t acc[R][BLOCK] = {{0}};                                                      \
            for (int t = 0; t < QUADS; t++) {                                                   \
                const uint8_t *p = block + ((size_t)g * QUADS + t) * 4 * BLOCK;                 \
                for (int r = 0; r < R; r++) {                                                   \
                    const int8_t *xr = xq + (size_t)r * k + g * GROUP + 4 * t;                  \
                    for (int c = 0; c < BLOCK; c++)                                             \
                        for (int i = 0; i < 4; i++) acc[r][c] += p[4 * c + i] * xr[i];          \
                }                                                                               \
            }                                                                                   \
            const float *sc = scales + (size_t)g * 2 * BLOCK;                                   \
            for (int r = 0; r < R; r++)                                                         \
                for (int c = 0; c < BLOCK; c++) {                                               \
                    total[r][c] = __builtin_fmaf(sc[BLOCK + c], xsum[(size_t)r * groups + g], total[r][c]); \
                    total[r][c] = __builtin_fmaf((float)acc[r][c], sc[c] * xs[(size_t)r * groups + g], total[r][c]); \
                }                                                                               \
        }                                                                                       \
        for (int r = 0; r < R; r++) store_sums(y + (size_t)r * n, total[r], bias, first, n);   \
    }
#endif
U4Q8_ROWS(u4q8_1, 1) U4Q8_ROWS(u4q8_2, 2) U4Q8_ROWS(u4q8_3, 3) U4Q8_ROWS(u4q8_4, 4)
#if Q8_ROWS > 4
U4Q8_ROWS(u4q8_5, 5) U4Q8_ROWS(u4q8_6, 6) U4Q8_ROWS(u4q8_7, 7) U4Q8_ROWS(u4q8_8, 8)
#endif

/* Rows [r0, end) of a chunk, already quantized (xq with a row stride of k, xs and xsum with
 * one of groups), times this thread's share of the blocks (the enclosing region's `omp for`). */
static void u4q8_chunk(const uint8_t *w, const float *scale, const float *bias, const int8_t *xq,
                       const float *xs, const float *xsum, float *y, int rows, int n, int k) {
    int num_blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
    _Pragma("omp for schedule(static) nowait")
    for (int b = 0; b < num_blocks; b++) {
        const uint8_t *block = w + (size_t)b * k * BLOCK;
        const float *sc = scale + (size_t)b * groups * 2 * BLOCK;
        for (int r = 0; r < rows; r += Q8_ROWS) {
            const int8_t *xr = xq + (size_t)r * k;
            const float *sr = xs + (size_t)r * groups, *mr = xsum + (size_t)r * groups;
            float *yr = y + (size_t)r * n;
            switch (rows - r < Q8_ROWS ? rows - r : Q8_ROWS) {
            case 1: u4q8_1(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
            case 2: u4q8_2(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
            case 3: u4q8_3(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
#if Q8_ROWS > 4
            case 4: u4q8_4(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
            case 5: u4q8_5(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
            case 6: u4q8_6(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
            case 7: u4q8_7(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
            default: u4q8_8(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
#else
            default: u4q8_4(block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k); break;
#endif
            }
        }
    }
}

/* y [m, n] = x @ (d * q + m).T + bias for x given quantized (ragspeed_quantize_q8: xq, xs,
 * xsum) and the weight in the layout above. */
void ragspeed_gemm_u4q8(const uint8_t *w, const float *scale, const float *bias, const int8_t *xq,
                        const float *xs, const float *xsum, float *y, int m, int n, int k,
                        int num_threads) {
    int groups = k / GROUP;
    _Pragma("omp parallel num_threads(num_threads)")
    for (int r0 = 0; r0 < m; r0 += Q8_CHUNK) {
        int rows = m - r0 < Q8_CHUNK ? m - r0 : Q8_CHUNK;
        u4q8_chunk(w, scale, bias, xq + (size_t)r0 * k, xs + (size_t)r0 * groups,
                   xsum + (size_t)r0 * groups, y + (size_t)r0 * n, rows, n, k);
    }
}

/* The same from fp32 rows x [m, k]: each thread rounds every row of a chunk for itself, into
 * its own buffer, which then stays in its L2 for its blocks: no barrier between rounding and
 * products (on a machine shared with other work a barrier waits for a descheduled thread: the
 * rounding alone took 11.8 ms on 2 threads against 0.9 ms on 1, 2,048 x 576, AMD EPYC). The
 * rows round as ragspeed_quantize_q8 rounds them, so the products are the same bits. */
void ragspeed_gemm_u4f32(const uint8_t *w, const float *scale, const float *bias, const float *x,
                         float *y, int m, int n, int k, int num_threads) {
    int groups = k / GROUP;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        int chunk = m < Q8_CHUNK ? m : Q8_CHUNK;
        int8_t *xq = malloc((size_t)chunk * k + 2 * sizeof(float) * chunk * groups + 64);
        float *xs = (float *)(xq + (((size_t)chunk * k + 63) & ~(size_t)63)), *xsum = xs + (size_t)chunk * groups;
        for (int r0 = 0; r0 < m; r0 += Q8_CHUNK) {
            int rows = m - r0 < Q8_CHUNK ? m - r0 : Q8_CHUNK;
            ragspeed_quantize_q8(x + (size_t)r0 * k, rows, k, xq, xs, xsum, 1);
            u4q8_chunk(w, scale, bias, xq, xs, xsum, y + (size_t)r0 * n, rows, n, k);
        }
        free(xq);
    }
}

/* The same with int16 activations: each group of GROUP inputs rounded to int16 (quantize_rows:
 * steps of max |x| / 32767, the decode kernels' rounding, 256x finer than int8's) and
 * multiplied by the 4-bit values widened to int16 (AVX-512 VNNI vpdpwssd, AVX2 vpmaddwd: half
 * the int8 products' rate, twice fp32's). Layout: values one a byte in pairs of inputs,
 * [ceil(n / 16)][k / 2][16][2] (a pair of a column is what vpdpwssd sums into one lane); steps
 * and offsets as above. |sum xq q| <= 32 x 15 x 32767 < 2^31. */
#define PAIRS16 (GROUP / 2)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX-512: rows times C blocks at once (C = 2 but for an odd last block), so that a pair of
 * inputs broadcast once serves C blocks: 2 weight loads and R broadcasts a 2R multiply-adds,
 * where one block took R + 1 loads a R (1.12x). */
#define U4Q16_COLUMNS 2
#define U4Q16_ROWS(NAME, R, C)                                                                   \
    static inline void NAME(const uint8_t *block, const int16_t *xq, const float *xs,            \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        size_t block_bytes = (size_t)k * BLOCK, block_scales = (size_t)groups * 2 * BLOCK;      \
        __m512 total[R][C];                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                     \
            _Pragma("GCC unroll 2") for (int c = 0; c < C; c++) total[r][c] = _mm512_setzero_ps(); \
        for (int g = 0; g < groups; g++) {                                                      \
            __m512i acc[R][C];                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                 \
                _Pragma("GCC unroll 2") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_si512(); \
            _Pragma("GCC unroll 2") for (int t = 0; t < PAIRS16; t++) {                         \
                __m512i w[C];                                                                   \
                _Pragma("GCC unroll 2") for (int c = 0; c < C; c++) w[c] = _mm512_cvtepu8_epi16( \
                    _mm256_loadu_si256((const __m256i *)(block + c * block_bytes + ((size_t)g * PAIRS16 + t) * 2 * BLOCK))); \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                           \
                    int32_t pair;                                                               \
                    memcpy(&pair, xq + (size_t)r * k + g * GROUP + 2 * t, sizeof pair);         \
                    __m512i x = _mm512_set1_epi32(pair);                                        \
                    _Pragma("GCC unroll 2") for (int c = 0; c < C; c++) DPWSSD_512(acc[r][c], w[c], x); \
                }                                                                               \
            }                                                                                   \
            _Pragma("GCC unroll 2") for (int c = 0; c < C; c++) {                               \
                __m512 d = _mm512_loadu_ps(scales + c * block_scales + (size_t)g * 2 * BLOCK);  \
                __m512 m = _mm512_loadu_ps(scales + c * block_scales + (size_t)g * 2 * BLOCK + BLOCK); \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                           \
                    total[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[(size_t)r * groups + g]), total[r][c]); \
                    total[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]),                 \
                                                  _mm512_mul_ps(d, _mm512_set1_ps(xs[(size_t)r * groups + g])), total[r][c]); \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                     \
            _Pragma("GCC unroll 2") for (int c = 0; c < C; c++) {                               \
                float sums[BLOCK];                                                              \
                _mm512_storeu_ps(sums, total[r][c]);                                            \
                store_sums(y + (size_t)r * n, sums, bias, first + c * BLOCK, n);                \
            }                                                                                   \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#define U4Q16_COLUMNS 1
#define U4Q16_ROWS(NAME, R, C) /* C: 1 */                                                        \
    static inline void NAME(const uint8_t *block, const int16_t *xq, const float *xs,            \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        __m256 total[R][2];                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                     \
            total[r][0] = total[r][1] = _mm256_setzero_ps();                                    \
        for (int g = 0; g < groups; g++) {                                                      \
            __m256i acc[R][2];                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                 \
                acc[r][0] = acc[r][1] = _mm256_setzero_si256();                                 \
            _Pragma("GCC unroll 4") for (int t = 0; t < PAIRS16; t++) {                         \
                const uint8_t *p = block + ((size_t)g * PAIRS16 + t) * 2 * BLOCK;               \
                __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));         \
                __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                           \
                    int32_t pair;                                                               \
                    memcpy(&pair, xq + (size_t)r * k + g * GROUP + 2 * t, sizeof pair);         \
                    __m256i xb = _mm256_set1_epi32(pair);                                       \
                    acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));         \
                    acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));         \
                }                                                                               \
            }                                                                                   \
            const float *sc = scales + (size_t)g * 2 * BLOCK;                                   \
            __m256 d0 = _mm256_loadu_ps(sc), d1 = _mm256_loadu_ps(sc + 8);                      \
            __m256 m0 = _mm256_loadu_ps(sc + 16), m1 = _mm256_loadu_ps(sc + 24);                \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                __m256 sx = _mm256_set1_ps(xs[(size_t)r * groups + g]);                         \
                __m256 sm = _mm256_set1_ps(xsum[(size_t)r * groups + g]);                       \
                total[r][0] = _mm256_fmadd_ps(m0, sm, total[r][0]);                             \
                total[r][1] = _mm256_fmadd_ps(m1, sm, total[r][1]);                             \
                total[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(d0, sx), total[r][0]); \
                total[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(d1, sx), total[r][1]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
            float sums[BLOCK];                                                                  \
            _mm256_storeu_ps(sums, total[r][0]);                                                \
            _mm256_storeu_ps(sums + 8, total[r][1]);                                            \
            store_sums(y + (size_t)r * n, sums, bias, first, n);                                \
        }                                                                                       \
    }
#else /* the same sums in plain C */
#define U4Q16_COLUMNS 1
#define U4Q16_ROWS(NAME, R, C) /* C: 1 */                                                        \
    static inline void NAME(const uint8_t *block, const int16_t *xq, const float *xs,            \
                            const float *xsum, const float *scales, float *y, const float *bias, \
                            int first, int n, int k) {                                          \
        int groups = k / GROUP;                                                                 \
        float total[R][BLOCK] = {{0}};                                                          \
        for (int g = 0; g < groups; g++) {                                                      \
            int32_t acc[R][BLOCK] = {{0}};                                                      \
            for (int t = 0; t < PAIRS16; t++) {                                                 \
                const uint8_t *p = block + ((size_t)g * PAIRS16 + t) * 2 * BLOCK;               \
                for (int r = 0; r < R; r++) {                                                   \
                    const int16_t *xr = xq + (size_t)r * k + g * GROUP + 2 * t;                 \
                    for (int c = 0; c < BLOCK; c++) acc[r][c] += p[2 * c] * xr[0] + p[2 * c + 1] * xr[1]; \
                }                                                                               \
            }                                                                                   \
            const float *sc = scales + (size_t)g * 2 * BLOCK;                                   \
            for (int r = 0; r < R; r++)                                                         \
                for (int c = 0; c < BLOCK; c++) {                                               \
                    total[r][c] = __builtin_fmaf(sc[BLOCK + c], xsum[(size_t)r * groups + g], total[r][c]); \
                    total[r][c] = __builtin_fmaf((float)acc[r][c], sc[c] * xs[(size_t)r * groups + g], total[r][c]); \
                }                                                                               \
        }                                                                                       \
        for (int r = 0; r < R; r++) store_sums(y + (size_t)r * n, total[r], bias, first, n);   \
    }
#endif
/* Rows of a pass times C blocks: u4q16_<R>x<C>. */
#define U4Q16_ALL(C)                                                                             \
    U4Q16_ROWS(u4q16_1x##C, 1, C) U4Q16_ROWS(u4q16_2x##C, 2, C) U4Q16_ROWS(u4q16_3x##C, 3, C)    \
    U4Q16_ROWS(u4q16_4x##C, 4, C) U4Q16_ROWS(u4q16_5x##C, 5, C) U4Q16_ROWS(u4q16_6x##C, 6, C)    \
    U4Q16_ROWS(u4q16_7x##C, 7, C) U4Q16_ROWS(u4q16_8x##C, 8, C)
U4Q16_ALL(1)
#if U4Q16_COLUMNS == 2
U4Q16_ALL(2)
#endif
#define U4Q16_PASS(C, rows, ...)                                                                 \
    switch (rows) {                                                                             \
    case 1: u4q16_1x##C(__VA_ARGS__); break;                                                    \
    case 2: u4q16_2x##C(__VA_ARGS__); break;                                                    \
    case 3: u4q16_3x##C(__VA_ARGS__); break;                                                    \
    case 4: u4q16_4x##C(__VA_ARGS__); break;                                                    \
    case 5: u4q16_5x##C(__VA_ARGS__); break;                                                    \
    case 6: u4q16_6x##C(__VA_ARGS__); break;                                                    \
    case 7: u4q16_7x##C(__VA_ARGS__); break;                                                    \
    default: u4q16_8x##C(__VA_ARGS__); break;                                                   \
    }

/* The chunk's tiles of U4Q16_COLUMNS blocks (the last may have fewer) split across the threads,
 * each read once for every pass of Q8_ROWS rows. */
static void u4q16_chunk(const uint8_t *w, const float *scale, const float *bias, const int16_t *xq,
                        const float *xs, const float *xsum, float *y, int rows, int n, int k) {
    int num_blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
    int tiles = (num_blocks + U4Q16_COLUMNS - 1) / U4Q16_COLUMNS;
    _Pragma("omp for schedule(static) nowait")
    for (int i = 0; i < tiles; i++) {
        int b = i * U4Q16_COLUMNS, whole = num_blocks - b >= U4Q16_COLUMNS;
        const uint8_t *block = w + (size_t)b * k * BLOCK;
        const float *sc = scale + (size_t)b * groups * 2 * BLOCK;
        for (int r = 0; r < rows; r += Q8_ROWS) {
            const int16_t *xr = xq + (size_t)r * k;
            const float *sr = xs + (size_t)r * groups, *mr = xsum + (size_t)r * groups;
            float *yr = y + (size_t)r * n;
            int pass = rows - r < Q8_ROWS ? rows - r : Q8_ROWS;
#if U4Q16_COLUMNS == 2
            if (whole) {
                U4Q16_PASS(2, pass, block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k)
                continue;
            }
#endif
            (void)whole;
            U4Q16_PASS(1, pass, block, xr, sr, mr, sc, yr, bias, b * BLOCK, n, k)
        }
    }
}

/* y [m, n] = x @ (d * q + m).T + bias, x [m, k] rounded to int16 per group by each thread for
 * itself, a chunk at a time (as ragspeed_gemm_u4f32); w in pairs, [ceil(n / 16)][k / 2][16][2]. */
void ragspeed_gemm_u4i16(const uint8_t *w, const float *scale, const float *bias, const float *x,
                         float *y, int m, int n, int k, int num_threads) {
    int groups = k / GROUP;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        int chunk = m < Q8_CHUNK ? m : Q8_CHUNK;
        int16_t *xq = malloc(sizeof(int16_t) * ((size_t)chunk * k + 32) + 2 * sizeof(float) * chunk * groups);
        float *xs = (float *)(xq + (size_t)chunk * k + 32), *xsum = xs + (size_t)chunk * groups;
        for (int r0 = 0; r0 < m; r0 += Q8_CHUNK) {
            int rows = m - r0 < Q8_CHUNK ? m - r0 : Q8_CHUNK;
            quantize_rows(x + (size_t)r0 * k, rows, k, xq, xs, xsum);
            u4q16_chunk(w, scale, bias, xq, xs, xsum, y + (size_t)r0 * n, rows, n, k);
        }
        free(xq);
    }
}

/* Which of the products above this build runs: 2 AVX-512 VNNI, 1 AVX2 (or AVX-VNNI), 0 plain C. */
int ragspeed_u4q8_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
