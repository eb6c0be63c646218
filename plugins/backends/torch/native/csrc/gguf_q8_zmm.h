/* The int8-activation products of Q4_K, Q5_K and Q6_K super-blocks in 16-lane registers, for
 * CPUs with AVX-512 BW and VNNI (gguf_q8.h includes this file; without those the 8-lane code
 * there serves every type).
 *
 * Why: on two cores a decode step's Q4_K product is bound by instructions per weight, not by
 * memory (one thread streamed 25 GB/s of Q4_K codes, two 49, on a machine that reads 75 GB/s).
 * A 16-lane integer dot product takes 64 weights at once, and with the codes of x and of the
 * weights in the quad order below the float work is per group of four 32-blocks, not per block:
 * 8 rows of x took 0.83-0.88 of the time of the pair-of-blocks order this replaced (Q4_K and Q6_K,
 * 16384 x 2048, two Zen 5 cores), one row as long (memory-bound there).
 *
 * Layout (quad order, quad_x): a group of four 32-blocks is two 64-byte halves; lane k of a half
 * holds four codes of block k % 4. x is put in that order once per call; a weight super-block as
 * it is unpacked (one 32-bit word permute per half). A block's factors are then the same in every
 * lane of a group, the two halves' integer products add up before one conversion, and d_x of the
 * four blocks is one broadcast load.
 *
 * Numerics: every term is the one gguf_q8.h's header states (integer dot products, the same fp32
 * factors d_x * (d * sc_j) and d_x * d, rounded in the same order); a lane's integer part sums 8
 * products of its block (4 in the 8-lane code), and the fp32 sum over lanes and blocks runs in
 * another order, so this build's outputs are not the 8-lane build's bits; both are tested against
 * the same fp64 reference (tests/backends/test_gguf_q8.py). */
#ifndef LLMSERVE_GGUF_Q8_ZMM_H
#define LLMSERVE_GGUF_Q8_ZMM_H

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_ZMM 1
#define ZM 8   /* rows of x per pass */
#define ZACC 8 /* accumulators: R * M at most */

static inline __attribute__((always_inline)) __m512i dot4_zmm(__m512i u, __m512i s) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
}

/* The quad order of a super-block's 256 codes (XQ.qz for x; the weights' codes are put in it as
 * they are unpacked): two groups g of 128 bytes (32-blocks 4g .. 4g + 3), each two halves h of 64
 * (weights 16h .. 16h + 15 of each of the four blocks), 32-bit lane k of a half holding weights
 * 16h + 4 (k / 4) .. + 3 of block 4g + k % 4. Every lane of a group's integer dot products then
 * belongs to one block in both halves, the two halves' products add up in int32, and a group's
 * factors are its four blocks' repeated four times: one conversion, one broadcast load of x's four
 * d and one FMA per group instead of one per pair of blocks. */
static __thread uint8_t *g_xz = NULL; /* the calling thread's, as g_xq */
static __thread int64_t g_xz_len = 0;

/* Lane k of a half h: natural 32-bit word 8 (k % 4) + 4h + k / 4 of its group's 128 bytes. */
static inline __attribute__((always_inline)) __m512i quad_words(const int h) {
    return _mm512_set_epi32(27 + 4 * h, 19 + 4 * h, 11 + 4 * h, 3 + 4 * h, 26 + 4 * h, 18 + 4 * h, 10 + 4 * h, 2 + 4 * h,
                            25 + 4 * h, 17 + 4 * h, 9 + 4 * h, 1 + 4 * h, 24 + 4 * h, 16 + 4 * h, 8 + 4 * h, 4 * h);
}

/* o's codes (XQ.q) in quad order too (XQ.qz). K a multiple of 256; 0 without memory. */
static int quad_x(XQ *o, int64_t M, int64_t K) {
    if (!scratch(&g_xz, &g_xz_len, M * K)) return 0;
    int8_t *qz = (int8_t *)g_xz;
    const __m512i i0 = quad_words(0), i1 = quad_words(1);
    for (int64_t c = 0; c < M * K; c += 128) { /* one group: 128 bytes in, 128 out */
        const __m512i a = _mm512_loadu_si512((const void *)(o->q + c)), b = _mm512_loadu_si512((const void *)(o->q + c + 64));
        _mm512_storeu_si512((void *)(qz + c), _mm512_permutex2var_epi32(a, i0, b));
        _mm512_storeu_si512((void *)(qz + c + 64), _mm512_permutex2var_epi32(a, i1, b));
    }
    o->qz = qz;
    return 1;
}

