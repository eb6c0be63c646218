/* The AVX2 pieces both decode-attention kernels use (paged_decode.c, paged_decode_q8.c): key
 * rows scored eight at a time and an in-place softmax (included, not compiled on its own; the
 * kernel cache key covers this file too). */
#ifndef LLMSERVE_ATTN_AVX2_H
#define LLMSERVE_ATTN_AVX2_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec_math.h"

/* Eight dot products at once: lane r of the result is the sum of a_r's lanes. */
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Scores of ``rows`` consecutive key rows (k, stride D) against one query, into sc[0..rows). */
static inline void score_rows(const float *restrict qg, const float *restrict k, int64_t rows, int64_t D,
                              float scale, float *restrict sc) {
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) {
        const float *kr = k + r * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qg + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + D + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 2 * D + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 3 * D + d), a3);
            a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 4 * D + d), a4);
            a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 5 * D + d), a5);
            a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 6 * D + d), a6);
            a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 7 * D + d), a7);
        }
        _mm256_storeu_ps(sc + r, _mm256_mul_ps(hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
    }
    for (; r < rows; r++) {
        const float *kr = k + r * D;
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kr + d), a);
        sc[r] = hsum8(a) * scale;
    }
}

/* In-place softmax of n scores. ``sink`` (NULL: none) points at an attention sink's logit: one
 * more term of the denominator, with no value row (gpt-oss), so the weights sum to less than 1.
 * It takes part in the maximum too, which keeps every exponent <= 0 (exp_nonpos) and the sum
 * exact however far the sink lies above the scores. */
static void softmax_avx2(float *restrict sc, int64_t n, const float *sink) {
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sc + j));
    float buf[8], mx = -INFINITY;
    _mm256_storeu_ps(buf, vmx);
    for (int i = 0; i < 8; i++) mx = buf[i] > mx ? buf[i] : mx;
    for (int64_t i = j; i < n; i++) mx = sc[i] > mx ? sc[i] : mx;
    if (sink != NULL) mx = *sink > mx ? *sink : mx;
    vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
        _mm256_storeu_ps(sc + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    if (j < n) { /* the tail through a padded vector: same exp as the body */
        for (int64_t i = 0; i < 8; i++) buf[i] = j + i < n ? sc[j + i] - mx : -INFINITY;
        _mm256_storeu_ps(buf, exp_nonpos(_mm256_loadu_ps(buf)));
        for (int64_t i = 0; j + i < n; i++) {
            sc[j + i] = buf[i];
            sum += buf[i];
        }
    }
    /* the sink's term through the same exp as the scores' (lane 0 of a broadcast) */
    if (sink != NULL) sum += _mm256_cvtss_f32(exp_nonpos(_mm256_set1_ps(*sink - mx)));
    const float inv = 1.0f / sum;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(sc + j, _mm256_mul_ps(_mm256_loadu_ps(sc + j), vinv));
    for (; j < n; j++) sc[j] *= inv;
}

#endif
