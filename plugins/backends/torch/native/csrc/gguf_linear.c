/* y = x @ W^T (+ bias) for fp32 x on an AVX2/FMA/F16C CPU, with W read straight from GGUF
 * blocks in the file's own layout (no fp32 copy, no repacking).
 *
 * Numerics: each weight is rebuilt in fp32 exactly as gguf-py's ``quants.dequantize`` (and
 * ggml's dequantizer) rebuilds it, then multiplied into x with fp32 FMAs; x is never quantized.
 * So y equals an fp32 matmul on the dequantized matrix up to summation order.
 *  - F32 as stored; F16 through F16C (exact); BF16 by a 16-bit shift.
 *  - Q8_0: d * q; Q4_0: d * (q - 8); Q5_0: d * (q - 16); Q4_1 / Q5_1: d * q + m.
 *  - Q4_K / Q5_K: (d * sc) * q - (dmin * m) per 32, sc and m the 6-bit packed scales.
 *  - Q6_K: (d * sc) * (q - 32) per 16, sc a signed byte.
 * Where the dequantizer multiplies and then adds, the product is exact in fp32 (an fp16 scale
 * has 11 significant bits, times at most 6 + 5 more), so one FMA rounds exactly like the
 * multiply-then-add; tests/backends/test_gguf_kernels.py checks every type bit for bit.
 *
 * Two paths, as packed_linear.c's quantized panels:
 *  - few rows of x (up to 8: decode steps): row-major dot products straight from the blocks,
 *    several output rows per pass so each x load feeds several FMAs, the next rows prefetched
 *    (16 weights per instruction where the CPU has AVX-512, 8 otherwise);
 *  - more rows (prefill, large batches): per thread, 16 output rows are unpacked into an fp32
 *    panel [K][16] (a transpose, 32 k at a time through L1) and fp32_panel.h's microkernel
 *    (6 x 16 in ymm registers, 12 x 16 in zmm with AVX-512; same bits) runs over the rows of x, so decoding is paid once per panel, not per row.
 * Opt-in (gguf_linear_amx, at the end): bf16 products, on AMX tiles from five rows of x and from
 * the codes of Q4_K / Q6_K with AVX512-BF16 below; not bit-identical to the paths above.
 * Threads split the outputs. The weight argument is a descriptor of segments (the parts of a
 * fused projection, each its own type, concatenated along N), written by gguf_ops.py.
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

/* gguf.GGMLQuantizationType values */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

#define CK 32 /* weights per decoded chunk: four ymm registers */

/* One part of the weight, as gguf_ops.py writes it: every field an int64. */
typedef struct {
    int64_t type, base, stride, n, rows; /* rows: address of int32 [n] or 0 */
} Seg;
typedef struct {
    int64_t nseg;
    Seg seg[];
} Desc;

static inline const uint8_t *seg_row(const Seg *s, int64_t n) {
    const int32_t *rows = (const int32_t *)(intptr_t)s->rows;
    return (const uint8_t *)(intptr_t)s->base + (rows ? (int64_t)rows[n] : n) * s->stride;
}

/* How many work units of ``unit`` output rows the parts make (a unit never spans two parts). */
static inline int64_t unit_count(const Desc *d, int64_t unit) {
    int64_t total = 0;
    for (int64_t s = 0; s < d->nseg; s++) total += (d->seg[s].n + unit - 1) / unit;
    return total;
}

/* Unit u's part, with its first output among all (*col), within the part (*n0), and how many
 * outputs it has (*cnt, up to unit). */
static inline const Seg *unit_of(const Desc *d, int64_t u, int64_t unit, int64_t *col, int64_t *n0, int64_t *cnt) {
    int64_t s = 0, left = u, c = 0;
    for (; s < d->nseg; s++) {
        const int64_t us = (d->seg[s].n + unit - 1) / unit;
        if (left < us) break;
        left -= us;
        c += d->seg[s].n;
    }
    const Seg *sg = &d->seg[s];
    *n0 = left * unit;
    *cnt = sg->n - *n0 < unit ? sg->n - *n0 : unit;
    *col = c + *n0;
    return sg;
}

/* Unit u's rows in rw (past the segment's end, its first row again) and the next unit's in
 * next; returns next, or NULL when the segment ends first (nothing there to prefetch). */
static inline const uint8_t *const *unit_rows(const Desc *d, int64_t u, int64_t unit, const uint8_t **rw,
                                              const uint8_t **next, const Seg **sg, int64_t *col, int64_t *cnt) {
    int64_t n0;
    *sg = unit_of(d, u, unit, col, &n0, cnt);
    for (int64_t r = 0; r < unit; r++) {
        rw[r] = seg_row(*sg, n0 + (r < *cnt ? r : 0));
        next[r] = seg_row(*sg, n0 + unit + r < (*sg)->n ? n0 + unit + r : (*sg)->n - 1);
    }
    return n0 + unit < (*sg)->n ? next : NULL;
}

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256 cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }

/* BODY(c, ph) for every full chunk c < full. For the K-quants ph = c % 4 is a compile-time
 * constant (their ``full`` is a multiple of 8, so chunks come four at a time); other types
 * ignore ph and get one copy of the body (``type`` is a compile-time constant wherever this is
 * expanded, so only one of the two loops is compiled). */
#define FOR_CHUNKS(full, BODY)                                                     \
    do {                                                                           \
        if (is_k(type)) {                                                          \
            for (int64_t c_ = 0; c_ + 4 <= (full); c_ += 4) {                      \
                BODY(c_, 0) BODY(c_ + 1, 1) BODY(c_ + 2, 2) BODY(c_ + 3, 3)        \
            }                                                                      \
        } else {                                                                   \
            for (int64_t c_ = 0; c_ < (full); c_++) { BODY(c_, 0) }                \
        }                                                                          \
    } while (0)

static inline int is_k(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* What every chunk loop over R rows does first: at each super-block the K-quant factors of
 * every row (into f[r], see kprep), then the next rows' bytes of chunk c (pf, pfstep; none
 * when pf is NULL). Expects ``type``, ``rw``, ``f``, ``pf`` and ``pfstep`` in scope. */
#define CHUNK_PROLOGUE(R, c)                                                  \
    if (is_k(type) && ((c) & 7) == 0)                                         \
        for (int r_ = 0; r_ < (R); r_++) kprep(type, rw[r_], c, f[r_]);      \
    if (pf) prefetch_rows((R), pf, (c) * pfstep, pfstep);

/* The fp32 factors of the K-quant super-block holding chunk c, computed once per super-block
 * and row as the dequantizer computes them: Q4_K / Q5_K: f[j] = d * sc_j, f[8 + j] = dmin * m_j
 * per 32; Q6_K: f[i] = d * sc_i per 16. Other types have none. */
