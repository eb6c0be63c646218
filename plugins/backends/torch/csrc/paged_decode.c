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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static void attend_one(const float *restrict q, const float *restrict kv, const int64_t *restrict table,
                       int64_t L, int64_t kvh, int64_t h, int64_t G, int64_t D, int64_t nblocks, int64_t bs,
                       float scale, int64_t window, float *restrict scores, float *restrict out) {
    const int64_t start = (window > 0 && L > window) ? L - window : 0;
    const int64_t n = L - start;
    const float *kbase = kv + h * nblocks * bs * D;
    const float *vbase = kv + (kvh + h) * nblocks * bs * D;

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
