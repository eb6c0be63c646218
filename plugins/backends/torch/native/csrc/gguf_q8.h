/* The int8-activation path of the GGUF linear for few rows of x (gguf_linear_q8, the same
 * arguments as gguf_linear_f32). Included once, at the end of gguf_linear.c: it falls back to
 * that file's gguf_linear_f32 and direct_part (the kernel cache key covers every header in csrc/).
 *
 * Why: a decode step on AVX2 is bound by instructions per weight, not by memory. Rebuilding a
 * 4-6 bit code in fp32 (widen, mask, convert, scale) and an FMA per row of x cost about five
 * vector instructions per 8 weights; with x quantized to int8, 32 weights per row of x take a
 * u8 x s8 multiply-add, a widening add, one conversion and one FMA (llama.cpp's scheme).
 *
 * Numerics (documented and tested, tests/backends/test_gguf_q8.py; not bit-identical to the
 * exact paths, since x is rounded):
 *  - Up to Q8_ROWS rows of x (below): each row is quantized once per call in blocks of 32, as ggml's
 *    Q8_0: d = max|x| / 127 (fp32 division), q = x / d (fp32 division) rounded to nearest with
 *    ties to even (the vector rounding; ggml's scalar reference rounds ties away from zero) and
 *    clamped to [-127, 127] (which matters only when d is subnormal); a block whose d is 0 has
 *    q = 0. Kept per block: d, sum(q) per 16, and d * sum(q) in fp32.
 *  - y[m][n] = sum over the 32-blocks b of d_x[b] * S_w(b) (+ bias), where S_w takes integer
 *    dot products of the weight codes with q and the weight block's own fp32 factors, exactly
 *    as the dequantizer forms them:
 *      Q8_0: d * dot(q_w, q);  Q4_0: d * dot(q_w - 8, q);  Q5_0: d * dot(q_w - 16, q);
 *      Q4_K / Q5_K, sub-block j of 32: (d * sc_j) * dot(q_w, q) - (dmin * m_j) * sum(q);
 *      Q6_K, each half h of 16: (d * sc_h) * (dot(q_w, q_h) - 32 * sum(q_h)).
 *    Integer parts are exact (no pairwise sum saturates: 2 * 128 * 127 < 2^15); the factors and
 *    the sum over blocks are fp32, rounded in this order: Q8_0 / Q4_0 / Q5_0 (float(dot) * d_x) * d;
 *    Q4_K / Q5_K float(dot) * (d_x * (d * sc_j)) - (dmin * m_j) * (d_x * sum(q)); Q6_K (its signed
 *    scales applied in int32) float(sum_h sc_h * dot_h) * (d_x * d) - float(sum_h sc_h * sum(q_h))
 *    * (32 * (d_x * d)).
 *  - Other types in the descriptor (float types, Q4_1, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4):
 *    those parts take the exact few-row path, bit for bit gguf_linear_f32's. More than Q8_ROWS
 *    rows, K not a multiple of 32 (float types only), no part of the types above or no scratch
 *    memory: gguf_linear_f32 for the whole call.
 * With AVX-512 BW and VNNI, Q4_K / Q5_K / Q6_K take gguf_q8_zmm.h's 16-lane code up to LANES_MIN
 * rows of x and gguf_q8_lanes.h's (x's rows in lanes) beyond: the same terms summed in other
 * orders (not this file's bits; both builds are tested against the reference).
 * Work split as the exact few-row path: GR output rows a unit, dynamic over threads, each unit
 * prefetching the next rows of its part; no reduction across threads, so the thread count does
 * not change any bit. */
#ifndef LLMSERVE_GGUF_Q8_H
#define LLMSERVE_GGUF_Q8_H

/* Unsigned bytes u times signed bytes s, summed four at a time into 8 int32 lanes (lane k:
 * bytes 4k .. 4k + 3). VNNI does it in one instruction; the pair gives the same lanes (the
 * 16-bit pair sums never saturate here), so VNNI changes no bit of this file's code. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT4(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#elif defined(__AVXVNNI__)
#define DOT4(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#else
#define DOT4(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#endif

/* Loops over rows of weights and of x, and over the blocks of a super-block: unrolled, so the
 * accumulators (acc[r][m], constant indices) stay in registers. */
