/* Decode attention straight from the paged KV pool (CPU, fp32), and the KV write before it.
 *
 * The torch path gathers every decode sequence's blocks into a contiguous buffer and then runs
 * two batched matmuls; on a CPU that reads the whole context three times (gather read, gather
 * write, matmul read). This kernel reads each key and value row once, from its block, for all
 * the queries of its GQA group. Built at run time by ``cpu_kernels.py`` (gcc -O3 -march=native
 * -fopenmp); it links against the OpenMP runtime torch already loaded, so both share one pool
 * of threads.
 *
 * Layout (one layer): ``kv`` is ``[2 * kvh, nblocks, bs, D]`` (keys of head h at row h, values
 * at row kvh + h). Query head j of sequence s starts at ``q + s * q_row + j * q_head`` and its
 * output at ``out + s * out_row + j * D`` (heads j = h * G .. h * G + G - 1 share KV head h),
 * so queries can be read in place from a fused QKV projection. ``tables`` is
 * ``[nd, max_blocks]`` block ids and ``ctx`` the number of positions each sequence attends to
 * (its last query sits at position ctx - 1). ``window`` > 0 keeps only the last ``window``
 * positions (sliding-window attention); 0 means full attention. ``sinks`` (NULL: none) holds
 * one attention-sink logit per query head (gpt-oss): an extra term of that head's softmax
 * denominator with no value row, exp(sink - m) next to the scores' exp(s_j - m).
 *
 * With AVX2 + FMA and a head size that is a multiple of 8 the hot loops are written with
 * intrinsics (eight key rows scored at once, a vector exp for the softmax, value sums for up
 * to three query heads held in registers) and the next item's rows are prefetched while one
 * item is computed; elsewhere the portable loops below run.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "attn_avx2.h"
#define HAVE_AVX2 1
#endif

/* One (sequence, KV head) pair: positions start..L-1 of the keys at kbase and the values at
 * vbase (blocks of bs rows of D floats, found through table) for G query heads, whose sink
 * logits are sink[0..G) (sink NULL: no sinks). */
typedef struct {
    const float *q, *kbase, *vbase, *sink;
    const int64_t *table;
    int64_t start, L, q_head;
    float *out;
} Item;

static void attend_one_portable(const Item *it, int64_t G, int64_t D, int64_t bs, float scale,
                                float *restrict scores) {
    const int64_t n = it->L - it->start;

    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = it->start + j;
        const float *k = it->kbase + (it->table[pos / bs] * bs + pos % bs) * D;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = it->q + g * it->q_head;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += qg[d] * k[d];
            scores[g * n + j] = acc * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * n;
        /* A sink joins the maximum and the sum but gets no weight of its own. */
        float mx = it->sink != NULL ? it->sink[g] : -INFINITY;
        for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        float sum = it->sink != NULL ? expf(it->sink[g] - mx) : 0.0f;
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - mx);
            sum += s[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; j++) s[j] *= inv;
        float *o = it->out + g * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    }
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = it->start + j;
        const float *v = it->vbase + (it->table[pos / bs] * bs + pos % bs) * D;
        for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * n + j];
            float *o = it->out + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
        }
    }
}

#ifdef HAVE_AVX2
/* Prefetches the key rows, then the value rows, of the item a thread attends next, a few cache
 * lines per step of the current item. An item's rows sit in scattered 4 KiB pieces that the
 * hardware prefetchers only pick up after missing; computing one item while the next one's
 * rows arrive keeps the cores busy instead of waiting on memory (batch 32, context 105: 12-15
 * ms per step for 30 layers without it, 8-11 with it). */
typedef struct {
    const Item *it;
    const char *line, *block_end; /* the next line to fetch and the end of its block's run */
    int64_t pos, per_tick, bs, row_bytes;
    int values;
} Ahead;

/* Points the walk at the run of rows from a->pos to the end of its block (or of the item). */
static inline void ahead_block(Ahead *a) {
    const Item *it = a->it;
    const int64_t off = a->pos % a->bs, rows = (a->bs - off < it->L - a->pos) ? a->bs - off : it->L - a->pos;
    const float *base = a->values ? it->vbase : it->kbase;
    a->line = (const char *)base + (it->table[a->pos / a->bs] * a->bs + off) * a->row_bytes;
    a->block_end = a->line + rows * a->row_bytes;
    a->pos += rows;
}

