/* The opt-in bf16 path of the GGUF linear (gguf_linear_amx, gguf_amx_ready; not bit-identical
 * to the fp32 paths). Included once, at the end of gguf_linear.c: it falls back to that file's
 * gguf_linear_f32 and few-row direct_unit (the kernel cache key covers every header in csrc/).
 * Without AMX-BF16 both entries are stubs.
 *
 * Many rows on AMX tiles:
 * Each activation is carried as two bf16, x_hi = bf16(x) and x_lo = bf16(x - x_hi) (about 16
 * significant bits), each weight is rebuilt exactly (dq32x) and rounded to bf16 (nearest even),
 * and the tile unit (TDPBF16PS) multiplies and accumulates in fp32: y = (x_hi + x_lo) @ bf16(W)^T.
 * Past SPLIT_ROWS rows (prefill) the weights are split the same way and the third product
 * W_lo x_hi is added: y = x @ W^T to about 2^-16 relative per product, close to the fp32 path,
 * where the panel's extra rebuild is shared by many rows. Decode batches keep the one rounding
 * (of the weight), whose lo panel would cost them about 40%. Rounding x as well cost twice the
 * error (SmolLM2 Q8_0, 20 batched prompts: 16 identical greedy continuations; now 20).
 * Per thread, 16 output rows are rebuilt once into a bf16 panel [K / 32][16][32] (L2) that
 * every 16 rows of x then multiply: the panel is the A operand (rows = outputs, row-major, as
 * rebuilt), x is packed once per call as the B operand (pairs of k interleaved by row), so C
 * holds [16 outputs][16 rows of x] and is transposed on the way out. Up to four rows of x (DMAX) take the few-row path below instead
 * (the panel would not pay for itself); K not a multiple of 32, or a kernel that refuses the
 * tile state: the exact fp32 kernel (gguf_linear_f32). */
#ifndef LLMSERVE_GGUF_AMX_H
#define LLMSERVE_GGUF_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define XT 16 /* rows of x per tile */
#define CT 4  /* C tiles held at once: 64 rows of x per pass over a panel */
#define SPLIT_ROWS 32 /* more rows of x than this (prefill): the weights as two bf16 as well */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int g_amx = 0; /* 0 not asked yet, 1 granted, -1 refused */

/* 32 floats (a0: the first 16, a1: the next) as bf16 words, and with lo, in *lo the bf16 of
 * what that rounding left out: hi + lo carries a to about 16 significant bits. */
static inline __m512i split_bf16(__m512 a0, __m512 a1, __m512i *lo) {
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(a1, a0);
    if (lo) {
        const __m512 h0 = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(h));
        const __m512 h1 = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(h, 1));
        *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(a1, h1), _mm512_sub_ps(a0, h0));
    }
    return h;
}

/* 32 rebuilt weights (w0: the first 16) into the panel at off as bf16, and with plo, the bf16 of
 * their remainders into plo at off (computed only then: decode batches have no plo). */
static inline void store_bf16(uint16_t *panel, uint16_t *plo, int64_t off, __m512 w0, __m512 w1) {
    __m512i l;
    _mm512_store_si512((__m512i *)(panel + off), split_bf16(w0, w1, plo ? &l : NULL));
    if (plo) _mm512_store_si512((__m512i *)(plo + off), l);
}

/* Ask Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process).
 * Returns 1 when the tiles may be used. */
int gguf_amx_ready(void) {
    if (g_amx == 0) g_amx = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return g_amx == 1;
}

/* x [M, K] as B tiles, twice: tile (t, c) holds rows 16t .. 16t + 15 and k 32c .. 32c + 31 as
 * [16 pairs][16 rows][2] bf16 (512 values), rows past M zero; xb holds bf16(x), xlo the bf16 of
 * the remainder x - bf16(x) in the same layout. */
