/* A Gated DeltaNet layer's decode rows (Qwen3.5, Qwen3-Next), fp32, in one call from the layer's
 * projections to its gated, normed output, reading and updating each sequence's convolution
 * window and delta-rule state in place in the state pools (no gather of the states into a batch,
 * no scatter back, two passes over each state; torch takes some thirty operations a layer).
 *
 * For sequence b (its states are pool row slots[b]), from its projection rows: the convolution's
 * input x [C] (queries, keys, values), the output gate z [Hv * Dv] and the per-head scalars
 * bb [Hv] and aa [Hv]:
 *   1. c[i] = silu(sum_j window[i][j] * w[i][j] + x[i] * w[i][K-1]); the window shifts in x.
 *   2. each key head's query and key L2-normalised, the query scaled by Dk^-1/2.
 *   3. per value head h (key head h % Hk in tiled order, h / (Hv / Hk) grouped), with
 *      decay = exp(neg_a[h] * softplus(aa[h] + dt_bias[h])) and beta = sigmoid(bb[h]):
 *        pass 1:  w[v] = beta * (value[v] - decay * sum_k S[k][v] key[k])
 *        pass 2:  S[k][v] = decay S[k][v] + key[k] w[v];   o[v] = sum_k S[k][v] query[k]
 *      then out[v] = norm[v] * o[v] / sqrt(mean(o^2) + eps) * silu(z[v]).
 *
 * Built at run time by ``build.py`` (gcc -O3 -march=native -fopenmp): C loops the compiler
 * vectorises, and two parts by hand. SiLU runs 8 values at a time (vec_math.h): a scalar exp per
 * channel and per output took 40% of a layer (18 layers of 8 sequences, 16 x 128 x 128 states:
 * 11.4 -> 8.0 ms). On AVX-512 the delta rule runs in 16-lane registers, 128 columns of a state
 * at a time, w and o in registers through both passes (the plain loops keep them in memory:
 * 13.3 -> 11.4 ms).
 */
#include <math.h>
#include <stdint.h>
#include "vec_math.h"

#define MAX_DV 1024
#define CONV_BLOCK 512 /* channels of one sequence a work unit of step 1 */

static inline float sigmoid1(float x) { return x >= 0.0f ? 1.0f / (1.0f + expf(-x)) : expf(x) / (1.0f + expf(x)); }

/* torch's softplus (beta 1, threshold 20) */
static inline float softplus1(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

#if defined(__AVX512F__)
/* Columns c0 .. c0 + 16 nv - 1 of one state S [Dk][Dv] (the last vector's lanes cut by tail):
 * pass 1 w = beta (value - decay S^T key), pass 2 S = decay S + key w^T and o = S^T query. */
static inline __attribute__((always_inline)) void delta_cols(float *S, const float *key, const float *query,
                                                            const float *val, float decay, float beta, float *o,
                                                            int64_t Dk, int64_t Dv, int64_t c0, const int nv,
                                                            __mmask16 tail) {
    __m512 acc[8], w[8];
    __mmask16 mk[8];
    for (int v = 0; v < 8; v++) {
        acc[v] = _mm512_setzero_ps();
        mk[v] = v < nv - 1 ? (__mmask16)0xFFFF : tail;
    }
    for (int64_t i = 0; i < Dk; i++) {
        const __m512 kv = _mm512_set1_ps(key[i]);
        const float *row = S + i * Dv + c0;
        for (int v = 0; v < 8; v++)
            if (v < nv) acc[v] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk[v], row + 16 * v), kv, acc[v]);
    }
    const __m512 dv = _mm512_set1_ps(decay), bv = _mm512_set1_ps(beta);
    for (int v = 0; v < 8; v++)
        if (v < nv) {
            w[v] = _mm512_mul_ps(bv, _mm512_fnmadd_ps(dv, acc[v], _mm512_maskz_loadu_ps(mk[v], val + c0 + 16 * v)));
            acc[v] = _mm512_setzero_ps(); /* now o */
        }
    for (int64_t i = 0; i < Dk; i++) {
        const __m512 kv = _mm512_set1_ps(key[i]), qv = _mm512_set1_ps(query[i]);
        float *row = S + i * Dv + c0;
        for (int v = 0; v < 8; v++)
            if (v < nv) {
                const __m512 st = _mm512_fmadd_ps(dv, _mm512_maskz_loadu_ps(mk[v], row + 16 * v), _mm512_mul_ps(kv, w[v]));
                _mm512_mask_storeu_ps(row + 16 * v, mk[v], st);
                acc[v] = _mm512_fmadd_ps(st, qv, acc[v]);
            }
    }
    for (int v = 0; v < nv; v++) _mm512_mask_storeu_ps(o + c0 + 16 * v, mk[v], acc[v]);
}