#define UNROLL _Pragma("GCC unroll 16")

static inline int q8_served(int64_t type) {
    return type == T_Q8_0 || type == T_Q4_0 || type == T_Q5_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* The served K-quants: those gguf_q8_zmm.h and gguf_q8_lanes.h take where the CPU has them
 * (always inlined: as a call, it kept q8_rows from folding its type and slowed 8-row products). */
static inline __attribute__((always_inline)) int q8_k_served(int64_t type) {
    return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* Rows of x as int8 blocks: row m's codes at q + m * K, its per-block d and d * sum(q) at
 * d / ds + m * K / 32, its sums per 16 at s16 + m * K / 16. */
typedef struct {
    const int8_t *q;
    const float *d, *ds;
    const int16_t *s16;
    const int8_t *qz; /* q in the 16-lane K-quant code's order (gguf_q8_zmm.h's quad_x), else NULL */
} XQ;

static __thread uint8_t *g_xq = NULL; /* the calling thread's: x is quantized before the parallel region */
static __thread int64_t g_xq_len = 0;

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* *buf (of *len bytes, 64-byte aligned) grown to at least need bytes; 0 without memory. */
static int scratch(uint8_t **buf, int64_t *len, int64_t need) {
    if (*len < need) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)(need + 63) / 64 * 64);
        *len = *buf ? need : 0;
    }
    return *buf != NULL;
}

/* x [M, K] (K a multiple of 32) quantized as the header says. Returns 0 without memory. */
static int quantize_x(const float *x, int64_t M, int64_t K, XQ *o) {
    const int64_t nb = M * K / 32, need = M * K + nb * 12 + 64;
    if (!scratch(&g_xq, &g_xq_len, need)) return 0;
    int8_t *q = (int8_t *)g_xq;
    float *d = (float *)(g_xq + M * K), *ds = d + nb; /* M * K is a multiple of 32: aligned */
    int16_t *s16 = (int16_t *)(ds + nb);
    const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
    for (int64_t i = 0; i < nb; i++) { /* the rows are contiguous: block i is x + 32 i */
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(x + 32 * i + 8 * k);
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        const float dd = hmax8(a) / 127.0f;
        d[i] = dd;
        if (dd == 0.0f) { /* zeros (or a max so small that d underflows): q = 0, no division by 0 */
            memset(q + 32 * i, 0, 32);
            ds[i] = 0.0f;
            s16[2 * i] = s16[2 * i + 1] = 0;
            continue;
        }
        const __m256 dv = _mm256_set1_ps(dd);
        __m256 t[4];
        __m256i n[4];
        for (int k = 0; k < 4; k++) {
            t[k] = _mm256_round_ps(_mm256_div_ps(v[k], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            t[k] = _mm256_min_ps(_mm256_max_ps(t[k], lo), hi);
            n[k] = _mm256_cvtps_epi32(t[k]); /* integral already: exact */
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * i), _mm256_permutevar8x32_epi32(p, order));
        /* small integers in fp32: these sums are exact */
        const int s0 = (int)hsum8(_mm256_add_ps(t[0], t[1])), s1 = (int)hsum8(_mm256_add_ps(t[2], t[3]));
        s16[2 * i] = (int16_t)s0;
        s16[2 * i + 1] = (int16_t)s1;
        ds[i] = dd * (float)(s0 + s1);
    }
    o->q = q;
    o->d = d;
    o->ds = ds;
    o->s16 = s16;
    o->qz = NULL;
    return 1;
}

/* Bit j of every byte of v as bit 4 (0x10) of that byte (the 16-bit shifts' carries across
 * bytes are masked off). j is a compile-time constant wherever this is inlined. */
static inline __attribute__((always_inline)) __m256i bit_to_16(__m256i v, const int j) {
    const __m256i m = _mm256_set1_epi8(0x10);
    if (j < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - j), m);
    if (j > 4) return _mm256_and_si256(_mm256_srli_epi16(v, j - 4), m);
    return _mm256_and_si256(v, m);
}

/* Block c (32 weights) of a Q8_0 / Q4_0 / Q5_0 row as signed bytes (q - 8, q - 16 for the
 * 4- and 5-bit codes), its fp16 d in *dw. */