static void pack_x_bf16(const float *x, int64_t M, int64_t K, uint16_t *xb, uint16_t *xlo, int nthreads) {
    const int64_t nch = K / CK, ntile = (M + XT - 1) / XT;
    const __m512i pairs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(XT));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K > 65536)
    for (int64_t tc = 0; tc < ntile * nch; tc++) {
        const int64_t t = tc / nch, c = tc % nch;
        int32_t *tile = (int32_t *)(xb + tc * 512);
        for (int m = 0; m < XT; m++) {
            const int64_t row = t * XT + m;
            __m512i v = _mm512_setzero_si512(), l = v;
            if (row < M) {
                const float *p = x + row * K + c * CK;
                v = split_bf16(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16), &l);
            }
            _mm512_i32scatter_epi32(tile + m, pairs, v, 4); /* pair p of this row -> dword 16 p + m */
            _mm512_i32scatter_epi32((int32_t *)(xlo + tc * 512) + m, pairs, l, 4);
        }
    }
}

/* The 16 stored rows rw as the bf16 panel [K / 32][16][32]. */
static inline __attribute__((always_inline)) void panel_bf16(const int type, const uint8_t *const *rw, int64_t K,
                                                            uint16_t *panel, uint16_t *plo, const uint8_t *const *pf,
                                                            int64_t pfstep) {
    const int64_t full = K / CK;
    float f[NR][16];
#define BF16_CHUNK(c, ph)                                                                                      \
    {                                                                                                          \
        CHUNK_PROLOGUE(NR, c) \
        for (int r = 0; r < NR; r++) {                                                                         \
            __m512 w[2];                                                                                       \
            dq32x(type, ph, rw[r], c, f[r], w);                                                                \
            store_bf16(panel, plo, ((c) * NR + r) * CK, w[0], w[1]);                                           \
        }                                                                                                      \
    }
    FOR_CHUNKS(full, BF16_CHUNK);
#undef BF16_CHUNK
}

/* panel_bf16 for Q4_K, by lookup: a sub-block's 16 possible weights (d * sc) * q - dmin * m,
 * q = 0..15, are computed once (the same FMS as dq32x) and rounded to bf16, and its 32 codes
 * pick theirs with one permute: the same bits as panel_bf16, in about half the instructions. */
static inline void panel_q4k_bf16(const uint8_t *const *rw, int64_t K, uint16_t *panel, uint16_t *plo,
                                  const uint8_t *const *pf) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float f[16];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        for (int r = 0; r < NR; r++) {
            if (pf) prefetch_span(1, pf + r, sb * 144, 144); /* spread over the rows: a burst of 48 would queue */
            kprep(T_Q4_K, rw[r], 8 * sb, f);
            __asm__ volatile("" ::: "memory"); /* read the factors back as broadcast loads, not lane shuffles */
            const uint8_t *qs = rw[r] + sb * 144 + 16;
            for (int g = 0; g < 4; g++) {
                /* both sub-blocks' tables in one register: words 0-15 sub-block 2g + 1 (high
                 * nibbles, index q), words 16-31 sub-block 2g (low nibbles, index q | 16) */
                __m512i tl;
                const __m512i t = split_bf16(_mm512_fmsub_ps(iota, _mm512_set1_ps(f[2 * g + 1]), _mm512_set1_ps(f[9 + 2 * g])),
                                             _mm512_fmsub_ps(iota, _mm512_set1_ps(f[2 * g]), _mm512_set1_ps(f[8 + 2 * g])),
                                             plo ? &tl : NULL);
                const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * g)));
                const __m512i lo = _mm512_ternarylogic_epi32(codes, _mm512_set1_epi16(15), _mm512_set1_epi16(16), 0xEA);
                const int64_t c = 8 * sb + 2 * g;
                _mm512_store_si512((__m512i *)(panel + (c * NR + r) * CK), _mm512_permutexvar_epi16(lo, t));
                _mm512_store_si512((__m512i *)(panel + ((c + 1) * NR + r) * CK),
                                   _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), t));
                if (plo) {
                    _mm512_store_si512((__m512i *)(plo + (c * NR + r) * CK), _mm512_permutexvar_epi16(lo, tl));
                    _mm512_store_si512((__m512i *)(plo + ((c + 1) * NR + r) * CK),
                                       _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), tl));
                }
            }
        }
    }
}

