/* The int8 KV cache (``--kv-cache-dtype int8``): the KV write that quantizes, and decode
 * attention that reads the codes in place.
 *
 * A cached row (one position of one KV head, keys or values) is D int8 codes followed by one
 * fp32 scale per group of 32 codes (the last group may be shorter), ``D + 4 * ceil(D / 32)``
 * bytes: x[d] ~ code[d] * scale with scale = max|x| / 127 over the group, rounded to nearest;
 * the groups of llama.cpp's q8_0. Groups rather than one scale per row because keys carry a
 * few outlier channels that would take a row's whole range; scales per row rather than per
 * block because a row is then final once written: blocks fill a token at a time and nothing is
 * ever quantized twice. Against fp32 rows: 3.6x less memory and less to read per decode step
 * (72 bytes a row for D = 64, against 256).
 *
 * Layout and arguments are those of paged_decode.c's fp32 functions, the pool ``[2 * kvh,
 * nblocks, bs, row bytes]``. Decode attention walks each (sequence, KV head) item's positions
 * block by block: the block's rows are converted to fp32 (times their scales) into a scratch of
 * bs rows, scored against the item's query heads eight keys at a time, and after the softmax the
 * value rows, converted the same way, are summed; no copy of the context is made beyond one
 * block. Built at run time like the others (gcc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "attn_avx2.h"
#define HAVE_AVX2 1
#endif

#define GROUP 32

static inline int64_t row_bytes(int64_t D) { return D + 4 * ((D + GROUP - 1) / GROUP); }

/* ``rows`` consecutive cached rows from src converted to fp32 (times their scales) into dst. */
static void rows_to_f32(const int8_t *src, int64_t rows, int64_t D, float *restrict dst) {
    const int64_t rb = row_bytes(D);
    for (int64_t r = 0; r < rows; r++, src += rb, dst += D)
        for (int64_t g0 = 0; g0 < D; g0 += GROUP) {
            float sc;
            memcpy(&sc, src + D + 4 * (g0 / GROUP), sizeof sc);
            const int64_t end = g0 + GROUP < D ? g0 + GROUP : D;
            int64_t d = g0;
#ifdef HAVE_AVX2
            const __m256 vs = _mm256_set1_ps(sc);
            for (; d + 8 <= end; d += 8) {
                const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + d)));
                _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(codes), vs));
            }
#endif
            for (; d < end; d++) dst[d] = (float)src[d] * sc;
        }
}

/* In-place softmax of n scores; ``sink`` (NULL: none) is an attention sink's logit, a term of
 * the denominator that gets no weight (paged_decode.c). */
static void softmax_rows(float *s, int64_t n, const float *sink) {
#ifdef HAVE_AVX2
    softmax_avx2(s, n, sink);
#else
    float mx = sink != NULL ? *sink : -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    float sum = sink != NULL ? expf(*sink - mx) : 0.0f;
    for (int64_t j = 0; j < n; j++) sum += (s[j] = expf(s[j] - mx));
    for (int64_t j = 0; j < n; j++) s[j] /= sum;
#endif
}

/* o[0..D) += p * v[0..D) */
static inline void add_scaled(float *restrict o, float p, const float *restrict v, int64_t D) {
    int64_t d = 0;
#ifdef HAVE_AVX2
    const __m256 vp = _mm256_set1_ps(p);
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
#endif
    for (; d < D; d++) o[d] += p * v[d];
}

/* One (sequence, KV head) item: positions start .. L - 1 for the G query heads at q (stride
 * q_head), output rows at out (stride D), their sink logits at sink[0..G) (NULL: none).
 * ``scores``: G * n floats; ``rows``: bs * D floats. */
