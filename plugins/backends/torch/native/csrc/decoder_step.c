/* A whole decode step of a Llama-style decoder in one call: every layer's norm, fused QKV
 * projection, the per-head query and key norms (Qwen3, Gemma 3; where the layer has them), RoPE, KV write, paged attention, output projection, norm, gate-and-up, SiLU-mul
 * and down projection, then the final norm.
 *
 * The per-layer work is the same kernels the fused forward calls from Python one by one
 * (packed_linear.c, elementwise.c, paged_decode.c), passed in as function pointers and called
 * in the same order with the same arguments, so the result is bit for bit the same. What goes
 * away is the Python between them: ~12 calls per layer, each a ctypes round trip that must
 * take the GIL back, and inside the server the GIL is often busy streaming tokens.
 *
 * Built at run time by ``cpu_kernels.py`` (gcc -O3 -march=native -fopenmp).
 */
#include <stdint.h>
#include <stddef.h>

typedef void (*linear_fn)(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t N,
                          int64_t K, int nthreads);
typedef void (*norm_fn)(float *h, const float *delta, const float *w, float *out, int64_t T, int64_t D, float eps,
                        int nthreads);
typedef void (*silu_fn)(const float *gu, float *out, int64_t T, int64_t I, int nthreads);
typedef void (*head_norm_fn)(float *x, const float *qw, const float *kw, int64_t T, int64_t heads,
                             int64_t kv_heads, int64_t D, int64_t ld, float eps, int nthreads);
typedef void (*rope_fn)(float *x, const float *cos, const float *sin, int64_t T, int64_t heads, int64_t D,
                        int64_t ld, int nthreads);
typedef int (*write_kv_fn)(const float *k, int64_t k_row, int64_t k_head, const float *v, int64_t v_row,
                           int64_t v_head, const int64_t *slots, int64_t T, int64_t kvh, int64_t D, int64_t nslots,
                           void *pool);
typedef int (*decode_fn)(const float *q, int64_t q_row, int64_t q_head, const void *kv, const int64_t *tables,
                         const int64_t *ctx, float *out, int64_t out_row, int64_t nd, int64_t H, int64_t kvh,
                         int64_t D, int64_t nblocks, int64_t bs, int64_t max_blocks, float scale, int64_t window,
                         const float *sinks, int nthreads);

typedef struct {
    norm_fn norm;
    silu_fn silu;
    rope_fn rope;
    write_kv_fn write_kv;
    decode_fn decode;
    head_norm_fn head_norm;
    silu_fn gelu; /* gelu_tanh_mul_f32: the same signature as silu_mul_f32 */
} Kernels;

/* One layer: packed weights (see packed_linear.c) with the kernel that reads each one's format
 * (packed_linear_f32 or packed_linear_q4), biases or NULL, norm weights (q_norm/k_norm [D] or
 * NULL; post_attn/post_mlp: Gemma's norms of the attention's and the MLP's outputs, or NULL),
 * the gate's activation (0: SiLU, 1: GELU tanh), which RoPE table it reads, and the layer's KV
 * pool ``[2 * kvh, nblocks, bs, D]`` (fp32, or int8 rows read by the _q8 attention kernels). */
typedef struct {
    const float *qkv, *qkv_bias, *o, *o_bias, *gu, *gu_bias, *down, *down_bias;
    const float *ln1, *ln2, *q_norm, *k_norm, *post_attn, *post_mlp;
    void *pool;
    linear_fn qkv_fn, o_fn, gu_fn, down_fn;
    float eps1, eps2, qk_eps, post_eps, scale;
    int64_t window; /* 0: none */
    int64_t act, rope;
} Layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    const float *norm_w;
    float norm_eps;
} Model;

/* Scratch for one step of T rows; each buffer is written before it is read. */
typedef struct {
    float *x;     /* [T, hidden]: a norm's output */
    float *qkv;   /* [T, (H + 2 kvh) D] */
    float *attn;  /* [T, H D] */
    float *o;     /* [T, hidden] */
    float *gu;    /* [T, 2 I] */
    float *act;   /* [T, I] */
    float *delta; /* [T, hidden]: what the MLP adds to the residual stream */
} Work;

/* ``h [T, hidden]``: the embedded tokens, used as the residual stream (updated in place);
 * ``out [T, hidden]``: the final normed hidden states. ``cos``/``sin [kinds, T, D]`` (a
 * layer reads table ``rope``), ``slots [T]``,
 * ``tables [T * max_blocks]`` and ``ctx [T]`` as for the kernels. Returns 0; -1 when a slot
 * is outside the pool (layers before it were run), -2 when attention could not allocate its
 * scratch memory. */
int decoder_step_f32(const Kernels *k, const Model *m, const Layer *layers, const Work *w, float *h, float *out,
                     int64_t T, const float *cos, const float *sin, const int64_t *slots, const int64_t *tables,
                     const int64_t *ctx, int64_t max_blocks, int64_t nblocks, int64_t bs, int nthreads) {
    const int64_t H = m->heads, kvh = m->kv_heads, D = m->head_dim, hid = m->hidden, I = m->inter;
    const int64_t width = (H + 2 * kvh) * D, nslots = nblocks * bs;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const Layer *L = layers + l;
        k->norm(h, l ? w->delta : NULL, L->ln1, w->x, T, hid, L->eps1, nthreads);
        L->qkv_fn(w->x, L->qkv, L->qkv_bias, w->qkv, T, width, hid, nthreads);
        if (L->q_norm) k->head_norm(w->qkv, L->q_norm, L->k_norm, T, H, kvh, D, width, L->qk_eps, nthreads);
        const int64_t table = L->rope * T * D;
        k->rope(w->qkv, cos + table, sin + table, T, H + kvh, D, width, nthreads); /* queries, keys side by side */
        if (k->write_kv(w->qkv + H * D, width, D, w->qkv + (H + kvh) * D, width, D, slots, T, kvh, D, nslots,
                        L->pool) != 0)
            return -1;
        if (k->decode(w->qkv, width, D, L->pool, tables, ctx, w->attn, H * D, T, H, kvh, D, nblocks, bs, max_blocks,
                      L->scale, L->window, NULL, nthreads) != 0) /* no attention sinks on this path */
            return -2;
        L->o_fn(w->attn, L->o, L->o_bias, w->o, T, hid, H * D, nthreads);
        if (L->post_attn) k->norm(w->o, NULL, L->post_attn, w->o, T, hid, L->post_eps, nthreads); /* in place */
        k->norm(h, w->o, L->ln2, w->x, T, hid, L->eps2, nthreads);
        L->gu_fn(w->x, L->gu, L->gu_bias, w->gu, T, 2 * I, hid, nthreads);
        (L->act ? k->gelu : k->silu)(w->gu, w->act, T, I, nthreads);
        L->down_fn(w->act, L->down, L->down_bias, w->delta, T, hid, I, nthreads);
        if (L->post_mlp) k->norm(w->delta, NULL, L->post_mlp, w->delta, T, hid, L->post_eps, nthreads);
    }
    k->norm(h, m->num_layers ? w->delta : NULL, m->norm_w, out, T, hid, m->norm_eps, nthreads);
    return 0;
}