static inline __attribute__((always_inline)) __m256i signed_block(const int type, const uint8_t *row, int64_t c,
                                                                 float *dw) {
    if (type == T_Q8_0) {
        *dw = h2f(row + c * 34);
        return _mm256_loadu_si256((const __m256i *)(row + c * 34 + 2));
    }
    const uint8_t *b = row + c * (type == T_Q4_0 ? 18 : 22);
    *dw = h2f(b);
    const __m128i t = _mm_loadu_si128((const __m128i *)(b + (type == T_Q4_0 ? 2 : 6)));
    /* weight i < 16: low nibble of byte i, 16 + i: its high nibble */
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
    if (type == T_Q4_0) return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
    /* Q5_0: bit i of qh is bit 4 of weight i; q - 16 is the nibble with 0xF0 or'ed in where it is clear */
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_or_si256(nib, _mm256_andnot_si256(set, _mm256_set1_epi8((char)0xF0)));
}

/* acc[r][m] += block c of rows rw (R) times block c of x's rows (M; row stride K): the sign
 * trick makes both operands fit the u8 x s8 multiply. */
static inline __attribute__((always_inline)) void q8_block(const int type, const int R, const int M,
                                                          const uint8_t *const *rw, const XQ *x, int64_t K, int64_t c,
                                                          __m256 acc[GR][DMAX]) {
    UNROLL for (int r = 0; r < R; r++) {
        float dw;
        const __m256i w = signed_block(type, rw[r], c, &dw), aw = _mm256_abs_epi8(w);
        const __m256 dv = _mm256_set1_ps(dw);
        UNROLL for (int m = 0; m < M; m++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + m * K + c * 32));
            const __m256 p = _mm256_cvtepi32_ps(DOT4(aw, _mm256_sign_epi8(xq, w)));
            acc[r][m] = _mm256_fmadd_ps(_mm256_mul_ps(p, _mm256_broadcast_ss(x->d + m * (K / 32) + c)), dv, acc[r][m]);
        }
    }
}

/* A Q4_K / Q5_K super-block's factors, as kprep has them (d * sc_j in *dsc, dmin * m_j in *dmn),
 * unpacked in one register: kprep's scalar unpacking took a quarter of the time here (Q4_K,
 * one row of x: a super-block serves one to four rows of x). Scale bytes 0-3 / 4-7: low 6 bits
 * of scales / mins 0-3, top 2 bits those of scales / mins 4-7; bytes 8-11: low nibbles scales
 * 4-7, high nibbles mins 4-7. */
static inline __attribute__((always_inline)) void k45_factors(const uint8_t *sb, __m256 *dsc, __m256 *dmn) {
    uint32_t dd;
    memcpy(&dd, sb, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd)); /* d, dmin */
    const __m128i b = _mm_loadu_si128((const __m128i *)(sb + 4)); /* the 12 scale bytes and 4 code bytes */
    /* byte lanes 0-7: scales 0-7, 8-15: mins 0-7 */
    const __m128i lo = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i hi = _mm_shuffle_epi8(b, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low = _mm_and_si128(_mm_blend_epi32(lo, _mm_srli_epi16(lo, 4), 8),
                                      _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_setr_epi8(0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30, 0, 0, 0,
                                                                           0, 0x30, 0x30, 0x30, 0x30));
    const __m128i v = _mm_or_si128(low, top);
    *dsc = _mm256_mul_ps(_mm256_broadcastss_ps(f), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    *dmn = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(f)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}

/* acc[r][m] += super-block s of Q4_K / Q5_K rows rw times x's rows. */
static inline __attribute__((always_inline)) void q8_super_k45(const int type, const int R, const int M,
                                                              const uint8_t *const *rw, const XQ *x, int64_t K,
                                                              int64_t s, __m256 acc[GR][DMAX]) {
    const int64_t nb = K / 32, bytes = type == T_Q4_K ? 144 : 176;
    /* d_x[b] * (d * sc_j), broadcast per sub-block below, and the mins' term (the loop that
     * computes them need not unroll: acc, which must stay in registers, is not touched there) */
    float sc[GR][DMAX][8];
    __m256 mins[GR][DMAX];
    for (int r = 0; r < R; r++) {
        __m256 dsc, dmn;
        k45_factors(rw[r] + s * bytes, &dsc, &dmn);
        for (int m = 0; m < M; m++) {
            _mm256_storeu_ps(sc[r][m], _mm256_mul_ps(_mm256_loadu_ps(x->d + m * nb + 8 * s), dsc));
            mins[r][m] = _mm256_mul_ps(dmn, _mm256_loadu_ps(x->ds + m * nb + 8 * s));
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int m = 0; m < M; m++) acc[r][m] = _mm256_sub_ps(acc[r][m], mins[r][m]);
    const __m256i low = _mm256_set1_epi8(15);
    UNROLL for (int p = 0; p < 4; p++) /* sub-blocks 2p, 2p + 1: low and high nibbles of the same 32 bytes */
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *sb = rw[r] + s * bytes;
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(sb + (type == T_Q4_K ? 16 : 48) + 32 * p));
            __m256i w[2] = {_mm256_and_si256(raw, low), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low)};
            if (type == T_Q5_K) { /* bit j of high-bit byte i is bit 4 of weight i of sub-block j */
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16));
                w[0] = _mm256_or_si256(w[0], bit_to_16(qh, 2 * p));
                w[1] = _mm256_or_si256(w[1], bit_to_16(qh, 2 * p + 1));
            }
            UNROLL for (int h = 0; h < 2; h++)
                UNROLL for (int m = 0; m < M; m++) {
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + m * K + s * 256 + 32 * (2 * p + h)));
                    acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT4(w[h], xq)),
                                                _mm256_broadcast_ss(&sc[r][m][2 * p + h]), acc[r][m]);
                }
        }
}