static __thread uint16_t *g_xb = NULL, *g_panel = NULL;
static __thread int64_t g_xb_len = 0, g_panel_len = 0;

static uint16_t *grow(uint16_t **buf, int64_t *len, int64_t need) {
    if (*len < need) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)((need * 2 + 63) / 64 * 64));
        *len = *buf ? need : 0;
    }
    return *buf;
}

/* ---- few rows under the same option: Q4_K and Q6_K from their codes with AVX512-BF16 dot products ----
 * A Q4_K weight is (d * sc_j) * q - dmin * m_j with q in 0..15, so sum_i w_i x_i =
 * D_j * sum_i q_i x_i - Mn_j * sum_i x_i per sub-block j of 32. A code under 128 OR-ed into the
 * mantissa of bf16 128.0 is the bf16 of 128 + q, exactly, in one bit operation (no table, no
 * fp32 rebuild); VDPBF16PS forms sum_i (128 + q_i) bf16(x_i), one FMA scales it by D_j, and the
 * offset's 128 D_j sum_i x_i joins the mins' term (the sums of the bf16 x, formed once). So these
 * products take exact weights and bf16 activations; the rebuild that bounds the fp32 kernel at
 * one to four rows is gone. Q6_K likewise ((d sc) (q - 32) per 16: 128 + q, offset 160;
 * dot_q6k_bf16); other types keep the exact fp32 kernel. (The offset costs a few low bits of
 * the fp32 sums, far under the bf16 rounding of x.) */

#define CODE_OFFSET 0x4300 /* bf16 128.0: OR-ing a code under 128 into it gives 128 + code */

/* sums[m * GR + r] = bf16(x row m) . Q4_K row r, R rows at once (R, M compile-time constants).
 * xb: bf16 x [M][K]; xs: per 32 of x the sum of its bf16 values, [M][K / 32]. */