static void ahead_init(Ahead *a, const Item *next, int64_t bs, int64_t D, int64_t ticks) {
    a->it = next && next->L > next->start ? next : NULL;
    a->bs = bs;
    a->row_bytes = D * (int64_t)sizeof(float);
    a->values = 0;
    a->per_tick = 0;
    if (a->it == NULL) return;
    a->pos = next->start;
    const int64_t lines = 2 * (next->L - next->start) * ((a->row_bytes + 63) / 64);
    a->per_tick = lines / (ticks > 0 ? ticks : 1) + 1;
    ahead_block(a);
}

static inline void ahead_issue(Ahead *a, int64_t ticks) {
    for (int64_t count = ticks * a->per_tick; count > 0 && a->it != NULL; count--) {
        _mm_prefetch(a->line, _MM_HINT_T1); /* into L2: L1 keeps the item being computed */
        a->line += 64;
        if (a->line < a->block_end) continue;
        if (a->pos >= a->it->L) { /* keys done: the values; values done: finished */
            if (a->values) {
                a->it = NULL;
                return;
            }
            a->values = 1;
            a->pos = a->it->start;
        }
        ahead_block(a);
    }
}

/* out[g] += p[g][j] * v_j for up to three query heads (gc) and w <= 32 output floats: twelve
 * accumulators, so each value row is read once per 32 floats rather than once per head. */
