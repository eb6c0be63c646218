/* y = x @ W^T (+ bias) for fp32 x on an AVX2/FMA/F16C CPU, with W read straight from GGUF
 * blocks in the file's own layout (no fp32 copy, no repacking).
 *
 * Numerics: each weight is rebuilt in fp32 exactly as gguf-py's ``quants.dequantize`` (and
 * ggml's dequantizer) rebuilds it, then multiplied into x with fp32 FMAs; x is never quantized here (gguf_q8.h: the opt-in int8 decode path).
 * So y equals an fp32 matmul on the dequantized matrix up to summation order.
 *  - F32 as stored; F16 through F16C (exact); BF16 by a 16-bit shift.
 *  - Q8_0: d * q; Q4_0: d * (q - 8); Q5_0: d * (q - 16); Q4_1 / Q5_1: d * q + m.
 *  - Q4_K / Q5_K: (d * sc) * q - (dmin * m) per 32, sc and m the 6-bit packed scales.
 *  - Q6_K: (d * sc) * (q - 32) per 16, sc a signed byte.
 * Where the dequantizer multiplies and then adds, the product is exact in fp32 (an fp16 scale
 * has 11 significant bits, times at most 6 + 5 more), so one FMA rounds exactly like the
 * multiply-then-add; tests/backends/test_gguf_kernels.py checks every type bit for bit.
 *
 * Two paths, as packed_linear.c's quantized panels (this file, with the entry points):
 *  - few rows of x (up to 8: decode steps): row-major dot products straight from the blocks,
 *    several output rows per pass so each x load feeds several FMAs, the next rows prefetched
 *    (16 weights per instruction where the CPU has AVX-512, 8 otherwise);
 *  - more rows (prefill, large batches): per thread, 16 output rows are unpacked into an fp32
 *    panel [K][16] (a transpose, 32 k at a time through L1) and fp32_panel.h's microkernel
 *    (6 x 16 in ymm registers, 12 x 16 in zmm with AVX-512; same bits) runs over the rows of x, so decoding is paid once per panel, not per row.
 * Opt-in (gguf_linear_amx, gguf_amx.h): bf16 products, on AMX tiles from five rows of x and from
 * the codes of Q4_K / Q6_K with AVX512-BF16 up to four rows; not bit-identical to the paths above.
 * Opt-in as well (gguf_linear_q8, gguf_q8.h): up to 8 rows of x quantized to int8 per 32 and
 * multiplied into Q8_0 / Q4_0 / Q5_0 / Q4_K / Q5_K / Q6_K codes with integer dot products (other
 * types of the same call keep the exact path); not bit-identical either.
 * Threads split the outputs. The weight argument is a descriptor of segments (the parts of a
 * fused projection, each its own type, concatenated along N), written by gguf_ops.py.
 * The rest is in headers this file alone includes (one translation unit, so every helper still
 * inlines into the kernels): gguf_blocks.h (type numbers, block sizes, the descriptor),
 * gguf_simd.h (small SIMD helpers), gguf_decode.h (the per-type rebuild), gguf_amx.h, gguf_q8.h.
 * Built at run time by build.py (gcc -O3 -march=native -fopenmp).
 */
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the GGUF linear kernel needs AVX2, FMA and F16C"
#endif
#define _GNU_SOURCE /* syscall(), for the AMX tile permission */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp32_panel.h"
#include "vec_math.h"
#include "gguf_blocks.h"
#include "gguf_simd.h"
#include "gguf_decode.h"

/* out [count, K] = stored rows ids[i] of a tensor of ``type`` (row stride ``stride`` bytes).
 * Returns 0, or -1 for a type the kernel does not read. */