static inline __attribute__((always_inline)) void dot_q4k_bf16(const int R, const int M, const uint8_t *const *rw,
                                                              const uint16_t *xb, const float *xs, int64_t K,
                                                              float *sums, const uint8_t *const *pf) {
    const __m512i off = _mm512_set1_epi16(CODE_OFFSET), f15 = _mm512_set1_epi16(15);
    __m512 acc[GR][DMAX]; /* lanes are summed at the end: the mins' term goes to lanes 0-7 */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    float f[GR][16];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        for (int r = 0; r < R; r++) { /* the mins' factors take the offset's too: Mn_j + 128 D_j */
            kprep(T_Q4_K, rw[r], sb * 8, f[r]);
            _mm256_storeu_ps(f[r] + 8, _mm256_fmadd_ps(_mm256_loadu_ps(f[r]), _mm256_set1_ps(128.0f),
                                                       _mm256_loadu_ps(f[r] + 8)));
        }
        if (pf) prefetch_span(R, pf, sb * 144, 144);
        for (int g = 0; g < 4; g++)
            for (int r = 0; r < R; r++) {
                const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rw[r] + sb * 144 + 16 + 32 * g)));
                const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(words, f15, off, 0xEA); /* (w & 15) | off */
                const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), off);
                const __m512 d0 = _mm512_set1_ps(f[r][2 * g]), d1 = _mm512_set1_ps(f[r][2 * g + 1]);
                for (int m = 0; m < M; m++) {
                    const uint16_t *xp = xb + m * K + sb * 256 + 64 * g;
                    const __m512 s0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xp));
                    const __m512 s1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), hi, (__m512bh)_mm512_loadu_si512(xp + 32));
                    acc[r][m] = _mm512_fmadd_ps(s1, d1, _mm512_fmadd_ps(s0, d0, acc[r][m]));
                }
            }
        for (int r = 0; r < R; r++)
            for (int m = 0; m < M; m++)
                acc[r][m] = _mm512_fnmadd_ps(_mm512_zextps256_ps512(_mm256_loadu_ps(f[r] + 8)),
                                             _mm512_zextps256_ps512(_mm256_loadu_ps(xs + m * (K / CK) + sb * 8)),
                                             acc[r][m]);
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sums[m * GR + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* The six-bit codes of half h (weights 128 h .. 128 h + 127) of the Q6_K super-block at b, in
 * 16-bit lanes, 32 weights per register: weight 128 h + r takes its low four bits from byte
 * 64 h + r % 64 (shifted by 4 (r / 64)) and its high two from byte 128 + 32 h + r % 32 (shifted
 * by 2 (r / 32)). Every lane carries offset as well: CODE_OFFSET makes it bf16(128 + q), 0 leaves q. */
static inline void q6k_codes(const uint8_t *b, int h, __m512i q[4], int offset) {
    const __m512i f15 = _mm512_set1_epi16(15), hmask = _mm512_set1_epi16(0x30), off = _mm512_set1_epi16(offset);
    const __m512i A = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h)));
    const __m512i B = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)));
    const __m512i H = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
    /* low | (high bits & 0x30): ternary logic a | (b & c); the low bits come OR-ed with offset:
     * (a & b) | c, or for the high nibbles a plain OR (a shifted byte has nothing above bit 3) */
    q[0] = _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(A, f15, off, 0xEA), _mm512_slli_epi16(H, 4), hmask, 0xF8);
    q[1] = _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(B, f15, off, 0xEA), _mm512_slli_epi16(H, 2), hmask, 0xF8);
    q[2] = _mm512_ternarylogic_epi32(_mm512_or_si512(_mm512_srli_epi16(A, 4), off), H, hmask, 0xF8);
    q[3] = _mm512_ternarylogic_epi32(_mm512_or_si512(_mm512_srli_epi16(B, 4), off), _mm512_srli_epi16(H, 2), hmask, 0xF8);
}

/* As dot_q4k_bf16 for Q6_K: w = (d * sc_i) * (q - 32) per 16, so each 32 weights are one dot
 * product of their codes as bf16(128 + q) (q6k_codes) with bf16(x), lanes 0-7 scaled by the
 * first 16's factor and lanes 8-15 by the second's; per super-block 160 (d * sc_i) times the
 * sums of x per 16 (xs16: [M][K / 16]) come off, lane i for group i (the lanes are summed at
 * the end, so any lane may carry any term). */
static inline __attribute__((always_inline)) void dot_q6k_bf16(const int R, const int M, const uint8_t *const *rw,
                                                              const uint16_t *xb, const float *xs16, int64_t K,
                                                              float *sums, const uint8_t *const *pf) {
    __m512i lanes[4];
    for (int c = 0; c < 4; c++) /* factor index of each dot-product lane, chunk c of a half */
        lanes[c] = _mm512_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1,
                                     2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1);
    __m512 acc[GR][DMAX];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    float f[GR][16];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        for (int r = 0; r < R; r++) kprep(T_Q6_K, rw[r], sb * 8, f[r]);
        if (pf) prefetch_span(R, pf, sb * 210, 210);
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) {
                __m512i q[4];
                q6k_codes(rw[r] + sb * 210, h, q, CODE_OFFSET);
                const __m512 fv = _mm512_loadu_ps(f[r]);
                if (h == 0) { /* here, not beside kprep: there one row ran 27 G weights/s, not 32 */
                    const __m512 f160 = _mm512_mul_ps(fv, _mm512_set1_ps(160.0f));
                    for (int m = 0; m < M; m++)
                        acc[r][m] = _mm512_fnmadd_ps(f160, _mm512_loadu_ps(xs16 + m * (K / 16) + sb * 16), acc[r][m]);
                }
                for (int c = 0; c < 4; c++) {
                    const __m512bh v = (__m512bh)q[c];
                    const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(lanes[c], _mm512_set1_epi32(8 * h)), fv);
                    for (int m = 0; m < M; m++) {
                        const uint16_t *xp = xb + m * K + sb * 256 + 128 * h + 32 * c;
                        const __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), v, (__m512bh)_mm512_loadu_si512(xp));
                        acc[r][m] = _mm512_fmadd_ps(d, scale, acc[r][m]);
                    }
                }
            }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sums[m * GR + r] = _mm512_reduce_add_ps(acc[r][m]);
}