#define PV_ACC(gi)                                                                                   \
    if (gc > gi) {                                                                                   \
        const __m256 p = _mm256_broadcast_ss(p##gi + t);                                             \
        o##gi##0 = _mm256_fmadd_ps(p, v0, o##gi##0);                                                 \
        if (w > 8) o##gi##1 = _mm256_fmadd_ps(p, v1, o##gi##1);                                      \
        if (w > 16) o##gi##2 = _mm256_fmadd_ps(p, v2, o##gi##2);                                     \
        if (w > 24) o##gi##3 = _mm256_fmadd_ps(p, v3, o##gi##3);                                     \
    }
#define PV_STORE(gi)                                                                                 \
    if (gc > gi) {                                                                                   \
        float *o = it->out + (g0 + gi) * D + d0;                                                     \
        _mm256_storeu_ps(o, o##gi##0);                                                               \
        if (w > 8) _mm256_storeu_ps(o + 8, o##gi##1);                                                \
        if (w > 16) _mm256_storeu_ps(o + 16, o##gi##2);                                              \
        if (w > 24) _mm256_storeu_ps(o + 24, o##gi##3);                                              \
    }

/* Same contract as attend_one_portable, for D % 8 == 0. Positions are walked block by block
 * (one table lookup per block, rows of a block are contiguous). */
static void attend_one_avx2(const Item *it, int64_t G, int64_t D, int64_t bs, float scale,
                            float *restrict scores, Ahead *ahead) {
    const int64_t start = it->start, L = it->L, n = L - start;

    for (int64_t pos = start; pos < L;) {
        const int64_t off = pos % bs, take = (bs - off < L - pos) ? bs - off : L - pos;
        const float *k = it->kbase + (it->table[pos / bs] * bs + off) * D;
        for (int64_t r = 0; r < take; r += 8) {
            const int64_t rows = take - r < 8 ? take - r : 8;
            ahead_issue(ahead, rows);
            for (int64_t g = 0; g < G; g++)
                score_rows(it->q + g * it->q_head, k + r * D, rows, D, scale, scores + g * n + (pos - start) + r);
        }
        pos += take;
    }
    for (int64_t g = 0; g < G; g++) softmax_avx2(scores + g * n, n, it->sink != NULL ? it->sink + g : NULL);
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int64_t gc = G - g0 < 3 ? G - g0 : 3;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const int64_t w = D - d0 < 32 ? D - d0 : 32; /* 8, 16, 24 or 32 */
            const int first = g0 == 0 && d0 == 0;
            __m256 o00 = _mm256_setzero_ps(), o01 = o00, o02 = o00, o03 = o00;
            __m256 o10 = o00, o11 = o00, o12 = o00, o13 = o00, o20 = o00, o21 = o00, o22 = o00, o23 = o00;
            for (int64_t pos = start; pos < L;) {
                const int64_t off = pos % bs, take = (bs - off < L - pos) ? bs - off : L - pos;
                const float *v = it->vbase + (it->table[pos / bs] * bs + off) * D + d0;
                const float *p0 = scores + g0 * n + (pos - start), *p1 = p0 + n, *p2 = p0 + 2 * n;
                if (first) ahead_issue(ahead, take);
                for (int64_t t = 0; t < take; t++, v += D) {
                    const __m256 v0 = _mm256_loadu_ps(v);
                    const __m256 v1 = w > 8 ? _mm256_loadu_ps(v + 8) : v0;
                    const __m256 v2 = w > 16 ? _mm256_loadu_ps(v + 16) : v0;
                    const __m256 v3 = w > 24 ? _mm256_loadu_ps(v + 24) : v0;
                    PV_ACC(0) PV_ACC(1) PV_ACC(2)
                }
                pos += take;
            }
            PV_STORE(0) PV_STORE(1) PV_STORE(2)
        }
    }
}
#undef PV_ACC
#undef PV_STORE
#endif

static Item make_item(const float *q, int64_t q_row, int64_t q_head, const float *kv, const int64_t *tables,
                      const int64_t *ctx, float *out, int64_t out_row, int64_t kvh, int64_t G, int64_t D,
                      int64_t nblocks, int64_t bs, int64_t max_blocks, int64_t window, const float *sinks,
                      int64_t item) {
    const int64_t s = item / kvh, h = item % kvh, L = ctx[s];
    Item it = {
        .q = q + s * q_row + h * G * q_head,
        .kbase = kv + h * nblocks * bs * D,
        .vbase = kv + (kvh + h) * nblocks * bs * D,
        .sink = sinks != NULL ? sinks + h * G : NULL,
        .table = tables + s * max_blocks,
        .start = (window > 0 && L > window) ? L - window : 0,
        .L = L,
        .q_head = q_head,
        .out = out + s * out_row + h * G * D,
    };
    return it;
}

/* Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int paged_decode_f32(const float *q, int64_t q_row, int64_t q_head, const void *pool, const int64_t *tables,
                     const int64_t *ctx, float *out, int64_t out_row, int64_t nd, int64_t H, int64_t kvh, int64_t D,
                     int64_t nblocks, int64_t bs, int64_t max_blocks, float scale, int64_t window,
                     const float *sinks, int nthreads) {
    const float *kv = (const float *)pool;
    const int64_t G = H / kvh, items = nd * kvh;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        /* Every context fits its block table: max_blocks * bs scores per query at most. */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_blocks * bs));
        failed = scores == NULL;
        /* Every thread must reach the worksharing loop, even one whose malloc failed. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            if (scores == NULL) continue;
            const Item it = make_item(q, q_row, q_head, kv, tables, ctx, out, out_row, kvh, G, D, nblocks, bs,
                                      max_blocks, window, sinks, i);
#ifdef HAVE_AVX2
            if (D % 8 == 0) {
                /* A static schedule hands each thread a contiguous run of items: the next one
                 * is usually this thread's (at the run's end it is the other's; harmless). */
                const Item next = i + 1 < items ? make_item(q, q_row, q_head, kv, tables, ctx, out, out_row, kvh,
                                                            G, D, nblocks, bs, max_blocks, window, sinks, i + 1)
                                                : it;
                Ahead ahead;
                ahead_init(&ahead, i + 1 < items ? &next : NULL, bs, D, 2 * (it.L - it.start));
                attend_one_avx2(&it, G, D, bs, scale, scores, &ahead);
                continue;
            }
#endif
            attend_one_portable(&it, G, D, bs, scale, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The step's keys and values into their slots of one layer's pool ``[2 * kvh, nslots, D]``:
 * row t's head h goes to slot ``slots[t]``, read from ``k + t * k_row + h * k_head`` (values
 * likewise), so keys and values can come straight from a fused QKV projection. Returns 0, or
 * -1 (nothing written) when a slot is out of range. */
int write_kv_f32(const float *k, int64_t k_row, int64_t k_head, const float *v, int64_t v_row, int64_t v_head,
                 const int64_t *slots, int64_t T, int64_t kvh, int64_t D, int64_t nslots, void *pool_) {
    float *pool = (float *)pool_;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= nslots) return -1;
    const size_t bytes = sizeof(float) * (size_t)D;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < kvh; h++) {
            memcpy(pool + (h * nslots + slots[t]) * D, k + t * k_row + h * k_head, bytes);
            memcpy(pool + ((kvh + h) * nslots + slots[t]) * D, v + t * v_row + h * v_head, bytes);
        }
    return 0;
}
