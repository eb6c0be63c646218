/* y = x @ w^T (+ bias) for fp32 on an AVX2/FMA CPU, with w packed once at load time.
 *
 * Decode steps multiply a few rows (one per running sequence) by every weight matrix, a shape
 * the BLAS bundled with torch handles far below this machine's peak: a single row runs at a
 * fraction of memory bandwidth and 32 rows at about half the FMA rate. Here w is stored as
 * column panels ``[ceil(N / 16)][K][16]`` (zero-padded past N), so the inner loop streams one
 * panel linearly while a 6 x 16 block of outputs lives in twelve ymm registers: per k, two
 * panel loads and six broadcasts of x feed twelve FMAs (with AVX-512: a 12 x 16 block in twelve
 * zmm registers, one panel load and twelve broadcast FMAs per k, the same bits as each output
 * is still one k-ordered FMA chain). Threads split the panels, so every
 * weight byte is read from memory once per call; rows of x are taken in chunks that stay in
 * L2.
 *
 * ``packed_linear_q4`` / ``packed_linear_q8`` take the same panels stored as codes: for each
 * column and each 32 consecutive k, w = d * q + m with q in 0..15 (the shape of a GGUF Q4_1
 * block), or w = d * q with q in -128..127 (GGUF Q8_0). ``cpu_kernels.py`` uses them only when
 * that storage reproduces every fp32 weight bit for bit, and the kernel rebuilds each weight
 * with the same exact arithmetic before the same FMA chain per output: the result is bit for
 * bit the fp32 kernel's, from 0.75 or 1.125 bytes per weight instead of 4.
 * Built at run time by ``cpu_kernels.py`` (gcc -O3 -march=native -fopenmp).
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the packed linear kernel needs AVX2 and FMA"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp32_panel.h"

void pack_weight_f32(const float *w, float *wp, int64_t N, int64_t K) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                wp[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* Rows of x per pass: about X_CHUNK_FLOATS floats of x (rounded to whole register blocks), so
 * the rows every panel meets stay in cache; each pass reads every panel from memory again. The
 * AVX-512 block runs twice as fast, so there a pass takes 2 MiB of x (measured on Sapphire
 * Rapids: 128 rows at K = 2048 in one pass instead of three, +35% at 128 rows); 512 KiB keeps
 * older AVX2 parts' smaller L2 in mind. */
#ifndef X_CHUNK_FLOATS
#ifdef __AVX512F__
#define X_CHUNK_FLOATS 524288
#else
#define X_CHUNK_FLOATS 131072
#endif
#endif
static inline int64_t x_chunk_rows(int64_t K) {
    int64_t chunk = (X_CHUNK_FLOATS / (K > 0 ? K : 1)) / MR * MR;
    return chunk < MR ? MR : chunk;
}

void packed_linear_f32(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int nthreads) {
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t chunk = x_chunk_rows(K);
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mend = M - m0 < chunk ? M : m0 + chunk;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const float *panel = wp + p * K * NR;
            const int64_t n = p * NR, ncols = N - n < NR ? N - n : NR;
            float bpad[NR];
            const float *b = panel_bias(bias, n, ncols, bpad);
            /* Panels of one thread are adjacent (static schedule): the next one follows this one. */
            panel_rows(x, K, panel, b, y, N, n, ncols, m0, mend, p + 1 < panels ? panel + K * NR : NULL);
        }
    }
}

/* ---- lossless 4-bit and 8-bit panels ----
 * Panel p (columns 16p .. 16p + 15), block b (k = 32b .. 32b + 31):
 *  - 4-bit: 16 scales d and 16 offsets m (fp32, one per column), then 32 rows of 8 bytes, byte
 *    j of row kk holding the code of column j in its low nibble and of column j + 8 in its
 *    high one; w = d * q + m, q in 0..15 (a GGUF Q4_1 block);
 *  - 8-bit: 16 scales d, then 32 rows of 16 signed bytes (column j at byte j); w = d * q, q in
 *    -128..127 (a GGUF Q8_0 block).
 * ``bits`` is a compile-time constant wherever these helpers are inlined. */
#define QK 32      /* k per block */
#define QROWS 4    /* rows per register block when multiplying straight from the codes */
#define QDIRECT 4  /* up to this many rows, straight from the codes; beyond, via a scratch panel */

static inline int64_t qblock_bytes(const int bits) { return bits == 4 ? 2 * NR * 4 + QK * NR / 2 : NR * 4 + QK * NR; }

/* A block's scales (and offsets: zero for 8-bit) and where its codes start. */
static inline __attribute__((always_inline)) const uint8_t *q_scales(const int bits, const uint8_t *blk, __m256 *d0,
                                                                    __m256 *d1, __m256 *m0, __m256 *m1) {
    const float *dm = (const float *)blk;
    *d0 = _mm256_loadu_ps(dm);
    *d1 = _mm256_loadu_ps(dm + 8);
    if (bits == 4) {
        *m0 = _mm256_loadu_ps(dm + 16);
        *m1 = _mm256_loadu_ps(dm + 24);
        return blk + 2 * NR * 4;
    }
    *m0 = *m1 = _mm256_setzero_ps();
    return blk + NR * 4;
}

/* The 16 weights of the block's row ``kk``, rebuilt exactly (d * q is exact in fp32, so one
 * FMA with m rounds like the dequantizer's multiply-then-add). */