static __thread uint16_t *g_xfew = NULL;
static __thread int64_t g_xfew_len = 0;
static uint16_t *grow(uint16_t **buf, int64_t *len, int64_t need);

/* Up to DMAX rows of x: Q4_K and Q6_K parts from their codes, every other part exactly. */
static void linear_few_bf16(const float *x, const Desc *desc, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int nthreads) {
    int codes = 0; /* any part read from its codes */
    for (int64_t s = 0; s < desc->nseg; s++) codes |= desc->seg[s].type == T_Q4_K || desc->seg[s].type == T_Q6_K;
    uint16_t *xb = codes ? grow(&g_xfew, &g_xfew_len, M * K + 6 * M * (K / CK) + 2) : NULL;
    if (!xb) {
        gguf_linear_f32(x, desc, bias, y, M, N, K, nthreads);
        return;
    }
    /* after the bf16 rows, 4-byte aligned: the sums of the bf16 values per 32 (Q4_K), per 16 (Q6_K) */
    float *xs = (float *)(xb + M * K + (M * K) % 2), *xs16 = xs + M * (K / CK);
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < K / CK; c++) {
            const float *p = x + m * K + c * CK;
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
            _mm512_storeu_si512(xb + m * K + c * CK, (__m512i)v);
            /* widened back to fp32 (exact): the first 16 and the next, then added */
            const __m512 a = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)v));
            const __m512 b = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)v, 1));
            const float sa = _mm512_reduce_add_ps(a), sb = _mm512_reduce_add_ps(b);
            xs16[m * (K / 16) + 2 * c] = sa;
            xs16[m * (K / 16) + 2 * c + 1] = sb;
            xs[m * (K / CK) + c] = sa + sb;
        }
    const int64_t total = unit_count(desc, GR);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 16)
    for (int64_t u = 0; u < total; u++) {
        int64_t col, cnt;
        const Seg *sg;
        const uint8_t *rw[GR], *next[GR];
        const uint8_t *const *pf = unit_rows(desc, u, GR, rw, next, &sg, &col, &cnt, NULL);
        const float *b = bias ? bias + col : NULL;
        if (sg->type != T_Q4_K && sg->type != T_Q6_K) {
            const int64_t pfstep = (sg->stride + K / CK - 1) / (K / CK);
#define DIRECT_UNIT(T) direct_unit(T, rw, (int)cnt, x, M, K, b, y + col, N, pf, pfstep)
            DISPATCH(sg->type, DIRECT_UNIT)
#undef DIRECT_UNIT
            continue;
        }
        float sums[DMAX * GR];
        if (sg->type == T_Q4_K) {
            switch (M) {
            case 1: dot_q4k_bf16(GR, 1, rw, xb, xs, K, sums, pf); break;
            case 2: dot_q4k_bf16(GR, 2, rw, xb, xs, K, sums, pf); break;
            case 3: dot_q4k_bf16(GR, 3, rw, xb, xs, K, sums, pf); break;
            default: dot_q4k_bf16(GR, 4, rw, xb, xs, K, sums, pf); break;
            }
        } else {
            switch (M) {
            case 1: dot_q6k_bf16(GR, 1, rw, xb, xs16, K, sums, pf); break;
            case 2: dot_q6k_bf16(GR, 2, rw, xb, xs16, K, sums, pf); break;
            case 3: dot_q6k_bf16(GR, 3, rw, xb, xs16, K, sums, pf); break;
            default: dot_q6k_bf16(GR, 4, rw, xb, xs16, K, sums, pf); break;
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < cnt; r++) y[m * N + col + r] = sums[m * GR + r] + (b ? b[r] : 0.0f);
    }
}

