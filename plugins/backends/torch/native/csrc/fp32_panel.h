/* The fp32 6 x 16 (AVX-512: 12 x 16) register-blocked microkernel shared by the linear kernels (included, not
 * compiled on its own; the kernel cache key covers this file too): rows of x times one column
 * panel ``[K][16]`` of weights, as ``packed_linear.c`` stores them and as ``gguf_linear.c``
 * unpacks quantized rows into per thread. */
#ifndef LLMSERVE_FP32_PANEL_H
#define LLMSERVE_FP32_PANEL_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 16 /* output columns per panel: two ymm registers */
#ifdef __AVX512F__
#define MR 12 /* rows of x per register block: twelve zmm accumulators, one per row */
#else
#define MR 6  /* rows of x per register block: twelve ymm accumulators, two per row */
#endif

static inline void store_row(__m256 lo, __m256 hi, const float *bias, float *y, int64_t ncols) {
    if (bias) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    if (ncols == NR) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
        return;
    }
    float buf[NR];
    _mm256_storeu_ps(buf, lo);
    _mm256_storeu_ps(buf + 8, hi);
    memcpy(y, buf, sizeof(float) * (size_t)ncols);
}

/* One block of ``rows`` (1..MR, a compile-time constant after inlining) rows of x times one
 * panel. Named accumulators rather than an array: gcc keeps them in registers only this way. */
#define ROW_FMA(i)                                                              \
    if (rows > i) {                                                             \
        const __m256 xb = _mm256_broadcast_ss(x + i * K + k);                   \
        c##i##0 = _mm256_fmadd_ps(xb, w0, c##i##0);                             \
        c##i##1 = _mm256_fmadd_ps(xb, w1, c##i##1);                             \
    }
#define ROW_STORE(i) \
    if (rows > i) store_row(c##i##0, c##i##1, bias, y + i * ldy, ncols);

#ifdef __AVX512F__
/* The AVX-512 block: one zmm holds a whole panel row, so per k one load and MR broadcast FMAs
 * (twice the rows per load of the ymm block). Each output is still one k-ordered FMA chain in
 * one lane, then the bias add: the same bits as the AVX2 block. */
#define ROW_FMA16(i) \
    if (rows > i) c##i = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k]), w, c##i);
#define ROW_STORE16(i) \
    if (rows > i) store_row16(c##i, bias, y + i * ldy, ncols);

static inline void store_row16(__m512 c, const float *bias, float *y, int64_t ncols) {
    if (bias) c = _mm512_add_ps(c, _mm512_loadu_ps(bias)); /* panel_bias pads to NR */
    if (ncols == NR)
        _mm512_storeu_ps(y, c);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << ncols) - 1), c);
}

static inline __attribute__((always_inline)) void block(const int rows, const float *restrict x, int64_t K,
                                                       const float *restrict panel, const float *bias,
                                                       float *restrict y, int64_t ldy, int64_t ncols,
                                                       const float *next) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    __m512 c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    for (int64_t k = 0; k < K; k++) {
        const __m512 w = _mm512_loadu_ps(panel + k * NR);
        if (next) _mm_prefetch((const char *)(next + k * NR), _MM_HINT_T1); /* one 64-byte line per k */
        ROW_FMA16(0) ROW_FMA16(1) ROW_FMA16(2) ROW_FMA16(3) ROW_FMA16(4) ROW_FMA16(5)
        ROW_FMA16(6) ROW_FMA16(7) ROW_FMA16(8) ROW_FMA16(9) ROW_FMA16(10) ROW_FMA16(11)
    }
    ROW_STORE16(0) ROW_STORE16(1) ROW_STORE16(2) ROW_STORE16(3) ROW_STORE16(4) ROW_STORE16(5)
    ROW_STORE16(6) ROW_STORE16(7) ROW_STORE16(8) ROW_STORE16(9) ROW_STORE16(10) ROW_STORE16(11)
}

#else
/* ``next``: the panel this thread multiplies next, prefetched into L2 line by line while this
 * one is computed (NULL: no prefetch), so its DRAM latency overlaps with the FMAs. */
static inline __attribute__((always_inline)) void block(const int rows, const float *restrict x, int64_t K,
                                                       const float *restrict panel, const float *bias,
                                                       float *restrict y, int64_t ldy, int64_t ncols,
                                                       const float *next) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(panel + k * NR), w1 = _mm256_loadu_ps(panel + k * NR + 8);
        if (next) _mm_prefetch((const char *)(next + k * NR), _MM_HINT_T1); /* one 64-byte line per k */
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

#endif

/* Rows m .. mend - 1 of x times one fp32 panel (columns n .. n + ncols - 1 of y), MR rows at
 * a time (either block above); the first block prefetches ``next`` (may be NULL). */
static void panel_rows(const float *x, int64_t K, const float *panel, const float *b, float *y, int64_t N,
                       int64_t n, int64_t ncols, int64_t m, int64_t mend, const float *next) {
    const int64_t first = m;
    for (; m + MR <= mend; m += MR)
        block(MR, x + m * K, K, panel, b, y + m * N + n, N, ncols, m == first ? next : NULL);
    const float *pf = m == first ? next : NULL;
#define TAIL(r) case r: block(r, x + m * K, K, panel, b, y + m * N + n, N, ncols, pf); break;
    switch (mend - m) {
#if MR > 6
    TAIL(11) TAIL(10) TAIL(9) TAIL(8) TAIL(7) TAIL(6)
#endif
    TAIL(5) TAIL(4) TAIL(3) TAIL(2) TAIL(1)
    }
#undef TAIL
}

/* The bias of a panel's columns, zero-padded to NR in ``pad`` (NULL without a bias). */
static inline const float *panel_bias(const float *bias, int64_t n, int64_t ncols, float *pad) {
    if (!bias) return NULL;
    memset(pad, 0, sizeof(float) * NR);
    memcpy(pad, bias + n, sizeof(float) * (size_t)ncols);
    return pad;
}

#endif