/* 32-bit lane k: a, b, c, d for k % 4 = 0, 1, 2, 3. */
static inline __attribute__((always_inline)) __m512i by_block(const int a, const int b, const int c, const int d) {
    return _mm512_set_epi32(d, c, b, a, d, c, b, a, d, c, b, a, d, c, b, a);
}

/* Group g's codes at x row m of super-block s, half h. */
static inline __attribute__((always_inline)) __m512i quad_xq(const XQ *x, int64_t K, int m, int64_t s, int g, int h) {
    return _mm512_loadu_si512((const void *)(x->qz + m * K + s * 256 + 128 * g + 64 * h));
}

/* x row m's d for blocks 4g .. 4g + 3, each in the lanes of its block (lane k: block 4g + k % 4). */
static inline __attribute__((always_inline)) __m512 quad_dx(const XQ *x, int64_t K, int m, int64_t s, int g) {
    return _mm512_broadcast_f32x4(_mm_loadu_ps(x->d + m * (K / 32) + 8 * s + 4 * g));
}

/* v[4g + k % 4] in lane k (v: 8 floats, one per 32-block). */
static inline __attribute__((always_inline)) __m512 quad_spread(__m256 v, const int g) {
    return _mm512_broadcast_f32x4(g ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v));
}

/* acc[r * M + m] += super-block s of Q4_K / Q5_K rows rw times x's rows (gguf_q8.h's q8_super_k45). */
static inline __attribute__((always_inline)) void zmm_super_k45(const int type, const int R, const int M,
                                                               const uint8_t *const *rw, const XQ *x, int64_t K,
                                                               int64_t s, __m512 acc[ZACC]) {
    const int64_t nb = K / 32, bytes = type == T_Q4_K ? 144 : 176;
    const __m512i low = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(0x10), nib = by_block(0, 4, 0, 4);
    /* qs bytes 64g .. 64g + 63: words 0-7 chunk 2g (low nibbles block 4g, high 4g + 1), 8-15 chunk
     * 2g + 1 (4g + 2, 4g + 3); high bits (Q5_K): bit b of byte i is bit 4 of weight i of block b */
    const __m512i src[2] = {_mm512_set_epi32(11, 11, 3, 3, 10, 10, 2, 2, 9, 9, 1, 1, 8, 8, 0, 0),
                            _mm512_set_epi32(15, 15, 7, 7, 14, 14, 6, 6, 13, 13, 5, 5, 12, 12, 4, 4)};
    const __m512i hsrc[2] = {_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                             _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4)};
    UNROLL for (int r = 0; r < R; r++) {
        const uint8_t *sb = rw[r] + s * bytes;
        __m256 dsc, dmn;
        k45_factors(sb, &dsc, &dmn);
        const __m512 f[2] = {quad_spread(dsc, 0), quad_spread(dsc, 1)};
        __m512i w[2][2];
        UNROLL for (int g = 0; g < 2; g++) {
            const __m512i z = _mm512_loadu_si512((const void *)(sb + bytes - 128 + 64 * g));
            UNROLL for (int h = 0; h < 2; h++) {
                w[g][h] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(src[h], z), nib), low);
                if (type == T_Q5_K) {
                    const __m512i qh = _mm512_permutexvar_epi32(
                        hsrc[h], _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(sb + 16))));
                    const __m512i rot = g ? by_block(0, 31, 30, 29) : by_block(4, 3, 2, 1); /* bit 4g + j to 4 */
                    w[g][h] = _mm512_or_si512(w[g][h], _mm512_and_si512(_mm512_rolv_epi32(qh, rot), bit4));
                }
            }
        }
        UNROLL for (int m = 0; m < M; m++) {
            const __m256 mins = _mm256_mul_ps(dmn, _mm256_loadu_ps(x->ds + m * nb + 8 * s));
            acc[r * M + m] = _mm512_sub_ps(acc[r * M + m], _mm512_zextps256_ps512(mins));
            UNROLL for (int g = 0; g < 2; g++) {
                const __m512i i = _mm512_dpbusd_epi32(dot4_zmm(w[g][0], quad_xq(x, K, m, s, g, 0)), w[g][1],
                                                      quad_xq(x, K, m, s, g, 1));
                acc[r * M + m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(quad_dx(x, K, m, s, g), f[g]),
                                                 acc[r * M + m]);
            }
        }
    }
}

/* Q6_K's 16 scales (int16 lanes 0-15) for group g, half h: lanes 2k, 2k + 1 take scale
 * 2 (4g + k % 4) + h. */