/* Byte pickers: Q6_K's scales of sub-block b's two halves, each to 8 lanes of 16 bits. */
static const uint8_t Q6_HALVES[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},         {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},         {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},         {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13}, {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

/* acc[r][m] += super-block s of Q6_K rows rw times x's rows. The codes stay unsigned (0..63):
 * the offset of 32 is taken once per super-block from x's sums per 16. */
static inline __attribute__((always_inline)) void q8_super_q6(const int R, const int M, const uint8_t *const *rw,
                                                             const XQ *x, int64_t K, int64_t s, __m256 acc[GR][DMAX]) {
    const int64_t nb = K / 32;
    float dx[GR][DMAX][8]; /* d * d_x[b] */
    __m256 offs[GR][DMAX];
    for (int r = 0; r < R; r++) {
        const uint8_t *sb = rw[r] + s * 210;
        const __m256 d = _mm256_set1_ps(h2f(sb + 208));
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sb + 192)));
        for (int m = 0; m < M; m++) {
            const __m256 f = _mm256_mul_ps(_mm256_loadu_ps(x->d + m * nb + 8 * s), d);
            _mm256_storeu_ps(dx[r][m], f);
            /* lane b: sc_2b * sum(q_2b) + sc_2b+1 * sum(q_2b+1), sums per 16 (|.| < 2^20) */
            const __m256i off = _mm256_madd_epi16(sc, _mm256_loadu_si256((const __m256i *)(x->s16 + m * 2 * nb + 16 * s)));
            offs[r][m] = _mm256_mul_ps(_mm256_cvtepi32_ps(off), _mm256_mul_ps(f, _mm256_set1_ps(32.0f)));
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int m = 0; m < M; m++) acc[r][m] = _mm256_sub_ps(acc[r][m], offs[r][m]);
    const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
    /* weight e = 128 h + i: low nibble from byte 64 h + i % 64 (shift 4 (i / 64)), high two bits
     * from byte 128 + 32 h + i % 32 (shift 2 (i / 32)); scale e / 16 */
    UNROLL for (int h = 0; h < 2; h++)
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *sb = rw[r] + s * 210;
            const __m128i sc8 = _mm_loadu_si128((const __m128i *)(sb + 192));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
            UNROLL for (int j = 0; j < 4; j++) {
                const int b = 4 * h + j;
                __m256i q = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32 * (j & 1)));
                q = _mm256_and_si256(j & 2 ? _mm256_srli_epi16(q, 4) : q, low);
                const __m256i hb = j == 0 ? _mm256_slli_epi16(qh, 4) : j == 1 ? _mm256_slli_epi16(qh, 2)
                                 : j == 2 ? qh : _mm256_srli_epi16(qh, 2);
                q = _mm256_or_si256(q, _mm256_and_si256(hb, top));
                const __m256i scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_loadu_si128((const __m128i *)Q6_HALVES[b])));
                UNROLL for (int m = 0; m < M; m++) {
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + m * K + s * 256 + 32 * b));
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), scv); /* 63 * 127 * 2 < 2^15 */
                    acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&dx[r][m][b]), acc[r][m]);
                }
            }
        }
}

