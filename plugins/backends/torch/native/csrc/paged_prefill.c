/* Prefill attention straight from the paged KV pool (CPU, fp32 arithmetic): the rows of prompt
 * chunks, each attending causally to its sequence's cached prefix and to itself.
 *
 * The torch path copies a chunk's whole context out of the pool (all blocks, every layer) and
 * hands it to SDPA with an explicit [chunk, context] mask; both the copy and the mask grow with
 * the context. Here the attention is tiled, flash-style: a work item is one KV head's query
 * heads (its GQA group) over a tile of consecutive query positions of one chunk. It walks the
 * keys those queries may see in tiles of KT positions read through the block table, keeps a
 * running maximum and sum per query row (online softmax) and accumulates its output in a
 * scratch tile. Each key tile is packed once (transposed, converted from the pool's dtype) and
 * used by all of the item's rows, so the products run as small register-blocked matrix
 * products (6 rows x 16 columns per pass with AVX2 + FMA); scratch memory is a few hundred KiB
 * per thread whatever the context length.
 *
 * Layout, as paged_decode.c: ``kv`` is ``[2 * kvh, nblocks, bs, D]`` (keys of head h at row h,
 * values at row kvh + h), fp32, bf16 or int8 (``kv_dtype`` 0, 1 or 2; an int8 row is D codes and
 * an fp32 scale per 32 of them, as paged_decode_q8.c writes them). Segment s owns the packed rows
 * ``rows[s] .. rows[s] + lens[s] - 1`` of ``q`` and ``out``, at positions ``starts[s] ..``; its
 * block table (``tables + s * width``) covers positions 0 .. starts[s] + lens[s] - 1, every one
 * of them written (the chunk's own keys and values are stored before this runs). Query head j
 * of row t starts at ``q + t * q_row + j * q_head``, its output at ``out + t * out_row + j * D``.
 * ``window`` > 0 is sliding-window attention (key k seen by query p when p - window < k <= p).
 * ``key_end`` (NULL: causal) holds per packed row the last key position the row sees, past its
 * own for the tokens of an image that attend to each other both ways (Gemma 3); every position up
 * to it is written.
 * ``sinks`` (NULL: none) holds one attention-sink logit per query head (gpt-oss): a term of the
 * head's softmax denominator with no value row. A row's online softmax starts from it (running
 * maximum = the sink, running sum = exp(0) = 1, output 0) instead of from nothing, which the
 * folds below then rescale like any earlier key tile.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#define HAVE_AVX2 1
#endif

#define KT 64 /* key positions per tile */
#define MR 6  /* query rows per register-blocked pass */
#define ROWS 192 /* query rows (positions x heads of a group) per work item */

enum { KV_F32 = 0, KV_BF16 = 1, KV_Q8 = 2 };

typedef struct {
    const float *q;
    int64_t q_row, q_head;
    const void *kv;
    int kv_dtype;
    const int64_t *tables, *rows, *lens, *starts;
    const int64_t *key_end; /* [packed rows] each row's last key position, or NULL: its own (causal) */
    const float *sinks;     /* [H] or NULL */
    int64_t width;
    float *out;
    int64_t out_row, kvh, G, D, nblocks, bs, window, bq, mp, row_bytes;
    float scale;
} Plan;

typedef struct {
    float *qs, *o, *s, *m, *l, *kt, *vt;
} Scratch;

typedef struct {
    int64_t seg, tile, cost;
} Tile;

static inline float bf16_to_f32(uint16_t x) {
    union {
        uint32_t u;
        float f;
    } c = {.u = (uint32_t)x << 16};
    return c.f;
}

/* The cached row of position pos of KV plane ``plane`` (0 .. 2 * kvh - 1). */
static inline const char *kv_row(const Plan *p, const int64_t *table, int64_t plane, int64_t pos) {
    return (const char *)p->kv + ((plane * p->nblocks + table[pos / p->bs]) * p->bs + pos % p->bs) * p->row_bytes;
}

