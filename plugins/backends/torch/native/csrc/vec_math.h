/* Vector helpers shared by the AVX2 kernels (included, not compiled on its own; the kernel
 * cache key covers this file too). */
#ifndef LLMSERVE_VEC_MATH_H
#define LLMSERVE_VEC_MATH_H
#include <immintrin.h>
#include <math.h>

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* e^x for x <= 0: range reduction, a degree-6 polynomial, scaling through the exponent bits
 * (relative error ~1e-7; below -87 the result is 0). */
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* sigmoid(z) from e = e^-|z| (never overflows): z >= 0: 1 / (1 + e);  z < 0: e / (1 + e). */
static inline __m256 sigmoid8(__m256 z) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 e = exp_nonpos(_mm256_or_ps(z, sign)); /* -|z| */
    const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, z); /* z's sign bit picks e */
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* silu(x) = x * sigmoid(x) */
static inline __m256 silu8(__m256 x) { return _mm256_mul_ps(x, sigmoid8(x)); }

static inline float silu1(float x) {
    return x >= 0.0f ? x / (1.0f + expf(-x)) : x * expf(x) / (1.0f + expf(x));
}

#endif