#include "gguf_q8_zmm.h"
#include "gguf_q8_lanes.h"

/* sums[m * GR + r] = x row m . weight row r (r < R, m < M; compile-time constants), x's rows
 * starting at *x; pf: the next R rows, each super-block's bytes prefetched (NULL: none). */
static inline __attribute__((always_inline)) void q8_rows(const int type, const int R, const int M,
                                                         const uint8_t *const *rw, const XQ *x, int64_t K, float *sums,
                                                         const uint8_t *const *pf) {
    __m256 acc[GR][DMAX];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    const int64_t step = bytes256(type), nsb = K / 256;
    for (int64_t s = 0; s < nsb; s++) {
        if (pf) prefetch_span(R, pf, s * step, step);
        if (type == T_Q4_K || type == T_Q5_K) q8_super_k45(type, R, M, rw, x, K, s, acc);
        else if (type == T_Q6_K) q8_super_q6(R, M, rw, x, K, s, acc);
        else
            UNROLL for (int i = 0; i < 8; i++) q8_block(type, R, M, rw, x, K, 8 * s + i, acc);
    }
    if (!is_k(type))
        for (int64_t c = nsb * 8; c < K / 32; c++) q8_block(type, R, M, rw, x, K, c, acc);
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int m = 0; m < M; m++) sums[m * GR + r] = hsum8(acc[r][m]);
}

/* GR weight rows (cnt of them stored) times all M rows of x, DMAX at a time (register blocks
 * as direct_unit's). */
static inline __attribute__((always_inline)) void q8_unit(const int type, const uint8_t *const *rw, int cnt,
                                                         const XQ *x, int64_t M, int64_t K, const float *bias, float *y,
                                                         int64_t ldy, const uint8_t *const *pf) {
#ifdef Q8_ZMM
    if (q8_k_served(type)) {
        zmm_unit(type, rw, cnt, x, M, K, bias, y, ldy, pf);
        return;
    }
#endif
    float sums[DMAX * GR];
    for (int64_t m0 = 0; m0 < M; m0 += DMAX) {
        const int64_t mm = M - m0 < DMAX ? M - m0 : DMAX;
        const XQ xm = {x->q + m0 * K, x->d + m0 * (K / 32), x->ds + m0 * (K / 32), x->s16 + m0 * (K / 16), NULL};
        const uint8_t *const *p = m0 ? NULL : pf, *const *p2 = p ? p + 2 : NULL;
        switch (mm) {
        case 1: q8_rows(type, 4, 1, rw, &xm, K, sums, p); break;
        case 2: q8_rows(type, 4, 2, rw, &xm, K, sums, p); break;
        case 3:
            for (int h = 0; h < GR; h += 2) q8_rows(type, 2, 3, rw + h, &xm, K, sums + h, h ? p2 : p);
            break;
        default:
            for (int h = 0; h < GR; h += 2) q8_rows(type, 2, 4, rw + h, &xm, K, sums + h, h ? p2 : p);
            break;
        }
        for (int64_t m = 0; m < mm; m++)
            for (int r = 0; r < cnt; r++) y[(m0 + m) * ldy + r] = sums[m * GR + r] + (bias ? bias[r] : 0.0f);
    }
}

/* Rows of x up to which the int8 path runs, where it stays ahead of the exact path's panels (Q4_K
 * and Q6_K, 8192 x 2048 and 2048 x 8192, two AMD Zen 5 cores): with AVX-512 VNNI, rows in lanes
 * past LANES_MIN rows, 1.4-1.7x at 64; the 8-lane code, one pass over the weights per DMAX rows, 1.3x at
 * 16 and even at 32. So a decode batch and a short prompt take it, a long prompt's chunks do not. */
