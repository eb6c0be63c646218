/* The int8-activation product of Q4_K, Q5_K and Q6_K parts for more than LANES_MIN rows of x,
 * with the rows of x in the lanes (gguf_q8.h includes this file; 16-lane builds only).
 *
 * Why: gguf_q8_zmm.h puts 64 weights of one row of x in a register, so every row of x costs an
 * integer dot product per 64 weights and a conversion and an FMA per 128, and its passes over
 * the weights serve eight rows of x each. Here a register holds 4 codes of each of 16 rows of x
 * (x is transposed once per call), a weight's 4 codes are broadcast into the integer dot product,
 * and one conversion and one FMA per 32-block serve all 16 rows: a 32-block of one weight row
 * against 16 rows costs 8 dot products and three other instructions. The weights are read once
 * per call for up to 64 rows.
 *
 * Numerics: the terms of gguf_q8.h's header, for Q4_K / Q5_K exactly those (float(dot) *
 * (d_x * (d * sc_j)), minus (dmin * m_j) * (d_x * sum(q)) per 32); for Q6_K per 16-weight half
 * instead of per 32: float(dot_h) * (d_x * (d * sc_h)) - (32 * (d * sc_h)) * (d_x * sum(q_h)).
 * Each output sums its terms in its own lane in super-block order (the minus terms first), so
 * no bit depends on the thread count or on the other rows of x. */
#ifndef LLMSERVE_GGUF_Q8_LANES_H
#define LLMSERVE_GGUF_Q8_LANES_H
#ifdef Q8_ZMM

/* From this many rows plus one. Up to it the 16-lane code's passes of 8 rows are faster (9 rows
 * 0.79-0.85 of this code's time, 12 rows 0.95-0.98: Q4_K 16384 x 2048, Q6_K 2048 x 8192, two Zen 5
 * cores), from 13 this one (16 rows: 0.75-0.93 of the passes' time). */
#define LANES_MIN 12

/* x's rows in lanes: codes [K / 4][G][16 rows][4], and per 32-block (per 16 for ds16) the
 * factors of the G * 16 rows (rows past M: zeros). */
typedef struct {
    const int8_t *q;
    const float *d, *ds, *ds16; /* d_x; d_x * sum(q); d_x * sum(q) of each 16 */
    int64_t G;
} XL;

static __thread uint8_t *g_xl = NULL; /* the calling thread's, as g_xq */
static __thread int64_t g_xl_len = 0;

/* xq's rows transposed into lanes. Returns 0 without memory. */
static int lanes_x(const XQ *xq, int64_t M, int64_t K, XL *o) {
    const int64_t G = (M + 15) / 16, P = G * 16, nb = K / 32;
    if (!scratch(&g_xl, &g_xl_len, K * P + 4 * nb * P * 4 + 64)) return 0;
    int32_t *q = (int32_t *)g_xl;
    float *d = (float *)(g_xl + K * P), *ds = d + nb * P, *ds16 = ds + nb * P;
    for (int64_t k4 = 0; k4 < K / 4; k4++)
        for (int64_t m = 0; m < P; m++) {
            int32_t v = 0;
            if (m < M) memcpy(&v, xq->q + m * K + 4 * k4, 4);
            q[k4 * P + m] = v;
        }
    for (int64_t b = 0; b < nb; b++)
        for (int64_t m = 0; m < P; m++) {
            const int in = m < M;
            const float dx = in ? xq->d[m * nb + b] : 0.0f;
            d[b * P + m] = dx;
            ds[b * P + m] = in ? xq->ds[m * nb + b] : 0.0f;
            ds16[2 * b * P + m] = in ? dx * (float)xq->s16[m * 2 * nb + 2 * b] : 0.0f;
            ds16[(2 * b + 1) * P + m] = in ? dx * (float)xq->s16[m * 2 * nb + 2 * b + 1] : 0.0f;
        }
    o->q = (const int8_t *)q;
    o->d = d;
    o->ds = ds;
    o->ds16 = ds16;
    o->G = G;
    return 1;
}

/* Super-block sb of a Q4_K / Q5_K / Q6_K row as 256 unsigned codes (weight i at wb[i]) and its
 * factors: Q4_K / Q5_K d * sc_j in f[0..7], dmin * m_j in f[8..15]; Q6_K d * sc_h in f[0..15]. */
static inline __attribute__((always_inline)) void lanes_unpack(const int type, const uint8_t *sb, uint8_t *wb,
                                                              float *f) {
    const __m256i low = _mm256_set1_epi8(15);
    if (type == T_Q6_K) {
        const float d = h2f(sb + 208);
        for (int h = 0; h < 16; h++) f[h] = d * (float)(int8_t)sb[192 + h];
        const __m256i top = _mm256_set1_epi8(0x30);
        UNROLL for (int b = 0; b < 8; b++) { /* as gguf_q8.h's q8_super_q6 */
            const int h = b / 4, j = b % 4;
            __m256i q = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32 * (j & 1)));
            q = _mm256_and_si256(j & 2 ? _mm256_srli_epi16(q, 4) : q, low);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
            const __m256i hb = j == 0 ? _mm256_slli_epi16(qh, 4) : j == 1 ? _mm256_slli_epi16(qh, 2)
                             : j == 2 ? qh : _mm256_srli_epi16(qh, 2);
            _mm256_store_si256((__m256i *)(wb + 32 * b), _mm256_or_si256(q, _mm256_and_si256(hb, top)));
        }
        return;
    }
    __m256 dsc, dmn;
    k45_factors(sb, &dsc, &dmn);
    _mm256_storeu_ps(f, dsc);
    _mm256_storeu_ps(f + 8, dmn);
    UNROLL for (int p = 0; p < 4; p++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(sb + (type == T_Q4_K ? 16 : 48) + 32 * p));
        __m256i w0 = _mm256_and_si256(raw, low), w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (type == T_Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16));
            w0 = _mm256_or_si256(w0, bit_to_16(qh, 2 * p));
            w1 = _mm256_or_si256(w1, bit_to_16(qh, 2 * p + 1));
        }
        _mm256_store_si256((__m256i *)(wb + 64 * p), w0);
        _mm256_store_si256((__m256i *)(wb + 64 * p + 32), w1);
    }
}

