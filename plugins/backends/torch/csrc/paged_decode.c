/* Decode attention straight from the paged KV pool (CPU, fp32).
 *
 * The torch path gathers every decode sequence's blocks into a contiguous buffer and then runs
 * two batched matmuls; on a CPU that reads the whole context three times (gather read, gather
 * write, matmul read). This kernel reads each key and value row once, from its block, for all
 * the queries of its GQA group. Built at run time by ``cpu_kernels.py`` (gcc -O3 -march=native
 * -fopenmp); it links against the OpenMP runtime torch already loaded, so both share one pool
 * of threads.
 *
 * Layout (one layer): ``kv`` is ``[2 * kvh, nblocks, bs, D]`` (keys of head h at row h, values
 * at row kvh + h), ``q`` and ``out`` are ``[nd, H, D]`` with H = kvh * G, ``tables`` is
 * ``[nd, max_blocks]`` block ids and ``ctx`` the number of positions each sequence attends to
 * (its last query sits at position ctx - 1). ``window`` > 0 keeps only the last ``window``
 * positions (sliding-window attention); 0 means full attention.
 *
 * With AVX2 + FMA and a head size that is a multiple of 8 the hot loops are written with
 * intrinsics (dot products, a vector exp for the softmax, the value sum held in registers);
 * elsewhere the portable loops below run.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#define HAVE_AVX2 1
#endif

/* Both variants attend positions start..L-1 of one KV head (keys at kbase, values at vbase,
 * laid out in blocks of bs rows of D floats) for its G query heads. */
static void attend_one_portable(const float *restrict q, const float *restrict kbase, const float *restrict vbase,
                                const int64_t *restrict table, int64_t start, int64_t L, int64_t G, int64_t D,
                                int64_t bs, float scale, float *restrict scores, float *restrict out) {
    const int64_t n = L - start;

    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = start + j;
        const float *k = kbase + (table[pos / bs] * bs + pos % bs) * D;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += qg[d] * k[d];
            scores[g * n + j] = acc * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * n;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - mx);
            sum += s[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; j++) s[j] *= inv;
        float *o = out + g * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    }
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = start + j;
        const float *v = vbase + (table[pos / bs] * bs + pos % bs) * D;
        for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * n + j];
            float *o = out + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
        }
    }
}

#ifdef HAVE_AVX2
/* Same contract as attend_one_portable, for D % 8 == 0. Positions are walked block by block
 * (one table lookup per block, rows of a block are contiguous). */
static void attend_one_avx2(const float *restrict q, const float *restrict kbase, const float *restrict vbase,
                            const int64_t *restrict table, int64_t start, int64_t L, int64_t G, int64_t D,
                            int64_t bs, float scale, float *restrict scores, float *restrict out) {
    const int64_t n = L - start;

    for (int64_t pos = start; pos < L;) {
        const int64_t off = pos % bs, take = (bs - off < L - pos) ? bs - off : L - pos;
        const float *k = kbase + (table[pos / bs] * bs + off) * D;
        for (int64_t t = 0; t < take; t++, k += D) {
            const int64_t j = pos - start + t;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + g * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int64_t d = 0;
                for (; d + 16 <= D; d += 16) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(k + d), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(k + d + 8), a1);
                }
                if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(k + d), a0);
                scores[g * n + j] = hsum8(_mm256_add_ps(a0, a1)) * scale;
            }
        }
        pos += take;
    }
    for (int64_t g = 0; g < G; g++) {
        float *sc = scores + g * n;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
            _mm256_storeu_ps(sc + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum8(vsum);
        if (j < n) {  /* the tail through a padded vector: same exp as the body */
            float buf[8];
            for (int64_t i = 0; i < 8; i++) buf[i] = j + i < n ? sc[j + i] - mx : -INFINITY;
            _mm256_storeu_ps(buf, exp_nonpos(_mm256_loadu_ps(buf)));
            for (int64_t i = 0; j + i < n; i++) {
                sc[j + i] = buf[i];
                sum += buf[i];
            }
        }
        const float inv = 1.0f / sum;
        for (j = 0; j < n; j++) sc[j] *= inv;
    }
    /* out[g] = sum_j p[g][j] * v_j, 32 output floats (four registers) per pass over the values. */
    for (int64_t g = 0; g < G; g++) {
        const float *pg = scores + g * n;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const int64_t w = D - d0 < 32 ? D - d0 : 32; /* 8, 16, 24 or 32 */
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
            for (int64_t pos = start; pos < L;) {
                const int64_t off = pos % bs, take = (bs - off < L - pos) ? bs - off : L - pos;
                const float *v = vbase + (table[pos / bs] * bs + off) * D + d0;
                const float *pj = pg + (pos - start);
                for (int64_t t = 0; t < take; t++, v += D) {
                    const __m256 p = _mm256_broadcast_ss(pj + t);
                    o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), o0);
                    if (w > 8) o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), o1);
                    if (w > 16) o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), o2);
                    if (w > 24) o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), o3);
                }
                pos += take;
            }
            float *o = out + g * D + d0;
            _mm256_storeu_ps(o, o0);
            if (w > 8) _mm256_storeu_ps(o + 8, o1);
            if (w > 16) _mm256_storeu_ps(o + 16, o2);
            if (w > 24) _mm256_storeu_ps(o + 24, o3);
        }
    }
}
#endif

static void attend_one(const float *restrict q, const float *restrict kv, const int64_t *restrict table,
                       int64_t L, int64_t kvh, int64_t h, int64_t G, int64_t D, int64_t nblocks, int64_t bs,
                       float scale, int64_t window, float *restrict scores, float *restrict out) {
    const int64_t start = (window > 0 && L > window) ? L - window : 0;
    const float *kbase = kv + h * nblocks * bs * D;
    const float *vbase = kv + (kvh + h) * nblocks * bs * D;
#ifdef HAVE_AVX2
    if (D % 8 == 0) {
        attend_one_avx2(q, kbase, vbase, table, start, L, G, D, bs, scale, scores, out);
        return;
    }
#endif
    attend_one_portable(q, kbase, vbase, table, start, L, G, D, bs, scale, scores, out);
}

/* Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int paged_decode_f32(const float *q, const float *kv, const int64_t *tables, const int64_t *ctx, float *out,
                     int64_t nd, int64_t H, int64_t kvh, int64_t D, int64_t nblocks, int64_t bs,
                     int64_t max_blocks, float scale, int64_t window, int nthreads) {
    const int64_t G = H / kvh;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        /* Every context fits its block table: max_blocks * bs scores per query at most. */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_blocks * bs));
        failed = scores == NULL;
        /* Every thread must reach the worksharing loop, even one whose malloc failed. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nd * kvh; item++) {
            if (scores == NULL) continue;
            const int64_t s = item / kvh, h = item % kvh;
            attend_one(q + (s * H + h * G) * D, kv, tables + s * max_blocks, ctx[s], kvh, h, G, D, nblocks, bs,
                       scale, window, scores, out + (s * H + h * G) * D);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