/* Element d of a cached row as fp32 (an int8 row's codes times the scale stored after them). */
static inline float row_value(const Plan *p, const char *row, int64_t d) {
    if (p->kv_dtype == KV_F32) return ((const float *)row)[d];
    if (p->kv_dtype == KV_BF16) return bf16_to_f32(((const uint16_t *)row)[d]);
    float scale; /* one per group of 32 codes, after the codes */
    memcpy(&scale, row + p->D + 4 * (d / 32), sizeof scale);
    return (float)((const int8_t *)row)[d] * scale;
}

/* Keys k0 .. k0 + nk - 1 of head h transposed into kt[d * KT + j] (columns past nk zeroed) and
 * their values into rows of vt[j * D + d], both in fp32: copies of a few KiB that every row of
 * the item then reads from L1/L2 with unit strides. */
static void pack_tile(const Plan *p, const int64_t *table, int64_t h, int64_t k0, int64_t nk, Scratch *w) {
    const int64_t D = p->D;
    for (int64_t j = 0; j < nk; j++) {
        const char *k = kv_row(p, table, h, k0 + j), *v = kv_row(p, table, p->kvh + h, k0 + j);
        float *vt = w->vt + j * D;
        for (int64_t d = 0; d < D; d++) {
            w->kt[d * KT + j] = row_value(p, k, d);
            vt[d] = row_value(p, v, d);
        }
    }
    for (int64_t d = 0; d < D && nk < KT; d++) memset(w->kt + d * KT + nk, 0, sizeof(float) * (size_t)(KT - nk));
}

#ifdef HAVE_AVX2
/* Elements d .. d + 7 of a cached row as fp32. */
static inline __m256 load8(const Plan *p, const char *row, int64_t d) {
    if (p->kv_dtype == KV_F32) return _mm256_loadu_ps((const float *)row + d);
    if (p->kv_dtype == KV_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    float scale; /* d .. d + 7 lie in one group of 32 */
    memcpy(&scale, row + p->D + 4 * (d / 32), sizeof scale);
    const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(scale));
}

static inline void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* pack_tile for D % 8 == 0: eight keys at a time, transposed in registers (columns past nk
 * come out zero). */
static void pack_tile_avx2(const Plan *p, const int64_t *table, int64_t h, int64_t k0, int64_t nk, Scratch *w) {
    const int64_t D = p->D;
    for (int64_t j0 = 0; j0 < nk; j0 += 8) {
        const int64_t cnt = nk - j0 < 8 ? nk - j0 : 8;
        const char *krow[8];
        for (int64_t i = 0; i < cnt; i++) {
            krow[i] = kv_row(p, table, h, k0 + j0 + i);
            const char *vrow = kv_row(p, table, p->kvh + h, k0 + j0 + i);
            float *vt = w->vt + (j0 + i) * D;
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vt + d, load8(p, vrow, d));
        }
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int64_t i = 0; i < 8; i++) r[i] = i < cnt ? load8(p, krow[i], d0) : _mm256_setzero_ps();
            transpose8(r);
            for (int64_t i = 0; i < 8; i++) _mm256_storeu_ps(w->kt + (d0 + i) * KT + j0, r[i]);
        }
    }
    const int64_t nk8 = (nk + 7) & ~(int64_t)7;
    for (int64_t d = 0; d < D && nk8 < KT; d++) memset(w->kt + d * KT + nk8, 0, sizeof(float) * (size_t)(KT - nk8));
}
#endif

/* ---- portable loops (any head size, any CPU) ---- */

static void scores_portable(const Plan *p, const Scratch *w, int64_t ncols) {
    for (int64_t r = 0; r < p->mp; r++)
        for (int64_t j = 0; j < ncols; j++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < p->D; d++) acc += w->qs[r * p->D + d] * w->kt[d * KT + j];
            w->s[r * KT + j] = acc;
        }
}