static inline __attribute__((always_inline)) void kprep(const int type, const uint8_t *row, int64_t c, float *f) {
    if (type == T_Q4_K || type == T_Q5_K) {
        /* The eight 6-bit scales and mins unpacked four bytes at a time (a super-block is decoded
         * every 256 weights, per row: byte by byte it cost as much as the weights' own rebuild).
         * Bytes 0-3: scales 0-3 (low 6 bits), 4-7: mins 0-3, 8-11: low nibbles scales 4-7, high
         * nibbles mins 4-7; the top two bits of bytes 0-3 / 4-7 are bits 4-5 of scales / mins 4-7. */
        const uint8_t *sb = row + (c >> 3) * (type == T_Q4_K ? 144 : 176);
        uint32_t w[3];
        memcpy(w, sb + 4, 12);
        const uint32_t m6 = 0x3F3F3F3Fu, m4 = 0x0F0F0F0Fu, m2 = 0x03030303u;
        const uint32_t sc[2] = {w[0] & m6, (w[2] & m4) | (((w[0] >> 6) & m2) << 4)};
        const uint32_t mn[2] = {w[1] & m6, ((w[2] >> 4) & m4) | (((w[1] >> 6) & m2) << 4)};
        const __m256 d = _mm256_set1_ps(h2f(sb)), dmin = _mm256_set1_ps(h2f(sb + 2));
        const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)sc[0], (int)sc[1], 0, 0)));
        const __m256 mnv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)mn[0], (int)mn[1], 0, 0)));
        _mm256_storeu_ps(f, _mm256_mul_ps(d, scv));
        _mm256_storeu_ps(f + 8, _mm256_mul_ps(dmin, mnv));
    } else if (type == T_Q6_K) {
        const uint8_t *sb = row + (c >> 3) * 210;
        const __m256 d = _mm256_set1_ps(h2f(sb + 208));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 192));
        _mm256_storeu_ps(f, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(f + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    }
}

/* Weights 32c .. 32c + 31 of one stored row, rebuilt exactly. ``type`` and ``ph`` (c % 4, used
 * by the K-quants) are compile-time constants wherever this is inlined, so every bit shift is
 * an immediate (a shift by a register count costs an extra shuffle-port uop, the port the
 * byte widening already saturates). ``f``: kprep's factors for this chunk's super-block. For
 * the float types K need not be a multiple of 32: callers take full chunks only (see
 * tail_weight). */
static inline __attribute__((always_inline)) void dq32(const int type, const int ph, const uint8_t *row, int64_t c,
                                                      const float *f, __m256 w[4]) {
    switch (type) {
    case T_F32: {
        const float *f = (const float *)row + c * CK;
        for (int v = 0; v < 4; v++) w[v] = _mm256_loadu_ps(f + 8 * v);
        break;
    }
    case T_F16: {
        const uint8_t *h = row + c * CK * 2;
        for (int v = 0; v < 4; v++) w[v] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 16 * v)));
        break;
    }
    case T_BF16: {
        const uint8_t *h = row + c * CK * 2;
        for (int v = 0; v < 4; v++)
            w[v] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + 16 * v))), 16));
        break;
    }
    case T_Q8_0: {
        const uint8_t *b = row + c * 34;
        const __m256 d = _mm256_set1_ps(h2f(b));
        for (int v = 0; v < 4; v++)
            w[v] = _mm256_mul_ps(cvt(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * v)))), d);
        break;
    }
    case T_Q4_0:
    case T_Q4_1: {
        /* weight i < 16: low nibble of byte i; weight 16 + i: its high nibble */
        const uint8_t *b = row + c * (type == T_Q4_0 ? 18 : 20), *qs = b + (type == T_Q4_0 ? 2 : 4);
        const __m256 d = _mm256_set1_ps(h2f(b));
        const __m256i e0 = u8x8(qs), e1 = u8x8(qs + 8), f = _mm256_set1_epi32(15);
        __m256i q[4] = {_mm256_and_si256(e0, f), _mm256_and_si256(e1, f), _mm256_srli_epi32(e0, 4),
                        _mm256_srli_epi32(e1, 4)};
        if (type == T_Q4_0) {
            for (int v = 0; v < 4; v++) w[v] = _mm256_mul_ps(cvt(_mm256_sub_epi32(q[v], _mm256_set1_epi32(8))), d);
        } else {
            const __m256 m = _mm256_set1_ps(h2f(b + 2));
            for (int v = 0; v < 4; v++) w[v] = _mm256_fmadd_ps(cvt(q[v]), d, m); /* d * q exact */
        }
        break;
    }
    case T_Q5_0:
    case T_Q5_1: {
        /* as Q4_x, plus bit i of the 32-bit qh as bit 4 of weight i */
        const uint8_t *b = row + c * (type == T_Q5_0 ? 22 : 24), *hp = b + (type == T_Q5_0 ? 2 : 4);
        const uint8_t *qs = hp + 4;
        uint32_t qh;
        memcpy(&qh, hp, 4);
        const __m256 d = _mm256_set1_ps(h2f(b));
        const __m256i e0 = u8x8(qs), e1 = u8x8(qs + 8), f = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
        const __m256i hv = _mm256_set1_epi32((int)qh), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i q[4] = {_mm256_and_si256(e0, f), _mm256_and_si256(e1, f), _mm256_srli_epi32(e0, 4),
                        _mm256_srli_epi32(e1, 4)};
        for (int v = 0; v < 4; v++) {
            const __m256i bit = _mm256_and_si256(
                _mm256_srlv_epi32(hv, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * v))), one);
            q[v] = _mm256_or_si256(q[v], _mm256_slli_epi32(bit, 4));
        }
        if (type == T_Q5_0) {
            for (int v = 0; v < 4; v++) w[v] = _mm256_mul_ps(cvt(_mm256_sub_epi32(q[v], _mm256_set1_epi32(16))), d);
        } else {
            const __m256 m = _mm256_set1_ps(h2f(b + 2));
            for (int v = 0; v < 4; v++) w[v] = _mm256_fmadd_ps(cvt(q[v]), d, m); /* d * q exact */
        }
        break;
    }
    case T_Q4_K:
    case T_Q5_K: {
        /* super-block of 256: d, dmin, 12 scale bytes, [Q5_K: 32 high-bit bytes,] 128 nibble
         * bytes; sub-block j: low (j even) or high (j odd) nibbles of bytes 32 (j / 2) .. + 31 */
        const uint8_t *sb = row + (c >> 3) * (type == T_Q4_K ? 144 : 176);
        const int j = (int)(c & 7);
        const __m256 D = _mm256_set1_ps(f[j]), Mn = _mm256_set1_ps(f[8 + j]);
        const uint8_t *qs = sb + (type == T_Q4_K ? 16 : 48) + (j >> 1) * 32;
        const __m256i hbit = _mm256_set1_epi32(1 << j);
        for (int v = 0; v < 4; v++) {
            const __m256i e = u8x8(qs + 8 * v); /* j = c % 8 has the parity of ph */
            __m256i q = ph & 1 ? _mm256_srli_epi32(e, 4) : _mm256_and_si256(e, _mm256_set1_epi32(15));
            if (type == T_Q5_K) { /* bit j of high-bit byte i is bit 4 of weight i */
                const __m256i hb = _mm256_and_si256(u8x8(sb + 16 + 8 * v), hbit);
                q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpgt_epi32(hb, _mm256_setzero_si256()),
                                                        _mm256_set1_epi32(16)));
            }
            w[v] = _mm256_fmsub_ps(cvt(q), D, Mn); /* (d * sc) * q exact: rounds as the multiply-then-subtract */
        }
        break;
    }
    case T_Q6_K: {
        /* super-block of 256: 128 low-nibble bytes, 64 high-2-bit bytes, 16 signed scales, d.
         * weight e = 128 h + r: low nibble from byte 64 h + r % 64 (shift 4 (r / 64)), high
         * bits from byte 32 h + r % 32 (shift 2 (r / 32)); scale e / 16. */
        const uint8_t *sb = row + (c >> 3) * 210;
        const int e0 = (int)(c & 7) * CK, h = e0 >> 7, r0 = e0 & 127;
        const uint8_t *ql = sb + h * 64 + (r0 & 63), *qh = sb + 128 + h * 32;
        const int ls = (ph >> 1) * 4, hs = ph * 2; /* r0 / 64 and r0 / 32, with r0 / 32 = c % 4 */
        for (int v = 0; v < 4; v++) {
            __m256i q = _mm256_and_si256(_mm256_srli_epi32(u8x8(ql + 8 * v), ls), _mm256_set1_epi32(15));
            q = _mm256_or_si256(q, _mm256_slli_epi32(
                                       _mm256_and_si256(_mm256_srli_epi32(u8x8(qh + 8 * v), hs), _mm256_set1_epi32(3)), 4));
            q = _mm256_sub_epi32(q, _mm256_set1_epi32(32));
            w[v] = _mm256_mul_ps(cvt(q), _mm256_set1_ps(f[e0 / 16 + (v >> 1)]));
        }
        break;
    }
    }
}

