/* What the products' sources (gemv.c: fp32 and int8; gemv_gguf.c: GGUF's blocks) share: the rows
 * a pass takes, the GEMV macro that makes one weight type's product out of its row kernels, and
 * the input rows' rounding to int16 before the integer products.
 *
 * A step of a few tokens reads every weight once, so its products are bound by memory bandwidth.
 * The weight W [n, k] is stored as blocks of 16 output columns, [n/16][k][16]: one block is a
 * contiguous stream that the kernel reads once, front to back, multiplying each 16-wide row by
 * one broadcast input element. Read this way a product streams at close to the machine's read
 * bandwidth; oneDNN's and MKL's one-row products read at about half of it (`ragspeed bench
 * engine` measures both).
 *
 * Every input row is accumulated the same way whatever the number of rows (two partial sums over
 * each group of inputs, added at its end), so a token's result does not depend on the batch it
 * ran in: speculative verification and batched decoding give the bits plain decoding gives.
 */
#ifndef RAGSPEED_GEMV_H
#define RAGSPEED_GEMV_H

#include <omp.h>
#include <stdlib.h>

#include "internal.h"
#include "vector.h"

/* Rows per pass over a block: a verification of 1 + 4 rows reads each block once, not twice. */
#define ROWS 6
#define STEP 16 /* inputs that share one Q6_K step (gemv_gguf.c) */
#define PAIRS (GROUP / 2) /* input pairs of a group: the integer products' layout */

/* The products of one weight type (WTYPE values, STYPE scales): blocks split across the threads
 * of the enclosing parallel region (NAME##_team, ending in its barrier; internal.h declares it
 * for the decoder), rows in passes of ROWS; NAME opens a region.
 * PREPARE runs on each thread before its blocks, FINISH after; PASS(KERNEL) is one pass of rows. */
#define GEMV(NAME, WTYPE, STYPE, KERNEL, PREPARE, PASS, FINISH)                                 \
    KERNEL(NAME##_1, 1) KERNEL(NAME##_2, 2) KERNEL(NAME##_3, 3)                                 \
    KERNEL(NAME##_4, 4) KERNEL(NAME##_5, 5) KERNEL(NAME##_6, 6)                                 \
    void NAME##_team(const WTYPE *w, const STYPE *scale, const float *bias, const float *x,    \
                     float *y, int m, int n, int k) {                                          \
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

/* int8: each thread quantizes every row for itself (no barrier before the products); block b
 * is [ceil(k / 2)][16][2], its scales [groups][16]. */
#define I8_PREPARE                                                                              \
    int groups = (k + GROUP - 1) / GROUP;                                                       \
    size_t row = (size_t)groups * GROUP;                                                        \
    int16_t *xq = malloc(sizeof(int16_t) * m * row + sizeof(float) * m * groups);               \
    float *xs = (float *)(xq + m * row);                                                        \
    quantize_rows(x, m, k, xq, xs, NULL);

/* 4-bit: as int8, with the rows' group sums; block b is [k / 2][16] bytes, its steps and
 * offsets [groups][2][16]. */
#define Q4_PREPARE                                                                              \
    int groups = k / GROUP;                                                                     \
    size_t row = (size_t)groups * GROUP;                                                        \
    int16_t *xq = malloc(sizeof(int16_t) * m * row + 2 * sizeof(float) * m * groups);           \
    float *xs = (float *)(xq + m * row), *xsum = xs + (size_t)m * groups;                       \
    quantize_rows(x, m, k, xq, xs, xsum);

#endif