static void values_portable(const Plan *p, const Scratch *w, int64_t nk) {
    for (int64_t r = 0; r < p->mp; r++) {
        float *o = w->o + r * p->D;
        for (int64_t j = 0; j < nk; j++) {
            const float pj = w->s[r * KT + j], *v = w->vt + j * p->D;
            if (pj != 0.0f)
                for (int64_t d = 0; d < p->D; d++) o[d] += pj * v[d];
        }
    }
}

/* Row r of the score tile (columns 0 .. nk - 1, only lo .. hi allowed) folded into the row's
 * running maximum m and sum l: the scores become their weights exp(s - m'), and the output row
 * o is rescaled by exp(m - m') when the maximum moved. Columns past hi become weight 0. */
static void fold_row_portable(float *s, int64_t nk, int64_t lo, int64_t hi, float *m, float *l, float *o,
                              int64_t D) {
    float mx = -INFINITY;
    for (int64_t j = lo; j <= hi; j++) mx = s[j] > mx ? s[j] : mx;
    const float mnew = mx > *m ? mx : *m;
    float sum = 0.0f;
    for (int64_t j = 0; j < nk; j++) {
        s[j] = (j < lo || j > hi) ? 0.0f : expf(s[j] - mnew);
        sum += s[j];
    }
    if (mnew > *m) {
        const float c = expf(*m - mnew); /* 0 while the row had seen nothing (m = -inf) */
        for (int64_t d = 0; d < D; d++) o[d] *= c;
        *l *= c;
        *m = mnew;
    }
    *l += sum;
}

#ifdef HAVE_AVX2
/* s[r][c .. c + 15] = qs[r] . kt[:, c .. c + 15] for MR rows: twelve accumulators, the key
 * columns loaded once per head dimension for all six rows. */
static __attribute__((noinline)) void scores6x16(const float *restrict qs, const float *restrict kt, float *restrict s, int64_t D) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * KT), k1 = _mm256_loadu_ps(kt + d * KT + 8);
        __m256 b = _mm256_broadcast_ss(qs + d);
        a00 = _mm256_fmadd_ps(b, k0, a00), a01 = _mm256_fmadd_ps(b, k1, a01);
        b = _mm256_broadcast_ss(qs + D + d);
        a10 = _mm256_fmadd_ps(b, k0, a10), a11 = _mm256_fmadd_ps(b, k1, a11);
        b = _mm256_broadcast_ss(qs + 2 * D + d);
        a20 = _mm256_fmadd_ps(b, k0, a20), a21 = _mm256_fmadd_ps(b, k1, a21);
        b = _mm256_broadcast_ss(qs + 3 * D + d);
        a30 = _mm256_fmadd_ps(b, k0, a30), a31 = _mm256_fmadd_ps(b, k1, a31);
        b = _mm256_broadcast_ss(qs + 4 * D + d);
        a40 = _mm256_fmadd_ps(b, k0, a40), a41 = _mm256_fmadd_ps(b, k1, a41);
        b = _mm256_broadcast_ss(qs + 5 * D + d);
        a50 = _mm256_fmadd_ps(b, k0, a50), a51 = _mm256_fmadd_ps(b, k1, a51);
    }
    _mm256_storeu_ps(s, a00), _mm256_storeu_ps(s + 8, a01);
    _mm256_storeu_ps(s + KT, a10), _mm256_storeu_ps(s + KT + 8, a11);
    _mm256_storeu_ps(s + 2 * KT, a20), _mm256_storeu_ps(s + 2 * KT + 8, a21);
    _mm256_storeu_ps(s + 3 * KT, a30), _mm256_storeu_ps(s + 3 * KT + 8, a31);
    _mm256_storeu_ps(s + 4 * KT, a40), _mm256_storeu_ps(s + 4 * KT + 8, a41);
    _mm256_storeu_ps(s + 5 * KT, a50), _mm256_storeu_ps(s + 5 * KT + 8, a51);
}