/* Weight k of a float-typed row (the tail past the last full chunk when K % 32 != 0). */
static inline float tail_weight(int type, const uint8_t *row, int64_t k) {
    if (type == T_F32) {
        float f;
        memcpy(&f, row + 4 * k, 4);
        return f;
    }
    if (type == T_F16) return h2f(row + 2 * k);
    uint32_t u = (uint32_t)(row[2 * k] | (row[2 * k + 1] << 8)) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define DISPATCH(type, CALL)                                                          \
    switch (type) {                                                                   \
    case T_F32: CALL(T_F32); break;                                                   \
    case T_F16: CALL(T_F16); break;                                                   \
    case T_BF16: CALL(T_BF16); break;                                                 \
    case T_Q8_0: CALL(T_Q8_0); break;                                                 \
    case T_Q4_0: CALL(T_Q4_0); break;                                                 \
    case T_Q4_1: CALL(T_Q4_1); break;                                                 \
    case T_Q5_0: CALL(T_Q5_0); break;                                                 \
    case T_Q5_1: CALL(T_Q5_1); break;                                                 \
    case T_Q4_K: CALL(T_Q4_K); break;                                                 \
    case T_Q5_K: CALL(T_Q5_K); break;                                                 \
    case T_Q6_K: CALL(T_Q6_K); break;                                                 \
    default: break;                                                                   \
    }

static int supported(int64_t type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: case T_Q8_0: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1:
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 1;
    default: return 0;
    }
}

/* ---- row dequantizer (embedding lookups and the tests' bit-for-bit check) ---- */

static inline __attribute__((always_inline)) void dq_row(const int type, const uint8_t *row, int64_t K, float *out) {
    const int64_t full = K / CK;
    float f[16];
#define DQ_CHUNK(c, ph)                                                           \
    {                                                                             \
        __m256 w[4];                                                              \
        if (is_k(type) && ((c) & 7) == 0) kprep(type, row, c, f);                 \
        dq32(type, ph, row, c, f, w);                                             \
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(out + (c) * CK + 8 * v, w[v]); \
    }
    FOR_CHUNKS(full, DQ_CHUNK);
#undef DQ_CHUNK
    for (int64_t k = full * CK; k < K; k++) out[k] = tail_weight(type, row, k);
}

/* out [count, K] = stored rows ids[i] of a tensor of ``type`` (row stride ``stride`` bytes).
 * Returns 0, or -1 for a type this file does not read. */
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

/* The lines of the next rows' bytes at ``off`` (one chunk's worth), into L2: a decode step
 * streams every weight byte from DRAM once, and the next rows (often not adjacent: other
 * parts, permuted rows) are fetched while this pass computes. (Into L1 they held the few line
 * fill buffers the demand loads need: Q8_0 times 8 rows streamed 12.6 GB/s that way, 14.1 now.) */
static inline __attribute__((always_inline)) void prefetch_rows(const int R, const uint8_t *const *pf, int64_t off,
                                                               int64_t step) {
    for (int r = 0; r < R; r++) {
        _mm_prefetch((const char *)(pf[r] + off), _MM_HINT_T1);
        if (step > 64) _mm_prefetch((const char *)(pf[r] + off + 64), _MM_HINT_T1);
    }
}

/* Every line of the R rows' bytes pf[r] + off .. + n - 1 (a super-block of the next rows), into
 * L2: a K-quant kernel reads whole super-blocks, and a line it did not ask for stalls it on DRAM. */
static inline __attribute__((always_inline)) void prefetch_span(const int R, const uint8_t *const *pf, int64_t off,
                                                               int64_t n) {
    for (int r = 0; r < R; r++) {
        const uintptr_t end = (uintptr_t)(pf[r] + off + n);
        for (uintptr_t a = (uintptr_t)(pf[r] + off) & ~(uintptr_t)63; a < end; a += 64)
            _mm_prefetch((const char *)a, _MM_HINT_T1);
    }
}

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
/* With AVX-512 the few-row path rebuilds 16 weights per instruction: a decode step is bound by
 * the rebuild's instruction count (fp32 weights from 4-6 bit codes), not by memory, so twice
 * the width is nearly twice the speed. Same rebuilds as dq32, so the same weights bit for bit. */
static inline __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

