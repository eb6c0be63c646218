/* y = x @ w^T (+ bias) for fp32 on an AVX2/FMA CPU, with w packed once at load time.
 *
 * Decode steps multiply a few rows (one per running sequence) by every weight matrix, a shape
 * the BLAS bundled with torch handles far below this machine's peak: a single row runs at a
 * fraction of memory bandwidth and 32 rows at about half the FMA rate. Here w is stored as
 * column panels ``[ceil(N / 16)][K][16]`` (zero-padded past N), so the inner loop streams one
 * panel linearly while a 6 x 16 block of outputs lives in twelve ymm registers: per k, two
 * panel loads and six broadcasts of x feed twelve FMAs. Threads split the panels, so every
 * weight byte is read from memory once per call; rows of x are taken in chunks that stay in
 * L2. Built at run time by ``cpu_kernels.py`` (gcc -O3 -march=native -fopenmp).
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the packed linear kernel needs AVX2 and FMA"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 16 /* output columns per panel: two ymm registers */
#define MR 6  /* rows of x per register block */

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

void packed_linear_f32(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int nthreads) {
    const int64_t panels = (N + NR - 1) / NR;
    /* Rows per pass: about 512 KiB of x, so the rows every panel meets stay in L2. */
    int64_t chunk = (131072 / (K > 0 ? K : 1)) / MR * MR;
    if (chunk < MR) chunk = MR;
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mend = M - m0 < chunk ? M : m0 + chunk;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const float *panel = wp + p * K * NR;
            const int64_t n = p * NR, ncols = N - n < NR ? N - n : NR;
            float bpad[NR] = {0};
            const float *b = NULL;
            if (bias) {
                memcpy(bpad, bias + n, sizeof(float) * (size_t)ncols);
                b = bpad;
            }
            /* Panels of one thread are adjacent (static schedule): the next one follows this one. */
            const float *next = p + 1 < panels ? panel + K * NR : NULL;
            int64_t m = m0;
            for (; m + MR <= mend; m += MR)
                block(MR, x + m * K, K, panel, b, y + m * N + n, N, ncols, m == m0 ? next : NULL);
            switch (mend - m) {
            case 5: block(5, x + m * K, K, panel, b, y + m * N + n, N, ncols, m == m0 ? next : NULL); break;
            case 4: block(4, x + m * K, K, panel, b, y + m * N + n, N, ncols, m == m0 ? next : NULL); break;
            case 3: block(3, x + m * K, K, panel, b, y + m * N + n, N, ncols, m == m0 ? next : NULL); break;
            case 2: block(2, x + m * K, K, panel, b, y + m * N + n, N, ncols, m == m0 ? next : NULL); break;
            case 1: block(1, x + m * K, K, panel, b, y + m * N + n, N, ncols, m == m0 ? next : NULL); break;
            }
        }
    }
}