/* o[r][c .. c + 8 * NV - 1] += sum_j s[r][j] * vt[j][c ..] for MR rows (NV = 2 or 1 vectors
 * of 8 columns); the accumulators stay in registers for the whole tile. Not inlined: its own
 * register allocation keeps the loop free of spills. */
#define PV_ROW(r)                                                                                    \
    {                                                                                                \
        const __m256 pr = _mm256_broadcast_ss(s + (r) * KT + j);                                     \
        o##r##0 = _mm256_fmadd_ps(pr, v0, o##r##0);                                                  \
        if (NV > 1) o##r##1 = _mm256_fmadd_ps(pr, v1, o##r##1);                                      \
    }
#define PV_LOAD(r)                                                                                   \
    __m256 o##r##0 = _mm256_loadu_ps(o + (r) * D), o##r##1 = o##r##0;                                \
    if (NV > 1) o##r##1 = _mm256_loadu_ps(o + (r) * D + 8);
#define PV_STORE(r)                                                                                  \
    _mm256_storeu_ps(o + (r) * D, o##r##0);                                                          \
    if (NV > 1) _mm256_storeu_ps(o + (r) * D + 8, o##r##1);
#define VALUES6(NAME, WIDTH)                                                                            \
    static __attribute__((noinline)) void NAME(const float *restrict s, const float *restrict vt, int64_t nk, \
                                               float *restrict o, int64_t D) {                       \
        enum { NV = WIDTH };                                                                         \
        PV_LOAD(0) PV_LOAD(1) PV_LOAD(2) PV_LOAD(3) PV_LOAD(4) PV_LOAD(5)                            \
        for (int64_t j = 0; j < nk; j++, vt += D) {                                                  \
            const __m256 v0 = _mm256_loadu_ps(vt), v1 = NV > 1 ? _mm256_loadu_ps(vt + 8) : v0;      \
            PV_ROW(0) PV_ROW(1) PV_ROW(2) PV_ROW(3) PV_ROW(4) PV_ROW(5)                              \
        }                                                                                            \
        PV_STORE(0) PV_STORE(1) PV_STORE(2) PV_STORE(3) PV_STORE(4) PV_STORE(5)                      \
    }
VALUES6(values6x16, 2)
VALUES6(values6x8, 1)
#undef VALUES6
#undef PV_ROW
#undef PV_LOAD
#undef PV_STORE

/* As fold_row_portable, eight columns at a time with the vector exp; nk8 = nk rounded up to 8. */
static void fold_row_avx2(float *s, int64_t nk, int64_t lo, int64_t hi, float *m, float *l, float *o, int64_t D) {
    const int64_t nk8 = (nk + 7) & ~(int64_t)7;
    const __m256 ninf = _mm256_set1_ps(-INFINITY), step = _mm256_set1_ps(8.0f);
    const __m256 vlo = _mm256_set1_ps((float)lo), vhi = _mm256_set1_ps((float)hi);
    __m256 col = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vmx = ninf;
    if (lo == 0 && hi == nk8 - 1) /* every column allowed (most tiles): no mask */
        for (int64_t j = 0; j < nk8; j += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + j));
    else
        for (int64_t j = 0; j < nk8; j += 8, col = _mm256_add_ps(col, step)) {
            const __m256 out_of =
                _mm256_or_ps(_mm256_cmp_ps(col, vlo, _CMP_LT_OQ), _mm256_cmp_ps(col, vhi, _CMP_GT_OQ));
            const __m256 v = _mm256_blendv_ps(_mm256_loadu_ps(s + j), ninf, out_of);
            _mm256_storeu_ps(s + j, v);
            vmx = _mm256_max_ps(vmx, v);
        }
    float buf[8], mx = -INFINITY;
    _mm256_storeu_ps(buf, vmx);
    for (int i = 0; i < 8; i++) mx = buf[i] > mx ? buf[i] : mx;
    const float mnew = mx > *m ? mx : *m;
    if (mnew == -INFINITY) { /* nothing seen yet and nothing allowed here: no weight at all */
        memset(s, 0, sizeof(float) * (size_t)nk8);
        return;
    }
    const __m256 vm = _mm256_set1_ps(mnew);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < nk8; j += 8) { /* exp_nonpos maps -inf (masked) to 0 */
        const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (mnew > *m) {
        const float c = expf(*m - mnew);
        const __m256 vc = _mm256_set1_ps(c);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), vc));
        *l *= c;
        *m = mnew;
    }
    *l += hsum8(vsum);
}
#endif

