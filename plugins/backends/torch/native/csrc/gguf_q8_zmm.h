/* The int8-activation products of Q4_K, Q5_K and Q6_K super-blocks in 16-lane registers, for
 * CPUs with AVX-512 BW and VNNI (gguf_q8.h includes this file; without those the 8-lane code
 * there serves every type).
 *
 * Why: on two cores a decode step's Q4_K product is bound by instructions per weight, not by
 * memory (one thread streamed 25 GB/s of Q4_K codes, two 49, on a machine that reads 75 GB/s).
 * A 16-lane integer dot product takes two 32-weight blocks at once, and the nibble unpacking of
 * those 64 weights is one broadcast load, one variable shift and one mask, so a super-block
 * costs about two thirds of the instructions of the 8-lane code.
 *
 * Layout: lanes 0-7 of a dot product hold 32-block b (its weights 4k .. 4k + 3 in lane k),
 * lanes 8-15 block b + 1; x's codes are read in their natural order. A pair's factors (d_x[b]
 * times the weight block's own, per block) are spread over the two halves by one permute.
 *
 * Numerics: every term is the one gguf_q8.h's header states (the same integer dot products, the
 * same fp32 factors, the same rounding of each term); only the order of the fp32 sum over the
 * blocks differs from the 8-lane code (16 partial sums instead of 8, reduced as a tree), so this
 * build's outputs are not the 8-lane build's bits; both are tested against the same fp64
 * reference (tests/backends/test_gguf_q8.py). */
#ifndef LLMSERVE_GGUF_Q8_ZMM_H
#define LLMSERVE_GGUF_Q8_ZMM_H

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_ZMM 1

static inline __attribute__((always_inline)) __m512i dot4_zmm(__m512i u, __m512i s) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
}

/* Lanes 0-7: v[2p], lanes 8-15: v[2p + 1] (v: 8 floats, one per 32-block of a super-block). */
static inline __attribute__((always_inline)) __m512 pair_factors(__m256 v, const int p) {
    const __m512i idx = _mm512_set_epi32(2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                         2 * p + 1, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v));
}

/* 16-bit lane counts: a in the low 256 bits, b in the high ones. */
static inline __attribute__((always_inline)) __m512i halves16(const int a, const int b) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

/* acc[r][m] += super-block s of Q4_K / Q5_K rows rw times x's rows (gguf_q8.h's q8_super_k45). */
static inline __attribute__((always_inline)) void zmm_super_k45(const int type, const int R, const int M,
                                                               const uint8_t *const *rw, const XQ *x, int64_t K,
                                                               int64_t s, __m512 acc[GR][DMAX]) {
    const int64_t nb = K / 32, bytes = type == T_Q4_K ? 144 : 176;
    __m256 sc[GR][DMAX]; /* d_x[b] * (d * sc_j), one lane per 32-block */
    UNROLL for (int r = 0; r < R; r++) {
        __m256 dsc, dmn;
        k45_factors(rw[r] + s * bytes, &dsc, &dmn);
        UNROLL for (int m = 0; m < M; m++) {
            sc[r][m] = _mm256_mul_ps(_mm256_loadu_ps(x->d + m * nb + 8 * s), dsc);
            const __m256 mins = _mm256_mul_ps(dmn, _mm256_loadu_ps(x->ds + m * nb + 8 * s));
            acc[r][m] = _mm512_sub_ps(acc[r][m], _mm512_zextps256_ps512(mins));
        }
    }
    const __m512i low = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(0x10);
    UNROLL for (int p = 0; p < 4; p++) /* blocks 2p (low nibbles of 32 bytes), 2p + 1 (their high nibbles) */
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *sb = rw[r] + s * bytes;
            const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb + bytes - 128 + 32 * p)));
            __m512i w = _mm512_and_si512(_mm512_srlv_epi16(raw, halves16(0, 4)), low);
            if (type == T_Q5_K) { /* bit j of high-bit byte i is bit 4 of weight i of block j */
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb + 16)));
                const __m512i t = _mm512_slli_epi16(_mm512_srlv_epi16(qh, halves16(2 * p, 2 * p + 1)), 4);
                w = _mm512_or_si512(w, _mm512_and_si512(t, bit4));
            }
            UNROLL for (int m = 0; m < M; m++) {
                const __m512i xq = _mm512_loadu_si512((const void *)(x->q + m * K + s * 256 + 64 * p));
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot4_zmm(w, xq)), pair_factors(sc[r][m], p),
                                            acc[r][m]);
            }
        }
}

