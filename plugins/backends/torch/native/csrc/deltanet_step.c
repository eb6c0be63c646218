/* One decode step of the gated delta rule (Gated DeltaNet layers: Qwen3.5, Qwen3-Next), fp32,
 * in place on the state pool: no gather of the sequences' states into a batch and no scatter
 * back, and two passes over each state instead of torch's six.
 *
 * For sequence b (its state is pool row slots[b]) and value head h, whose key head is
 * kh = h % Hk (tiled order) or h / (Hv / Hk) (grouped order), with S = the [Dk, Dv] state:
 *   pass 1:  p[v] = sum_k S[k][v] * key[k]            (what the state predicts for this key)
 *            w[v] = beta * (value[v] - decay * p[v])  (decay = exp(g): the state decays first)
 *   pass 2:  S[k][v] = decay * S[k][v] + key[k] * w[v];   out[v] = sum_k S[k][v] * query[k]
 * Queries and keys come prepared by the caller (L2-normalised, the query scaled), one per key head.
 *
 * Built at run time by ``build.py`` (gcc -O3 -march=native -fopenmp); plain C loops over the
 * value dimension, which the compiler vectorises.
 */
#include <math.h>
#include <stdint.h>

#define MAX_DV 1024

void deltanet_step_f32(float *pool, const int64_t *slots, int64_t slot_stride, const float *q, const float *k,
                       const float *v, const float *g, const float *beta, float *out, int64_t B, int64_t Hk,
                       int64_t Hv, int64_t Dk, int64_t Dv, int tiled, int threads) {
    const int64_t per_key = Hv / Hk;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hv; h++) {
            const int64_t kh = tiled ? h % Hk : h / per_key;
            float *S = pool + slots[b] * slot_stride + h * Dk * Dv;
            const float *key = k + (b * Hk + kh) * Dk, *query = q + (b * Hk + kh) * Dk;
            const float *val = v + (b * Hv + h) * Dv;
            float *o = out + (b * Hv + h) * Dv;
            const float decay = expf(g[b * Hv + h]), bt = beta[b * Hv + h];
            float w[MAX_DV];
            for (int64_t j = 0; j < Dv; j++) w[j] = 0.0f;
            for (int64_t i = 0; i < Dk; i++) {
                const float ki = key[i];
                const float *row = S + i * Dv;
#pragma omp simd
                for (int64_t j = 0; j < Dv; j++) w[j] += row[j] * ki;
            }
            for (int64_t j = 0; j < Dv; j++) {
                w[j] = bt * (val[j] - decay * w[j]);
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
    }
}
