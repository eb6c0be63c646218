/* Per-type decoding of GGUF blocks for gguf_linear.c (included by that file only; the kernel
 * cache key covers every header in csrc/): each served type's weights rebuilt in fp32 exactly as
 * the dequantizer rebuilds them, 32 at a time, in 8-wide registers (dq32) and, where the CPU has
 * AVX-512, in 16-wide ones (dq32x, the same bits); the K-quants' per-super-block factors; the
 * chunk loops every path runs; whole rows for the row dequantizer. */
#ifndef LLMSERVE_GGUF_DECODE_H
#define LLMSERVE_GGUF_DECODE_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "gguf_blocks.h"
#include "gguf_simd.h"

#define CK 32 /* weights per decoded chunk: four ymm registers */

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

/* What every chunk loop over R rows does first: at each super-block the K-quant factors of
 * every row (into f[r], see kprep), then the next rows' bytes of chunk c (pf, pfstep; none
 * when pf is NULL). Expects ``type``, ``rw``, ``f``, ``pf`` and ``pfstep`` in scope. */
#define CHUNK_PROLOGUE(R, c)                                                  \
    if (is_k(type) && ((c) & 7) == 0)                                         \
        for (int r_ = 0; r_ < (R); r_++) kprep(type, rw[r_], c, f[r_]);      \
    if (pf) prefetch_rows((R), pf, (c) * pfstep, pfstep);

/* IQ4_NL's (and IQ4_XS's) 16 non-uniform levels, and MXFP4's: e2m1 values doubled (the scale
 * below is halved to match), as the dequantizer's tables give them. */
static const int8_t IQ4NL_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* MXFP4's shared exponent (e8m0) as half the fp32 scale 2^(e - 127) (2^-127 and 2^-126 as
 * subnormals), as the dequantizer decodes it. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The 16 levels picked by the nibbles of 16 bytes: weights 0-15 from the low nibbles (lo),
 * 16-31 from the high ones (hi), as signed bytes. */
static inline __attribute__((always_inline)) void nibble_levels(const uint8_t *qs, const int8_t *levels,
                                                               __m128i *lo, __m128i *hi) {
    const __m128i table = _mm_loadu_si128((const __m128i *)levels), m = _mm_set1_epi8(15);
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    *lo = _mm_shuffle_epi8(table, _mm_and_si128(b, m));
    *hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), m));
}

/* Q3_K's 16 scales: 6 bits each, low four from bytes 0-7 (low nibbles for 0-7, high for 8-15),
 * top two from bytes 8-11 (scale i: bits 2 (i / 4) of byte 8 + i % 4), offset by 32. */