#define Q6Q(a, b, c, d) a, a, b, b, c, c, d, d
#define Q6Q4(a, b, c, d) Q6Q(a, b, c, d), Q6Q(a, b, c, d), Q6Q(a, b, c, d), Q6Q(a, b, c, d)
static const int16_t Q6_QUAD[2][2][32] = {{{Q6Q4(0, 2, 4, 6)}, {Q6Q4(1, 3, 5, 7)}},
                                          {{Q6Q4(8, 10, 12, 14)}, {Q6Q4(9, 11, 13, 15)}}};
#undef Q6Q4
#undef Q6Q

/* acc[r * M + m] += super-block s of Q6_K rows rw times x's rows (gguf_q8.h's q8_super_q6). */
static inline __attribute__((always_inline)) void zmm_super_q6(const int R, const int M, const uint8_t *const *rw,
                                                              const XQ *x, int64_t K, int64_t s, __m512 acc[ZACC]) {
    const int64_t nb = K / 32;
    const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30), nib = by_block(0, 0, 4, 4);
    const __m512i rot = by_block(4, 2, 0, 30); /* block 4g + j: high bits 2j, 2j + 1 to 4, 5 */
    /* low bits 64g .. 64g + 63: words 0-7 blocks 4g (low nibbles), 4g + 2 (high), words 8-15 4g + 1,
     * 4g + 3; high bits 128 + 32g .. + 31: byte i's bits 2j, 2j + 1 for weight i of block 4g + j */
    const __m512i src[2] = {_mm512_set_epi32(11, 3, 11, 3, 10, 2, 10, 2, 9, 1, 9, 1, 8, 0, 8, 0),
                            _mm512_set_epi32(15, 7, 15, 7, 14, 6, 14, 6, 13, 5, 13, 5, 12, 4, 12, 4)};
    const __m512i hsrc[2] = {_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                             _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4)};
    UNROLL for (int r = 0; r < R; r++) {
        const uint8_t *sb = rw[r] + s * 210;
        const __m512 d16 = _mm512_set1_ps(h2f(sb + 208));
        const __m256 d = _mm512_castps512_ps256(d16);
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sb + 192)));
        __m512i w[2][2], scv[2][2];
        UNROLL for (int g = 0; g < 2; g++) {
            const __m512i z = _mm512_loadu_si512((const void *)(sb + 64 * g));
            const __m512i qh = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * g)));
            UNROLL for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(src[h], z), nib), low);
                const __m512i hb = _mm512_rolv_epi32(_mm512_permutexvar_epi32(hsrc[h], qh), rot);
                w[g][h] = _mm512_or_si512(q, _mm512_and_si512(hb, top));
                scv[g][h] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)Q6_QUAD[g][h]),
                                                     _mm512_castsi256_si512(sc));
            }
        }
        UNROLL for (int m = 0; m < M; m++) {
            const __m256 dx = _mm256_mul_ps(_mm256_loadu_ps(x->d + m * nb + 8 * s), d);
            /* lane b: sc_2b * sum(q_2b) + sc_2b+1 * sum(q_2b+1), sums per 16 (|.| < 2^20) */
            const __m256i off = _mm256_madd_epi16(sc, _mm256_loadu_si256((const __m256i *)(x->s16 + m * 2 * nb + 16 * s)));
            const __m256 offs = _mm256_mul_ps(_mm256_cvtepi32_ps(off), _mm256_mul_ps(dx, _mm256_set1_ps(32.0f)));
            acc[r * M + m] = _mm512_sub_ps(acc[r * M + m], _mm512_zextps256_ps512(offs));
            UNROLL for (int g = 0; g < 2; g++) {
                /* 63 * 127 * 2 < 2^15 per pair; both halves' scaled sums in int32 */
                const __m512i i = _mm512_dpwssd_epi32(
                    _mm512_madd_epi16(_mm512_maddubs_epi16(w[g][0], quad_xq(x, K, m, s, g, 0)), scv[g][0]),
                    _mm512_maddubs_epi16(w[g][1], quad_xq(x, K, m, s, g, 1)), scv[g][1]);
                acc[r * M + m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(quad_dx(x, K, m, s, g), d16),
                                                 acc[r * M + m]);
            }
        }
    }
}

/* io[r * M + m] (+)= x row m . weight row r over super-blocks s0 .. s1 - 1 (r < R, m < M), R * M
 * accumulators in registers between the two; s0 = 0 starts them at zero. */