/* panel_bf16 for Q6_K: the six-bit codes assembled 32 at a time in 16-bit lanes (as
 * dot_q6k_bf16 does), then (d * sc) * (q - 32) in fp32 per 16 and rounded to bf16: the same
 * bits as panel_bf16 (the product is exact: at most 24 significant bits), with the bit
 * gathering done once per 32 weights instead of per 8. */
static inline void panel_q6k_bf16(const uint8_t *const *rw, int64_t K, uint16_t *panel, uint16_t *plo,
                                  const uint8_t *const *pf) {
    const __m512i b32 = _mm512_set1_epi16(32);
    float f[16];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        for (int r = 0; r < NR; r++) {
            if (pf) prefetch_span(1, pf + r, sb * 210, 210);
            kprep(T_Q6_K, rw[r], 8 * sb, f);
            const uint8_t *b = rw[r] + sb * 210;
            for (int h = 0; h < 2; h++) {
                __m512i q[4];
                q6k_codes(b, h, q, 0);
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_sub_epi16(q[c], b32);
                    const int i = 8 * h + 2 * c; /* the factor of weights 0-15 of this chunk; i + 1: 16-31 */
                    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v))),
                                                    _mm512_set1_ps(f[i]));
                    const __m512 hi = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1))), _mm512_set1_ps(f[i + 1]));
                    const int64_t ch = 8 * sb + 4 * h + c;
                    store_bf16(panel, plo, (ch * NR + r) * CK, lo, hi);
                }
            }
        }
    }
}


/* The 16 rows' weights k0 .. k0 + kn - 1 (k0 a multiple of 256, or 0) as a bf16 panel,
 * prefetching the rows pf from their weight pk on (as far as the panel reaches). */
static inline void rebuild(int64_t type, const uint8_t *const *rw, int64_t k0, int64_t kn, uint16_t *panel,
                           uint16_t *plo, const uint8_t *const *pf, int64_t pk, int64_t pfstep) {
    const uint8_t *r2[NR], *p2[NR];
    const int64_t off = k0 / 256 * bytes256(type), poff = pk / 256 * bytes256(type);
    for (int r = 0; r < NR; r++) {
        r2[r] = rw[r] + off;
        p2[r] = pf ? pf[r] + poff : NULL;
    }
    const uint8_t *const *pp = pf ? p2 : NULL;
#define PANEL(T) panel_bf16(T, r2, kn, panel, plo, pp, pfstep)
    if (type == T_Q4_K)
        panel_q4k_bf16(r2, kn, panel, plo, pp);
    else if (type == T_Q6_K)
        panel_q6k_bf16(r2, kn, panel, plo, pp);
    else
        DISPATCH(type, PANEL)
#undef PANEL
}

#define TLOAD(t, p) _tile_loadd(t, (p), 64)
#define DP(c, a, b) _tile_dpbf16ps(c, a, b)

/* C tiles += panel chunks 0 .. n - 1 (A: tile 4; the weights' remainders, plo, tile 6) times
 * chunks c0 .. c0 + n - 1 of x tiles t0 .. t0 + nt - 1 and of their remainders (B: tiles 5
 * and 7, x's remainders xlo further on). A product into a C tile waits for the one before it
 * into that tile (a latency of about three products' issue), so consecutive products go to
 * different C tiles: one tile of x spreads its products over all four C tiles by chunk, two
 * put x's and its remainder's into their own tiles, three or four go round them pass by pass.
 * amx_store sums them back. */