#ifdef Q8_ZMM
#define Q8_ROWS 64
#else
#define Q8_ROWS 16
#endif

int gguf_q8_rows(void) { return Q8_ROWS; }

/* One unit (GR rows of part sg, cnt of them stored) on the int8 path, each type's code inlined
 * (a call per unit costs nothing beside its rows' products). */
static void __attribute__((noinline)) q8_any(const Seg *sg, int64_t n0, int64_t cnt, const uint8_t *const *rw,
                                             const XQ *xq, const float *x, int64_t M, int64_t K, const float *b,
                                             float *y, int64_t ldy, const uint8_t *const *pf) {
    switch (sg->type) {
    case T_Q8_0: q8_unit(T_Q8_0, rw, (int)cnt, xq, M, K, b, y, ldy, pf); break;
    case T_Q4_0: q8_unit(T_Q4_0, rw, (int)cnt, xq, M, K, b, y, ldy, pf); break;
    case T_Q5_0: q8_unit(T_Q5_0, rw, (int)cnt, xq, M, K, b, y, ldy, pf); break;
    case T_Q4_K: q8_unit(T_Q4_K, rw, (int)cnt, xq, M, K, b, y, ldy, pf); break;
    case T_Q5_K: q8_unit(T_Q5_K, rw, (int)cnt, xq, M, K, b, y, ldy, pf); break;
    case T_Q6_K: q8_unit(T_Q6_K, rw, (int)cnt, xq, M, K, b, y, ldy, pf); break;
    default: direct_part(sg, n0, cnt, rw, x, M, K, b, y, ldy); break; /* exact, bit for bit */
    }
}

void gguf_linear_q8(const float *x, const void *wp, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                    int nthreads) {
    const Desc *desc = (const Desc *)wp;
    int any = 0;
    for (int64_t s = 0; s < desc->nseg; s++) any |= q8_served(desc->seg[s].type);
    XQ xq;
    if (M > Q8_ROWS || K % 32 || !any || !quantize_x(x, M, K, &xq)) {
        gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads);
        return;
    }
    const int64_t total = unit_count(desc, GR);
#ifdef Q8_ZMM
    int anyk = 0;
    for (int64_t s = 0; s < desc->nseg; s++) anyk |= q8_k_served(desc->seg[s].type);
    XL xl; /* more than LANES_MIN rows: the K-quants with x's rows in lanes (a loop of its own: a
            * branch in the loop below slowed its 8-row products by a tenth) */
    if (M > LANES_MIN && anyk && lanes_x(&xq, M, K, &xl)) {
#pragma omp parallel for num_threads(nthreads) schedule(guided, 16)
        for (int64_t u = 0; u < total; u++) {
            const uint8_t *rw[GR], *next[GR];
            const Seg *sg;
            int64_t col, cnt, n0;
            const uint8_t *const *pf = unit_rows(desc, u, GR, rw, next, &sg, &col, &cnt, &n0);
            const float *b = bias ? bias + col : NULL;
            if (q8_k_served(sg->type)) lanes_call(sg->type, rw, (int)cnt, &xl, M, K, b, y + col, N, pf);
            else q8_any(sg, n0, cnt, rw, &xq, x, M, K, b, y + col, N, pf);
        }
        return;
    }
    if (anyk && !quad_x(&xq, M, K)) { /* K-quant parts need x in quad order too */
        gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads);
        return;
    }
#endif
    /* guided: each thread first takes a long run of rows (half the units, then a quarter...), whose
     * weights the CPU's prefetchers stream better than interleaved chunks of 16 units (one row of x
     * 0.81-0.96 of the time on two Zen 5 cores), and the shrinking chunks at the end still balance
     * mixed-type parts, which cost unevenly per row, and a thread that lost its core for a while */
#pragma omp parallel for num_threads(nthreads) schedule(guided, 16)
    for (int64_t u = 0; u < total; u++) {
        const uint8_t *rw[GR], *next[GR];
        const Seg *sg;
        int64_t col, cnt, n0;
        const uint8_t *const *pf = unit_rows(desc, u, GR, rw, next, &sg, &col, &cnt, &n0);
        q8_any(sg, n0, cnt, rw, &xq, x, M, K, bias ? bias + col : NULL, y + col, N, pf);
    }
}

#endif
