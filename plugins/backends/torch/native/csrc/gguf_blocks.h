/* GGUF block layouts and the weight descriptor, for gguf_linear.c (included by that file only;
 * the kernel cache key covers every header in csrc/): the served types' numbers and bytes per
 * 256 weights, the per-type switch that makes ``type`` a compile-time constant, and the segments
 * (parts of a fused projection, each its own type) that gguf_ops.py writes, cut into work units
 * of output rows. */
#ifndef LLMSERVE_GGUF_BLOCKS_H
#define LLMSERVE_GGUF_BLOCKS_H
#include <stdint.h>

/* gguf.GGMLQuantizationType values */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10,
       T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30,
       T_MXFP4 = 39 };

/* One part of the weight, as gguf_ops.py writes it: every field an int64. */
typedef struct {
    int64_t type, base, stride, n, rows; /* rows: address of int32 [n] or 0 */
} Seg;
typedef struct {
    int64_t nseg;
    Seg seg[];
} Desc;

static inline const uint8_t *seg_row(const Seg *s, int64_t n) {
    const int32_t *rows = (const int32_t *)(intptr_t)s->rows;
    return (const uint8_t *)(intptr_t)s->base + (rows ? (int64_t)rows[n] : n) * s->stride;
}

/* How many work units of ``unit`` output rows the parts make (a unit never spans two parts). */
static inline int64_t unit_count(const Desc *d, int64_t unit) {
    int64_t total = 0;
    for (int64_t s = 0; s < d->nseg; s++) total += (d->seg[s].n + unit - 1) / unit;
    return total;
}

/* Unit u's part, with its first output among all (*col), within the part (*n0), and how many
 * outputs it has (*cnt, up to unit). */
static inline const Seg *unit_of(const Desc *d, int64_t u, int64_t unit, int64_t *col, int64_t *n0, int64_t *cnt) {
    int64_t s = 0, left = u, c = 0;
    for (; s < d->nseg; s++) {
        const int64_t us = (d->seg[s].n + unit - 1) / unit;
        if (left < us) break;
        left -= us;
        c += d->seg[s].n;
    }
    const Seg *sg = &d->seg[s];
    *n0 = left * unit;
    *cnt = sg->n - *n0 < unit ? sg->n - *n0 : unit;
    *col = c + *n0;
    return sg;
}

/* Unit u's rows in rw (past the segment's end, its first row again) and the next unit's in
 * next; returns next, or NULL when the segment ends first (nothing there to prefetch). The
 * unit's first row in its part goes to *first where that is not NULL. */
static inline const uint8_t *const *unit_rows(const Desc *d, int64_t u, int64_t unit, const uint8_t **rw,
                                              const uint8_t **next, const Seg **sg, int64_t *col, int64_t *cnt,
                                              int64_t *first) {
    int64_t n0;
    *sg = unit_of(d, u, unit, col, &n0, cnt);
    if (first) *first = n0;
    for (int64_t r = 0; r < unit; r++) {
        rw[r] = seg_row(*sg, n0 + (r < *cnt ? r : 0));
        next[r] = seg_row(*sg, n0 + unit + r < (*sg)->n ? n0 + unit + r : (*sg)->n - 1);
    }
    return n0 + unit < (*sg)->n ? next : NULL;
}

/* The types in super-blocks of 256 weights with per-sub-block factors (kprep): the K-quants and IQ4_XS. */
static inline int is_k(int type) {
    return type == T_Q2_K || type == T_Q3_K || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K || type == T_IQ4_XS;
}

#define DISPATCH(type, CALL)                                                          \
    switch (type) {                                                                   \
    case T_F32: CALL(T_F32); break;                                                   \
    case T_F16: CALL(T_F16); break;                                                   \
    case T_BF16: CALL(T_BF16); break;                                                 \
    case T_Q8_0: CALL(T_Q8_0); break;                                                 \
    case T_Q4_0: CALL(T_Q4_0); break;                                                 \
    case T_Q4_1: CALL(T_Q4_1); break;                                                 \
    case T_Q5_0: CALL(T_Q5_0); break;                                                 \
    case T_Q5_1: CALL(T_Q5_1); break;                                                 \
    case T_Q4_K: CALL(T_Q4_K); break;                                                 \
    case T_Q5_K: CALL(T_Q5_K); break;                                                 \
    case T_Q6_K: CALL(T_Q6_K); break;                                                 \
    case T_Q2_K: CALL(T_Q2_K); break;                                                 \
    case T_Q3_K: CALL(T_Q3_K); break;                                                 \
    case T_IQ4_NL: CALL(T_IQ4_NL); break;                                             \
    case T_IQ4_XS: CALL(T_IQ4_XS); break;                                             \
    case T_MXFP4: CALL(T_MXFP4); break;                                               \
    default: break;                                                                   \
    }

static int supported(int64_t type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: case T_Q8_0: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1:
    case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_Q2_K: case T_Q3_K: case T_IQ4_NL: case T_IQ4_XS: case T_MXFP4:
        return 1;
    default: return 0;
    }
}

/* Bytes that 256 weights of a row take in ``type`` (every served type packs 256 evenly). */
static inline int64_t bytes256(int64_t type) {
    switch (type) {
    case T_F32: return 1024;
    case T_F16: case T_BF16: return 512;
    case T_Q8_0: return 272;
    case T_Q4_0: case T_Q4_K: return 144;
    case T_Q4_1: return 160;
    case T_Q5_0: case T_Q5_K: return 176;
    case T_Q5_1: return 192;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_IQ4_NL: return 144;
    case T_IQ4_XS: case T_MXFP4: return 136;
    default: return 210; /* Q6_K */
    }
}

#endif