static inline __attribute__((always_inline)) void dq32x(const int type, const int ph, const uint8_t *row, int64_t c,
                                                       const float *f, __m512 w[2]) {
    const __m512i f15 = _mm512_set1_epi32(15), b16 = _mm512_set1_epi32(16);
    switch (type) {
    case T_F32:
        for (int v = 0; v < 2; v++) w[v] = _mm512_loadu_ps((const float *)row + c * CK + 16 * v);
        break;
    case T_F16:
        for (int v = 0; v < 2; v++)
            w[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + c * CK * 2 + 32 * v)));
        break;
    case T_BF16:
        for (int v = 0; v < 2; v++)
            w[v] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + c * CK * 2 + 32 * v))), 16));
        break;
    case T_Q8_0: {
        const uint8_t *b = row + c * 34;
        const __m512 d = _mm512_set1_ps(h2f(b));
        for (int v = 0; v < 2; v++)
            w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * v)))), d);
        break;
    }
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q5_1: {
        const int five = type == T_Q5_0 || type == T_Q5_1, offset = type == T_Q4_1 || type == T_Q5_1;
        const uint8_t *b = row + c * (type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24);
        const uint8_t *qs = b + 2 + 2 * offset + 4 * five;
        const __m512 d = _mm512_set1_ps(h2f(b));
        const __m512i e = u8x16(qs);
        __m512i q[2] = {_mm512_and_si512(e, f15), _mm512_srli_epi32(e, 4)};
        if (five) { /* bit i of qh: bit 4 of weight i */
            uint32_t qh;
            memcpy(&qh, b + 2 + 2 * offset, 4);
            q[0] = _mm512_mask_or_epi32(q[0], (__mmask16)(qh & 0xFFFF), q[0], b16);
            q[1] = _mm512_mask_or_epi32(q[1], (__mmask16)(qh >> 16), q[1], b16);
        }
        for (int v = 0; v < 2; v++) {
            if (offset)
                w[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[v]), d, _mm512_set1_ps(h2f(b + 2))); /* d * q exact */
            else
                w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q[v], _mm512_set1_epi32(five ? 16 : 8))), d);
        }
        break;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const uint8_t *sb = row + (c >> 3) * (type == T_Q4_K ? 144 : 176);
        const int j = (int)(c & 7);
        const __m512 D = _mm512_set1_ps(f[j]), Mn = _mm512_set1_ps(f[8 + j]);
        const uint8_t *qs = sb + (type == T_Q4_K ? 16 : 48) + (j >> 1) * 32;
        for (int v = 0; v < 2; v++) {
            const __m512i e = u8x16(qs + 16 * v);
            __m512i q = ph & 1 ? _mm512_srli_epi32(e, 4) : _mm512_and_si512(e, f15);
            if (type == T_Q5_K)
                q = _mm512_mask_or_epi32(q, _mm512_test_epi32_mask(u8x16(sb + 16 + 16 * v), _mm512_set1_epi32(1 << j)),
                                         q, b16);
            w[v] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q), D, Mn); /* (d * sc) * q exact */
        }
        break;
    }
    case T_Q6_K: {
        const uint8_t *sb = row + (c >> 3) * 210;
        const int e0 = (int)(c & 7) * CK, h = e0 >> 7, r0 = e0 & 127;
        const uint8_t *ql = sb + h * 64 + (r0 & 63), *qh = sb + 128 + h * 32;
        const int ls = (ph >> 1) * 4, hs = ph * 2;
        for (int v = 0; v < 2; v++) {
            __m512i q = _mm512_and_si512(_mm512_srli_epi32(u8x16(ql + 16 * v), ls), f15);
            q = _mm512_or_si512(q, _mm512_slli_epi32(
                                       _mm512_and_si512(_mm512_srli_epi32(u8x16(qh + 16 * v), hs), _mm512_set1_epi32(3)), 4));
            q = _mm512_sub_epi32(q, _mm512_set1_epi32(32));
            w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(f[e0 / 16 + v]));
        }
        break;
    }
    }
}

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

/* ---- more rows: unpack 16 output rows into an fp32 panel [K][16], then the 6 x 16 kernel ---- */

/* The 8 x 8 block at src (row stride ls) transposed into dst (row stride ld). */
static inline void transpose8(const float *src, int64_t ls, float *dst, int64_t ld) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ls);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}

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
#pragma omp for schedule(dynamic, 16) /* mixed-type parts cost unevenly per row */
        for (int64_t u = 0; u < total; u++) {
            int64_t col, n0, cnt;
            const Seg *sg = unit_of(desc, u, unit, &col, &n0, &cnt);
            const uint8_t *rw[NR];
            for (int64_t r = 0; r < unit; r++) rw[r] = seg_row(sg, n0 + (r < cnt ? r : 0));
            const float *b = bias ? bias + col : NULL;
            if (direct || panel == NULL) { /* few rows (or no scratch memory): from the blocks */
                /* each group of GR rows prefetches the GR rows after it in its part (most often
                 * the rows this thread multiplies next) */
                const uint8_t *next[NR + GR];
                const int64_t pfstep = K >= CK ? (sg->stride + K / CK - 1) / (K / CK) : 0;
                for (int64_t i = 0; i < cnt + GR; i++) next[i] = seg_row(sg, n0 + GR + i < sg->n ? n0 + GR + i : sg->n - 1);
                for (int64_t g = 0; g < cnt; g += GR) {
                    const int gc = (int)(cnt - g < GR ? cnt - g : GR);
                    const uint8_t *const *pf = n0 + g + GR < sg->n && pfstep ? next + g : NULL;
#define DIRECT_UNIT(T) direct_unit(T, rw + g, gc, x, M, K, b ? b + g : NULL, y + col + g, N, pf, pfstep)
                    DISPATCH(sg->type, DIRECT_UNIT)
#undef DIRECT_UNIT
                }
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

/* ---- many rows in bf16 on AMX tiles (opt-in: not bit-identical to the fp32 paths) ----
 *
 * Each activation is carried as two bf16, x_hi = bf16(x) and x_lo = bf16(x - x_hi) (about 16
 * significant bits), each weight is rebuilt exactly (dq32x) and rounded to bf16 (nearest even),
 * and the tile unit (TDPBF16PS) multiplies and accumulates in fp32: y = (x_hi + x_lo) @ bf16(W)^T.
 * Past SPLIT_ROWS rows (prefill) the weights are split the same way and the third product
 * W_lo x_hi is added: y = x @ W^T to about 2^-16 relative per product, close to the fp32 path,
 * where the panel's extra rebuild is shared by many rows. Decode batches keep the one rounding
 * (of the weight), whose lo panel would cost them about 40%. Rounding x as well cost twice the
 * error (SmolLM2 Q8_0, 20 batched prompts: 16 identical greedy continuations; now 20).
 * Per thread, 16 output rows are rebuilt once into a bf16 panel [K / 32][16][32] (L2) that
 * every 16 rows of x then multiply: the panel is the A operand (rows = outputs, row-major, as
 * rebuilt), x is packed once per call as the B operand (pairs of k interleaved by row), so C
 * holds [16 outputs][16 rows of x] and is transposed on the way out. Up to four rows of x (DMAX) take the few-row path below instead
 * (the panel would not pay for itself); K not a multiple of 32, or a kernel that refuses the
 * tile state: the exact fp32 kernel above. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define XT 16 /* rows of x per tile */
#define CT 4  /* C tiles held at once: 64 rows of x per pass over a panel */
#define SPLIT_ROWS 32 /* more rows of x than this (prefill): the weights as two bf16 as well */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int g_amx = 0; /* 0 not asked yet, 1 granted, -1 refused */

/* 32 floats (a0: the first 16, a1: the next) as bf16 words, and with lo, in *lo the bf16 of
 * what that rounding left out: hi + lo carries a to about 16 significant bits. */
static inline __m512i split_bf16(__m512 a0, __m512 a1, __m512i *lo) {
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(a1, a0);
    if (lo) {
        const __m512 h0 = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(h));
        const __m512 h1 = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(h, 1));
        *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(a1, h1), _mm512_sub_ps(a0, h0));
    }
    return h;
}

/* 32 rebuilt weights (w0: the first 16) into the panel at off as bf16, and with plo, the bf16 of
 * their remainders into plo at off (computed only then: decode batches have no plo). */
