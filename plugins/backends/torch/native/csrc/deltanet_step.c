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
 * Built at run time by ``build.py`` (gcc -O3 -march=native -fopenmp); plain C loops, which the
 * compiler vectorises.
 */
#include <math.h>
#include <stdint.h>

#define MAX_DV 1024

static inline float silu1(float x) { return x >= 0.0f ? x / (1.0f + expf(-x)) : x * expf(x) / (1.0f + expf(x)); }

static inline float sigmoid1(float x) { return x >= 0.0f ? 1.0f / (1.0f + expf(-x)) : expf(x) / (1.0f + expf(x)); }

/* torch's softplus (beta 1, threshold 20) */
static inline float softplus1(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

void deltanet_decode_f32(const float *x, int64_t x_stride, const float *z, int64_t z_stride, const float *bb,
                         int64_t b_stride, const float *aa, int64_t a_stride, float *conv_pool, const float *conv_w,
                         int64_t K, float *ssm_pool, const int64_t *slots, const float *neg_a, const float *dt_bias,
                         const float *norm, float eps, float *scratch, float *out, int64_t B, int64_t Hk, int64_t Hv,
                         int64_t Dk, int64_t Dv, int tiled, int threads) {
    const int64_t C = 2 * Hk * Dk + Hv * Dv, W = K - 1, per_key = Hv / Hk;
    /* 1. the short convolution and SiLU, per channel */
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < C; i++) {
            float *win = conv_pool + slots[b] * C * W + i * W;
            const float *w = conv_w + i * K;
            const float xi = x[b * x_stride + i];
            float s = xi * w[W];
            for (int64_t j = 0; j < W; j++) s += win[j] * w[j];
            for (int64_t j = 0; j + 1 < W; j++) win[j] = win[j + 1];
            if (W > 0) win[W - 1] = xi;
            scratch[b * C + i] = silu1(s);
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
            float w[MAX_DV], o[MAX_DV];
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
            float ss = 0.0f;
            for (int64_t j = 0; j < Dv; j++) ss += o[j] * o[j];
            const float inv = 1.0f / sqrtf(ss / (float)Dv + eps);
            const float *gate = z + b * z_stride + h * Dv;
            float *dst = out + b * Hv * Dv + h * Dv;
            for (int64_t j = 0; j < Dv; j++) dst[j] = norm[j] * (o[j] * inv) * silu1(gate[j]);
        }
    }
}
