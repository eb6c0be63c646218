/* The small per-layer operations of the fused forward, fp32 on an AVX2/FMA CPU.
 *
 * Each is a handful of torch ops (RMSNorm alone is six: pow, mean, add, rsqrt, mul, mul), and
 * at a decode step's few rows their dispatch and extra passes over memory cost more than the
 * arithmetic. One call here does the whole thing in one pass per row.
 *
 *   add_rms_norm_f32:  h += delta (when delta is given), out = h / sqrt(mean(h^2) + eps) * w
 *   silu_mul_f32:      out[t, i] = silu(gu[t, i]) * gu[t, I + i]   (gate and up side by side)
 *   gelu_tanh_mul_f32: the same with GELU's tanh approximation (Gemma)
 *   rope_f32:          rotary embedding of queries and keys in place
 *   head_rms_norm_f32: RMSNorm of every query and key head on its own (Qwen3's q/k norms), in place
 *   greedy_pick_f32:   argmax and its log-probability per row of logits
 *
 * Built at run time by ``cpu_kernels.py`` (gcc -O3 -march=native -fopenmp).
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the elementwise kernels need AVX2 and FMA"
#endif
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

/* GELU, tanh form: 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), which is
 * x * sigmoid(2u) exactly (1 + tanh(u) = 2 sigmoid(2u)): no tanh, and no overflow for large |x|. */
#define GELU_2C 1.5957691216057308f /* 2 sqrt(2/pi) */
#define GELU_A 0.044715f

static inline __m256 gelu8(__m256 x) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(GELU_2C), _mm256_fmadd_ps(_mm256_set1_ps(GELU_A), x3, x));
    return _mm256_mul_ps(x, sigmoid8(z));
}

static inline float gelu1(float x) {
    const float z = GELU_2C * (x + GELU_A * x * x * x);
    const float e = expf(-fabsf(z));
    return x * (z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

void add_rms_norm_f32(float *h, const float *delta, const float *w, float *out, int64_t T, int64_t D, float eps,
                      int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        float *row = h + t * D;
        const float *dr = delta ? delta + t * D : NULL;
        __m256 acc = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            __m256 v = _mm256_loadu_ps(row + d);
            if (dr) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(dr + d));
                _mm256_storeu_ps(row + d, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; d < D; d++) {
            if (dr) row[d] += dr[d];
            ss += row[d] * row[d];
        }
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        float *o = out + t * D;
        for (d = 0; d + 8 <= D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(w + d),
                                                  _mm256_mul_ps(_mm256_loadu_ps(row + d), vinv)));
        for (; d < D; d++) o[d] = w[d] * (row[d] * inv);
    }
}

/* RMSNorm of each head vector in place: the first ``heads`` heads of each row of x (row stride
 * ``ld`` floats) scaled by ``qw [D]``, the ``kv_heads`` after them by ``kw [D]``; queries and keys
 * side by side as in a fused QKV output. The same arithmetic, in the same order, as
 * add_rms_norm_f32 on one head's D values. */
void head_rms_norm_f32(float *x, const float *qw, const float *kw, int64_t T, int64_t heads, int64_t kv_heads,
                       int64_t D, int64_t ld, float eps, int nthreads) {
    const int64_t per_row = heads + kv_heads;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * per_row * D >= 32768)
    for (int64_t i = 0; i < T * per_row; i++) {
        const int64_t t = i / per_row, h = i % per_row;
        float *row = x + t * ld + h * D;
        const float *w = h < heads ? qw : kw;
        __m256 acc = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            const __m256 v = _mm256_loadu_ps(row + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; d < D; d++) ss += row[d] * row[d];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (d = 0; d + 8 <= D; d += 8)
            _mm256_storeu_ps(row + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(row + d), vinv)));
        for (; d < D; d++) row[d] = w[d] * (row[d] * inv);
    }
}

/* out[t, i] = act(gu[t, i]) * gu[t, I + i]: GELU (tanh) where ``gelu``, else SiLU (a constant
 * wherever this is inlined, so each entry point keeps one activation in its loop). */
static inline __attribute__((always_inline)) void gated_mul(const float *gu, float *out, int64_t T, int64_t I,
                                                           int nthreads, const int gelu) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I >= 16384)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 v = _mm256_loadu_ps(g + i);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu ? gelu8(v) : silu8(v), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = (gelu ? gelu1(g[i]) : silu1(g[i])) * u[i];
    }
}

void silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int nthreads) {
    gated_mul(gu, out, T, I, nthreads, 0);
}

void gelu_tanh_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int nthreads) {
    gated_mul(gu, out, T, I, nthreads, 1);
}

/* Greedy decoding of a [B, V] logits matrix: per row the first index of the maximum (as
 * torch.argmax) and its log-probability, -log(sum(exp(x - max))), in three passes over the
 * row. Returns the number of rows with no finite maximum (NaN or all -inf): for those,
 * token is -1 and the caller must take its general path. */
int64_t greedy_pick_f32(const float *logits, int64_t B, int64_t V, int64_t *token, float *logprob, int nthreads) {
    int64_t bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : bad) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *x = logits + b * V;
        __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= V; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            vmax = _mm256_max_ps(vmax, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float buf[8], mx = -INFINITY;
        _mm256_storeu_ps(buf, vmax);
        int any_nan = _mm256_movemask_ps(nan) != 0;
        for (int j = 0; j < 8; j++) mx = buf[j] > mx ? buf[j] : mx;
        for (; i < V; i++) {
            mx = x[i] > mx ? x[i] : mx;
            any_nan |= x[i] != x[i];
        }
        /* A NaN anywhere (torch.argmax would pick it) or no finite maximum: the caller's path. */
        int64_t arg = -1;
        if (!any_nan && isfinite(mx)) {
            const __m256 m = _mm256_set1_ps(mx);
            for (i = 0; i + 8 <= V; i += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), m, _CMP_EQ_OQ));
                if (hit) {
                    arg = i + __builtin_ctz((unsigned)hit);
                    break;
                }
            }
            for (; arg < 0 && i < V; i++)
                if (x[i] == mx) arg = i;
        }
        token[b] = arg;
        if (arg < 0) {
            bad += 1;
            continue;
        }
        const __m256 m = _mm256_set1_ps(mx);
        __m256 acc = _mm256_setzero_ps();
        for (i = 0; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
        float sum = hsum8(acc);
        for (; i < V; i++) sum += expf(x[i] - mx);
        logprob[b] = -logf(sum);
    }
    return bad;
}

/* Rotary embedding ("rotate half") in place on the first ``heads`` heads of each row of x
 * (row stride ``ld`` floats; queries and keys side by side), with per-row cos/sin [T, D]:
 * x[i] <- x[i] cos[i] - x[i + D/2] sin[i],  x[i + D/2] <- x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]. */
void rope_f32(float *x, const float *cos, const float *sin, int64_t T, int64_t heads, int64_t D, int64_t ld,
              int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * heads * D >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * ld + h * D, *b = a + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
                _mm256_storeu_ps(a + i, _mm256_fnmadd_ps(vb, _mm256_loadu_ps(s + i), _mm256_mul_ps(va, _mm256_loadu_ps(c + i))));
                _mm256_storeu_ps(b + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(s + half + i),
                                                        _mm256_mul_ps(vb, _mm256_loadu_ps(c + half + i))));
            }
            for (; i < half; i++) {
                const float va = a[i], vb = b[i];
                a[i] = va * c[i] - vb * s[i];
                b[i] = vb * c[half + i] + va * s[half + i];
            }
        }
    }
}