static inline __attribute__((always_inline)) void amx_run(const uint16_t *panel, const uint16_t *plo,
                                                         const uint16_t *xb, int64_t xlo, int64_t nch, int64_t t0,
                                                         int64_t c0, int64_t n, int nt) {
    const int64_t xs = nch * 512; /* from one tile of x to the next */
    for (int64_t i = 0; i < n; i++) {
        const int64_t c = c0 + i;
        const uint16_t *b = xb + (t0 * nch + c) * 512;
        TLOAD(4, panel + i * NR * CK);
        if (plo) TLOAD(6, plo + i * NR * CK);
        if (nt == 1) {
            TLOAD(5, b);
            TLOAD(7, b + xlo);
            switch (c & 3) { /* x -> C[c], its remainder -> C[c + 2], the weights' -> C[c + 1] */
#define ONE(k0, k1, k2)                      \
    DP(k0, 4, 5);                            \
    DP(k1, 4, 7);                            \
    if (plo) DP(k2, 6, 5);                   \
    break;
            case 0: ONE(0, 2, 1)
            case 1: ONE(1, 3, 2)
            case 2: ONE(2, 0, 3)
            default: ONE(3, 1, 0)
#undef ONE
            }
        } else if (nt == 2) { /* x -> C0, C1; remainders -> C2, C3 */
            TLOAD(5, b);
            DP(0, 4, 5);
            TLOAD(7, b + xs);
            DP(1, 4, 7);
            if (plo) {
                DP(2, 6, 5);
                DP(3, 6, 7);
            }
            TLOAD(5, b + xlo);
            DP(2, 4, 5);
            TLOAD(7, b + xs + xlo);
            DP(3, 4, 7);
        } else { /* C tile j for x tile j; a pass each for x, its remainder, the weights' */
#define PASS(a, off)                          \
    TLOAD(5, b + (off));                      \
    DP(0, a, 5);                              \
    TLOAD(7, b + xs + (off));                 \
    DP(1, a, 7);                              \
    TLOAD(5, b + 2 * xs + (off));             \
    DP(2, a, 5);                              \
    if (nt > 3) {                             \
        TLOAD(7, b + 3 * xs + (off));         \
        DP(3, a, 7);                          \
    }
            PASS(4, 0)
            PASS(4, xlo)
            if (plo) { PASS(6, 0) }
#undef PASS
        }
    }
}

/* The C tiles of x tiles t0 .. t0 + nt - 1 into y (outputs col .. col + cnt - 1), plus bias,
 * summing the tiles that amx_run spread one tile's products over (all four for one tile of x,
 * j and j + 2 for two). */
static inline void amx_store(float (*cbuf)[NR * XT], int nt, int64_t t0, int64_t M, int64_t N, int64_t col,
                             int64_t cnt, const float *bias, float *y) {
    _tile_stored(0, cbuf[0], 64);
    _tile_stored(1, cbuf[1], 64);
    _tile_stored(2, cbuf[2], 64);
    _tile_stored(3, cbuf[3], 64);
    for (int j = 0; j < nt; j++) {
        const int64_t m0 = (t0 + j) * XT, mm = M - m0 < XT ? M - m0 : XT;
        for (int64_t m = 0; m < mm; m++)
            for (int64_t r = 0; r < cnt; r++) {
                float v = cbuf[j][r * XT + m];
                if (nt == 1) v += cbuf[1][r * XT + m] + cbuf[2][r * XT + m] + cbuf[3][r * XT + m];
                if (nt == 2) v += cbuf[j + 2][r * XT + m];
                y[(m0 + m) * N + col + r] = v + (bias ? bias[col + r] : 0.0f);
            }
    }
}