static inline void store_bf16(uint16_t *panel, uint16_t *plo, int64_t off, __m512 w0, __m512 w1) {
    __m512i l;
    _mm512_store_si512((__m512i *)(panel + off), split_bf16(w0, w1, plo ? &l : NULL));
    if (plo) _mm512_store_si512((__m512i *)(plo + off), l);
}

/* Ask Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process).
 * Returns 1 when the tiles may be used. */
int gguf_amx_ready(void) {
    if (g_amx == 0) g_amx = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return g_amx == 1;
}

/* x [M, K] as B tiles, twice: tile (t, c) holds rows 16t .. 16t + 15 and k 32c .. 32c + 31 as
 * [16 pairs][16 rows][2] bf16 (512 values), rows past M zero; xb holds bf16(x), xlo the bf16 of
 * the remainder x - bf16(x) in the same layout. */
static void pack_x_bf16(const float *x, int64_t M, int64_t K, uint16_t *xb, uint16_t *xlo, int nthreads) {
    const int64_t nch = K / CK, ntile = (M + XT - 1) / XT;
    const __m512i pairs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(XT));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K > 65536)
    for (int64_t tc = 0; tc < ntile * nch; tc++) {
        const int64_t t = tc / nch, c = tc % nch;
        int32_t *tile = (int32_t *)(xb + tc * 512);
        for (int m = 0; m < XT; m++) {
            const int64_t row = t * XT + m;
            __m512i v = _mm512_setzero_si512(), l = v;
            if (row < M) {
                const float *p = x + row * K + c * CK;
                v = split_bf16(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16), &l);
            }
            _mm512_i32scatter_epi32(tile + m, pairs, v, 4); /* pair p of this row -> dword 16 p + m */
            _mm512_i32scatter_epi32((int32_t *)(xlo + tc * 512) + m, pairs, l, 4);
        }
    }
}

/* The 16 stored rows rw as the bf16 panel [K / 32][16][32]. */
static inline __attribute__((always_inline)) void panel_bf16(const int type, const uint8_t *const *rw, int64_t K,
                                                            uint16_t *panel, uint16_t *plo, const uint8_t *const *pf,
                                                            int64_t pfstep) {
    const int64_t full = K / CK;
    float f[NR][16];
#define BF16_CHUNK(c, ph)                                                                                      \
    {                                                                                                          \
        CHUNK_PROLOGUE(NR, c) \
        for (int r = 0; r < NR; r++) {                                                                         \
            __m512 w[2];                                                                                       \
            dq32x(type, ph, rw[r], c, f[r], w);                                                                \
            store_bf16(panel, plo, ((c) * NR + r) * CK, w[0], w[1]);                                           \
        }                                                                                                      \
    }
    FOR_CHUNKS(full, BF16_CHUNK);
#undef BF16_CHUNK
}

/* panel_bf16 for Q4_K, by lookup: a sub-block's 16 possible weights (d * sc) * q - dmin * m,
 * q = 0..15, are computed once (the same FMS as dq32x) and rounded to bf16, and its 32 codes
 * pick theirs with one permute: the same bits as panel_bf16, in about half the instructions. */
static inline void panel_q4k_bf16(const uint8_t *const *rw, int64_t K, uint16_t *panel, uint16_t *plo,
                                  const uint8_t *const *pf) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float f[16];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        for (int r = 0; r < NR; r++) {
            if (pf) prefetch_span(1, pf + r, sb * 144, 144); /* spread over the rows: a burst of 48 would queue */
            kprep(T_Q4_K, rw[r], 8 * sb, f);
            __asm__ volatile("" ::: "memory"); /* read the factors back as broadcast loads, not lane shuffles */
            const uint8_t *qs = rw[r] + sb * 144 + 16;
            for (int g = 0; g < 4; g++) {
                /* both sub-blocks' tables in one register: words 0-15 sub-block 2g + 1 (high
                 * nibbles, index q), words 16-31 sub-block 2g (low nibbles, index q | 16) */
                __m512i tl;
                const __m512i t = split_bf16(_mm512_fmsub_ps(iota, _mm512_set1_ps(f[2 * g + 1]), _mm512_set1_ps(f[9 + 2 * g])),
                                             _mm512_fmsub_ps(iota, _mm512_set1_ps(f[2 * g]), _mm512_set1_ps(f[8 + 2 * g])),
                                             plo ? &tl : NULL);
                const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * g)));
                const __m512i lo = _mm512_ternarylogic_epi32(codes, _mm512_set1_epi16(15), _mm512_set1_epi16(16), 0xEA);
                const int64_t c = 8 * sb + 2 * g;
                _mm512_store_si512((__m512i *)(panel + (c * NR + r) * CK), _mm512_permutexvar_epi16(lo, t));
                _mm512_store_si512((__m512i *)(panel + ((c + 1) * NR + r) * CK),
                                   _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), t));
                if (plo) {
                    _mm512_store_si512((__m512i *)(plo + (c * NR + r) * CK), _mm512_permutexvar_epi16(lo, tl));
                    _mm512_store_si512((__m512i *)(plo + ((c + 1) * NR + r) * CK),
                                       _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), tl));
                }
            }
        }
    }
}

static __thread uint16_t *g_xb = NULL, *g_panel = NULL;
static __thread int64_t g_xb_len = 0, g_panel_len = 0;

static uint16_t *grow(uint16_t **buf, int64_t *len, int64_t need) {
    if (*len < need) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)((need * 2 + 63) / 64 * 64));
        *len = *buf ? need : 0;
    }
    return *buf;
}

/* ---- few rows under the same option: Q4_K and Q6_K from their codes with AVX512-BF16 dot products ----
 * A Q4_K weight is (d * sc_j) * q - dmin * m_j with q in 0..15, so sum_i w_i x_i =
 * D_j * sum_i q_i x_i - Mn_j * sum_i x_i per sub-block j of 32. A code under 128 OR-ed into the
 * mantissa of bf16 128.0 is the bf16 of 128 + q, exactly, in one bit operation (no table, no
 * fp32 rebuild); VDPBF16PS forms sum_i (128 + q_i) bf16(x_i), one FMA scales it by D_j, and the
 * offset's 128 D_j sum_i x_i joins the mins' term (the sums of the bf16 x, formed once). So these
 * products take exact weights and bf16 activations; the rebuild that bounds the fp32 kernel at
 * one to four rows is gone. Q6_K likewise ((d sc) (q - 32) per 16: 128 + q, offset 160;
 * dot_q6k_bf16); other types keep the exact fp32 kernel. (The offset costs a few low bits of
 * the fp32 sums, far under the bf16 rounding of x.) */

#define CODE_OFFSET 0x4300 /* bf16 128.0: OR-ing a code under 128 into it gives 128 + code */

/* sums[m * GR + r] = bf16(x row m) . Q4_K row r, R rows at once (R, M compile-time constants).
 * xb: bf16 x [M][K]; xs: per 32 of x the sum of its bf16 values, [M][K / 32]. */