/* One work item: query positions ``tile * bq ..`` of segment ``seg`` for the G query heads of
 * KV head h. Rows are position-major (row r: position r / G, head h * G + r % G); rows past
 * the tile's end (padding up to a multiple of MR) compute on zeros and are never stored. */
static void attend_tile(const Plan *p, int64_t seg, int64_t tile, int64_t h, Scratch *w) {
    const int64_t D = p->D, G = p->G, mp = p->mp;
    const int64_t i0 = tile * p->bq, nq = p->lens[seg] - i0 < p->bq ? p->lens[seg] - i0 : p->bq;
    const int64_t first = p->starts[seg] + i0, row0 = p->rows[seg] + i0;
    int64_t last = first + nq - 1; /* the last key any of the item's rows sees */
    if (p->key_end != NULL)
        for (int64_t i = 0; i < nq; i++) last = p->key_end[row0 + i] > last ? p->key_end[row0 + i] : last;
    const int64_t *table = p->tables + seg * p->width;
    const int vec =
#ifdef HAVE_AVX2
        D % 8 == 0;
#else
        0;
#endif
    (void)vec;
    memset(w->qs, 0, sizeof(float) * (size_t)(mp * D));
    for (int64_t r = 0; r < nq * G; r++) {
        const float *src = p->q + (row0 + r / G) * p->q_row + (h * G + r % G) * p->q_head;
        for (int64_t d = 0; d < D; d++) w->qs[r * D + d] = src[d] * p->scale;
    }
    memset(w->o, 0, sizeof(float) * (size_t)(mp * D));
    for (int64_t r = 0; r < mp; r++) { /* row r is head h * G + r % G (padding rows too) */
        if (p->sinks != NULL)
            w->m[r] = p->sinks[h * G + r % G], w->l[r] = 1.0f;
        else
            w->m[r] = -INFINITY, w->l[r] = 0.0f;
    }
    const int64_t kbeg = (p->window > 0 && first - p->window + 1 > 0) ? first - p->window + 1 : 0;
    for (int64_t k0 = kbeg; k0 <= last; k0 += KT) {
        const int64_t nk = last - k0 + 1 < KT ? last - k0 + 1 : KT;
#ifdef HAVE_AVX2
        if (vec)
            pack_tile_avx2(p, table, h, k0, nk, w);
        else
#endif
            pack_tile(p, table, h, k0, nk, w);
#ifdef HAVE_AVX2
        if (vec)
            for (int64_t r = 0; r < mp; r += MR)
                for (int64_t c = 0; c < nk; c += 16) scores6x16(w->qs + r * D, w->kt + c, w->s + r * KT + c, D);
        else
#endif
            scores_portable(p, w, nk);
        for (int64_t r = 0; r < mp; r++) {
            const int64_t i = r < nq * G ? r / G : nq - 1, pos = first + i;
            const int64_t end = p->key_end != NULL ? p->key_end[row0 + i] : pos;
            const int64_t lo_pos = p->window > 0 ? pos - p->window + 1 : 0;
            const int64_t lo = lo_pos > k0 ? lo_pos - k0 : 0, hi = end - k0 < nk - 1 ? end - k0 : nk - 1;
#ifdef HAVE_AVX2
            if (vec) {
                fold_row_avx2(w->s + r * KT, nk, lo, hi, w->m + r, w->l + r, w->o + r * D, D);
                continue;
            }
#endif
            fold_row_portable(w->s + r * KT, nk, lo, hi, w->m + r, w->l + r, w->o + r * D, D);
        }
#ifdef HAVE_AVX2
        if (vec) {
            for (int64_t r = 0; r < mp; r += MR)
                for (int64_t c = 0; c < D; c += 16) {
                    if (D - c >= 16)
                        values6x16(w->s + r * KT, w->vt + c, nk, w->o + r * D + c, D);
                    else
                        values6x8(w->s + r * KT, w->vt + c, nk, w->o + r * D + c, D);
                }
            continue;
        }
#endif
        values_portable(p, w, nk);
    }
    for (int64_t r = 0; r < nq * G; r++) {
        float *dst = p->out + (row0 + r / G) * p->out_row + (h * G + r % G) * D;
        const float inv = 1.0f / w->l[r], *o = w->o + r * D;
        for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
    }
}