static inline int q3k_scale(const uint8_t *sc, int i) {
    const int low = i < 8 ? sc[i] & 15 : sc[i - 8] >> 4;
    return (low | ((sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4) - 32;
}

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
    } else if (type == T_Q3_K) { /* f[i] = d * (scale_i - 32) per 16 weights */
        const uint8_t *sb = row + (c >> 3) * 110;
        const float d = h2f(sb + 108);
        for (int i = 0; i < 16; i++) f[i] = d * (float)q3k_scale(sb + 96, i);
    } else if (type == T_Q2_K) { /* f[i] = d * (scale_i & 15) per 16 weights (the mins: dq32) */
        const uint8_t *sb = row + (c >> 3) * 84;
        const __m256 d = _mm256_set1_ps(h2f(sb + 80));
        const __m128i sc = _mm_and_si128(_mm_loadu_si128((const __m128i *)sb), _mm_set1_epi8(15));
        _mm256_storeu_ps(f, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
        _mm256_storeu_ps(f + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8)))));
    } else if (type == T_IQ4_XS) { /* f[j] = d * (scale_j - 32) per 32 weights; 6-bit scales */
        const uint8_t *sb = row + (c >> 3) * 136;
        const float d = h2f(sb);
        const unsigned hi = (unsigned)(sb[2] | sb[3] << 8);
        for (int j = 0; j < 8; j++)
            f[j] = d * (float)((int)(((sb[4 + j / 2] >> (4 * (j & 1))) & 15) | ((hi >> (2 * j)) & 3) << 4) - 32);
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
    case T_Q2_K:
    case T_Q3_K: {
        /* super-block of 256 in two halves of 128; chunk (c % 8) = 4 n + j: 2-bit codes at shift 2 j
         * of bytes 32 n .. 32 n + 31 of qs, sixteen weights per scale. Q2_K: d sc q - dmin m.
         * Q3_K: q - 4, plus 4 where bit 4 n + j of hmask byte i is set. */
        const int cc = (int)(c & 7), n = cc >> 2, g = 8 * n + 2 * ph;
        const uint8_t *sb = row + (c >> 3) * (type == T_Q2_K ? 84 : 110);
        const uint8_t *qs = sb + (type == T_Q2_K ? 16 : 32) + 32 * n;
        for (int v = 0; v < 4; v++) {
            __m256i q = _mm256_and_si256(_mm256_srli_epi32(u8x8(qs + 8 * v), 2 * ph), _mm256_set1_epi32(3));
            const __m256 D = _mm256_set1_ps(f[g + (v >> 1)]);
            if (type == T_Q2_K) {
                const __m256 M = _mm256_set1_ps(h2f(sb + 82) * (float)(sb[g + (v >> 1)] >> 4));
                w[v] = _mm256_fmsub_ps(cvt(q), D, M); /* (d * sc) * q exact: rounds as the multiply-then-subtract */
            } else {
                const __m256i hb = _mm256_and_si256(u8x8(sb + 8 * v), _mm256_set1_epi32(1 << (4 * n + ph)));
                q = _mm256_sub_epi32(q, _mm256_andnot_si256(_mm256_cmpgt_epi32(hb, _mm256_setzero_si256()),
                                                            _mm256_set1_epi32(4)));
                w[v] = _mm256_mul_ps(cvt(q), D);
            }
        }
        break;
    }
    case T_IQ4_NL:
    case T_IQ4_XS:
    case T_MXFP4: {
        /* levels picked by nibbles: weight i < 16 by byte i's low nibble, 16 + i by its high one.
         * IQ4_NL: blocks of 32 (fp16 d, 16 bytes); MXFP4: (e8m0, 16 bytes); IQ4_XS: super-blocks
         * of 256 (d, scale bits, 128 bytes: 16 per 32 weights) with a factor per 32 (kprep). */
        const uint8_t *qs;
        __m256 d;
        if (type == T_IQ4_XS) {
            qs = row + (c >> 3) * 136 + 8 + 16 * (c & 7);
            d = _mm256_set1_ps(f[c & 7]);
        } else if (type == T_IQ4_NL) {
            qs = row + c * 18 + 2;
            d = _mm256_set1_ps(h2f(row + c * 18));
        } else {
            qs = row + c * 17 + 1;
            d = _mm256_set1_ps(e8m0_half(row[c * 17]));
        }
        __m128i lo, hi;
        nibble_levels(qs, type == T_MXFP4 ? MXFP4_LEVELS : IQ4NL_LEVELS, &lo, &hi);
        w[0] = _mm256_mul_ps(cvt(_mm256_cvtepi8_epi32(lo)), d);
        w[1] = _mm256_mul_ps(cvt(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
        w[2] = _mm256_mul_ps(cvt(_mm256_cvtepi8_epi32(hi)), d);
        w[3] = _mm256_mul_ps(cvt(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
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

/* A whole stored row rebuilt, for the row dequantizer (embedding lookups and the tests'
 * bit-for-bit check). */
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

#ifdef __AVX512F__
/* dq32 in 16-wide registers, for the AVX-512 few-row path and the bf16 panels: a decode step is
 * bound by the rebuild's instruction count (fp32 weights from 4-6 bit codes), not by memory, so
 * twice the width is nearly twice the speed. The same rebuilds as dq32, so the same weights bit
 * for bit. */
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
    case T_Q2_K:
    case T_Q3_K: {
        const int cc = (int)(c & 7), n = cc >> 2, g = 8 * n + 2 * ph;
        const uint8_t *sb = row + (c >> 3) * (type == T_Q2_K ? 84 : 110);
        const uint8_t *qs = sb + (type == T_Q2_K ? 16 : 32) + 32 * n;
        for (int v = 0; v < 2; v++) {
            __m512i q = _mm512_and_si512(_mm512_srli_epi32(u8x16(qs + 16 * v), 2 * ph), _mm512_set1_epi32(3));
            const __m512 D = _mm512_set1_ps(f[g + v]);
            if (type == T_Q2_K) {
                const __m512 M = _mm512_set1_ps(h2f(sb + 82) * (float)(sb[g + v] >> 4));
                w[v] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q), D, M);
            } else {
                const __mmask16 set = _mm512_test_epi32_mask(u8x16(sb + 16 * v), _mm512_set1_epi32(1 << (4 * n + ph)));
                q = _mm512_mask_sub_epi32(q, (__mmask16)~set, q, _mm512_set1_epi32(4));
                w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), D);
            }
        }
        break;
    }
    case T_IQ4_NL:
    case T_IQ4_XS:
    case T_MXFP4: {
        const uint8_t *qs;
        __m512 d;
        if (type == T_IQ4_XS) {
            qs = row + (c >> 3) * 136 + 8 + 16 * (c & 7);
            d = _mm512_set1_ps(f[c & 7]);
        } else if (type == T_IQ4_NL) {
            qs = row + c * 18 + 2;
            d = _mm512_set1_ps(h2f(row + c * 18));
        } else {
            qs = row + c * 17 + 1;
            d = _mm512_set1_ps(e8m0_half(row[c * 17]));
        }
        __m128i lo, hi;
        nibble_levels(qs, type == T_MXFP4 ? MXFP4_LEVELS : IQ4NL_LEVELS, &lo, &hi);
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d);
        break;
    }
    }
}
#endif

#endif