static inline __attribute__((always_inline)) void zmm_rows(const int type, const int R, const int M,
                                                          const uint8_t *const *rw, const XQ *x, int64_t K, int64_t s0,
                                                          int64_t s1, __m512 *io, const uint8_t *const *pf) {
    __m512 acc[ZACC];
    UNROLL for (int i = 0; i < R * M; i++) acc[i] = s0 ? io[i] : _mm512_setzero_ps();
    const int64_t step = bytes256(type);
    for (int64_t s = s0; s < s1; s++) {
        if (pf) prefetch_span(R, pf, s * step, step);
        if (type == T_Q6_K) zmm_super_q6(R, M, rw, x, K, s, acc);
        else zmm_super_k45(type, R, M, rw, x, K, s, acc);
    }
    UNROLL for (int i = 0; i < R * M; i++) io[i] = acc[i];
}

/* One function per type and pass shape (R weight rows, M rows of x): inlined into one body, the
 * shapes' register allocations met and spilled (8 rows of x took 2-3 times as many stack moves). */
typedef void (*ZmmRows)(const uint8_t *const *rw, const XQ *x, int64_t K, int64_t s0, int64_t s1, __m512 *io,
                        const uint8_t *const *pf);
#define ZMM_FN(T, R, M)                                                                                       \
    static void __attribute__((noinline)) zmm_##T##_##M(const uint8_t *const *rw, const XQ *x, int64_t K,     \
                                                        int64_t s0, int64_t s1, __m512 *io,                   \
                                                        const uint8_t *const *pf) {                           \
        zmm_rows(T, R, M, rw, x, K, s0, s1, io, pf);                                                          \
    }
#define ZMM_TYPE(T)                                                                                           \
    ZMM_FN(T, 4, 1) ZMM_FN(T, 4, 2) ZMM_FN(T, 1, 3) ZMM_FN(T, 1, 4) ZMM_FN(T, 1, 5) ZMM_FN(T, 1, 6)          \
    ZMM_FN(T, 1, 7) ZMM_FN(T, 1, 8)
ZMM_TYPE(T_Q4_K)
ZMM_TYPE(T_Q5_K)
ZMM_TYPE(T_Q6_K)
#define ZMM_ROW(T) {zmm_##T##_1, zmm_##T##_2, zmm_##T##_3, zmm_##T##_4, zmm_##T##_5, zmm_##T##_6, zmm_##T##_7, zmm_##T##_8}
static const ZmmRows ZMM_ROWS[3][ZM] = {ZMM_ROW(T_Q4_K), ZMM_ROW(T_Q5_K), ZMM_ROW(T_Q6_K)};
static const int ZMM_R[ZM] = {4, 4, 1, 1, 1, 1, 1, 1}; /* weight rows per call, by rows of x: R * M <= ZACC */
#undef ZMM_ROW
#undef ZMM_TYPE
#undef ZMM_FN

/* Super-blocks per pass over x: 8 rows of x's codes and factors for 2048 weights (about 26 KB)
 * stay in the L1 cache while every weight row of the unit reads them (with K = 8192 and the whole
 * of x per weight row, 8-row products took 1.5 times as long). */
#define ZCHUNK 8

/* q8_unit for the K-quants: GR weight rows (cnt stored) times M rows of x, ZM at a time. A weight
 * super-block is unpacked once per pass and serves every row of x in it. */
static inline __attribute__((always_inline)) void zmm_unit(const int type, const uint8_t *const *rw, int cnt,
                                                          const XQ *x, int64_t M, int64_t K, const float *bias,
                                                          float *y, int64_t ldy, const uint8_t *const *pf) {
    __m512 io[GR][ZACC];
    const int t = type == T_Q4_K ? 0 : type == T_Q5_K ? 1 : 2;
    const int64_t nsb = K / 256;
    for (int64_t m0 = 0; m0 < M; m0 += ZM) {
        const int mm = M - m0 < ZM ? (int)(M - m0) : ZM, R = ZMM_R[mm - 1];
        const XQ xm = {x->q + m0 * K, x->d + m0 * (K / 32), x->ds + m0 * (K / 32), x->s16 + m0 * (K / 16),
                       x->qz + m0 * K};
        const uint8_t *const *p = m0 ? NULL : pf;
        const ZmmRows fn = ZMM_ROWS[t][mm - 1];
        for (int64_t s0 = 0; s0 < nsb; s0 += ZCHUNK)
            for (int h = 0; h < GR; h += R) fn(rw + h, &xm, K, s0, s0 + ZCHUNK < nsb ? s0 + ZCHUNK : nsb, io[h], p ? p + h : NULL);
        for (int h = 0; h < GR; h += R)
            for (int r = 0; r < R && h + r < cnt; r++)
                for (int m = 0; m < mm; m++)
                    y[(m0 + m) * ldy + h + r] = _mm512_reduce_add_ps(io[h][r * mm + m]) + (bias ? bias[h + r] : 0.0f);
    }
}

#endif
#endif