/* acc[r] (16 rows of x, from row 16 g) += codes wb[r][o .. o + 4n) times x's codes from 4-group
 * k4, times d_x * f[r][fi]: the dot products of n groups of 4 weights are taken in integers
 * first. P: x's rows in lanes, padded. */
static inline __attribute__((always_inline)) void lanes_block(const int n, const XL *x, int64_t P, int64_t g, int64_t k4,
                                                             int64_t b, const uint8_t wb[GR][256], int o,
                                                             const float f[GR][16], int fi, __m512 acc[GR]) {
    __m512i dot[GR];
    UNROLL for (int r = 0; r < GR; r++) dot[r] = _mm512_setzero_si512();
    UNROLL for (int i = 0; i < n; i++) {
        const __m512i xv = _mm512_load_si512((const void *)(x->q + ((k4 + i) * P + 16 * g) * 4));
        UNROLL for (int r = 0; r < GR; r++) {
            int32_t w;
            memcpy(&w, wb[r] + o + 4 * i, 4);
            dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(w), xv);
        }
    }
    const __m512 dv = _mm512_loadu_ps(x->d + b * P + 16 * g);
    UNROLL for (int r = 0; r < GR; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dv, _mm512_set1_ps(f[r][fi])), acc[r]);
}

/* GR weight rows (cnt of them stored) of a Q4_K / Q5_K / Q6_K part times x's rows 16 g .. 16 g + 15
 * (those below M). One group of 16 rows a pass over the weights: x's codes of a pass (16 K bytes)
 * then stay in the L1 cache where K is 2048 (two groups a pass took 2.2x one group's time). */
static inline __attribute__((always_inline)) void lanes_unit(const int type, int64_t g, const uint8_t *const *rw,
                                                            int cnt, const XL *x, int64_t M, int64_t K,
                                                            const float *bias, float *y, int64_t ldy,
                                                            const uint8_t *const *pf) {
    const int64_t P = x->G * 16, nsb = K / 256, bytes = bytes256(type);
    __m512 acc[GR];
    UNROLL for (int r = 0; r < GR; r++) acc[r] = _mm512_setzero_ps();
    uint8_t wb[GR][256] __attribute__((aligned(64)));
    float f[GR][16];
    for (int64_t s = 0; s < nsb; s++) {
        if (pf) prefetch_span(GR, pf, s * bytes, bytes);
        UNROLL for (int r = 0; r < GR; r++) lanes_unpack(type, rw[r] + s * bytes, wb[r], f[r]);
        if (type == T_Q6_K) {
            for (int h = 0; h < 16; h++) {
                const __m512 v = _mm512_loadu_ps(x->ds16 + (16 * s + h) * P + 16 * g);
                UNROLL for (int r = 0; r < GR; r++) acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(32.0f * f[r][h]), v, acc[r]);
            }
            for (int h = 0; h < 16; h++) lanes_block(4, x, P, g, 64 * s + 4 * h, 8 * s + h / 2, wb, 16 * h, f, h, acc);
        } else {
            for (int j = 0; j < 8; j++) {
                const __m512 v = _mm512_loadu_ps(x->ds + (8 * s + j) * P + 16 * g);
                UNROLL for (int r = 0; r < GR; r++) acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(f[r][8 + j]), v, acc[r]);
            }
            for (int j = 0; j < 8; j++) lanes_block(8, x, P, g, 64 * s + 8 * j, 8 * s + j, wb, 32 * j, f, j, acc);
        }
    }
    float out[16];
    for (int r = 0; r < cnt; r++) {
        _mm512_storeu_ps(out, acc[r]);
        for (int64_t l = 0, m = 16 * g; l < 16 && m < M; l++, m++) y[m * ldy + r] = out[l] + (bias ? bias[r] : 0.0f);
    }
}

/* lanes_unit over x's groups of 16 rows, the type as a constant. */
static void lanes_call(int64_t type, const uint8_t *const *rw, int cnt, const XL *x, int64_t M, int64_t K,
                       const float *bias, float *y, int64_t ldy, const uint8_t *const *pf) {
    for (int64_t g = 0; g < x->G; g++) {
        const uint8_t *const *p = g ? NULL : pf;
        if (type == T_Q4_K) lanes_unit(T_Q4_K, g, rw, cnt, x, M, K, bias, y, ldy, p);
        else if (type == T_Q5_K) lanes_unit(T_Q5_K, g, rw, cnt, x, M, K, bias, y, ldy, p);
        else lanes_unit(T_Q6_K, g, rw, cnt, x, M, K, bias, y, ldy, p);
    }
}

#endif
#endif