static inline __attribute__((always_inline)) void dot_q4k_bf16(const int R, const int M, const uint8_t *const *rw,
                                                              const uint16_t *xb, const float *xs, int64_t K,
                                                              float *sums, const uint8_t *const *pf) {
    const __m512i off = _mm512_set1_epi16(CODE_OFFSET), f15 = _mm512_set1_epi16(15);
    __m512 acc[GR][DMAX]; /* lanes are summed at the end: the mins' term goes to lanes 0-7 */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    float f[GR][16];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        for (int r = 0; r < R; r++) { /* the mins' factors take the offset's too: Mn_j + 128 D_j */
            kprep(T_Q4_K, rw[r], sb * 8, f[r]);
            _mm256_storeu_ps(f[r] + 8, _mm256_fmadd_ps(_mm256_loadu_ps(f[r]), _mm256_set1_ps(128.0f),
                                                       _mm256_loadu_ps(f[r] + 8)));
        }
        if (pf) prefetch_span(R, pf, sb * 144, 144);
        for (int g = 0; g < 4; g++)
            for (int r = 0; r < R; r++) {
                const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rw[r] + sb * 144 + 16 + 32 * g)));
                const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(words, f15, off, 0xEA); /* (w & 15) | off */
                const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), off);
                const __m512 d0 = _mm512_set1_ps(f[r][2 * g]), d1 = _mm512_set1_ps(f[r][2 * g + 1]);
                for (int m = 0; m < M; m++) {
                    const uint16_t *xp = xb + m * K + sb * 256 + 64 * g;
                    const __m512 s0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xp));
                    const __m512 s1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), hi, (__m512bh)_mm512_loadu_si512(xp + 32));
                    acc[r][m] = _mm512_fmadd_ps(s1, d1, _mm512_fmadd_ps(s0, d0, acc[r][m]));
                }
            }
        for (int r = 0; r < R; r++)
            for (int m = 0; m < M; m++)
                acc[r][m] = _mm512_fnmadd_ps(_mm512_zextps256_ps512(_mm256_loadu_ps(f[r] + 8)),
                                             _mm512_zextps256_ps512(_mm256_loadu_ps(xs + m * (K / CK) + sb * 8)),
                                             acc[r][m]);
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sums[m * GR + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* The six-bit codes of half h (weights 128 h .. 128 h + 127) of the Q6_K super-block at b, in
 * 16-bit lanes, 32 weights per register: weight 128 h + r takes its low four bits from byte
 * 64 h + r % 64 (shifted by 4 (r / 64)) and its high two from byte 128 + 32 h + r % 32 (shifted
 * by 2 (r / 32)). Every lane carries offset as well: CODE_OFFSET makes it bf16(128 + q), 0 leaves q. */
static inline void q6k_codes(const uint8_t *b, int h, __m512i q[4], int offset) {
    const __m512i f15 = _mm512_set1_epi16(15), hmask = _mm512_set1_epi16(0x30), off = _mm512_set1_epi16(offset);
    const __m512i A = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h)));
    const __m512i B = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)));
    const __m512i H = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
    /* low | (high bits & 0x30): ternary logic a | (b & c); the low bits come OR-ed with offset:
     * (a & b) | c, or for the high nibbles a plain OR (a shifted byte has nothing above bit 3) */
    q[0] = _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(A, f15, off, 0xEA), _mm512_slli_epi16(H, 4), hmask, 0xF8);
    q[1] = _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(B, f15, off, 0xEA), _mm512_slli_epi16(H, 2), hmask, 0xF8);
    q[2] = _mm512_ternarylogic_epi32(_mm512_or_si512(_mm512_srli_epi16(A, 4), off), H, hmask, 0xF8);
    q[3] = _mm512_ternarylogic_epi32(_mm512_or_si512(_mm512_srli_epi16(B, 4), off), _mm512_srli_epi16(H, 2), hmask, 0xF8);
}

/* As dot_q4k_bf16 for Q6_K: w = (d * sc_i) * (q - 32) per 16, so each 32 weights are one dot
 * product of their codes as bf16(128 + q) (q6k_codes) with bf16(x), lanes 0-7 scaled by the
 * first 16's factor and lanes 8-15 by the second's; per super-block 160 (d * sc_i) times the
 * sums of x per 16 (xs16: [M][K / 16]) come off, lane i for group i (the lanes are summed at
 * the end, so any lane may carry any term). */
static inline __attribute__((always_inline)) void dot_q6k_bf16(const int R, const int M, const uint8_t *const *rw,
                                                              const uint16_t *xb, const float *xs16, int64_t K,
                                                              float *sums, const uint8_t *const *pf) {
    __m512i lanes[4];
    for (int c = 0; c < 4; c++) /* factor index of each dot-product lane, chunk c of a half */
        lanes[c] = _mm512_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1,
                                     2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1);
    __m512 acc[GR][DMAX];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    float f[GR][16];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        for (int r = 0; r < R; r++) kprep(T_Q6_K, rw[r], sb * 8, f[r]);
        if (pf) prefetch_span(R, pf, sb * 210, 210);
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) {
                __m512i q[4];
                q6k_codes(rw[r] + sb * 210, h, q, CODE_OFFSET);
                const __m512 fv = _mm512_loadu_ps(f[r]);
                if (h == 0) { /* here, not beside kprep: there one row ran 27 G weights/s, not 32 */
                    const __m512 f160 = _mm512_mul_ps(fv, _mm512_set1_ps(160.0f));
                    for (int m = 0; m < M; m++)
                        acc[r][m] = _mm512_fnmadd_ps(f160, _mm512_loadu_ps(xs16 + m * (K / 16) + sb * 16), acc[r][m]);
                }
                for (int c = 0; c < 4; c++) {
                    const __m512bh v = (__m512bh)q[c];
                    const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(lanes[c], _mm512_set1_epi32(8 * h)), fv);
                    for (int m = 0; m < M; m++) {
                        const uint16_t *xp = xb + m * K + sb * 256 + 128 * h + 32 * c;
                        const __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), v, (__m512bh)_mm512_loadu_si512(xp));
                        acc[r][m] = _mm512_fmadd_ps(d, scale, acc[r][m]);
                    }
                }
            }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sums[m * GR + r] = _mm512_reduce_add_ps(acc[r][m]);
}

static __thread uint16_t *g_xfew = NULL;
static __thread int64_t g_xfew_len = 0;
static uint16_t *grow(uint16_t **buf, int64_t *len, int64_t need);