/* The delta rule on one state, 128 columns at a time (full chunks unrolled with all lanes on). */
static void delta_rule(float *S, const float *key, const float *query, const float *val, float decay, float beta,
                       float *o, int64_t Dk, int64_t Dv) {
    int64_t c0 = 0;
    for (; c0 + 128 <= Dv; c0 += 128) delta_cols(S, key, query, val, decay, beta, o, Dk, Dv, c0, 8, 0xFFFF);
    if (c0 < Dv) {
        const int64_t n = Dv - c0;
        const __mmask16 tail = n % 16 ? (__mmask16)((1u << (n % 16)) - 1) : (__mmask16)0xFFFF;
        delta_cols(S, key, query, val, decay, beta, o, Dk, Dv, c0, (int)((n + 15) / 16), tail);
    }
}
#else
/* The same in plain loops (w and o through memory). */
static void delta_rule(float *S, const float *key, const float *query, const float *val, float decay, float beta,
                       float *o, int64_t Dk, int64_t Dv) {
    float w[MAX_DV];
    for (int64_t j = 0; j < Dv; j++) w[j] = 0.0f;
    for (int64_t i = 0; i < Dk; i++) {
        const float ki = key[i];
        const float *row = S + i * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) w[j] += row[j] * ki;
    }
    for (int64_t j = 0; j < Dv; j++) {
        w[j] = beta * (val[j] - decay * w[j]);
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < Dk; i++) {
        const float ki = key[i], qi = query[i];
        float *row = S + i * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) {
            const float s = decay * row[j] + ki * w[j];
            row[j] = s;
            o[j] += s * qi;
        }
    }
}
#endif

void deltanet_decode_f32(const float *x, int64_t x_stride, const float *z, int64_t z_stride, const float *bb,
                         int64_t b_stride, const float *aa, int64_t a_stride, float *conv_pool, const float *conv_w,
                         int64_t K, float *ssm_pool, const int64_t *slots, const float *neg_a, const float *dt_bias,
                         const float *norm, float eps, float *scratch, float *out, int64_t B, int64_t Hk, int64_t Hv,
                         int64_t Dk, int64_t Dv, int tiled, int threads) {
    const int64_t C = 2 * Hk * Dk + Hv * Dv, W = K - 1, per_key = Hv / Hk;
    /* 1. the short convolution per channel, then SiLU 8 channels at a time (see the header) */
    const int64_t nblk = (C + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t blk = 0; blk < nblk; blk++) {
            const int64_t i0 = blk * CONV_BLOCK, i1 = i0 + CONV_BLOCK < C ? i0 + CONV_BLOCK : C;
            float *dst = scratch + b * C;
            for (int64_t i = i0; i < i1; i++) {
                float *win = conv_pool + slots[b] * C * W + i * W;
                const float *w = conv_w + i * K;
                const float xi = x[b * x_stride + i];
                float s = xi * w[W];
                for (int64_t j = 0; j < W; j++) s += win[j] * w[j];
                for (int64_t j = 0; j + 1 < W; j++) win[j] = win[j + 1];
                if (W > 0) win[W - 1] = xi;
                dst[i] = s;
            }
            int64_t i = i0;
            for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(dst + i, silu8(_mm256_loadu_ps(dst + i)));
            for (; i < i1; i++) dst[i] = silu1(dst[i]);
        }
    }
    /* 2. queries and keys L2-normalised (the query scaled too) */
    const float scale = 1.0f / sqrtf((float)Dk);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t r = 0; r < 2 * Hk; r++) {
            float *u = scratch + b * C + r * Dk;
            float ss = 0.0f;
            for (int64_t j = 0; j < Dk; j++) ss += u[j] * u[j];
            const float f = 1.0f / sqrtf(ss + 1e-6f) * (r < Hk ? scale : 1.0f);
            for (int64_t j = 0; j < Dk; j++) u[j] *= f;
        }
    }
    /* 3. the delta rule on each value head's state, then the gated norm */
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hv; h++) {
            const int64_t kh = tiled ? h % Hk : h / per_key;
            float *S = ssm_pool + (slots[b] * Hv + h) * Dk * Dv;
            const float *query = scratch + b * C + kh * Dk, *key = scratch + b * C + (Hk + kh) * Dk;
            const float *val = scratch + b * C + 2 * Hk * Dk + h * Dv;
            const float decay = expf(neg_a[h] * softplus1(aa[b * a_stride + h] + dt_bias[h]));
            const float beta = sigmoid1(bb[b * b_stride + h]);
            float o[MAX_DV];
            delta_rule(S, key, query, val, decay, beta, o, Dk, Dv);
            float ss = 0.0f;
            for (int64_t j = 0; j < Dv; j++) ss += o[j] * o[j];
            const float inv = 1.0f / sqrtf(ss / (float)Dv + eps);
            const float *gate = z + b * z_stride + h * Dv;
            float *dst = out + b * Hv * Dv + h * Dv;
            const __m256 iv = _mm256_set1_ps(inv);
            int64_t j = 0;
            for (; j + 8 <= Dv; j += 8)
                _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(norm + j),
                                                                      _mm256_mul_ps(_mm256_loadu_ps(o + j), iv)),
                                                        silu8(_mm256_loadu_ps(gate + j))));
            for (; j < Dv; j++) dst[j] = norm[j] * (o[j] * inv) * silu1(gate[j]);
        }
    }
}