static inline __attribute__((always_inline)) void q_weights(const int bits, const uint8_t *codes, int kk, __m256 d0,
                                                           __m256 d1, __m256 m0, __m256 m1, __m256 *w0, __m256 *w1) {
    if (bits == 4) {
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + kk * NR / 2)));
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(e, _mm256_set1_epi32(15))), d0, m0);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(e, 4)), d1, m1);
    } else {
        const __m128i e = _mm_loadu_si128((const __m128i *)(codes + kk * NR));
        *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e)), d0);
        *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e, 8))), d1);
    }
}

/* One quantized panel as the fp32 panel ``[K][16]`` it stands for. */
static inline __attribute__((always_inline)) void q_unpack_panel(const int bits, const uint8_t *qp, int64_t K,
                                                                float *out) {
    for (int64_t kb = 0; kb < K / QK; kb++) {
        __m256 d0, d1, m0, m1;
        const uint8_t *codes = q_scales(bits, qp + kb * qblock_bytes(bits), &d0, &d1, &m0, &m1);
        float *o = out + kb * QK * NR;
        for (int kk = 0; kk < QK; kk++) {
            __m256 w0, w1;
            q_weights(bits, codes, kk, d0, d1, m0, m1, &w0, &w1);
            _mm256_storeu_ps(o + kk * NR, w0);
            _mm256_storeu_ps(o + kk * NR + 8, w1);
        }
    }
}

/* ``block`` for a quantized panel, rebuilding each k's weights in registers (few rows: the
 * codes are read once, and the weight bytes are what a step of few rows waits for). */
static inline __attribute__((always_inline)) void qblock(const int bits, const int rows, const float *restrict x,
                                                        int64_t K, const uint8_t *restrict qp, const float *bias,
                                                        float *restrict y, int64_t ldy, int64_t ncols) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00;
    for (int64_t kb = 0; kb < K / QK; kb++) {
        __m256 d0, d1, m0, m1;
        const uint8_t *codes = q_scales(bits, qp + kb * qblock_bytes(bits), &d0, &d1, &m0, &m1);
        for (int kk = 0; kk < QK; kk++) {
            const int64_t k = kb * QK + kk;
            __m256 w0, w1;
            q_weights(bits, codes, kk, d0, d1, m0, m1, &w0, &w1);
            ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3)
        }
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3)
}

/* Each OpenMP thread's scratch panel (the threads persist, so it is allocated once). */
static __thread float *q_scratch = NULL;
static __thread int64_t q_scratch_len = 0;

static inline __attribute__((always_inline)) void packed_linear_q(const int bits, const float *x, const uint8_t *qp,
                                                                 const float *bias, float *y, int64_t M, int64_t N,
                                                                 int64_t K, int nthreads) {
    const int64_t panels = (N + NR - 1) / NR, pbytes = K / QK * qblock_bytes(bits);
    const int direct = M <= QDIRECT;
    const int64_t chunk = direct ? M : x_chunk_rows(K);
#pragma omp parallel num_threads(nthreads)
    {
        float *panel = NULL;
        if (!direct) {
            if (q_scratch_len < K * NR) {
                free(q_scratch);
                q_scratch = aligned_alloc(64, (size_t)(K * NR) * sizeof(float));
                q_scratch_len = q_scratch ? K * NR : 0;
            }
            panel = q_scratch;
        }
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t mend = M - m0 < chunk ? M : m0 + chunk;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const uint8_t *q = qp + p * pbytes;
                const int64_t n = p * NR, ncols = N - n < NR ? N - n : NR;
                float bpad[NR];
                const float *b = panel_bias(bias, n, ncols, bpad);
                if (p + 1 < panels && m0 == 0) /* this thread's next panel, into L2 */
                    for (int64_t off = 0; off < pbytes; off += 64)
                        _mm_prefetch((const char *)(q + pbytes + off), _MM_HINT_T1);
                int64_t m = m0;
                if (direct || panel == NULL) { /* few rows (or no scratch memory): from the codes */
                    for (; m + QROWS <= mend; m += QROWS)
                        qblock(bits, QROWS, x + m * K, K, q, b, y + m * N + n, N, ncols);
                    switch (mend - m) {
                    case 3: qblock(bits, 3, x + m * K, K, q, b, y + m * N + n, N, ncols); break;
                    case 2: qblock(bits, 2, x + m * K, K, q, b, y + m * N + n, N, ncols); break;
                    case 1: qblock(bits, 1, x + m * K, K, q, b, y + m * N + n, N, ncols); break;
                    }
                    continue;
                }
                q_unpack_panel(bits, q, K, panel);
                panel_rows(x, K, panel, b, y, N, n, ncols, m, mend, NULL);
            }
        }
    }
}

/* y = x @ w^T (+ bias) with w as 4-bit or 8-bit panels (``packed`` points at their bytes); K
 * must be a multiple of 32. The same signature as packed_linear_f32, so the decoder step can
 * call any of them through one pointer type. */
void packed_linear_q4(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int nthreads) {
    packed_linear_q(4, x, (const uint8_t *)packed, bias, y, M, N, K, nthreads);
}

void packed_linear_q8(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int nthreads) {
    packed_linear_q(8, x, (const uint8_t *)packed, bias, y, M, N, K, nthreads);
}

/* The fp32 panels (``[panels][K][16]``, as pack_weight_f32 writes them) that quantized panels
 * of ``bits`` (4 or 8) stand for: the packer's bit-for-bit check. */
void unpack_quantized(const uint8_t *qp, float *wp, int64_t N, int64_t K, int bits) {
    const int64_t panels = (N + NR - 1) / NR, pbytes = K / QK * qblock_bytes(bits == 4 ? 4 : 8);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        if (bits == 4)
            q_unpack_panel(4, qp + p * pbytes, K, wp + p * K * NR);
        else
            q_unpack_panel(8, qp + p * pbytes, K, wp + p * K * NR);
    }
}