/* Q6_K's scales of blocks b, b + 1 (b = 2 q): each 16-weight half's signed byte, spread over
 * that half's 8 lanes of 16 bits. */
static const uint8_t Q6_PAIRS[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13,
     14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

/* acc[r][m] += super-block s of Q6_K rows rw times x's rows (gguf_q8.h's q8_super_q6). */
static inline __attribute__((always_inline)) void zmm_super_q6(const int R, const int M, const uint8_t *const *rw,
                                                              const XQ *x, int64_t K, int64_t s, __m512 acc[GR][DMAX]) {
    const int64_t nb = K / 32;
    __m256 dx[GR][DMAX]; /* d * d_x[b] */
    UNROLL for (int r = 0; r < R; r++) {
        const uint8_t *sb = rw[r] + s * 210;
        const __m256 d = _mm256_set1_ps(h2f(sb + 208));
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sb + 192)));
        UNROLL for (int m = 0; m < M; m++) {
            dx[r][m] = _mm256_mul_ps(_mm256_loadu_ps(x->d + m * nb + 8 * s), d);
            const __m256i off = _mm256_madd_epi16(sc, _mm256_loadu_si256((const __m256i *)(x->s16 + m * 2 * nb + 16 * s)));
            const __m256 offs = _mm256_mul_ps(_mm256_cvtepi32_ps(off), _mm256_mul_ps(dx[r][m], _mm256_set1_ps(32.0f)));
            acc[r][m] = _mm512_sub_ps(acc[r][m], _mm512_zextps256_ps512(offs));
        }
    }
    const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
    /* weights 128 h + i, i < 64 (blocks 4h, 4h + 1): low nibbles of bytes 64 h + i, top bits
     * (byte 128 + 32 h + i % 32) << 4 for i < 32, << 2 beyond; i >= 64 (blocks 4h + 2, 4h + 3):
     * high nibbles of the same bytes, top bits as they are, then >> 2 */
    UNROLL for (int h = 0; h < 2; h++)
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *sb = rw[r] + s * 210;
            const __m512i ql = _mm512_loadu_si512((const void *)(sb + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h)));
            const __m256i sc8 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(sb + 192)));
            UNROLL for (int half = 0; half < 2; half++) {
                const int b = 4 * h + 2 * half;
                const __m512i q = half ? _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                                         _mm512_and_si512(_mm512_srlv_epi16(qh, halves16(0, 2)), top))
                                       : _mm512_or_si512(_mm512_and_si512(ql, low),
                                                         _mm512_and_si512(_mm512_sllv_epi16(qh, halves16(4, 2)), top));
                const __m512i scv = _mm512_cvtepi8_epi16(
                    _mm256_shuffle_epi8(sc8, _mm256_loadu_si256((const __m256i *)Q6_PAIRS[b / 2])));
                UNROLL for (int m = 0; m < M; m++) {
                    const __m512i xq = _mm512_loadu_si512((const void *)(x->q + m * K + s * 256 + 32 * b));
                    const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(q, xq), scv); /* 63 * 127 * 2 < 2^15 */
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_factors(dx[r][m], b / 2), acc[r][m]);
                }
            }
        }
}

/* q8_rows for the K-quants: sums[m * GR + r] = x row m . weight row r. */
static inline __attribute__((always_inline)) void zmm_rows(const int type, const int R, const int M,
                                                          const uint8_t *const *rw, const XQ *x, int64_t K, float *sums,
                                                          const uint8_t *const *pf) {
    __m512 acc[GR][DMAX];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    const int64_t step = bytes256(type), nsb = K / 256;
    for (int64_t s = 0; s < nsb; s++) {
        if (pf) prefetch_span(R, pf, s * step, step);
        if (type == T_Q6_K) zmm_super_q6(R, M, rw, x, K, s, acc);
        else zmm_super_k45(type, R, M, rw, x, K, s, acc);
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int m = 0; m < M; m++) sums[m * GR + r] = _mm512_reduce_add_ps(acc[r][m]);
}

#endif
#endif