static inline void zero_tiles(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Same arguments as gguf_linear_f32. */
void gguf_linear_amx(const float *x, const void *wp, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int nthreads) {
    if (K % CK || g_amx != 1) {
        gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads);
        return;
    }
    if (M <= DMAX) { /* one direct pass: the tiles would not pay for the panel */
        linear_few_bf16(x, (const Desc *)wp, bias, y, M, N, K, nthreads);
        return;
    }
    const int64_t nch = K / CK, ntile = (M + XT - 1) / XT;
    const int wsplit = M > SPLIT_ROWS;
    const int64_t xlo = ntile * nch * 512; /* the remainders' tiles follow x's */
    uint16_t *xb = grow(&g_xb, &g_xb_len, 2 * xlo);
    if (!xb) {
        gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads);
        return;
    }
    pack_x_bf16(x, M, K, xb, xb + xlo, nthreads);
    const Desc *desc = (const Desc *)wp;
    const int64_t total = unit_count(desc, NR);
    /* Long prompts: x's tiles (2 KiB per tile and 32 k, remainders included) are taken about
     * 1 MiB at a time, which stays in L2 while every panel multiplies it (the weights are then
     * rebuilt once per block); all of them at once would stream from L3 for every 16 weight rows. */
    int64_t tb = (1 << 20) / (nch * 2048) / CT * CT;
    if (tb < CT || ntile <= CT) tb = CT;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) { /* C tiles 0..3 [16 outputs][16 rows] fp32, A 4, B 5 and 7: 16 x 64 bytes */
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        uint16_t *panel = grow(&g_panel, &g_panel_len, nch * NR * CK * (1 + wsplit));
        float cbuf[CT][NR * XT];
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t b0 = 0; b0 < ntile; b0 += tb) {
            const int64_t b1 = b0 + tb < ntile ? b0 + tb : ntile;
#pragma omp for schedule(dynamic, 4)
            for (int64_t u = 0; u < total; u++) {
                if (!panel) continue; /* out of memory in this thread: redone below */
                int64_t col, cnt;
                const Seg *sg;
                const uint8_t *rw[NR], *next[NR];
                const uint8_t *const *pf = unit_rows(desc, u, NR, rw, next, &sg, &col, &cnt, NULL);
                const int64_t pfstep = (sg->stride + nch - 1) / nch;
                if (ntile <= CT && K % 256 == 0) {
                    /* one pass over the rows (decode batches up to 64): rebuild 256 k at a time into
                     * an L1-sized panel and multiply it at once, instead of a round trip through L2 */
                    const int nt = (int)ntile;
                    zero_tiles();
                    uint16_t *plo = wsplit ? panel + 8 * NR * CK : NULL;
                    for (int64_t k0 = 0; k0 < K; k0 += 256) {
                        /* prefetch what comes next: these rows' next 256 k, else the next rows' first */
                        if (k0 + 256 < K)
                            rebuild(sg->type, rw, k0, 256, panel, plo, rw, k0 + 256, pfstep);
                        else
                            rebuild(sg->type, rw, k0, 256, panel, plo, pf, 0, pfstep);
                        amx_run(panel, plo, xb, xlo, nch, 0, k0 / CK, 8, nt);
                    }
                    amx_store(cbuf, nt, 0, M, N, col, cnt, bias, y);
                    continue;
                }
                uint16_t *plo = wsplit ? panel + nch * NR * CK : NULL;
                rebuild(sg->type, rw, 0, K, panel, plo, pf, 0, pfstep);
                for (int64_t t0 = b0; t0 < b1; t0 += CT) {
                    const int nt = (int)(b1 - t0 < CT ? b1 - t0 : CT);
                    zero_tiles();
                    amx_run(panel, plo, xb, xlo, nch, t0, 0, nch, nt);
                    amx_store(cbuf, nt, t0, M, N, col, cnt, bias, y);
                }
            }
        }
        _tile_release();
    }
    if (failed) gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads); /* a thread had no panel memory */
}
#else
int gguf_amx_ready(void) { return 0; }
void gguf_linear_amx(const float *x, const void *wp, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int nthreads) {
    gguf_linear_f32(x, wp, bias, y, M, N, K, nthreads);
}
#endif

#endif