static int heavier_first(const void *a, const void *b) {
    const int64_t ca = ((const Tile *)a)->cost, cb = ((const Tile *)b)->cost;
    return ca < cb ? 1 : ca > cb ? -1 : 0;
}

/* Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int paged_prefill(const float *q, int64_t q_row, int64_t q_head, const void *kv, int kv_dtype, const int64_t *tables,
                  int64_t width, const int64_t *rows, const int64_t *lens, const int64_t *starts, int64_t nseg,
                  const int64_t *key_end, float *out, int64_t out_row, int64_t H, int64_t kvh, int64_t D,
                  int64_t nblocks, int64_t bs, float scale, int64_t window, const float *sinks, int nthreads) {
    const int64_t G = H / kvh;
    /* About ROWS query rows per item: enough to reuse each packed key tile many times, few
     * enough to keep the item's scratch in L2 and to give every thread work on short chunks. */
    const int64_t bq = G >= ROWS ? 1 : (ROWS + G - 1) / G, mp = (bq * G + MR - 1) / MR * MR;
    Plan p = {.q = q, .q_row = q_row, .q_head = q_head, .kv = kv, .kv_dtype = kv_dtype, .tables = tables,
              .rows = rows, .lens = lens, .starts = starts, .key_end = key_end, .sinks = sinks, .width = width, .out = out, .out_row = out_row,
              .kvh = kvh, .G = G, .D = D, .nblocks = nblocks, .bs = bs, .window = window, .bq = bq, .mp = mp,
              .row_bytes = kv_dtype == KV_F32 ? 4 * D : kv_dtype == KV_BF16 ? 2 * D : D + 4 * ((D + 31) / 32),
              .scale = scale};
    int64_t ntiles = 0;
    for (int64_t s = 0; s < nseg; s++) ntiles += (lens[s] + bq - 1) / bq;
    Tile *tiles = (Tile *)malloc(sizeof(Tile) * (size_t)(ntiles > 0 ? ntiles : 1));
    if (tiles == NULL) return -1;
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++)
        for (int64_t t = 0; t * bq < lens[s]; t++) {
            const int64_t last = starts[s] + (t + 1) * bq;
            tiles[n++] = (Tile){s, t, window > 0 && last > window ? window : last};
        }
    /* The longest items first: a dynamic schedule then ends with short ones on every thread. */
    qsort(tiles, (size_t)ntiles, sizeof(Tile), heavier_first);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        Scratch w = {0};
        float *mem = (float *)malloc(sizeof(float) * (size_t)(2 * mp * D + mp * KT + 2 * mp + 2 * D * KT));
        failed = mem == NULL;
        if (mem != NULL) {
            w.qs = mem, w.o = w.qs + mp * D, w.s = w.o + mp * D, w.m = w.s + mp * KT, w.l = w.m + mp;
            w.kt = w.l + mp, w.vt = w.kt + D * KT;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < ntiles * kvh; i++)
            if (mem != NULL) attend_tile(&p, tiles[i / kvh].seg, tiles[i / kvh].tile, i % kvh, &w);
        free(mem);
    }
    free(tiles);
    return failed ? -1 : 0;
}