int gguf_dequant_rows(int64_t type, const uint8_t *base, int64_t stride, const int64_t *ids, int64_t count,
                      int64_t K, float *out) {
    if (!supported(type)) return -1;
#pragma omp parallel for schedule(static) if (count * K > 65536)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = base + ids[i] * stride;
#define DQ_ROW(T) dq_row(T, row, K, out + i * K)
        DISPATCH(type, DQ_ROW)
#undef DQ_ROW
    }
    return 0;
}

/* ---- few rows: dot products straight from the blocks ---- */
#define GR 4     /* output rows per pass (R below: 4, or 2 for 3-4 rows of x, to stay in registers) */
#define DMAX 4   /* rows of x per pass */
#ifndef DIRECT
#define DIRECT 8 /* up to this many rows of x: straight from the blocks; beyond, through panels */
#endif

/* sums[m * GR + r] = x row m . weight row r (r < R, m < M; R and M compile-time constants).
 * Two accumulators per pair halve the FMA dependency chains. */
static inline __attribute__((always_inline)) void dot_rows(const int type, const int R, const int M,
                                                          const uint8_t *const *rw, const float *x, int64_t K,
                                                          float *sums, const uint8_t *const *pf, int64_t pfstep) {
    __m256 acc[GR][DMAX][2];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m][0] = acc[r][m][1] = _mm256_setzero_ps();
    const int64_t full = K / CK;
    float f[GR][16];
#define DOT_CHUNK(c, ph)                                                                      \
    {                                                                                         \
        CHUNK_PROLOGUE(R, c) \
        for (int r = 0; r < R; r++) {                                                         \
            __m256 w[4];                                                                      \
            dq32(type, ph, rw[r], c, f[r], w);                                                \
            for (int m = 0; m < M; m++) {                                                     \
                const float *xp = x + m * K + (c) * CK;                                       \
                acc[r][m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp), w[0], acc[r][m][0]);      \
                acc[r][m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 8), w[1], acc[r][m][1]);  \
                acc[r][m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 16), w[2], acc[r][m][0]); \
                acc[r][m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 24), w[3], acc[r][m][1]); \
            }                                                                                 \
        }                                                                                     \
    }
    FOR_CHUNKS(full, DOT_CHUNK);
#undef DOT_CHUNK
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            float s = hsum8(_mm256_add_ps(acc[r][m][0], acc[r][m][1]));
            for (int64_t k = full * CK; k < K; k++) s += x[m * K + k] * tail_weight(type, rw[r], k);
            sums[m * GR + r] = s;
        }
}

#ifdef __AVX512F__
/* dot_rows with 16-wide registers (32 of them: up to 4 x 4 pairs with two accumulators each). */
static inline __attribute__((always_inline)) void dot_rows512(const int type, const int R, const int M,
                                                             const uint8_t *const *rw, const float *x, int64_t K,
                                                             float *sums, const uint8_t *const *pf, int64_t pfstep) {
    __m512 acc[GR][DMAX][2];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
    const int64_t full = K / CK;
    float f[GR][16];
#define DOT_CHUNK(c, ph)                                                                       \
    {                                                                                          \
        CHUNK_PROLOGUE(R, c) \
        for (int r = 0; r < R; r++) {                                                          \
            __m512 w[2];                                                                       \
            dq32x(type, ph, rw[r], c, f[r], w);                                                \
            for (int m = 0; m < M; m++) {                                                      \
                const float *xp = x + m * K + (c) * CK;                                        \
                acc[r][m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp), w[0], acc[r][m][0]);       \
                acc[r][m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + 16), w[1], acc[r][m][1]);  \
            }                                                                                  \
        }                                                                                      \
    }
    FOR_CHUNKS(full, DOT_CHUNK);
#undef DOT_CHUNK
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
            for (int64_t k = full * CK; k < K; k++) s += x[m * K + k] * tail_weight(type, rw[r], k);
            sums[m * GR + r] = s;
        }
}
#define DOT_ROWS dot_rows512
#else
#define DOT_ROWS dot_rows
#endif

