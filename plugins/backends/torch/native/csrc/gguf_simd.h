/* Small SIMD helpers of the GGUF kernels (included by gguf_linear.c only; the kernel cache key
 * covers every header in csrc/): fp16 scalar loads, byte widening, prefetching the next rows
 * into L2 and an 8 x 8 fp32 transpose. */
#ifndef LLMSERVE_GGUF_SIMD_H
#define LLMSERVE_GGUF_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256 cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }

#ifdef __AVX512F__
static inline __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* The lines of the next rows' bytes at ``off`` (one chunk's worth), into L2: a decode step
 * streams every weight byte from DRAM once, and the next rows (often not adjacent: other
 * parts, permuted rows) are fetched while this pass computes. (Into L1 they held the few line
 * fill buffers the demand loads need: Q8_0 times 8 rows streamed 12.6 GB/s that way, 14.1 now.) */
static inline __attribute__((always_inline)) void prefetch_rows(const int R, const uint8_t *const *pf, int64_t off,
                                                               int64_t step) {
    for (int r = 0; r < R; r++) {
        _mm_prefetch((const char *)(pf[r] + off), _MM_HINT_T1);
        if (step > 64) _mm_prefetch((const char *)(pf[r] + off + 64), _MM_HINT_T1);
    }
}

/* Every line of the R rows' bytes pf[r] + off .. + n - 1 (a super-block of the next rows), into
 * L2: a K-quant kernel reads whole super-blocks, and a line it did not ask for stalls it on DRAM. */
static inline __attribute__((always_inline)) void prefetch_span(const int R, const uint8_t *const *pf, int64_t off,
                                                               int64_t n) {
    for (int r = 0; r < R; r++) {
        const uintptr_t end = (uintptr_t)(pf[r] + off + n);
        for (uintptr_t a = (uintptr_t)(pf[r] + off) & ~(uintptr_t)63; a < end; a += 64)
            _mm_prefetch((const char *)a, _MM_HINT_T1);
    }
}

/* The 8 x 8 block at src (row stride ls) transposed into dst (row stride ld). */
static inline void transpose8(const float *src, int64_t ls, float *dst, int64_t ld) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ls);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}

#endif