/* Up to DMAX rows of x: Q4_K and Q6_K parts from their codes, every other part exactly. */
static void linear_few_bf16(const float *x, const Desc *desc, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int nthreads) {
    int codes = 0; /* any part read from its codes */
    for (int64_t s = 0; s < desc->nseg; s++) codes |= desc->seg[s].type == T_Q4_K || desc->seg[s].type == T_Q6_K;
    uint16_t *xb = codes ? grow(&g_xfew, &g_xfew_len, M * K + 6 * M * (K / CK) + 2) : NULL;
    if (!xb) {
        gguf_linear_f32(x, desc, bias, y, M, N, K, nthreads);
        return;
    }
    /* after the bf16 rows, 4-byte aligned: the sums of the bf16 values per 32 (Q4_K), per 16 (Q6_K) */
    float *xs = (float *)(xb + M * K + (M * K) % 2), *xs16 = xs + M * (K / CK);
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < K / CK; c++) {
            const float *p = x + m * K + c * CK;
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
            _mm512_storeu_si512(xb + m * K + c * CK, (__m512i)v);
            /* widened back to fp32 (exact): the first 16 and the next, then added */
            const __m512 a = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)v));
            const __m512 b = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)v, 1));
            const float sa = _mm512_reduce_add_ps(a), sb = _mm512_reduce_add_ps(b);
            xs16[m * (K / 16) + 2 * c] = sa;
            xs16[m * (K / 16) + 2 * c + 1] = sb;
            xs[m * (K / CK) + c] = sa + sb;
        }
    const int64_t total = unit_count(desc, GR);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 16)
    for (int64_t u = 0; u < total; u++) {
        int64_t col, cnt;
        const Seg *sg;
        const uint8_t *rw[GR], *next[GR];
        const uint8_t *const *pf = unit_rows(desc, u, GR, rw, next, &sg, &col, &cnt);
        const float *b = bias ? bias + col : NULL;
        if (sg->type != T_Q4_K && sg->type != T_Q6_K) {
            const int64_t pfstep = (sg->stride + K / CK - 1) / (K / CK);
#define DIRECT_UNIT(T) direct_unit(T, rw, (int)cnt, x, M, K, b, y + col, N, pf, pfstep)
            DISPATCH(sg->type, DIRECT_UNIT)
#undef DIRECT_UNIT
            continue;
        }
        float sums[DMAX * GR];
        if (sg->type == T_Q4_K) {
            switch (M) {
            case 1: dot_q4k_bf16(GR, 1, rw, xb, xs, K, sums, pf); break;
            case 2: dot_q4k_bf16(GR, 2, rw, xb, xs, K, sums, pf); break;
            case 3: dot_q4k_bf16(GR, 3, rw, xb, xs, K, sums, pf); break;
            default: dot_q4k_bf16(GR, 4, rw, xb, xs, K, sums, pf); break;
            }
        } else {
            switch (M) {
            case 1: dot_q6k_bf16(GR, 1, rw, xb, xs16, K, sums, pf); break;
            case 2: dot_q6k_bf16(GR, 2, rw, xb, xs16, K, sums, pf); break;
            case 3: dot_q6k_bf16(GR, 3, rw, xb, xs16, K, sums, pf); break;
            default: dot_q6k_bf16(GR, 4, rw, xb, xs16, K, sums, pf); break;
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < cnt; r++) y[m * N + col + r] = sums[m * GR + r] + (b ? b[r] : 0.0f);
    }
}

/* panel_bf16 for Q6_K: the six-bit codes assembled 32 at a time in 16-bit lanes (as
 * dot_q6k_bf16 does), then (d * sc) * (q - 32) in fp32 per 16 and rounded to bf16: the same
 * bits as panel_bf16 (the product is exact: at most 24 significant bits), with the bit
 * gathering done once per 32 weights instead of per 8. */
static inline void panel_q6k_bf16(const uint8_t *const *rw, int64_t K, uint16_t *panel, uint16_t *plo,
                                  const uint8_t *const *pf) {
    const __m512i b32 = _mm512_set1_epi16(32);
    float f[16];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        for (int r = 0; r < NR; r++) {
            if (pf) prefetch_span(1, pf + r, sb * 210, 210);
            kprep(T_Q6_K, rw[r], 8 * sb, f);
            const uint8_t *b = rw[r] + sb * 210;
            for (int h = 0; h < 2; h++) {
                __m512i q[4];
                q6k_codes(b, h, q, 0);
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_sub_epi16(q[c], b32);
                    const int i = 8 * h + 2 * c; /* the factor of weights 0-15 of this chunk; i + 1: 16-31 */
                    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v))),
                                                    _mm512_set1_ps(f[i]));
                    const __m512 hi = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1))), _mm512_set1_ps(f[i + 1]));
                    const int64_t ch = 8 * sb + 4 * h + c;
                    store_bf16(panel, plo, (ch * NR + r) * CK, lo, hi);
                }
            }
        }
    }
}

/* Bytes that 256 weights of a row take in ``type`` (every served type packs 256 evenly). */
static inline int64_t bytes256(int64_t type) {
    switch (type) {
    case T_F32: return 1024;
    case T_F16: case T_BF16: return 512;
    case T_Q8_0: return 272;
    case T_Q4_0: case T_Q4_K: return 144;
    case T_Q4_1: return 160;
    case T_Q5_0: case T_Q5_K: return 176;
    case T_Q5_1: return 192;
    default: return 210; /* Q6_K */
    }
}

/* The 16 rows' weights k0 .. k0 + kn - 1 (k0 a multiple of 256, or 0) as a bf16 panel,
 * prefetching the rows pf from their weight pk on (as far as the panel reaches). */
static inline void rebuild(int64_t type, const uint8_t *const *rw, int64_t k0, int64_t kn, uint16_t *panel,
                           uint16_t *plo, const uint8_t *const *pf, int64_t pk, int64_t pfstep) {
    const uint8_t *r2[NR], *p2[NR];
    const int64_t off = k0 / 256 * bytes256(type), poff = pk / 256 * bytes256(type);
    for (int r = 0; r < NR; r++) {
        r2[r] = rw[r] + off;
        p2[r] = pf ? pf[r] + poff : NULL;
    }
    const uint8_t *const *pp = pf ? p2 : NULL;
#define PANEL(T) panel_bf16(T, r2, kn, panel, plo, pp, pfstep)
    if (type == T_Q4_K)
        panel_q4k_bf16(r2, kn, panel, plo, pp);
    else if (type == T_Q6_K)
        panel_q6k_bf16(r2, kn, panel, plo, pp);
    else
        DISPATCH(type, PANEL)
#undef PANEL
}

#define TLOAD(t, p) _tile_loadd(t, (p), 64)
#define DP(c, a, b) _tile_dpbf16ps(c, a, b)

/* C tiles += panel chunks 0 .. n - 1 (A: tile 4; the weights' remainders, plo, tile 6) times
 * chunks c0 .. c0 + n - 1 of x tiles t0 .. t0 + nt - 1 and of their remainders (B: tiles 5
 * and 7, x's remainders xlo further on). A product into a C tile waits for the one before it
 * into that tile (a latency of about three products' issue), so consecutive products go to
 * different C tiles: one tile of x spreads its products over all four C tiles by chunk, two
 * put x's and its remainder's into their own tiles, three or four go round them pass by pass.
 * amx_store sums them back. */