/* GR weight rows (cnt of them stored) times all M rows of x, DMAX at a time; ``pf``: the next
 * GR rows to prefetch during the first pass (NULL: none), ``pfstep`` bytes per chunk. */
static inline __attribute__((always_inline)) void direct_unit(const int type, const uint8_t *const *rw, int cnt,
                                                             const float *x, int64_t M, int64_t K, const float *bias,
                                                             float *y, int64_t ldy, const uint8_t *const *pf,
                                                             int64_t pfstep) {
    float sums[DMAX * GR];
    for (int64_t m0 = 0; m0 < M; m0 += DMAX) {
        const int64_t mm = M - m0 < DMAX ? M - m0 : DMAX;
        const float *xm = x + m0 * K;
        const uint8_t *const *p = m0 ? NULL : pf, *const *p2 = p ? p + 2 : NULL;
        switch (mm) {
        case 1: DOT_ROWS(type, 4, 1, rw, xm, K, sums, p, pfstep); break;
        case 2: DOT_ROWS(type, 4, 2, rw, xm, K, sums, p, pfstep); break;
        case 3: /* two rows of weights at a time (a loop, so one inlined copy) */
            for (int h = 0; h < GR; h += 2) DOT_ROWS(type, 2, 3, rw + h, xm, K, sums + h, h ? p2 : p, pfstep);
            break;
        default:
            for (int h = 0; h < GR; h += 2) DOT_ROWS(type, 2, 4, rw + h, xm, K, sums + h, h ? p2 : p, pfstep);
            break;
        }
        for (int64_t m = 0; m < mm; m++)
            for (int r = 0; r < cnt; r++) y[(m0 + m) * ldy + r] = sums[m * GR + r] + (bias ? bias[r] : 0.0f);
    }
}

/* Outputs n0 .. n0 + cnt - 1 of part sg (stored rows rw) for all M rows of x, GR at a time,
 * into y (row stride ldy); b: their bias or NULL. Each group of GR rows prefetches the GR rows
 * after it in its part (most often the rows this thread multiplies next). */
static void direct_part(const Seg *sg, int64_t n0, int64_t cnt, const uint8_t *const *rw, const float *x, int64_t M,
                        int64_t K, const float *b, float *y, int64_t ldy) {
    const uint8_t *next[NR + GR];
    const int64_t pfstep = K >= CK ? (sg->stride + K / CK - 1) / (K / CK) : 0;
    for (int64_t i = 0; i < cnt + GR; i++) next[i] = seg_row(sg, n0 + GR + i < sg->n ? n0 + GR + i : sg->n - 1);
    for (int64_t g = 0; g < cnt; g += GR) {
        const int gc = (int)(cnt - g < GR ? cnt - g : GR);
        const uint8_t *const *pf = n0 + g + GR < sg->n && pfstep ? next + g : NULL;
#define DIRECT_UNIT(T) direct_unit(T, rw + g, gc, x, M, K, b ? b + g : NULL, y + g, ldy, pf, pfstep)
        DISPATCH(sg->type, DIRECT_UNIT)
#undef DIRECT_UNIT
    }
}

/* ---- more rows: unpack 16 output rows into an fp32 panel [K][16], then the 6 x 16 kernel ---- */

/* 16 stored rows (rw; rows past cnt repeat a valid one and are never stored) as the panel
 * [K][16]: 32 k at a time into tmp [16][32] (L1), then transposed into place. */