static void attend_item(const float *q, int64_t q_head, const int8_t *kbase, const int8_t *vbase,
                        const int64_t *table, int64_t start, int64_t L, float *out, int64_t G, int64_t D, int64_t bs,
                        float scale, const float *sink, float *restrict scores, float *restrict rows) {
    const int64_t n = L - start, rb = row_bytes(D);
    for (int64_t pos = start; pos < L;) {
        const int64_t off = pos % bs, take = (bs - off < L - pos) ? bs - off : L - pos;
        rows_to_f32(kbase + (table[pos / bs] * bs + off) * rb, take, D, rows);
        for (int64_t g = 0; g < G; g++) {
            float *sc = scores + g * n + (pos - start);
#ifdef HAVE_AVX2
            if (D % 8 == 0) {
                score_rows(q + g * q_head, rows, take, D, scale, sc);
                continue;
            }
#endif
            for (int64_t r = 0; r < take; r++) {
                float acc = 0.0f;
                for (int64_t d = 0; d < D; d++) acc += q[g * q_head + d] * rows[r * D + d];
                sc[r] = acc * scale;
            }
        }
        pos += take;
    }
    for (int64_t g = 0; g < G; g++) {
        softmax_rows(scores + g * n, n, sink != NULL ? sink + g : NULL);
        memset(out + g * D, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t pos = start; pos < L;) {
        const int64_t off = pos % bs, take = (bs - off < L - pos) ? bs - off : L - pos;
        rows_to_f32(vbase + (table[pos / bs] * bs + off) * rb, take, D, rows);
        for (int64_t g = 0; g < G; g++)
            for (int64_t r = 0; r < take; r++) add_scaled(out + g * D, scores[g * n + pos - start + r], rows + r * D, D);
        pos += take;
    }
}

/* paged_decode_f32's contract over an int8 pool (rows of row_bytes(D)), sinks included. Returns
 * 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int paged_decode_q8(const float *q, int64_t q_row, int64_t q_head, const void *kv, const int64_t *tables,
                    const int64_t *ctx, float *out, int64_t out_row, int64_t nd, int64_t H, int64_t kvh, int64_t D,
                    int64_t nblocks, int64_t bs, int64_t max_blocks, float scale, int64_t window,
                    const float *sinks, int nthreads) {
    const int64_t G = H / kvh, items = nd * kvh, plane = nblocks * bs * row_bytes(D);
    const int8_t *pool = (const int8_t *)kv;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_blocks * bs + bs * D));
        failed = scores == NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            if (scores == NULL) continue;
            const int64_t s = i / kvh, h = i % kvh, L = ctx[s];
            const int64_t start = (window > 0 && L > window) ? L - window : 0;
            attend_item(q + s * q_row + h * G * q_head, q_head, pool + h * plane, pool + (kvh + h) * plane,
                        tables + s * max_blocks, start, L, out + s * out_row + h * G * D, G, D, bs, scale,
                        sinks != NULL ? sinks + h * G : NULL, scores, scores + G * max_blocks * bs);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* One row quantized: its codes, then one scale per group. */
static void quantize_row(const float *x, int64_t D, int8_t *row) {
    for (int64_t g0 = 0; g0 < D; g0 += GROUP) {
        const int64_t end = g0 + GROUP < D ? g0 + GROUP : D;
        float amax = 0.0f;
        for (int64_t d = g0; d < end; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t d = g0; d < end; d++) {
            const float c = nearbyintf(x[d] * inv);
            row[d] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
        }
        memcpy(row + D + 4 * (g0 / GROUP), &scale, sizeof scale);
    }
}

/* write_kv_f32's contract into an int8 pool ``[2 * kvh, nslots, row_bytes(D)]``: each row
 * quantized as it is written. Returns 0, or -1 (nothing written) when a slot is out of range. */
int write_kv_q8(const float *k, int64_t k_row, int64_t k_head, const float *v, int64_t v_row, int64_t v_head,
                const int64_t *slots, int64_t T, int64_t kvh, int64_t D, int64_t nslots, void *pool) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= nslots) return -1;
    int8_t *base = (int8_t *)pool;
    const int64_t rb = row_bytes(D);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < kvh; h++) {
            quantize_row(k + t * k_row + h * k_head, D, base + (h * nslots + slots[t]) * rb);
            quantize_row(v + t * v_row + h * v_head, D, base + ((kvh + h) * nslots + slots[t]) * rb);
        }
    return 0;
}