static inline __attribute__((always_inline)) void amx_run(const uint16_t *panel, const uint16_t *plo,
                                                         const uint16_t *xb, int64_t xlo, int64_t nch, int64_t t0,
                                                         int64_t c0, int64_t n, int nt) {
    const int64_t xs = nch * 512; /* from one tile of x to the next */
    for (int64_t i = 0; i < n; i++) {
        const int64_t c = c0 + i;
        const uint16_t *b = xb + (t0 * nch + c) * 512;
        TLOAD(4, panel + i * NR * CK);
        if (plo) TLOAD(6, plo + i * NR * CK);
        if (nt == 1) {
            TLOAD(5, b);
            TLOAD(7, b + xlo);
            switch (c & 3) { /* x -> C[c], its remainder -> C[c + 2], the weights' -> C[c + 1] */
#define ONE(k0, k1, k2)                      \
    DP(k0, 4, 5);                            \
    DP(k1, 4, 7);                            \
    if (plo) DP(k2, 6, 5);                   \
    break;
            case 0: ONE(0, 2, 1)
            case 1: ONE(1, 3, 2)
            case 2: ONE(2, 0, 3)
            default: ONE(3, 1, 0)
#undef ONE
            }
        } else if (nt == 2) { /* x -> C0, C1; remainders -> C2, C3 */
            TLOAD(5, b);
            DP(0, 4, 5);
            TLOAD(7, b + xs);
            DP(1, 4, 7);
            if (plo) {
                DP(2, 6, 5);
                DP(3, 6, 7);
            }
            TLOAD(5, b + xlo);
            DP(2, 4, 5);
            TLOAD(7, b + xs + xlo);
            DP(3, 4, 7);
        } else { /* C tile j for x tile j; a pass each for x, its remainder, the weights' */
#define PASS(a, off)                          \
    TLOAD(5, b + (off));                      \
    DP(0, a, 5);                              \
    TLOAD(7, b + xs + (off));                 \
    DP(1, a, 7);                              \
    TLOAD(5, b + 2 * xs + (off));             \
    DP(2, a, 5);                              \
    if (nt > 3) {                             \
        TLOAD(7, b + 3 * xs + (off));         \
        DP(3, a, 7);                          \
    }
            PASS(4, 0)
            PASS(4, xlo)
            if (plo) { PASS(6, 0) }
#undef PASS
        }
    }
}

/* The C tiles of x tiles t0 .. t0 + nt - 1 into y (outputs col .. col + cnt - 1), plus bias,
 * summing the tiles that amx_run spread one tile's products over (all four for one tile of x,
 * j and j + 2 for two). */
static inline void amx_store(float (*cbuf)[NR * XT], int nt, int64_t t0, int64_t M, int64_t N, int64_t col,
                             int64_t cnt, const float *bias, float *y) {
    _tile_stored(0, cbuf[0], 64);
    _tile_stored(1, cbuf[1], 64);
    _tile_stored(2, cbuf[2], 64);
    _tile_stored(3, cbuf[3], 64);
    for (int j = 0; j < nt; j++) {
        const int64_t m0 = (t0 + j) * XT, mm = M - m0 < XT ? M - m0 : XT;
        for (int64_t m = 0; m < mm; m++)
            for (int64_t r = 0; r < cnt; r++) {
                float v = cbuf[j][r * XT + m];
                if (nt == 1) v += cbuf[1][r * XT + m] + cbuf[2][r * XT + m] + cbuf[3][r * XT + m];
                if (nt == 2) v += cbuf[j + 2][r * XT + m];
                y[(m0 + m) * N + col + r] = v + (bias ? bias[col + r] : 0.0f);
            }
    }
}

static inline void zero_tiles(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Same arguments as gguf_linear_f32. */
void gguf_linear_amx(const float *x, const void *wp, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int nthreads) {
    if (K % CK || g_amx != 1) {
        gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads);
        return;
    }
    if (M <= DMAX) { /* one direct pass: the tiles would not pay for the panel */
        linear_few_bf16(x, (const Desc *)wp, bias, y, M, N, K, nthreads);
        return;
    }
    const int64_t nch = K / CK, ntile = (M + XT - 1) / XT;
    const int wsplit = M > SPLIT_ROWS;
    const int64_t xlo = ntile * nch * 512; /* the remainders' tiles follow x's */
    uint16_t *xb = grow(&g_xb, &g_xb_len, 2 * xlo);
    if (!xb) {
        gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads);
        return;
    }
    pack_x_bf16(x, M, K, xb, xb + xlo, nthreads);
    const Desc *desc = (const Desc *)wp;
    const int64_t total = unit_count(desc, NR);
    /* Long prompts: x's tiles (2 KiB per tile and 32 k, remainders included) are taken about
     * 1 MiB at a time, which stays in L2 while every panel multiplies it (the weights are then
     * rebuilt once per block); all of them at once would stream from L3 for every 16 weight rows. */
    int64_t tb = (1 << 20) / (nch * 2048) / CT * CT;
    if (tb < CT || ntile <= CT) tb = CT;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) { /* C tiles 0..3 [16 outputs][16 rows] fp32, A 4, B 5 and 7: 16 x 64 bytes */
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        uint16_t *panel = grow(&g_panel, &g_panel_len, nch * NR * CK * (1 + wsplit));
        float cbuf[CT][NR * XT];
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t b0 = 0; b0 < ntile; b0 += tb) {
            const int64_t b1 = b0 + tb < ntile ? b0 + tb : ntile;
#pragma omp for schedule(dynamic, 4)
            for (int64_t u = 0; u < total; u++) {
                if (!panel) continue; /* out of memory in this thread: redone below */
                int64_t col, cnt;
                const Seg *sg;
                const uint8_t *rw[NR], *next[NR];
                const uint8_t *const *pf = unit_rows(desc, u, NR, rw, next, &sg, &col, &cnt);
                const int64_t pfstep = (sg->stride + nch - 1) / nch;
                if (ntile <= CT && K % 256 == 0) {
                    /* one pass over the rows (decode batches up to 64): rebuild 256 k at a time into
                     * an L1-sized panel and multiply it at once, instead of a round trip through L2 */
                    const int nt = (int)ntile;
                    zero_tiles();
                    uint16_t *plo = wsplit ? panel + 8 * NR * CK : NULL;
                    for (int64_t k0 = 0; k0 < K; k0 += 256) {
                        /* prefetch what comes next: these rows' next 256 k, else the next rows' first */
                        if (k0 + 256 < K)
                            rebuild(sg->type, rw, k0, 256, panel, plo, rw, k0 + 256, pfstep);
                        else
                            rebuild(sg->type, rw, k0, 256, panel, plo, pf, 0, pfstep);
                        amx_run(panel, plo, xb, xlo, nch, 0, k0 / CK, 8, nt);
                    }
                    amx_store(cbuf, nt, 0, M, N, col, cnt, bias, y);
                    continue;
                }
                uint16_t *plo = wsplit ? panel + nch * NR * CK : NULL;
                rebuild(sg->type, rw, 0, K, panel, plo, pf, 0, pfstep);
                for (int64_t t0 = b0; t0 < b1; t0 += CT) {
                    const int nt = (int)(b1 - t0 < CT ? b1 - t0 : CT);
                    zero_tiles();
                    amx_run(panel, plo, xb, xlo, nch, t0, 0, nch, nt);
                    amx_store(cbuf, nt, t0, M, N, col, cnt, bias, y);
                }
            }
        }
        _tile_release();
    }
    if (failed) gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads); /* a thread had no panel memory */
}
#else
int gguf_amx_ready(void) { return 0; }
void gguf_linear_amx(const float *x, const void *wp, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int nthreads) {
    gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads);
}
#endif