static inline __attribute__((always_inline)) void unpack_panel(const int type, const uint8_t *const *rw, int64_t K,
                                                              float *panel, float *tmp, const uint8_t *const *pf,
                                                              int64_t pfstep) {
    const int64_t chunks = (K + CK - 1) / CK, full = K / CK;
    float f[NR][16];
#define PANEL_CHUNK(c, ph)                                                                                     \
    {                                                                                                          \
        CHUNK_PROLOGUE(NR, c) \
        for (int r = 0; r < NR; r++) {                                                                         \
            __m256 w[4];                                                                                       \
            dq32(type, ph, rw[r], c, f[r], w);                                                                 \
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(tmp + r * CK + 8 * v, w[v]);                         \
        }                                                                                                      \
        for (int kb = 0; kb < CK; kb += 8)                                                                     \
            for (int rb = 0; rb < NR; rb += 8) transpose8(tmp + rb * CK + kb, CK, panel + ((c) * CK + kb) * NR + rb, NR); \
    }
    FOR_CHUNKS(full, PANEL_CHUNK);
#undef PANEL_CHUNK
    if (chunks > full) { /* float types only: the tail past K is never read by the microkernel */
        for (int r = 0; r < NR; r++)
            for (int64_t k = 0; k < CK; k++) tmp[r * CK + k] = full * CK + k < K ? tail_weight(type, rw[r], full * CK + k) : 0.0f;
        for (int kb = 0; kb < CK; kb += 8)
            for (int rb = 0; rb < NR; rb += 8) transpose8(tmp + rb * CK + kb, CK, panel + (full * CK + kb) * NR + rb, NR);
    }
}

/* Each OpenMP thread's scratch panel (the threads persist, so it is allocated once). */
static __thread float *g_scratch = NULL;
static __thread int64_t g_scratch_len = 0;

/* y [M, N] (row stride N) = x [M, K] @ W^T (+ bias), W the descriptor's segments along N. */
void gguf_linear_f32(const float *x, const void *wp, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int nthreads) {
    const Desc *desc = (const Desc *)wp;
    const int direct = M <= DIRECT;
    const int64_t unit = direct ? GR : NR;
    const int64_t total = unit_count(desc, unit);
    const int64_t need = ((K + CK - 1) / CK * CK + CK) * NR;
    (void)N;
#pragma omp parallel num_threads(nthreads)
    {
        float *panel = NULL;
        if (!direct) {
            if (g_scratch_len < need) {
                free(g_scratch);
                g_scratch = aligned_alloc(64, (size_t)need * sizeof(float));
                g_scratch_len = g_scratch ? need : 0;
            }
            panel = g_scratch;
        }
#pragma omp for schedule(guided, 16) /* long runs of rows first (the prefetchers stream them better), shrinking chunks to balance mixed-type parts */
        for (int64_t u = 0; u < total; u++) {
            int64_t col, n0, cnt;
            const Seg *sg = unit_of(desc, u, unit, &col, &n0, &cnt);
            const uint8_t *rw[NR];
            for (int64_t r = 0; r < unit; r++) rw[r] = seg_row(sg, n0 + (r < cnt ? r : 0));
            const float *b = bias ? bias + col : NULL;
            if (direct || panel == NULL) { /* few rows (or no scratch memory): from the blocks */
                direct_part(sg, n0, cnt, rw, x, M, K, b, y + col, N);
                continue;
            }
            const uint8_t *next[NR]; /* the next 16 rows of this part, fetched while these are unpacked */
            for (int64_t i = 0; i < NR; i++) next[i] = seg_row(sg, n0 + NR + i < sg->n ? n0 + NR + i : sg->n - 1);
            const int64_t pfstep = K >= CK ? (sg->stride + K / CK - 1) / (K / CK) : 0;
            const uint8_t *const *pf = n0 + NR < sg->n && pfstep ? next : NULL;
#define UNPACK(T) unpack_panel(T, rw, K, panel, panel + need - CK * NR, pf, pfstep)
            DISPATCH(sg->type, UNPACK)
#undef UNPACK
            float bpad[NR];
            panel_rows(x, K, panel, panel_bias(b ? bias : NULL, col, cnt, bpad), y, N, col, cnt, 0, M, NULL);
        }
    }
}

/* Last: they call the fp32 kernel above where their own paths do not apply. */
#include "gguf_amx.h"
#include "gguf_q8.h"
