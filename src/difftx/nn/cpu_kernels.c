/* CPU kernels of difftx (difftx.nn.native compiles and loads this file): one pass per row or per
 * vector where torch would make several passes over whole tensors.
 *
 *   difftx_softmax_combine    fused attention forward: the causal triangle, softmax of each map
 *                             (float32 statistics) and the combined map P1 - lambda P2 (or P),
 *                             rounded once to the value product's dtype
 *   difftx_softmax_backward   dS = P (dP - rowsum(P dP)) per map, and the row sums (lambda's grad)
 *   difftx_rms_norm(_backward), difftx_swiglu(_backward), difftx_rope
 *   difftx_diff_decode        one decoding query of DIFF V1 over a KV cache, with the head norm
 *                             (also DIFF V2's, and softmax attention's: one map)
 *
 * Data are float32 or bfloat16 ("is_bf16"); every sum, exp and statistic is float32.
 *
 * Attention layouts (row-major, contiguous rows of `ke` keys):
 *   s, p, ds  (B, M, R, ke)   M maps (1 or 2), R = Hk * rep * C rows per map
 *   comb, dp  (B, R, ke)
 *   rs        (B, M, R) float32
 *   lam_rows  (B, R) float32 or NULL (then the scalar lam)
 * Causal (diag0 >= 0): row j is query diag0 + j % c and sees keys [0, diag0 + j % c]; the
 * keys past it get probability 0 (and are not read).  diag0 < 0: every key is visible
 * (masked logits are -inf and get probability exactly 0).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)h) << 16;
    return v.f;
}

/* float32 -> bfloat16 as torch rounds: to nearest even, and a NaN to a quiet NaN (here torch's 0x7FC0; the
 * vectors OR 0x7FC0 into the rounded bits, two operations cheaper).  Rounding a NaN's bits as a number
 * carries a payload of 0x7FFF8000 or more into the sign (all-ones 0xFFFFFFFF gives +0) and a signalling low
 * payload into infinity: a NaN must stay one. */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Vectors (GCC/Clang vector extensions) as wide as the machine's registers: 16 floats with
 * AVX-512, 8 with AVX/AVX2, 4 elsewhere (SSE, NEON).  A vector wider than the registers is not
 * split into register-wide halves for every operation: without AVX-512, GCC turns 16-lane
 * comparisons and conversions into scalar code (measured on an AVX2 AMD EPYC: the SwiGLU kernel
 * 5x slower than torch's, against 1.8x faster with 8 lanes). */
#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
#define LANES (VBYTES / 4)
typedef float vf __attribute__((vector_size(VBYTES), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VBYTES), aligned(4)));

/* Lanes of a (and b) picked by constant indices (b's lanes numbered after a's).  Clang (and GCC >= 12) have
 * __builtin_shufflevector; GCC before 12 only __builtin_shuffle, which takes the indices as a vector of
 * type T (of a's lane width). */
#if defined(__clang__)
#define SHUF1(a, T, ...) __builtin_shufflevector(a, a, __VA_ARGS__)
#define SHUF2(a, b, T, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF1(a, T, ...) __builtin_shuffle(a, (T){__VA_ARGS__})
#define SHUF2(a, b, T, ...) __builtin_shuffle(a, b, (T){__VA_ARGS__})
#endif
#define DIFFTX_LIST(...) __VA_ARGS__
/* Loops over a register block's rows, unrolled so that its accumulator arrays live in registers: GCC does so
 * where the row count is a constant (always_inline, a switch per count); Clang only when told. */
#if defined(__clang__)
#define DIFFTX_UNROLL _Pragma("clang loop unroll(full)")
#else
#define DIFFTX_UNROLL
#endif

/* exp(x) for x <= 0 (x - row max), LANES at a time: Cephes' expf polynomial, within 2 ulp;
 * exactly 0 below -87.3, so -inf (a masked logit) gives 0. */

static inline vf vexp_nonpos(vf x) {
    const vi under = x < -87.3f;
    vf xc = (vf)(((vi)x & ~under) | ((vi)((vf){0} - 87.3f) & under));
    vf t = xc * 1.44269504088896341f;
    vf n = (t + 12582912.0f) - 12582912.0f; /* round to nearest (|t| < 2^22) */
    vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * r * r + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    y = y * (vf)bits;
    return (vf)((vi)y & ~under);
}

typedef uint16_t vh __attribute__((vector_size(VBYTES / 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VBYTES), aligned(4)));

/* LANES 16-bit values at p, zero-extended to 32-bit lanes.  With AVX-512 through the intrinsic: GCC builds the
 * vector extensions' conversion from two 8-lane halves and an insert (5 instructions for 1). */
static inline vu vwiden_u16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#else
    return __builtin_convertvector(*(const vh *)p, vu);
#endif
}

/* LANES bfloat16 values as floats, and back (round to nearest even). */
static inline vf vload_bf16(const uint16_t *p) { return (vf)(vwiden_u16(p) << 16); }

static inline vu vbf16_bits(vf v) { /* f32_to_bf16 in 32-bit lanes; a NaN keeps exponent and quiet bit set */
    const vu x = (vu)v;
    return ((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16) | ((vu)(v != v) & 0x7FC0u);
}

static inline vh vround_bf16(vf v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    /* vcvtneps2bf16 rounds to nearest even as vbf16_bits does, but flushes subnormals to zero and quiets
     * NaNs its own way: a vector with either (vfpclassps) takes the integer path, so the bits are the same */
    if (__builtin_expect(!_mm512_fpclass_ps_mask((__m512)v, 0xA1), 1)) return (vh)_mm512_cvtneps_pbh((__m512)v);
#endif
    return __builtin_convertvector(vbf16_bits(v), vh);
}

static inline void vstore_bf16(uint16_t *p, vf v) { *(vh *)p = vround_bf16(v); }

#if defined(__AVX512BF16__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define DIFFTX_CVT_BF16 1 /* vcvtne2ps2bf16, where its bits are vbf16_bits' (see vround_bf16) */
static inline int vplain2(vf a, vf b) { /* neither a subnormal nor a NaN among a's and b's lanes */
    return !(_mm512_fpclass_ps_mask((__m512)a, 0xA1) | _mm512_fpclass_ps_mask((__m512)b, 0xA1));
}
#endif

#if LANES == 16 /* the bf16 packing's (AVX-512 only) */
/* 32 consecutive floats (a, then b) rounded to bf16, as 16 32-bit pairs (the 32 bf16 values in order). */
static inline vu vround_bf16_32(vf a, vf b) {
#ifdef DIFFTX_CVT_BF16
    if (__builtin_expect(vplain2(a, b), 1)) return (vu)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a);
#endif
    const vu lo = vbf16_bits(a), hi = vbf16_bits(b);
    return SHUF2(lo, hi, vu, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) |
           (SHUF2(lo, hi, vu, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31) << 16);
}
#endif

/* Two rows' LANES floats rounded to bf16 and interleaved: lane c = bf16(a[c]) | bf16(b[c]) << 16. */
static inline vu vround_bf16_pairs(vf a, vf b) {
#ifdef DIFFTX_CVT_BF16
    if (__builtin_expect(vplain2(a, b), 1)) {
        const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                             21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        return (vu)_mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a));
    }
#endif
    return vbf16_bits(a) | (vbf16_bits(b) << 16);
}

/* n (<= LANES) values at base[off] as floats, lanes past n set to pad. */
static inline vf vload(const void *base, int64_t off, int is_bf16, int64_t n, float pad) {
    if (n == LANES) {
        if (is_bf16) return vload_bf16((const uint16_t *)base + off);
        return *(const vf *)((const float *)base + off);
    }
    vf v = (vf){0} + pad;
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int64_t i = 0; i < n; i++) v[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(&v, (const float *)base + off, (size_t)n * sizeof(float));
    }
    return v;
}

static inline void vstore(void *base, int64_t off, int is_bf16, vf v, int64_t n) {
    if (is_bf16) {
        vh r = vround_bf16(v);
        if (n == LANES) {
            *(vh *)((uint16_t *)base + off) = r;
        } else {
            memcpy((uint16_t *)base + off, &r, (size_t)n * sizeof(uint16_t));
        }
    } else if (n == LANES) {
        *(vf *)((float *)base + off) = v;
    } else {
        memcpy((float *)base + off, &v, (size_t)n * sizeof(float));
    }
}

/* The sum of the lanes (a shuffle tree). */
static inline float vhsum(vf v) {
#if LANES == 16
    v += SHUF1(v, vi, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUF1(v, vi, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUF1(v, vi, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUF1(v, vi, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif LANES == 8
    v += SHUF1(v, vi, 4, 5, 6, 7, 0, 1, 2, 3);
    v += SHUF1(v, vi, 2, 3, 0, 1, 6, 7, 4, 5);
    v += SHUF1(v, vi, 1, 0, 3, 2, 5, 4, 7, 6);
#else
    v += SHUF1(v, vi, 2, 3, 0, 1);
    v += SHUF1(v, vi, 1, 0, 3, 2);
#endif
    return v[0];
}

static inline void load_row(const void *base, int64_t off, int is_bf16, float *dst, int64_t n) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    }
}

/* dst[0:n] = src[0:n] * a (+ b * src2[0:n] when src2), then zeros up to `width`. */
static inline void store_row(void *base, int64_t off, int is_bf16, const float *src, float a,
                             const float *src2, float b, int64_t n, int64_t width) {
    if (is_bf16) {
        uint16_t *dst = (uint16_t *)base + off;
        if (src2) {
            for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i] * a + src2[i] * b);
        } else {
            for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i] * a);
        }
        if (width > n) memset(dst + n, 0, (size_t)(width - n) * sizeof(uint16_t));
    } else {
        float *dst = (float *)base + off;
        if (src2) {
            for (int64_t i = 0; i < n; i++) dst[i] = src[i] * a + src2[i] * b;
        } else {
            for (int64_t i = 0; i < n; i++) dst[i] = src[i] * a;
        }
        if (width > n) memset(dst + n, 0, (size_t)(width - n) * sizeof(float));
    }
}

/* e[0:n] = exp(e - max) (unnormalised); returns the sum, sets *mx. */
static inline float exp_row(float *e, int64_t n, float *mx_out) {
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < n; i++) mx = e[i] > mx ? e[i] : mx;
    vf acc = {0}, acc2 = {0};
    int64_t i = 0;
    for (; i + 2 * LANES <= n; i += 2 * LANES) {
        vf x = vexp_nonpos(*(const vf *)(e + i) - mx), y = vexp_nonpos(*(const vf *)(e + i + LANES) - mx);
        *(vf *)(e + i) = x;
        *(vf *)(e + i + LANES) = y;
        acc += x;
        acc2 += y;
    }
    acc += acc2;
    for (; i + LANES <= n; i += LANES) {
        vf x = vexp_nonpos(*(const vf *)(e + i) - mx);
        *(vf *)(e + i) = x;
        acc += x;
    }
    if (i < n) {
        vf x = (vf){0} - INFINITY;
        memcpy(&x, e + i, (size_t)(n - i) * sizeof(float));
        x = vexp_nonpos(x - mx);
        memcpy(e + i, &x, (size_t)(n - i) * sizeof(float));
        acc += x;
    }
    *mx_out = mx;
    return vhsum(acc);
}

/* e[0:n] = exp(e - max), returns 1 / sum. */
static inline float softmax_inplace(float *e, int64_t n) {
    float mx;
    return 1.0f / exp_row(e, n, &mx);
}

static inline int64_t visible(int64_t j, int64_t c, int64_t diag0, int64_t ke) {
    if (diag0 < 0) return ke;
    int64_t n = diag0 + j % c + 1;
    return n < ke ? n : ke;
}

/* Per-thread scratch: a thread whose allocation failed flags it and skips its rows (every thread still reaches
 * the work-shared loop); the kernel then returns 1, and its caller (difftx/nn/native.py) raises MemoryError. */
#define FLAG_IF(cond)                        \
    do {                                     \
        if (cond) {                          \
            _Pragma("omp atomic write")      \
            failed = 1;                      \
        }                                    \
    } while (0)

int difftx_softmax_combine(const void *s, int s_bf16, void *p, void *comb, int comb_bf16,
                           int64_t B, int64_t M, int64_t R, int64_t ke, int64_t c, int64_t diag0,
                           float lam, const float *lam_rows, int nthreads) {
    const int64_t rows = B * R;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *e = (float *)malloc((size_t)(2 * ke) * sizeof(float));
        FLAG_IF(!e);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (!e) continue;
            const int64_t b = row / R, j = row % R;
            const int64_t n = visible(j, c, diag0, ke);
            const int64_t off0 = (b * M * R + j) * ke; /* map 0; map 1 is R * ke further */
            load_row(s, off0, s_bf16, e, n);
            float inv0 = softmax_inplace(e, n);
            if (M == 1) {
                if (p) store_row(p, off0, s_bf16, e, inv0, NULL, 0.0f, n, ke);
                if (comb) store_row(comb, row * ke, comb_bf16, e, inv0, NULL, 0.0f, n, ke);
                continue;
            }
            float *e1 = e + ke;
            load_row(s, off0 + R * ke, s_bf16, e1, n);
            float inv1 = softmax_inplace(e1, n);
            if (p) {
                store_row(p, off0, s_bf16, e, inv0, NULL, 0.0f, n, ke);
                store_row(p, off0 + R * ke, s_bf16, e1, inv1, NULL, 0.0f, n, ke);
            }
            if (comb) {
                const float l = lam_rows ? lam_rows[row] : lam;
                store_row(comb, row * ke, comb_bf16, e, inv0, e1, -l * inv1, n, ke);
            }
        }
        free(e);
    }
    return failed;
}

/* ds = p * (dp - rowsum(p * dp)) per map (dp shared by the maps), rs = rowsum(p * dp) in float32. */
int difftx_softmax_backward(const void *p, const void *dp, void *ds, int is_bf16, float *rs,
                            int64_t B, int64_t M, int64_t R, int64_t ke, int64_t c, int64_t diag0,
                            int nthreads) {
    const int64_t rows = B * R;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc((size_t)(2 * ke) * sizeof(float));
        float *g = buf, *pm = buf + ke;
        FLAG_IF(!buf);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (!buf) continue;
            const int64_t b = row / R, j = row % R;
            const int64_t n = visible(j, c, diag0, ke);
            load_row(dp, row * ke, is_bf16, g, n);
            for (int64_t m = 0; m < M; m++) {
                const int64_t off = ((b * M + m) * R + j) * ke;
                load_row(p, off, is_bf16, pm, n);
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < n; i++) acc += pm[i] * g[i];
                rs[(b * M + m) * R + j] = acc;
                if (is_bf16) {
                    uint16_t *dst = (uint16_t *)ds + off;
                    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(pm[i] * (g[i] - acc));
                    if (ke > n) memset(dst + n, 0, (size_t)(ke - n) * sizeof(uint16_t));
                } else {
                    float *dst = (float *)ds + off;
                    for (int64_t i = 0; i < n; i++) dst[i] = pm[i] * (g[i] - acc);
                    if (ke > n) memset(dst + n, 0, (size_t)(ke - n) * sizeof(float));
                }
            }
        }
        free(buf);
    }
    return failed;
}

/* y row = xr / sqrt(mean(xr^2) + eps) * (wg or gain); e: dim floats of scratch for a bfloat16 y (may be xr). */
static inline void rms_norm_row(const float *xr, void *y, int y_bf16, int64_t row, float *rstd_out, const float *wg,
                                float gain, float eps, int64_t dim, float *e) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
    const float r = 1.0f / sqrtf(ss / (float)dim + eps), rg = r * gain;
    if (rstd_out) rstd_out[row] = r;
    float *yr = y_bf16 ? e : (float *)y + row * dim;
    if (wg) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) yr[i] = (xr[i] * wg[i]) * r;
    } else {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) yr[i] = xr[i] * rg;
    }
    if (y_bf16) store_row(y, row * dim, 1, e, 1.0f, NULL, 0.0f, dim, dim);
}

/* RMSNorm over rows of `dim`: y = x * rstd * wg, rstd = 1 / sqrt(mean(x^2) + eps) (float32, also
 * written to rstd_out when given), wg the float32 weight times the gain (NULL: the scalar gain). */
int difftx_rms_norm(const void *x, int x_bf16, void *y, int y_bf16, float *rstd_out, const float *wg,
                    float gain, float eps, int64_t rows, int64_t dim, int nthreads) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *e = (float *)malloc((size_t)dim * sizeof(float)); /* a bfloat16 row as floats */
        FLAG_IF(!e);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (!e) continue;
            /* float32 rows are read and written in place; bfloat16 ones go through e */
            const float *xr = x_bf16 ? e : (const float *)x + row * dim;
            if (x_bf16) load_row(x, row * dim, 1, e, dim);
            rms_norm_row(xr, y, y_bf16, row, rstd_out, wg, gain, eps, dim, e);
        }
        free(e);
    }
    return failed;
}

/* One decoding query of differential attention per head over a cache: DIFF V1 with its per-head RMSNorm,
 * or DIFF V2 (both maps over the same keys, a value of d, lambda per head and sequence, no norm), or (M = 1)
 * plain softmax attention (one map, no lambda; the second map's arguments unused):
 *   q       q1 of (batch b, head hi) at b * q_batch + hi * q_head, d contiguous elements; q2 q_map further
 *           ((B, M, H, d) contiguous: q_batch = M H d, q_map = H d, q_head = d; DIFF V2's heads 2i, 2i + 1:
 *           q_map = d, q_head = 2d)
 *   k       K1 of (batch b, head kh, token t) at b * k_batch + kh * k_head + t * k_tok, d contiguous
 *           elements; K2 k2_off further.  The paired bf16 cache ([K1 | K2] per token):
 *           k_tok = 2d, k2_off = d; the fp32 cache (B, 2 Hk, T, d): k_tok = d, k2_off = Hk heads;
 *           DIFF V2's one set of keys: k2_off = 0.
 *   v       vw contiguous elements (2d for V1, d for V2) at b * v_batch + kh * v_head + t * v_tok
 *   valid   (B, T) uint8 (1 = a key this query may see) or NULL (all T keys)
 *   lam_bh  (B, H) float32 lambda per sequence and head, or NULL for the scalar lam
 *   out     (B, H, vw): (softmax(q1 K1^T s) - lam softmax(q2 K2^T s)) V, then (when norm) the
 *           RMSNorm over vw with weight*gain wg (float32, or NULL for the gain alone)
 * Query head i uses K/V head i / (H / Hk).  Logits, softmax, sums: float32. */
#define MAX_DV (128 / LANES) /* vectors per head dim d in the decoding kernel's vector path (d <= 128) */
int difftx_diff_decode(const void *q, const void *k, const void *v, const uint8_t *valid, void *out,
                       int is_bf16, int out_bf16, int64_t M, int64_t B, int64_t H, int64_t Hk, int64_t T, int64_t d,
                       int64_t vw, int64_t q_batch, int64_t q_map, int64_t q_head, int64_t k_batch, int64_t k_head,
                       int64_t k_tok, int64_t k2_off, int64_t v_batch, int64_t v_head, int64_t v_tok, float scale,
                       float lam_scalar, const float *lam_bh, int norm, const float *wg, float gain, float eps,
                       int nthreads) {
    const int64_t group = H / Hk, w = 2 * d, nv = d / LANES, nvv = vw / LANES;
    const int vec = d % LANES == 0 && nv <= MAX_DV && vw % LANES == 0 && vw <= w;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc((size_t)(2 * T + 4 * w) * sizeof(float));
        float *l1 = buf, *l2 = buf + T, *qf = buf + 2 * T, *row = qf + w, *acc = row + w;
        FLAG_IF(!buf);
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            if (!buf) continue;
            const int64_t b = bh / H, hi = bh % H, kh = hi / group;
            const int64_t k_off = b * k_batch + kh * k_head, v_off = b * v_batch + kh * v_head;
            const float lam = lam_bh ? lam_bh[bh] : lam_scalar;
            const int64_t q1o = b * q_batch + hi * q_head, q2o = q1o + q_map;
            if (vec) { /* d a multiple of LANES up to 128: whole vectors, q and the sums in registers */
                vf q1v[MAX_DV], q2v[MAX_DV], av[2 * MAX_DV];
                for (int64_t j = 0; j < nv; j++) {
                    q1v[j] = vload(q, q1o + j * LANES, is_bf16, LANES, 0.0f) * scale;
                    q2v[j] = M == 2 ? vload(q, q2o + j * LANES, is_bf16, LANES, 0.0f) * scale : (vf){0};
                }
                if (M == 1) { /* plain softmax attention: one map */
                    for (int64_t t = 0; t < T; t++) {
                        if (valid && !valid[b * T + t]) {
                            l1[t] = -INFINITY;
                            continue;
                        }
                        const int64_t o = k_off + t * k_tok;
                        vf a1 = {0};
                        for (int64_t j = 0; j < nv; j++) a1 += q1v[j] * vload(k, o + j * LANES, is_bf16, LANES, 0.0f);
                        l1[t] = vhsum(a1);
                    }
                    const float inv1 = softmax_inplace(l1, T);
                    for (int64_t j = 0; j < nvv; j++) av[j] = (vf){0};
                    for (int64_t t = 0; t < T; t++) {
                        const float pt = l1[t] * inv1;
                        if (pt == 0.0f) continue; /* masked keys */
                        const int64_t o = v_off + t * v_tok;
                        for (int64_t j = 0; j < nvv; j++) av[j] += pt * vload(v, o + j * LANES, is_bf16, LANES, 0.0f);
                    }
                } else {
                for (int64_t t = 0; t < T; t++) {
                    if (valid && !valid[b * T + t]) {
                        l1[t] = -INFINITY;
                        l2[t] = -INFINITY;
                        continue;
                    }
                    const int64_t o = k_off + t * k_tok;
                    vf a1 = {0}, a2 = {0};
                    for (int64_t j = 0; j < nv; j++) {
                        a1 += q1v[j] * vload(k, o + j * LANES, is_bf16, LANES, 0.0f);
                        a2 += q2v[j] * vload(k, o + k2_off + j * LANES, is_bf16, LANES, 0.0f);
                    }
                    l1[t] = vhsum(a1);
                    l2[t] = vhsum(a2);
                }
                const float inv1 = softmax_inplace(l1, T), inv2 = softmax_inplace(l2, T);
                for (int64_t j = 0; j < nvv; j++) av[j] = (vf){0};
                for (int64_t t = 0; t < T; t++) {
                    const float pt = l1[t] * inv1 - lam * inv2 * l2[t];
                    if (pt == 0.0f) continue; /* masked keys */
                    const int64_t o = v_off + t * v_tok;
                    for (int64_t j = 0; j < nvv; j++) av[j] += pt * vload(v, o + j * LANES, is_bf16, LANES, 0.0f);
                }
                }
                for (int64_t j = 0; j < nvv; j++) memcpy(acc + j * LANES, &av[j], sizeof(vf));
            } else {
            load_row(q, q1o, is_bf16, qf, d);                 /* q1 */
            if (M == 2) load_row(q, q2o, is_bf16, qf + d, d); /* q2 */
            for (int64_t i = 0; i < M * d; i++) qf[i] *= scale;
            for (int64_t t = 0; t < T; t++) {
                if (valid && !valid[b * T + t]) {
                    l1[t] = -INFINITY;
                    l2[t] = -INFINITY;
                    continue;
                }
                load_row(k, k_off + t * k_tok, is_bf16, row, d);
                float a1 = 0.0f, a2 = 0.0f;
#pragma omp simd reduction(+ : a1)
                for (int64_t i = 0; i < d; i++) a1 += qf[i] * row[i];
                if (M == 2) {
                    load_row(k, k_off + t * k_tok + k2_off, is_bf16, row + d, d);
#pragma omp simd reduction(+ : a2)
                    for (int64_t i = d; i < w; i++) a2 += qf[i] * row[i];
                }
                l1[t] = a1;
                l2[t] = a2;
            }
            const float inv1 = softmax_inplace(l1, T);
            if (M == 2) {
                const float inv2 = softmax_inplace(l2, T);
                for (int64_t t = 0; t < T; t++) l1[t] = l1[t] * inv1 - lam * inv2 * l2[t];
            } else {
                for (int64_t t = 0; t < T; t++) l1[t] *= inv1;
            }
            for (int64_t i = 0; i < vw; i++) acc[i] = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                const float pt = l1[t];
                if (pt == 0.0f) continue; /* masked keys */
                load_row(v, v_off + t * v_tok, is_bf16, row, vw);
#pragma omp simd
                for (int64_t i = 0; i < vw; i++) acc[i] += pt * row[i];
            }
            }
            float r = 1.0f;
            if (norm) {
                float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
                for (int64_t i = 0; i < vw; i++) ss += acc[i] * acc[i];
                r = 1.0f / sqrtf(ss / (float)vw + eps);
                if (wg) {
                    for (int64_t i = 0; i < vw; i++) acc[i] *= wg[i];
                } else {
                    r *= gain;
                }
            }
            store_row(out, bh * vw, out_bf16, acc, r, NULL, 0.0f, vw, vw);
        }
        free(buf);
    }
    return failed;
}

/* x1 = x + a (float32; a float32 or bfloat16, widened) and y = rms_norm(x1) in one pass per row: a residual
 * addition and the PreNorm after it (difftx.nn.fused.add_rms_norm).  x1 is bitwise torch's x + a. */
int difftx_add_rms_norm(const float *x, const void *a, int a_bf16, float *x1, void *y, int y_bf16, float *rstd_out,
                        const float *wg, float gain, float eps, int64_t rows, int64_t dim, int nthreads) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *e = (float *)malloc((size_t)dim * sizeof(float));
        FLAG_IF(!e);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (!e) continue;
            const float *xr = x + row * dim;
            float *x1r = x1 + row * dim;
            if (a_bf16) {
                load_row(a, row * dim, 1, e, dim);
                for (int64_t i = 0; i < dim; i++) x1r[i] = xr[i] + e[i];
            } else {
                const float *ar = (const float *)a + row * dim;
                for (int64_t i = 0; i < dim; i++) x1r[i] = xr[i] + ar[i];
            }
            rms_norm_row(x1r, y, y_bf16, row, rstd_out, wg, gain, eps, dim, e);
        }
        free(e);
    }
    return failed;
}

/* d[i] += s[i], kept out of line so the compiler cannot contract it with the product that made d: the
 * sum is the one autograd's separate addition gives. */
static void __attribute__((noinline)) add_row(float *d, const float *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = d[i] + s[i];
}

/* RMSNorm backward (see difftx_rms_norm), per row with xhat = x * rstd and g = dy * wg:
 *   dx = rstd * (g - xhat * mean(g * xhat)),   dw += xhat * dy  (summed over rows, float32)
 * dy is float32 or bfloat16 (dy_bf16); dx has x's dtype.  dw_out (dim floats) may be NULL.
 * acc (float32 rows, or NULL; x float32): a gradient reaching x by another path, added to dx (after dx is
 * complete, as autograd adds it); dx2 (or NULL): a second copy of dx, bfloat16 when dx2_bf16. */
int difftx_rms_norm_backward(const void *x, int x_bf16, const void *dy, int dy_bf16, const float *rstd,
                             const float *wg, float gain, void *dx, float *dw_out, int64_t rows, int64_t dim,
                             const float *acc, void *dx2, int dx2_bf16, int nthreads) {
    /* dw: one partial sum per thread (static schedule), added in thread order: deterministic. */
    float *partial = dw_out ? (float *)calloc((size_t)(nthreads * dim), sizeof(float)) : NULL;
    if (dw_out && !partial) return 1;
    int used = 1, failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc((size_t)(2 * dim) * sizeof(float)); /* bfloat16 rows as floats */
        float *xb = buf, *gb = buf + dim;
        float *dw = partial ? partial + (int64_t)omp_get_thread_num() * dim : NULL;
        FLAG_IF(!buf);
#pragma omp single
        used = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (!buf) continue;
            const float r = rstd[row];
            /* float32 rows are read (and dx written) in place; bfloat16 ones go through buf */
            const float *xr = x_bf16 ? xb : (const float *)x + row * dim;
            const float *dyr = dy_bf16 ? gb : (const float *)dy + row * dim;
            if (x_bf16) load_row(x, row * dim, 1, xb, dim);
            if (dy_bf16) load_row(dy, row * dim, 1, gb, dim);
            if (dw) {
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) dw[i] += xr[i] * r * dyr[i];
            }
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < dim; i++) dot += (dyr[i] * (wg ? wg[i] : gain)) * (xr[i] * r);
            const float c = -dot / (float)dim;
            float *dxr = x_bf16 ? gb : (float *)dx + row * dim; /* dx has x's dtype */
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) dxr[i] = (dyr[i] * (wg ? wg[i] : gain) + (xr[i] * r) * c) * r;
            if (acc) add_row(dxr, acc + row * dim, dim);
            if (x_bf16) store_row(dx, row * dim, 1, gb, 1.0f, NULL, 0.0f, dim, dim);
            if (dx2) store_row(dx2, row * dim, dx2_bf16, dxr, 1.0f, NULL, 0.0f, dim, dim);
        }
        free(buf);
    }
    if (partial) {
        memcpy(dw_out, partial, (size_t)dim * sizeof(float));
        for (int t = 1; t < used; t++)
            for (int64_t i = 0; i < dim; i++) dw_out[i] += partial[(int64_t)t * dim + i];
        free(partial);
    }
    return failed;
}

/* ---------------------------------------------------------------- SwiGLU: h = silu(g) * u */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* 1 / x for x in [1, 2].  With AVX-512 a 16-lane division occupies one port for ~10 cycles of the ~28 a
 * SwiGLU vector takes (bfloat16, Sapphire Rapids): there the 14-bit reciprocal estimate and one Newton step
 * (within 1.3e-7 relative, one float32 ulp, even for an estimate 2^-14 off); elsewhere the division (on
 * AVX2 Zen 3 the 12-bit estimate and a step measured no faster). */
static inline vf vrecip_1_2(vf x) {
#if defined(__AVX512F__)
    const vf r = (vf)_mm512_rcp14_ps((__m512)x);
    return r * (2.0f - x * r);
#else
    return 1.0f / x;
#endif
}

static inline vf vsigmoid(vf g) { /* 1 / (1 + exp(-g)), via exp(-|g|) <= 1 */
    const vi neg = g < 0.0f;
    vf e = vexp_nonpos((vf)((vi)g | ((vi){0} + INT32_MIN))); /* -|g|: the sign bit set */
    vf r = vrecip_1_2(1.0f + e);
    return (vf)(((vi)r & ~neg) | ((vi)(e * r) & neg));
}

/* Elementwise kernels hand out blocks of EW_BLOCK elements; whole vectors go through a plain loop per
 * dtype (no per-vector dtype or length tests: 1.3-1.6x faster at the small preset's FFN), a block's
 * tail through vload / vstore.  The same operations either way. */
#define EW_BLOCK 4096

static inline vf swiglu_vec(vf g, vf u) { return g * vsigmoid(g) * u; }

void difftx_swiglu(const void *g, const void *u, void *h, int is_bf16, int64_t n, int nthreads) {
    const int64_t blocks = (n + EW_BLOCK - 1) / EW_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t end = n < (blk + 1) * EW_BLOCK ? n : (blk + 1) * EW_BLOCK;
        int64_t off = blk * EW_BLOCK;
        if (!is_bf16) {
            const float *gf = (const float *)g, *uf = (const float *)u;
            float *hf = (float *)h;
            for (; off + LANES <= end; off += LANES)
                *(vf *)(hf + off) = swiglu_vec(*(const vf *)(gf + off), *(const vf *)(uf + off));
        } else {
            const uint16_t *gb = (const uint16_t *)g, *ub = (const uint16_t *)u;
            uint16_t *hb = (uint16_t *)h;
            for (; off + LANES <= end; off += LANES)
                vstore_bf16(hb + off, swiglu_vec(vload_bf16(gb + off), vload_bf16(ub + off)));
        }
        for (; off < end; off += LANES) {
            const int64_t m = end - off < LANES ? end - off : LANES;
            vstore(h, off, is_bf16, swiglu_vec(vload(g, off, is_bf16, m, 0.0f), vload(u, off, is_bf16, m, 0.0f)), m);
        }
    }
}

/* dg = dh * u * s * (1 + g (1 - s)), du = dh * g * s with s = sigmoid(g). */
static inline void swiglu_grad_vec(vf g, vf u, vf dh, vf *dg, vf *du) {
    const vf s = vsigmoid(g), gs = g * s;
    *du = dh * gs;
    *dg = dh * u * (s + gs * (1.0f - s));
}

void difftx_swiglu_backward(const void *g, const void *u, const void *dh, void *dg, void *du, int is_bf16,
                            int64_t n, int nthreads) {
    const int64_t blocks = (n + EW_BLOCK - 1) / EW_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t end = n < (blk + 1) * EW_BLOCK ? n : (blk + 1) * EW_BLOCK;
        int64_t off = blk * EW_BLOCK;
        vf a, b;
        if (!is_bf16) {
            const float *gf = (const float *)g, *uf = (const float *)u, *hf = (const float *)dh;
            float *dgf = (float *)dg, *duf = (float *)du;
            for (; off + LANES <= end; off += LANES) {
                swiglu_grad_vec(*(const vf *)(gf + off), *(const vf *)(uf + off), *(const vf *)(hf + off), &a, &b);
                *(vf *)(dgf + off) = a;
                *(vf *)(duf + off) = b;
            }
        } else {
            const uint16_t *gb = (const uint16_t *)g, *ub = (const uint16_t *)u, *hb = (const uint16_t *)dh;
            uint16_t *dgb = (uint16_t *)dg, *dub = (uint16_t *)du;
            for (; off + LANES <= end; off += LANES) {
                swiglu_grad_vec(vload_bf16(gb + off), vload_bf16(ub + off), vload_bf16(hb + off), &a, &b);
                vstore_bf16(dgb + off, a);
                vstore_bf16(dub + off, b);
            }
        }
        for (; off < end; off += LANES) {
            const int64_t m = end - off < LANES ? end - off : LANES;
            swiglu_grad_vec(vload(g, off, is_bf16, m, 0.0f), vload(u, off, is_bf16, m, 0.0f),
                            vload(dh, off, is_bf16, m, 0.0f), &a, &b);
            vstore(du, off, is_bf16, b, m);
            vstore(dg, off, is_bf16, a, m);
        }
    }
}

/* ---------------------------------------------------------------- rotary embeddings
 * x and out (B, A1, A2, N, d), each with its own strides (in elements) for B, A1, A2 and N and a
 * contiguous last dim: a view of a projection's output is read in place, and a gradient can be
 * written in the layout its projection produced.  cos/sin (Bc, N, d/2) float32 with Bc 1 or B.
 * half: channel i rotates with i + d/2; interleaved: 2i with 2i + 1.  sign -1 rotates backwards
 * (the gradient).  float32 math, out in x's dtype. */
static inline void rope_row(const void *x, int64_t xo, void *out, int64_t oo, int is_bf16, const float *c,
                            const float *s, int64_t d, int interleaved, float sign, float *xr, float *yr) {
    const int64_t half = d / 2;
    if (is_bf16 && !interleaved && half % LANES == 0) { /* whole bf16 vectors straight from and to the rows */
        for (int64_t i = 0; i < half; i += LANES) {
            const vf a = vload(x, xo + i, is_bf16, LANES, 0.0f), e = vload(x, xo + i + half, is_bf16, LANES, 0.0f);
            vf ci, si;
            memcpy(&ci, c + i, sizeof ci);
            memcpy(&si, s + i, sizeof si);
            si *= sign;
            vstore(out, oo + i, is_bf16, a * ci - e * si, LANES);
            vstore(out, oo + i + half, is_bf16, a * si + e * ci, LANES);
        }
        return;
    }
    /* float32 rows are read and written in place; bfloat16 ones go through xr / yr */
    const float *xs = is_bf16 ? xr : (const float *)x + xo;
    float *ys = is_bf16 ? yr : (float *)out + oo;
    if (is_bf16) load_row(x, xo, 1, xr, d);
    if (interleaved) {
        for (int64_t i = 0; i < half; i++) {
            const float a = xs[2 * i], e = xs[2 * i + 1], si = sign * s[i];
            ys[2 * i] = a * c[i] - e * si;
            ys[2 * i + 1] = a * si + e * c[i];
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = xs[i], e = xs[i + half], si = sign * s[i];
            ys[i] = a * c[i] - e * si;
            ys[i + half] = a * si + e * c[i];
        }
    }
    if (is_bf16) store_row(out, oo, 1, yr, 1.0f, NULL, 0.0f, d, d);
}

int difftx_rope(const void *x, const int64_t *xst, void *out, const int64_t *ost, int is_bf16, const float *cos_,
                const float *sin_, int64_t B, int64_t A1, int64_t A2, int64_t N, int64_t d, int64_t Bc,
                int interleaved, float sign, int nthreads) {
    const int64_t half = d / 2, heads = A1 * A2;
    /* Rows in the order memory holds them: position-major when either side keeps a position's heads side
     * by side (a projection's output, or a gradient going back to one), else head-major. */
    const int pos_major = (A2 > 1 && (xst[3] > xst[2] || ost[3] > ost[2])) ||
                          (A1 > 1 && (xst[3] > xst[1] || ost[3] > ost[1]));
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = is_bf16 ? (float *)malloc((size_t)(2 * d) * sizeof(float)) : NULL; /* bf16 rows only */
        float *xr = buf, *yr = buf ? buf + d : NULL;
        const int skip = is_bf16 && !buf;
        FLAG_IF(skip);
        if (pos_major) {
#pragma omp for schedule(static)
            for (int64_t o = 0; o < B * N; o++) {
                if (skip) continue;
                const int64_t b = o / N, n = o % N, bc = Bc > 1 ? b : 0;
                for (int64_t a1 = 0; a1 < A1; a1++)
                    for (int64_t a2 = 0; a2 < A2; a2++)
                        rope_row(x, b * xst[0] + a1 * xst[1] + a2 * xst[2] + n * xst[3], out,
                                 b * ost[0] + a1 * ost[1] + a2 * ost[2] + n * ost[3], is_bf16, cos_ + (bc * N + n) * half,
                                 sin_ + (bc * N + n) * half, d, interleaved, sign, xr, yr);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t o = 0; o < B * heads; o++) {
                if (skip) continue;
                const int64_t b = o / heads, a1 = o % heads / A2, a2 = o % A2, bc = Bc > 1 ? b : 0;
                const int64_t xo = b * xst[0] + a1 * xst[1] + a2 * xst[2], oo = b * ost[0] + a1 * ost[1] + a2 * ost[2];
                for (int64_t n = 0; n < N; n++)
                    rope_row(x, xo + n * xst[3], out, oo + n * ost[3], is_bf16, cos_ + (bc * N + n) * half,
                             sin_ + (bc * N + n) * half, d, interleaved, sign, xr, yr);
            }
        }
        free(buf);
    }
    return failed;
}

/* ---------------------------------------------------------------- float32 attention, forward and backward
 * The fused attention (difftx/nn/fused.py) for float32 without padding: every matrix product of a
 * block of queries runs through one register-blocked micro-kernel while the block's maps stay in
 * this core's cache, instead of a dozen batched torch calls per block (whose K = 64 GEMMs reach
 * 55-60 GFLOP/s on the AVX2 EPYC against 80-88 here).
 *
 * Layouts (float32; "rows" have a contiguous last dim):
 *   q     (B, M, H, N, d) contiguous          out, dout (B, N, H, dv) contiguous
 *   k     slice s = (b*MK + m % MK)*Hk + hk at k + s*ks, key j at + j*kr (nk keys of d): MK = M, a K per
 *         map, or MK = 1, one K that both maps read (DIFF V2's query heads 2i, 2i+1 share a K/V group)
 *   v     slice (b, hk) at v + b*vsb + hk*vsh, key j at + j*vr (nk keys of dv): a head view of the
 *         value projection's output is read in place
 *   lse   (B, M, H, N) log-sum-exp of each map's row (written by the forward when not NULL)
 *   dq like q; dk (B*MK*Hk, nk, d) contiguous (a shared K's: both maps' sum); dv with its own strides
 *   (dvsb, dvsh, dvr) like v's;
 *   rs2 (B, H, N): rowsum(P2 dP) of map 2
 * Causal: query i (position q_start + i) sees keys [0, q_start + i]; else all nk keys.
 * d and dv are multiples of GEMM_NR (the caller checks difftx_gemm_nr()). */
#define GEMM_MR 6
#define GEMM_NR (2 * LANES)

int difftx_gemm_nr(void) { return GEMM_NR; }

/* C[i][0:NR] (= | +=) alpha * sum_k A[i*rsa + k*csa] * B[k*ldb + 0:NR] for i < mr (<= GEMM_MR):
 * 2 * mr accumulators, B's two vectors and one broadcast in registers (15 of AVX2's 16). */
static inline __attribute__((always_inline)) void ukernel(int mr, int64_t K, const float *A, int64_t rsa,
                                                         int64_t csa, const float *B, int64_t ldb, float *C,
                                                         int64_t ldc, float alpha, int acc) {
    volatile float alpha_mem = alpha; /* on the stack during the loop: a register holding it would
                                       * be AVX2's 16th, and B's first vector would spill instead */
    vf c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    vf c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    const float *a0 = A, *a1 = A + rsa, *a2 = A + 2 * rsa, *a3 = A + 3 * rsa, *a4 = A + 4 * rsa, *a5 = A + 5 * rsa;
    for (int64_t k = 0; k < K; k++) {
        const vf b0 = *(const vf *)(B + k * ldb), b1 = *(const vf *)(B + k * ldb + LANES);
        const int64_t o = k * csa;
        float x;
        x = a0[o]; c00 += b0 * x; c01 += b1 * x; /* vector * scalar: a broadcast load */
        if (mr > 1) { x = a1[o]; c10 += b0 * x; c11 += b1 * x; }
        if (mr > 2) { x = a2[o]; c20 += b0 * x; c21 += b1 * x; }
        if (mr > 3) { x = a3[o]; c30 += b0 * x; c31 += b1 * x; }
        if (mr > 4) { x = a4[o]; c40 += b0 * x; c41 += b1 * x; }
        if (mr > 5) { x = a5[o]; c50 += b0 * x; c51 += b1 * x; }
    }
    alpha = alpha_mem;
#define DIFFTX_STORE(i, x0, x1)                                                                         \
    if (mr > i) {                                                                                      \
        vf *p0 = (vf *)(C + i * ldc), *p1 = (vf *)(C + i * ldc + LANES);                               \
        if (acc) { *p0 += x0 * alpha; *p1 += x1 * alpha; } else { *p0 = x0 * alpha; *p1 = x1 * alpha; } \
    }
    DIFFTX_STORE(0, c00, c01)
    DIFFTX_STORE(1, c10, c11)
    DIFFTX_STORE(2, c20, c21)
    DIFFTX_STORE(3, c30, c31)
    DIFFTX_STORE(4, c40, c41)
    DIFFTX_STORE(5, c50, c51)
#undef DIFFTX_STORE
}

/* C (M x N) (= | +=) alpha A B with A[i][k] = A[i*rsa + k*csa] and B's rows at B + k*ldb, N a
 * multiple of GEMM_NR.  Causal structure skips products with zeros: with ``kend`` >= 0, rows
 * [i, i + MR) take k < kend + i + MR only (A is zero past the diagonal: maps times V or K); with
 * ``kbegin`` >= 0, k >= i - kbegin only (a map transposed: key rows i see queries from i - kbegin). */
static void gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t rsa, int64_t csa, const float *B,
                 int64_t ldb, float *C, int64_t ldc, float alpha, int acc, int64_t kend, int64_t kbegin) {
    for (int64_t i = 0; i < M; i += GEMM_MR) {
        const int64_t mr = M - i < GEMM_MR ? M - i : GEMM_MR;
        int64_t k0 = 0, k1 = K;
        if (kend >= 0 && kend + i + mr < k1) k1 = kend + i + mr;
        if (kbegin >= 0 && i - kbegin > 0) k0 = i - kbegin;
        if (k1 < k0) k1 = k0;
        const float *a = A + i * rsa + k0 * csa, *b = B + k0 * ldb;
        for (int64_t j = 0; j < N; j += GEMM_NR) {
            float *c = C + i * ldc + j;
            switch (mr) { /* constant row counts, so each keeps its accumulators in registers */
                case 6: ukernel(6, k1 - k0, a, rsa, csa, b + j, ldb, c, ldc, alpha, acc); break;
                case 5: ukernel(5, k1 - k0, a, rsa, csa, b + j, ldb, c, ldc, alpha, acc); break;
                case 4: ukernel(4, k1 - k0, a, rsa, csa, b + j, ldb, c, ldc, alpha, acc); break;
                case 3: ukernel(3, k1 - k0, a, rsa, csa, b + j, ldb, c, ldc, alpha, acc); break;
                case 2: ukernel(2, k1 - k0, a, rsa, csa, b + j, ldb, c, ldc, alpha, acc); break;
                default: ukernel(1, k1 - k0, a, rsa, csa, b + j, ldb, c, ldc, alpha, acc); break;
            }
        }
    }
}

/* C (M x np*NR) = alpha A X^T where X^T comes as np panels of (K, NR) floats (pack_t).  With
 * ``diag`` >= 0 (causal: row i is the query at key position diag + i), rows [i, i + MR) stop at the
 * panel holding key diag + i + MR - 1; columns past it are left unwritten. */
static void gemm_panels(int64_t M, int64_t np, int64_t K, const float *A, int64_t rsa, const float *panels,
                        float *C, int64_t ldc, float alpha, int64_t diag) {
    for (int64_t i = 0; i < M; i += GEMM_MR) {
        const int64_t mr = M - i < GEMM_MR ? M - i : GEMM_MR;
        int64_t npt = np;
        if (diag >= 0 && (diag + i + mr + GEMM_NR - 1) / GEMM_NR < npt) npt = (diag + i + mr + GEMM_NR - 1) / GEMM_NR;
        for (int64_t p = 0; p < npt; p++)
            gemm(mr, GEMM_NR, K, A + i * rsa, rsa, 1, panels + p * K * GEMM_NR, GEMM_NR, C + i * ldc + p * GEMM_NR,
                 ldc, alpha, 0, -1, -1);
    }
}

/* X (n rows of w floats, row stride ldx) transposed into ceil(n / NR) panels of (w, NR), zero-padded. */
static void pack_t(const float *x, int64_t ldx, int64_t n, int64_t w, float *out) {
    const int64_t np = (n + GEMM_NR - 1) / GEMM_NR;
    for (int64_t p = 0; p < np; p++) {
        float *dst = out + p * w * GEMM_NR;
        for (int64_t jj = 0; jj < GEMM_NR; jj++) {
            const int64_t j = p * GEMM_NR + jj;
            if (j < n) {
                const float *src = x + j * ldx;
                for (int64_t c = 0; c < w; c++) dst[c * GEMM_NR + jj] = src[c];
            } else {
                for (int64_t c = 0; c < w; c++) dst[c * GEMM_NR + jj] = 0.0f;
            }
        }
    }
}

/* Query i of a call (at key position q_start + i) sees keys [attn_first, attn_visible): the causal prefix, or
 * all; with a sliding window (window > 0) only the keys fewer than ``window`` positions away. */
static inline int64_t attn_visible(int causal, int64_t window, int64_t q_start, int64_t i, int64_t nk) {
    const int64_t n = causal ? q_start + i + 1 : (window > 0 ? q_start + i + window : nk);
    return n < nk ? n : nk;
}

static inline int64_t attn_first(int64_t window, int64_t q_start, int64_t i) {
    const int64_t lo = q_start + i - window + 1;
    return window > 0 && lo > 0 ? lo : 0;
}

/* The first key of the block of queries from i0: its first query's first key, down to a multiple of 32 (whole
 * packed panels and tiles).  A block's products run over keys [k0, ke) only: with a sliding window, the keys
 * left of every query's window are neither multiplied nor read. */
static inline int64_t attn_block_first(int64_t window, int64_t q_start, int64_t i0) {
    return attn_first(window, q_start, i0) / 32 * 32;
}

/* e[0:n] = exp(e - lse): the probabilities of a row from its saved log-sum-exp. */
static inline void exp_lse_row(float *e, int64_t n, float lse) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) *(vf *)(e + i) = vexp_nonpos(*(const vf *)(e + i) - lse);
    if (i < n) {
        vf x = (vf){0} - INFINITY;
        memcpy(&x, e + i, (size_t)(n - i) * sizeof(float));
        x = vexp_nonpos(x - lse);
        memcpy(e + i, &x, (size_t)(n - i) * sizeof(float));
    }
}

/* p1[0:n] = exp(p1 - lse) and g = p0 - l p1 in one pass: map 2's probabilities and the combined map. */
static inline void exp_lse_comb_row(float *p1, const float *p0, float *g, int64_t n, float lse, float l) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf x = vexp_nonpos(*(const vf *)(p1 + i) - lse);
        *(vf *)(p1 + i) = x;
        *(vf *)(g + i) = *(const vf *)(p0 + i) - l * x;
    }
    if (i < n) {
        vf x = (vf){0} - INFINITY, y = {0};
        memcpy(&x, p1 + i, (size_t)(n - i) * sizeof(float));
        memcpy(&y, p0 + i, (size_t)(n - i) * sizeof(float));
        x = vexp_nonpos(x - lse);
        y -= l * x;
        memcpy(p1 + i, &x, (size_t)(n - i) * sizeof(float));
        memcpy(g + i, &y, (size_t)(n - i) * sizeof(float));
    }
}

/* Slice s of `slices` starts at x + (s / inner) * so + (s % inner) * si: rows of keys (or values) of
 * one head, row stride xr. */
static inline const float *slice_at(const float *x, int64_t s, int64_t inner, int64_t so, int64_t si) {
    return x + (s / inner) * so + (s % inner) * si;
}

static void pack_keys(const float *x, int64_t inner, int64_t so, int64_t si, int64_t xr, int64_t slices, int64_t nk,
                      int64_t w, float *out, int nthreads) {
    const int64_t np = (nk + GEMM_NR - 1) / GEMM_NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t s = 0; s < slices; s++) pack_t(slice_at(x, s, inner, so, si), xr, nk, w, out + s * np * w * GEMM_NR);
}

/* X (n rows of w floats, row stride ldx; w a multiple of NR) as w / NR column panels of (n, NR), each
 * contiguous: the B operand of a product over X's rows, streamed in order. */
static void pack_n(const float *x, int64_t ldx, int64_t n, int64_t w, float *out) {
    for (int64_t p = 0; p < w / GEMM_NR; p++) {
        float *dst = out + p * n * GEMM_NR;
        for (int64_t j = 0; j < n; j++) memcpy(dst + j * GEMM_NR, x + j * ldx + p * GEMM_NR, GEMM_NR * sizeof(float));
    }
}

static void pack_values(const float *x, int64_t inner, int64_t so, int64_t si, int64_t xr, int64_t slices,
                        int64_t nk, int64_t w, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t s = 0; s < slices; s++) pack_n(slice_at(x, s, inner, so, si), xr, nk, w, out + s * nk * w);
}

int difftx_attn_forward(const float *q, const float *k, int64_t ks, int64_t kr, const float *v, int64_t vsb,
                        int64_t vsh, int64_t vr, float *out, float *lse, float *kpack, float *vpack, int64_t B,
                        int64_t M, int64_t MK, int64_t H, int64_t Hk, int64_t N, int64_t nk, int64_t d, int64_t dv,
                        int64_t q_start, int causal, int64_t window,
                        int64_t chunk, float scale, float lam, const float *lam_rows, int nthreads) {
    const int64_t np_all = (nk + GEMM_NR - 1) / GEMM_NR, rep = H / Hk;
    const int64_t nblk = (N + chunk - 1) / chunk, tasks = B * H * nblk;
    pack_keys(k, 1, ks, 0, kr, B * MK * Hk, nk, d, kpack, nthreads);
    pack_values(v, Hk, vsb, vsh, vr, B * Hk, nk, dv, vpack, nthreads);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *S = (float *)malloc((size_t)(M * chunk * np_all * GEMM_NR) * sizeof(float));
        FLAG_IF(!S);
        /* the last blocks see the most keys: hand them out first, one at a time */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!S) continue;
            const int64_t blk = nblk - 1 - t / (B * H), bh = t % (B * H), b = bh / H, h = bh % H, hk = h / rep;
            const int64_t i0 = blk * chunk, i1 = i0 + chunk < N ? i0 + chunk : N, c = i1 - i0;
            /* keys [k0, ke), the maps' columns [0, ke - k0) */
            const int64_t k0 = attn_block_first(window, q_start, i0);
            const int64_t ke = attn_visible(causal, window, q_start, i1 - 1, nk) - k0;
            const int64_t np = (ke + GEMM_NR - 1) / GEMM_NR, ld = np * GEMM_NR;
            const int64_t diag = causal ? q_start + i0 - k0 : -1; /* the block's first query among the keys */
            for (int64_t m = 0; m < M; m++) {
                const int64_t s = (b * MK + m % MK) * Hk + hk; /* K's slice: its own per map, or one shared */
                const float *qm = q + (((b * M + m) * H + h) * N + i0) * d;
                gemm_panels(c, np, d, qm, d, kpack + (s * np_all + k0 / GEMM_NR) * d * GEMM_NR, S + m * chunk * ld, ld,
                            scale, diag);
            }
            for (int64_t i = 0; i < c; i++) {
                const int64_t n = attn_visible(causal, window, q_start, i0 + i, nk) - k0;
                const int64_t lo = attn_first(window, q_start, i0 + i) - k0; /* columns [0, lo): outside the window */
                float *e0 = S + i * ld, mx;
                if (lo) memset(e0, 0, (size_t)lo * sizeof(float));
                const float sum0 = exp_row(e0 + lo, n - lo, &mx), inv0 = 1.0f / sum0;
                const int64_t row = (b * M * H + h) * N + i0 + i; /* lse index of map 0 */
                if (lse) lse[row] = mx + logf(sum0);
                if (M == 1) {
                    for (int64_t j = lo; j < n; j++) e0[j] *= inv0;
                } else {
                    float *e1 = S + (chunk + i) * ld, mx1;
                    const float sum1 = exp_row(e1 + lo, n - lo, &mx1), inv1 = 1.0f / sum1;
                    if (lse) lse[row + H * N] = mx1 + logf(sum1);
                    const float l = lam_rows ? lam_rows[(b * H + h) * N + i0 + i] : lam, w1 = -l * inv1;
                    for (int64_t j = lo; j < n; j++) e0[j] = e0[j] * inv0 + e1[j] * w1;
                }
                if (ke > n) memset(e0 + n, 0, (size_t)(ke - n) * sizeof(float));
            }
            for (int64_t j = 0; j < dv; j += GEMM_NR) /* one contiguous panel of values at a time */
                gemm(c, GEMM_NR, ke, S, ld, 1, vpack + ((b * Hk + hk) * dv + j) * nk + k0 * GEMM_NR, GEMM_NR,
                     out + ((b * N + i0) * H + h) * dv + j, H * dv, 1.0f, 0, diag, -1);
        }
        free(S);
    }
    return failed;
}

int difftx_attn_backward(const float *q, const float *k, int64_t ks, int64_t kr, const float *v, int64_t vsb,
                         int64_t vsh, int64_t vr, const float *dout, const float *lse, float *dq, float *dk,
                         float *dv_, int64_t dvsb, int64_t dvsh, int64_t dvr,
                         float *rs2, float *kpack, float *vpack, int64_t B, int64_t M, int64_t MK, int64_t H,
                         int64_t Hk,
                         int64_t N, int64_t nk, int64_t d, int64_t dv, int64_t q_start, int causal, int64_t window,
                         int64_t chunk, float scale, float lam, const float *lam_rows, int nthreads) {
    const int64_t np_all = (nk + GEMM_NR - 1) / GEMM_NR, rep = H / Hk;
    const int64_t nblk = (N + chunk - 1) / chunk;
    pack_keys(k, 1, ks, 0, kr, B * MK * Hk, nk, d, kpack, nthreads);
    pack_keys(v, Hk, vsb, vsh, vr, B * Hk, nk, dv, vpack, nthreads);
    /* one task per K/V head: its dK and dV sums are its own (no races, and the same order of
     * summation whatever the thread count) */
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t ldmax = np_all * GEMM_NR;
        float *S = (float *)malloc((size_t)((M + 1) * chunk * ldmax) * sizeof(float));
        FLAG_IF(!S);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < B * Hk; t++) {
            if (!S) continue;
            const int64_t b = t / Hk, hk = t % Hk;
            float *dvs = dv_ + b * dvsb + hk * dvsh;
            for (int64_t j = 0; j < nk; j++) memset(dvs + j * dvr, 0, (size_t)dv * sizeof(float));
            for (int64_t m = 0; m < MK; m++)
                memset(dk + ((b * MK + m) * Hk + hk) * nk * d, 0, (size_t)(nk * d) * sizeof(float));
            for (int64_t h = hk * rep; h < (hk + 1) * rep; h++) {
                for (int64_t blk = 0; blk < nblk; blk++) {
                    const int64_t i0 = blk * chunk, i1 = i0 + chunk < N ? i0 + chunk : N, c = i1 - i0;
                    /* keys [k0, ke), the maps' columns [0, ke - k0) (the forward's) */
                    const int64_t k0 = attn_block_first(window, q_start, i0);
                    const int64_t ke = attn_visible(causal, window, q_start, i1 - 1, nk) - k0;
                    const int64_t np = (ke + GEMM_NR - 1) / GEMM_NR, ld = np * GEMM_NR;
                    const int64_t diag = causal ? q_start + i0 - k0 : -1;
                    float *G = S + M * chunk * ld; /* the combined map, then dP */
                    const float *doc = dout + ((b * N + i0) * H + h) * dv;
                    for (int64_t m = 0; m < M; m++) { /* the maps again, from the saved log-sum-exp */
                        const int64_t s = (b * MK + m % MK) * Hk + hk;
                        const float *qm = q + (((b * M + m) * H + h) * N + i0) * d;
                        gemm_panels(c, np, d, qm, d, kpack + (s * np_all + k0 / GEMM_NR) * d * GEMM_NR,
                                    S + m * chunk * ld, ld, scale, diag);
                    }
                    for (int64_t i = 0; i < c; i++) { /* P1 (and P2) rebuilt, and the combined map G, per row */
                        const int64_t n = attn_visible(causal, window, q_start, i0 + i, nk) - k0;
                        const int64_t lo = attn_first(window, q_start, i0 + i) - k0, row = (b * M * H + h) * N + i0 + i;
                        float *p0 = S + i * ld, *g = G + i * ld;
                        if (lo) { /* outside the window: probability 0 */
                            memset(p0, 0, (size_t)lo * sizeof(float));
                            memset(g, 0, (size_t)lo * sizeof(float));
                        }
                        exp_lse_row(p0 + lo, n - lo, lse[row]);
                        if (M == 1) {
                            memcpy(g + lo, p0 + lo, (size_t)(n - lo) * sizeof(float));
                        } else {
                            float *p1 = S + (chunk + i) * ld;
                            const float l = lam_rows ? lam_rows[(b * H + h) * N + i0 + i] : lam;
                            if (lo) memset(p1, 0, (size_t)lo * sizeof(float));
                            exp_lse_comb_row(p1 + lo, p0 + lo, g + lo, n - lo, lse[row + H * N], l);
                            if (ke > n) memset(p1 + n, 0, (size_t)(ke - n) * sizeof(float));
                        }
                        if (ke > n) {
                            memset(p0 + n, 0, (size_t)(ke - n) * sizeof(float));
                            memset(g + n, 0, (size_t)(ke - n) * sizeof(float));
                        }
                    }
                    /* dV[k0:k0 + ke] += comb^T dO */
                    gemm(ke, dv, c, G, 1, ld, doc, H * dv, dvs + k0 * dvr, dvr, 1.0f, 1, -1, diag);
                    /* dP = dO V^T */
                    gemm_panels(c, np, dv, doc, H * dv, vpack + (t * np_all + k0 / GEMM_NR) * dv * GEMM_NR, G, ld, 1.0f,
                                diag);
                    for (int64_t i = 0; i < c; i++) { /* dS_m = w_m P_m (dP - rowsum(P_m dP)), w = 1, -lambda */
                        const int64_t n = attn_visible(causal, window, q_start, i0 + i, nk) - k0;
                        float *p0 = S + i * ld;
                        const float *g = G + i * ld;
                        if (M == 1) {
                            float r = 0.0f;
#pragma omp simd reduction(+ : r)
                            for (int64_t j = 0; j < n; j++) r += p0[j] * g[j];
#pragma omp simd
                            for (int64_t j = 0; j < n; j++) p0[j] = p0[j] * (g[j] - r);
                        } else {
                            float *p1 = S + (chunk + i) * ld;
                            float r0 = 0.0f, r1 = 0.0f;
#pragma omp simd reduction(+ : r0, r1)
                            for (int64_t j = 0; j < n; j++) {
                                r0 += p0[j] * g[j];
                                r1 += p1[j] * g[j];
                            }
                            rs2[(b * H + h) * N + i0 + i] = r1;
                            const float w1 = -(lam_rows ? lam_rows[(b * H + h) * N + i0 + i] : lam);
#pragma omp simd
                            for (int64_t j = 0; j < n; j++) {
                                p0[j] = p0[j] * (g[j] - r0);
                                p1[j] = w1 * p1[j] * (g[j] - r1);
                            }
                        }
                    }
                    for (int64_t m = 0; m < M; m++) {
                        float *Sm = S + m * chunk * ld;
                        const int64_t s = (b * MK + m % MK) * Hk + hk; /* a shared K sums both maps' dK */
                        const float *qm = q + (((b * M + m) * H + h) * N + i0) * d;
                        /* dQ = scale dS K, dK[k0:k0 + ke] += scale dS^T Q */
                        gemm(c, d, ke, Sm, ld, 1, k + s * ks + k0 * kr, kr, dq + (((b * M + m) * H + h) * N + i0) * d, d,
                             scale, 0, diag, -1);
                        gemm(ke, d, c, Sm, 1, ld, qm, d, dk + (s * nk + k0) * d, d, scale, 1, -1, diag);
                    }
                }
            }
        }
        free(S);
    }
    return failed;
}

/* ---------------------------------------------------------------- bfloat16 attention on AMX tiles
 * The same blocks, maps and layouts as the float32 kernels above, for bfloat16 q, k, v (and out,
 * dout, dq, dk, dv), with every matrix product on the AMX unit (bf16 x bf16 -> float32 tiles)
 * and the maps' softmax, statistics and sums in float32.  A product C (M x N) = A (M x K) B reads A
 * as bf16 rows (K contiguous) and B as packed tiles: for each strip of 16 columns, K / 32 tiles of
 * 16 rows x 16 pairs (row r of a tile holds B[2r][c] and B[2r + 1][c] side by side), 1 KiB each.
 * M, N and K are multiples of 32 (blocks and key ranges are padded with zeros), d and dv multiples
 * of 32.  Built only where the compiler targets AMX (gcc/clang -march=native on such a CPU);
 * difftx_amx() says whether it is here and the kernel may use the tiles (Linux asks the kernel
 * for the tile state once per process). */
/* The two entry points' parameters (the same with and without AMX: without it they return 0). */
#define DIFFTX_ATTN_FORWARD_BF16_ARGS                                                                               \
    const uint16_t *q, const uint16_t *k, int64_t ks, int64_t kr, const uint16_t *v, int64_t vsb, int64_t vsh,      \
        int64_t vr, uint16_t *out, float *lse, int64_t B, int64_t M, int64_t MK, int64_t H, int64_t Hk, int64_t N,  \
        int64_t nk, int64_t d, int64_t dv, int64_t q_start, int causal, int64_t window, int64_t chunk, float scale, \
        float lam, const float *lam_rows, int nthreads
#define DIFFTX_ATTN_BACKWARD_BF16_ARGS                                                                              \
    const uint16_t *q, const uint16_t *k, int64_t ks, int64_t kr, const uint16_t *v, int64_t vsb, int64_t vsh,      \
        int64_t vr, const uint16_t *dout, const float *lse, uint16_t *dq, uint16_t *dk, uint16_t *dv_,             \
        int64_t dvsb, int64_t dvsh, int64_t dvr, float *rs2, int64_t B, int64_t M, int64_t MK, int64_t H,          \
        int64_t Hk, int64_t N, int64_t nk, int64_t d, int64_t dv, int64_t q_start, int causal, int64_t window,     \
        int64_t chunk, float scale, float lam, const float *lam_rows, int nthreads

/* ---- Few-row products (decoding): y (M x N) = x (M x K) W^T [+ b], float32 ----
 * W is (N, K) row-major (a Linear's weight), x and y row-major.  With one token per sequence a
 * projection is a few rows times a whole weight: the time is reading W once.  torch's GEMM for
 * these shapes (MKL, torch 2.13, on an AVX2 AMD EPYC) read W at 3-6 GB/s, no faster on two
 * threads than on one.  Here each thread streams a contiguous share of W's rows once,
 * LR rows at a time, against every row of x (which stays in L1/L2), LM rows of x at a time: LR x LM
 * accumulators (the LR rows stay in L1 between x's steps).  Each
 * output is one vector's lanes summed in a fixed order, so a row's result does not depend on M,
 * on the thread count or on the other rows. */
#define LR 4 /* rows of W per step */
#if LANES == 16
#define LM 4 /* rows of x per step: 16 accumulators of AVX-512's 32 registers */
#else
#define LM 2 /* AVX2's 16 registers: 8 accumulators, 4 vectors of W and one of x (4 rows of W by 2 of x
              * measured a little faster than 2 by 4 on an AMD EPYC) */
#endif

static inline __attribute__((always_inline)) void few_rows_tile(int nr, int mr, const float *x, int64_t K,
                                                                const float *w, float *acc_out, int pf) {
    vf acc[LM][LR];
    for (int i = 0; i < LM; i++)
        for (int r = 0; r < LR; r++) acc[i][r] = (vf){0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        vf wv[LR];
        for (int r = 0; r < LR; r++) wv[r] = r < nr ? *(const vf *)(w + r * K + k) : (vf){0};
        if (pf && (k & (64 / sizeof(float) - 1)) == 0) /* the next LR rows, a cache line of each */
            for (int r = 0; r < LR; r++) __builtin_prefetch(w + (LR + r) * K + k, 0, 0);
        for (int i = 0; i < LM; i++) {
            if (i < mr) {
                const vf xv = *(const vf *)(x + i * K + k);
                for (int r = 0; r < LR; r++)
                    if (r < nr) acc[i][r] += xv * wv[r];
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        for (int r = 0; r < nr; r++) {
            float t = vhsum(acc[i][r]);
            for (int64_t j = k; j < K; j++) t += x[i * K + j] * w[r * K + j];
            acc_out[i * LR + r] = t;
        }
    }
}

void difftx_few_rows_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *b,
                            float *y, int nthreads) {
    const int64_t groups = (N + LR - 1) / LR;
    /* Prefetching the next rows of W in software: 1.1-1.4x for rows of 512 floats (too short for the hardware
     * prefetcher to ramp up within a row), and for 2-8 rows of x; with one row of x and rows of 1408 floats it was
     * 10-20% slower (the hardware prefetcher keeps up, and the prefetches cost instructions).  AMD EPYC, 1 and 2
     * threads. */
    const int pf = M > 1 || K <= 1024;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = g * LR;
        const int nr = N - n0 < LR ? (int)(N - n0) : LR;
        for (int64_t m0 = 0; m0 < M; m0 += LM) {
            const int mr = M - m0 < LM ? (int)(M - m0) : LM;
            float t[LM * LR];
            const float *xm = x + m0 * K, *wn = w + n0 * K;
            if (nr == LR) {
                switch (mr) { /* constant counts, so each keeps its accumulators in registers */
#if LM == 4
                    case 4: few_rows_tile(LR, 4, xm, K, wn, t, pf); break;
                    case 3: few_rows_tile(LR, 3, xm, K, wn, t, pf); break;
#endif
                    case 2: few_rows_tile(LR, 2, xm, K, wn, t, pf); break;
                    default: few_rows_tile(LR, 1, xm, K, wn, t, pf); break;
                }
            } else {
                few_rows_tile(nr, mr, xm, K, wn, t, pf);
            }
            for (int i = 0; i < mr; i++)
                for (int r = 0; r < nr; r++) y[(m0 + i) * N + n0 + r] = t[i * LR + r] + (b ? b[n0 + r] : 0.0f);
        }
    }
}
#undef LR
#undef LM

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DIFFTX_AMX 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DIFFTX_DPBF16 1 /* vdpbf16ps on zmm registers: the bf16 attention kernel's products without AMX */
#endif
#if defined(DIFFTX_AMX) || defined(DIFFTX_DPBF16)
#define DIFFTX_BF16K 1
#endif

#define TILE 512 /* bf16 elements in a packed tile: 16 rows x 32 */

/* The bf16 products' causal limits for the 32 rows from i (see amx_gemm): K tiles to use, columns to write. */
static inline void causal_limits(int64_t i, int64_t N, int64_t K, int64_t kdiag, int64_t ndiag, int64_t *kk_end,
                                 int64_t *n_end) {
    *kk_end = K / 32;
    *n_end = N;
    if (kdiag >= 0 && (kdiag + i + 32 + 31) / 32 < *kk_end) *kk_end = (kdiag + i + 32 + 31) / 32;
    if (ndiag >= 0 && (ndiag + i + 32 + 31) / 32 * 32 < *n_end) *n_end = (ndiag + i + 32 + 31) / 32 * 32;
}

#ifdef DIFFTX_AMX
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

static void amx_configure(void) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

int difftx_amx(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* C (M x N, float32, row stride ldc) (= | +=) A (M x K bf16 rows, stride lda) B (packed: strip j at
 * Bp + j * kt * TILE, kt tiles per strip, the first K / 32 used).  Causal limits per 32 rows i:
 * ``kdiag`` >= 0: K < kdiag + i + 32 only (A zero past it); ``ndiag`` >= 0: columns < ndiag + i + 32
 * only (the rest is left unwritten). */
static void amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *Bp, int64_t kt,
                     float *C, int64_t ldc, int acc, int64_t kdiag, int64_t ndiag) {
    for (int64_t i = 0; i < M; i += 32) {
        int64_t kk_end, n_end;
        causal_limits(i, N, K, kdiag, ndiag, &kk_end, &n_end);
        const uint16_t *a0 = A + i * lda, *a1 = A + (i + 16) * lda;
        for (int64_t j = 0; j < n_end; j += 32) {
            float *c00 = C + i * ldc + j, *c10 = C + (i + 16) * ldc + j;
            if (acc) {
                _tile_loadd(0, c00, ldc * 4);
                _tile_loadd(1, c00 + 16, ldc * 4);
                _tile_loadd(2, c10, ldc * 4);
                _tile_loadd(3, c10 + 16, ldc * 4);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            const uint16_t *b0 = Bp + (j / 16) * kt * TILE, *b1 = b0 + kt * TILE;
            for (int64_t kk = 0; kk < kk_end; kk++) {
                _tile_loadd(4, a0 + kk * 32, lda * 2);
                _tile_loadd(5, a1 + kk * 32, lda * 2);
                _tile_loadd(6, b0 + kk * TILE, 64);
                _tile_loadd(7, b1 + kk * TILE, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c00, ldc * 4);
            _tile_stored(1, c00 + 16, ldc * 4);
            _tile_stored(2, c10, ldc * 4);
            _tile_stored(3, c10 + 16, ldc * 4);
        }
    }
}
#else
int difftx_amx(void) { return 0; }
#endif

#ifdef DIFFTX_DPBF16
/* The register block of the bf16 products without AMX: rows [0, mr) (mr <= 8) of C (16 nv columns, nv 1 or 2) =
 * A rows (lda) x the strip pair at b0 (strips kstride tiles apart; strip 0 alone when nv is 1), over the first kt
 * tiles of the contraction, then, with half, the first 8 pair rows (16 values) of tile kt; A's pairs broadcast
 * against packed rows (vdpbf16ps: acc += a0 b0 + a1 b1 per float32 lane), 8 nv float32 accumulators.  Pair p of
 * A's row m is at a + m lda + p ps: ps 2 for row-major A, 32 for A^T packed as a B operand (pack_bn's layout,
 * where a row's pairs are 32 elements apart; callers pass ps as a constant).
 * Epilogue: + bias[0:16 nv] (float32) when given; then into cb (bf16, nearest-even) when given, else cf
 * (float32).  acc: the sums start from cf's values. */
#define DOT_STEP(KK, R)                                                                            \
    do {                                                                                           \
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(b0 + (KK) * TILE + (R) * 32);             \
        const __m512bh v1 = nv == 2 ? (__m512bh)_mm512_loadu_si512(b1 + (KK) * TILE + (R) * 32) : v0; \
        DIFFTX_UNROLL                                                                              \
        for (int m = 0; m < mr; m++) {                                                             \
            int32_t pair;                                                                          \
            memcpy(&pair, a + m * lda + ((KK) * 16 + (R)) * ps, 4);                                \
            const __m512bh u = (__m512bh)_mm512_set1_epi32(pair);                                  \
            c0[m] = _mm512_dpbf16_ps(c0[m], u, v0);                                                \
            if (nv == 2) c1[m] = _mm512_dpbf16_ps(c1[m], u, v1);                                   \
        }                                                                                          \
    } while (0)

static inline __attribute__((always_inline)) void dot_block(int mr, int nv, const uint16_t *a, int64_t lda, int ps,
                                                            const uint16_t *b0, int64_t kstride, int64_t kt, int half,
                                                            float *cf, int64_t ldc, int acc, uint16_t *cb,
                                                            int64_t ldb, const float *bias) {
    __m512 c0[8], c1[8];
    const uint16_t *b1 = b0 + kstride * TILE;
    DIFFTX_UNROLL
    for (int m = 0; m < mr; m++) {
        c0[m] = acc ? _mm512_loadu_ps(cf + m * ldc) : _mm512_setzero_ps();
        c1[m] = acc && nv == 2 ? _mm512_loadu_ps(cf + m * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t kk = 0; kk < kt; kk++)
        for (int r = 0; r < 16; r++) DOT_STEP(kk, r);
    if (half)
        for (int r = 0; r < 8; r++) DOT_STEP(kt, r);
    DIFFTX_UNROLL
    for (int m = 0; m < mr; m++) {
        __m512 y0 = c0[m], y1 = c1[m];
        if (bias) { /* only then: x + 0 is not x for x = -0 (the attention's products pass none) */
            y0 = _mm512_add_ps(y0, _mm512_loadu_ps(bias));
            if (nv == 2) y1 = _mm512_add_ps(y1, _mm512_loadu_ps(bias + 16));
        }
        if (cb) { /* vround_bf16: subnormal sums kept, as torch's cast keeps them */
            vstore_bf16(cb + m * ldb, (vf)y0);
            if (nv == 2) vstore_bf16(cb + m * ldb + 16, (vf)y1);
        } else {
            _mm512_storeu_ps(cf + m * ldc, y0);
            if (nv == 2) _mm512_storeu_ps(cf + m * ldc + 16, y1);
        }
    }
}

/* dot_block summed over nseg products into one set of accumulators: C rows [0, mr) (16 nv columns) = the sum
 * over s of A_s rows (as[s] + m ldas[s], row-major: pair stride 2) x the strip pair at bs[s] (ksts[s] tiles a
 * strip, the first kts[s] whole, then halves[s] as dot_block's half), stored once: into cb (bf16) when given,
 * else cf (float32).  The sums run in dot_block's order, segment after segment, so they equal a chain of
 * dot_block calls that store and reload float32 between segments, bit for bit. */
static inline __attribute__((always_inline)) void dot_block_segs(int mr, int nv, int nseg, const uint16_t *const *as,
                                                                 const int64_t *ldas, const uint16_t *const *bs,
                                                                 const int64_t *ksts, const int64_t *kts,
                                                                 const int *halves, float *cf, int64_t ldc,
                                                                 uint16_t *cb, int64_t ldb) {
    __m512 c0[8], c1[8];
    const int ps = 2;
    DIFFTX_UNROLL
    for (int m = 0; m < mr; m++) c0[m] = c1[m] = _mm512_setzero_ps();
    for (int sg = 0; sg < nseg; sg++) {
        const uint16_t *a = as[sg], *b0 = bs[sg], *b1 = b0 + ksts[sg] * TILE;
        const int64_t lda = ldas[sg], kt = kts[sg];
        for (int64_t kk = 0; kk < kt; kk++)
            for (int r = 0; r < 16; r++) DOT_STEP(kk, r);
        if (halves[sg])
            for (int r = 0; r < 8; r++) DOT_STEP(kt, r);
    }
    DIFFTX_UNROLL
    for (int m = 0; m < mr; m++) {
        if (cb) {
            vstore_bf16(cb + m * ldb, (vf)c0[m]);
            if (nv == 2) vstore_bf16(cb + m * ldb + 16, (vf)c1[m]);
        } else {
            _mm512_storeu_ps(cf + m * ldc, c0[m]);
            if (nv == 2) _mm512_storeu_ps(cf + m * ldc + 16, c1[m]);
        }
    }
}
#undef DOT_STEP

#define DOT_MR 8 /* rows of C per register block (x 32 columns: 16 accumulators) */

/* amx_gemm's product (same operands, packing and causal limits) on AVX512-BF16, 8 rows x 32 columns of C at a
 * time (dot_block): a packed tile row (16 pairs along K for 16 columns) is one register. */
static void dot_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *Bp, int64_t kt,
                     float *C, int64_t ldc, int acc, int64_t kdiag, int64_t ndiag) {
    for (int64_t i = 0; i < M; i += 32) {
        int64_t kk_end, n_end;
        causal_limits(i, N, K, kdiag, ndiag, &kk_end, &n_end);
        for (int64_t j = 0; j < n_end; j += 32) {
            const uint16_t *b0 = Bp + (j / 16) * kt * TILE;
            for (int64_t ii = i; ii < i + 32; ii += DOT_MR)
                dot_block(DOT_MR, 2, A + ii * lda, lda, 2, b0, kt, kk_end, 0, C + ii * ldc + j, ldc, acc, NULL, 0, NULL);
        }
    }
}

/* C (M x N float32, row stride ldc) += A B with A given as A^T packed as a B operand (pack_bn's layout: strip
 * r of 16 rows of A at Ap + r kt TILE, kt tiles) and B packed (strip j at Bp + j kt TILE, the same kt): the
 * attention's dK = dS^T Q and dV = G^T dO with dS and G in the layout the maps are packed in anyway, so no
 * operand is transposed and the gradients come out row-major.  Causal (diag >= 0): A's row i is zero over
 * the contraction before i - diag (a key's gradient has no term from the queries that cannot see it), so each
 * block of rows starts at the tile holding its first nonzero term. */
static void dot_gemm_at(int64_t M, int64_t N, const uint16_t *Ap, const uint16_t *Bp, int64_t kt, float *C,
                        int64_t ldc, int64_t diag) {
    for (int64_t i = 0; i < M; i += DOT_MR) {
        int64_t k0 = diag >= 0 && i > diag ? (i - diag) / 32 : 0;
        if (k0 > kt) k0 = kt;
        const uint16_t *a = Ap + (i / 16) * kt * TILE + (i % 16) * 2 + k0 * TILE;
        for (int64_t j = 0; j < N; j += 32)
            dot_block(DOT_MR, 2, a, 2, 32, Bp + ((j / 16) * kt + k0) * TILE, kt, kt - k0, 0, C + i * ldc + j, ldc, 1,
                      NULL, 0, NULL);
    }
}
#undef DOT_MR
#endif

#ifdef DIFFTX_BF16K
/* Which products the bf16 attention kernel runs on: 2 AMX tiles (built for them and granted by Linux), 1
 * AVX512-BF16 dot products, 0 neither (the kernel is not taken). */
int difftx_bf16_attention(void) {
#ifdef DIFFTX_AMX
    if (difftx_amx()) return 2;
#endif
#ifdef DIFFTX_DPBF16
    return 1;
#else
    return 0;
#endif
}

static void bf16_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *Bp, int64_t kt,
                      float *C, int64_t ldc, int acc, int64_t kdiag, int64_t ndiag) {
#ifdef DIFFTX_AMX
    if (difftx_amx()) {
        amx_gemm(M, N, K, A, lda, Bp, kt, C, ldc, acc, kdiag, ndiag);
        return;
    }
#endif
#ifdef DIFFTX_DPBF16
    dot_gemm(M, N, K, A, lda, Bp, kt, C, ldc, acc, kdiag, ndiag);
#endif
}

static void tiles_begin(void) { /* each thread configures its tiles */
#ifdef DIFFTX_AMX
    if (difftx_amx()) amx_configure();
#endif
}

static void tiles_end(void) {
#ifdef DIFFTX_AMX
    if (difftx_amx()) _tile_release();
#endif
}

/* A 16 x 16 matrix of 32-bit values (r[i] its rows) transposed in place: four butterfly stages, each
 * swapping the off-diagonal blocks of size b between rows i and i + b. */
static inline void transpose16(vu *r) {
#define DIFFTX_STAGE(b, lo, hi)                                                   \
    for (int i = 0; i < 16; i++)                                                  \
        if (!(i & (b))) {                                                         \
            const vu x = r[i], y = r[i + (b)];                                    \
            r[i] = SHUF2(x, y, vu, DIFFTX_LIST lo);                                \
            r[i + (b)] = SHUF2(x, y, vu, DIFFTX_LIST hi);                          \
        }
    DIFFTX_STAGE(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                 (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
    DIFFTX_STAGE(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                 (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
    DIFFTX_STAGE(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                 (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
    DIFFTX_STAGE(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                 (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef DIFFTX_STAGE
}

/* B = X^T for a product over X's columns: X (n rows of w bf16, or float32 with x_f32, row stride ldx; w a
 * multiple of 16) packed for K = w, N = npad (a multiple of 32; rows past n are zero): strip j, tile kk holds
 * the 32-bit pairs X[16 j + c][32 kk + 2 r : + 2] at row r, column c (past w: zero).  pack_bt_strip: strip j
 * alone. */
static inline __attribute__((always_inline)) void pack_bt_strip(const void *x, int x_f32, int64_t ldx, int64_t n,
                                                                 int64_t w, int64_t j, uint16_t *out) {
    const int64_t kt = (w + 31) / 32, rows = n - j * 16 < 16 ? (n > j * 16 ? n - j * 16 : 0) : 16;
    for (int64_t kk = 0; kk < kt; kk++) {
        const int half = w - kk * 32 < 32; /* w an odd multiple of 16: the last tile's pairs 8-15 are zero */
        vu r[16];
        if (x_f32) {
            for (int64_t c = 0; c < 16; c++) {
                const float *src = (const float *)x + (j * 16 + c) * ldx + kk * 32;
                /* 32 floats rounded to bf16 (nearest-even), as 16 pairs */
                r[c] = c < rows ? vround_bf16_32(*(const vf *)src, half ? (vf){0} : *(const vf *)(src + 16)) : (vu){0};
            }
        } else { /* masked loads: a variable-length copy per row took 3-5x as long (2026-11-27, AMD EPYC) */
            const __mmask16 m = half ? 0xff : 0xffff;
            const uint16_t *src = (const uint16_t *)x + j * 16 * ldx + kk * 32;
            for (int64_t c = 0; c < 16; c++) r[c] = c < rows ? (vu)_mm512_maskz_loadu_epi32(m, src + c * ldx) : (vu){0};
        }
        transpose16(r);
        for (int c = 0; c < 16; c++) memcpy(out + (j * kt + kk) * TILE + c * 32, &r[c], 64); /* kept in registers */
    }
}

static void pack_bt(const uint16_t *x, int64_t ldx, int64_t n, int64_t npad, int64_t w, uint16_t *out) {
    for (int64_t j = 0; j < npad / 16; j++) pack_bt_strip(x, 0, ldx, n, w, j, out);
}

/* Tile kk of pack_bn's output (kt tiles per strip), one strip after another: each strip's tile is 1 KB written
 * front to back.  Row pairs outermost wrote 64 bytes to every strip in turn, kt KB apart (4 KB for a 128-row
 * block of keys, 64 KB for 2048 rows), into one L1 set: the bf16 attention backward 6% slower (DIFF, 4 x 512
 * tokens, AMD Zen 5) and pack_rows 1.4x slower. */
static void pack_bn_tile(const void *x, int x_f32, int64_t ldx, int64_t n, int64_t kt, int64_t kk, int64_t w,
                         uint16_t *out) {
    const vu zero = {0};
    const vf zf = {0};
    for (int64_t j = 0; j < w / 16; j++)
        for (int64_t r = 0; r < 16; r++) {
            const int64_t r0 = kk * 32 + 2 * r, r1 = r0 + 1;
            vu *o = (vu *)(out + (j * kt + kk) * TILE + r * 32);
            if (x_f32) {
                const float *xf = (const float *)x + j * 16;
                *o = vround_bf16_pairs(r0 < n ? *(const vf *)(xf + r0 * ldx) : zf,
                                       r1 < n ? *(const vf *)(xf + r1 * ldx) : zf);
            } else {
                const uint16_t *xh = (const uint16_t *)x + j * 16;
                const vu lo = r0 < n ? vwiden_u16(xh + r0 * ldx) : zero, hi = r1 < n ? vwiden_u16(xh + r1 * ldx) : zero;
                *o = lo | (hi << 16);
            }
        }
}

static void pack_bn(const void *x, int x_f32, int64_t ldx, int64_t n, int64_t npad, int64_t w, uint16_t *out) {
    for (int64_t kk = 0; kk < npad / 32; kk++) pack_bn_tile(x, x_f32, ldx, n, npad / 32, kk, w, out);
}

/* dst (rows x w bf16, contiguous) = src rows (stride lds), rows past n zero. */
static void copy_rows_bf16(const uint16_t *src, int64_t lds, int64_t n, int64_t rows, int64_t w, uint16_t *dst) {
    for (int64_t i = 0; i < rows; i++) {
        if (i < n) memcpy(dst + i * w, src + i * lds, (size_t)w * 2);
        else memset(dst + i * w, 0, (size_t)w * 2);
    }
}

/* dst (w x rows bf16) = src^T (src: n rows of w, stride lds; columns past n zero); rows a multiple of 32,
 * w of 16: rows 2i and 2i + 1 interleaved into 32-bit pairs, then 16 x 16 blocks of pairs transposed. */
static void transpose_bf16_ld(const uint16_t *src, int64_t lds, int64_t n, int64_t rows, int64_t w, uint16_t *dst,
                              int64_t ldd) {
    for (int64_t i0 = 0; i0 < rows; i0 += 32)
        for (int64_t x0 = 0; x0 < w; x0 += 16) {
            vu r[16];
            for (int64_t p = 0; p < 16; p++) {
                const int64_t a = i0 + 2 * p, b = a + 1;
                const vu lo = a < n ? vwiden_u16(src + a * lds + x0) : (vu){0};
                const vu hi = b < n ? vwiden_u16(src + b * lds + x0) : (vu){0};
                r[p] = lo | (hi << 16);
            }
            transpose16(r);
            for (int64_t x = 0; x < 16; x++) memcpy(dst + (x0 + x) * ldd + i0, &r[x], 64);
        }
}

static void transpose_bf16(const uint16_t *src, int64_t lds, int64_t n, int64_t rows, int64_t w, uint16_t *dst) {
    transpose_bf16_ld(src, lds, n, rows, w, dst, rows);
}

/* dst rows j < n (row stride ldd, bf16) = alpha * src^T (src: w rows of >= n floats, row stride lds). */
static void transpose_out(const float *src, int64_t lds, int64_t n, int64_t w, float alpha, uint16_t *dst, int64_t ldd) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t nj = n - j0 < 16 ? n - j0 : 16;
        for (int64_t x0 = 0; x0 < w; x0 += 16) {
            vu r[16]; /* 16 x 16 floats as 32-bit lanes, transposed by shuffles (was a scalar gather per column) */
            for (int64_t x = 0; x < 16; x++) memcpy(&r[x], src + (x0 + x) * lds + j0, 64);
            transpose16(r);
            for (int64_t j = 0; j < nj; j++) {
                vf col;
                memcpy(&col, &r[j], 64);
                vstore(dst + (j0 + j) * ldd, x0, 1, col * alpha, 16);
            }
        }
    }
}

/* dst (cols x rows bf16, row stride ldd) = src^T, src rows x cols (row stride lds): a weight gradient's
 * operand for a GEMM that reads both operands row-major (torch's bf16 GEMM runs dY^T X at about half speed
 * when dY^T is a transposed view, and torch's own bf16 transposing copy moves ~3 GB/s).  Needs rows a
 * multiple of 32 and cols of 16 (returns 0 otherwise); threads take blocks of 32 source rows, each read
 * front to back (an ldd padded past a power of two keeps the 16 output rows written together out of one
 * L1 cache set). */
int difftx_transpose_bf16(const uint16_t *src, int64_t lds, int64_t rows, int64_t cols, uint16_t *dst, int64_t ldd,
                          int nthreads) {
    if (rows % 32 || cols % 16) return 0;
    const int64_t blocks = rows / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < blocks; i++) transpose_bf16_ld(src + i * 32 * lds, lds, 32, 32, cols, dst + i * 32, ldd);
    return 1;
}

/* dst (cols x rows float32, row stride ldd) = float(src^T), src rows x cols bf16 (row stride lds): a weight
 * gradient computed transposed (X^T dY), handed back in the weight's layout and dtype in the pass that
 * casts it.  Needs rows and cols multiples of 16 (returns 0 otherwise); threads take output row blocks. */
int difftx_transpose_bf16_f32(const uint16_t *src, int64_t lds, int64_t rows, int64_t cols, float *dst, int64_t ldd,
                              int nthreads) {
    if (rows % 16 || cols % 16) return 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t x0 = 0; x0 < cols; x0 += 16) /* 16 output rows at a time, written front to back */
        for (int64_t i0 = 0; i0 < rows; i0 += 16) {
            vu r[16];
            for (int64_t p = 0; p < 16; p++)
                r[p] = vwiden_u16(src + (i0 + p) * lds + x0) << 16;
            transpose16(r);
            for (int64_t x = 0; x < 16; x++) memcpy(dst + (x0 + x) * ldd + i0, &r[x], 64);
        }
    return 1;
}

/* dst[0:n] = bf16(a * src (+ b * src2 when src2)), zeros up to width. */
static inline void row_to_bf16(const float *src, float a, const float *src2, float b, uint16_t *dst, int64_t n,
                               int64_t width) {
    int64_t i = 0;
    if (src2) {
        for (; i + LANES <= n; i += LANES)
            vstore(dst, i, 1, *(const vf *)(src + i) * a + *(const vf *)(src2 + i) * b, LANES);
        for (; i < n; i++) dst[i] = f32_to_bf16(src[i] * a + src2[i] * b);
    } else {
        for (; i + LANES <= n; i += LANES) vstore(dst, i, 1, *(const vf *)(src + i) * a, LANES);
        for (; i < n; i++) dst[i] = f32_to_bf16(src[i] * a);
    }
    if (width > n) memset(dst + n, 0, (size_t)(width - n) * 2);
}

/* e[0:n] = exp(scale * (e - max)) (unnormalised); returns the sum, sets *mx to scale * max. */
static inline float exp_row_scaled(float *e, int64_t n, float scale, float *mx_out) {
    __m512 vm = _mm512_set1_ps(-INFINITY), v1 = vm, v2 = vm, v3 = vm;
    int64_t t = 0;
    /* vmaxps(x, m) is x > m ? x : m (m where x is NaN), as the compare-and-select it replaces, in half the time;
     * four chains (one waited on vmaxps's latency every vector), combined the same way: the same maximum */
    for (; t + 4 * LANES <= n; t += 4 * LANES) {
        vm = _mm512_max_ps(_mm512_loadu_ps(e + t), vm);
        v1 = _mm512_max_ps(_mm512_loadu_ps(e + t + LANES), v1);
        v2 = _mm512_max_ps(_mm512_loadu_ps(e + t + 2 * LANES), v2);
        v3 = _mm512_max_ps(_mm512_loadu_ps(e + t + 3 * LANES), v3);
    }
    vm = _mm512_max_ps(_mm512_max_ps(v1, vm), _mm512_max_ps(v3, v2));
    for (; t + LANES <= n; t += LANES) vm = _mm512_max_ps(_mm512_loadu_ps(e + t), vm);
    float mx = -INFINITY;
    for (int64_t l = 0; l < LANES; l++) mx = vm[l] > mx ? vm[l] : mx;
    for (; t < n; t++) mx = e[t] > mx ? e[t] : mx;
    const float ms = mx * scale;
    vf acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf x = vexp_nonpos(*(const vf *)(e + i) * scale - ms);
        *(vf *)(e + i) = x;
        acc += x;
    }
    if (i < n) {
        vf x = (vf){0} - INFINITY;
        memcpy(&x, e + i, (size_t)(n - i) * sizeof(float));
        x = vexp_nonpos(x * scale - ms);
        memcpy(e + i, &x, (size_t)(n - i) * sizeof(float));
        acc += x;
    }
    *mx_out = ms;
    return vhsum(acc);
}

/* e[0:n] = exp(scale * e - lse). */
static inline void exp_lse_row_scaled(float *e, int64_t n, float scale, float lse) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) *(vf *)(e + i) = vexp_nonpos(*(const vf *)(e + i) * scale - lse);
    for (; i < n; i++) e[i] = expf(e[i] * scale - lse);
}

/* dst[0:n] = bf16(w p (g - r)) (w p first, as the float32 maps were), zeros up to width. */
static inline void ds_row_bf16(const float *p, const float *g, float r, float w, int64_t n, int64_t width,
                               uint16_t *dst) {
    int64_t j = 0;
    if (w == 1.0f) { /* x 1 is exact: the map's own product */
        for (; j + LANES <= n; j += LANES) vstore(dst, j, 1, *(const vf *)(p + j) * (*(const vf *)(g + j) - r), LANES);
        for (; j < n; j++) dst[j] = f32_to_bf16(p[j] * (g[j] - r));
    } else {
        for (; j + LANES <= n; j += LANES)
            vstore(dst, j, 1, w * *(const vf *)(p + j) * (*(const vf *)(g + j) - r), LANES);
        for (; j < n; j++) dst[j] = f32_to_bf16(w * p[j] * (g[j] - r));
    }
    if (width > n) memset(dst + n, 0, (size_t)(width - n) * 2);
}

#define PAD32(x) (((x) + 31) / 32 * 32)

/* Query rows whose maps the bf16 forward and backward compute at a time, a multiple of 32 (the products' row
 * groups): each slab's float32 maps (and the backward's dP) are read back from L2 while still there (2 maps x
 * 32 rows x 2048 keys: 512 KB), where a whole block's fell out to L3 (inference blocks run to 1024 rows at 2048
 * keys).  Each element is the same sum either way, so the outputs keep their bits.  Measured on a 2-core Zen 5
 * (benchmarks/performance/results/amd-zen5/session61/): DIFF's inference forward 1.26x faster at 1 x 2048,
 * 1.18x at 1 x 8192, 1.04x at 4 x 512; the training blocks (64-128 rows) were near L2 already. */
#define MAP_SLAB 32

int difftx_attn_forward_bf16(DIFFTX_ATTN_FORWARD_BF16_ARGS) {
    if (!difftx_bf16_attention() || d % 32 || dv % 32 || chunk % 32) return 0;
    const int64_t kpad_all = PAD32(nk), rep = H / Hk, cpad = PAD32(chunk);
    const int64_t nblk = (N + chunk - 1) / chunk, tasks = B * H * nblk;
    uint16_t *kt = (uint16_t *)malloc((size_t)(B * MK * Hk * kpad_all * d) * 2); /* K^T per slice */
    uint16_t *vn = (uint16_t *)malloc((size_t)(B * Hk * kpad_all * dv) * 2);    /* V per (b, hk) */
    int failed = 0;
    if (!kt || !vn) {
        free(kt);
        free(vn);
        return 0;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t s = 0; s < B * MK * Hk; s++) pack_bt(k + s * ks, kr, nk, kpad_all, d, kt + s * kpad_all * d);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t s = 0; s < B * Hk; s++)
        pack_bn(v + (s / Hk) * vsb + (s % Hk) * vsh, 0, vr, nk, kpad_all, dv, vn + s * kpad_all * dv);
#pragma omp parallel num_threads(nthreads)
    {
        tiles_begin();
        float *S = (float *)malloc((size_t)(M * MAP_SLAB * kpad_all) * sizeof(float)); /* one slab's maps */
        float *O = (float *)malloc((size_t)(cpad * dv) * sizeof(float));
        uint16_t *Qb = (uint16_t *)malloc((size_t)(M * cpad * d) * 2), *Pb = (uint16_t *)malloc((size_t)(cpad * kpad_all) * 2);
        const int ok = S && O && Qb && Pb;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!ok) continue; /* every thread still reaches the loop's barrier; the caller raises MemoryError */
            const int64_t blk = nblk - 1 - t / (B * H), bh = t % (B * H), b = bh / H, h = bh % H, hk = h / rep;
            const int64_t i0 = blk * chunk, i1 = i0 + chunk < N ? i0 + chunk : N, c = i1 - i0, cp = PAD32(c);
            /* keys [k0, k0 + ke), the maps' columns [0, ke) */
            const int64_t k0 = attn_block_first(window, q_start, i0);
            const int64_t ke = attn_visible(causal, window, q_start, i1 - 1, nk) - k0, kp = PAD32(ke);
            const int64_t diag = causal ? q_start + i0 - k0 : -1;
            for (int64_t m = 0; m < M; m++)
                copy_rows_bf16(q + (((b * M + m) * H + h) * N + i0) * d, d, c, cp, d, Qb + m * cpad * d);
            for (int64_t i = 0; i < cp; i++) {
                const int64_t si = i % MAP_SLAB; /* the row within its slab */
                if (si == 0) { /* the slab's maps (see MAP_SLAB) */
                    const int64_t rows = cp - i < MAP_SLAB ? cp - i : MAP_SLAB;
                    for (int64_t m = 0; m < M; m++) {
                        const int64_t s = (b * MK + m % MK) * Hk + hk; /* K's slice: its own per map, or one shared */
                        bf16_gemm(rows, kp, d, Qb + (m * cpad + i) * d, d, kt + s * kpad_all * d + k0 / 16 * (d / 32) * TILE,
                                  d / 32, S + m * MAP_SLAB * kp, kp, 0, -1, diag >= 0 ? diag + i : -1);
                    }
                }
                uint16_t *prow = Pb + i * kp;
                if (i >= c) {
                    memset(prow, 0, (size_t)kp * 2);
                    continue;
                }
                const int64_t n = attn_visible(causal, window, q_start, i0 + i, nk) - k0;
                const int64_t lo = attn_first(window, q_start, i0 + i) - k0; /* columns [0, lo): outside the window */
                float *e0 = S + si * kp, mx;
                if (lo) memset(e0, 0, (size_t)lo * sizeof(float));
                const float sum0 = exp_row_scaled(e0 + lo, n - lo, scale, &mx), inv0 = 1.0f / sum0;
                const int64_t row = (b * M * H + h) * N + i0 + i;
                if (lse) lse[row] = mx + logf(sum0);
                if (M == 1) {
                    row_to_bf16(e0, inv0, NULL, 0.0f, prow, n, kp);
                } else {
                    float *e1 = S + (MAP_SLAB + si) * kp, mx1;
                    if (lo) memset(e1, 0, (size_t)lo * sizeof(float));
                    const float sum1 = exp_row_scaled(e1 + lo, n - lo, scale, &mx1), inv1 = 1.0f / sum1;
                    if (lse) lse[row + H * N] = mx1 + logf(sum1);
                    const float l = lam_rows ? lam_rows[(b * H + h) * N + i0 + i] : lam, w1 = -l * inv1;
                    row_to_bf16(e0, inv0, e1, w1, prow, n, kp);
                }
            }
            bf16_gemm(cp, dv, kp, Pb, kp, vn + (b * Hk + hk) * kpad_all * dv + k0 / 32 * TILE, kpad_all / 32, O, dv, 0,
                      diag, -1);
            for (int64_t i = 0; i < c; i++) row_to_bf16(O + i * dv, 1.0f, NULL, 0.0f, out + ((b * N + i0 + i) * H + h) * dv, dv, dv);
        }
        free(S);
        free(O);
        free(Qb);
        free(Pb);
        tiles_end();
    }
    free(kt);
    free(vn);
    return !failed;
}

/* The backward's form for dK and dV: 1 (AVX512-BF16 without AMX, unless a test asked for 0) the products
 * dS^T Q and G^T dO from the packed maps (dot_gemm_at), else dK^T = Q^T dS and dV^T = dO^T G, transposed at
 * the end (AMX tiles read their A rows contiguous).  Both sum the same products in the same order: the same
 * bits.  difftx_attn_bwd_form(f) sets it (f 0 or 1; -1 reads it) and returns it. */
static int bwd_form = 1;
int difftx_attn_bwd_form(int f) {
    if (f == 0 || f == 1) bwd_form = f;
    return bwd_form;
}
static int bwd_at_form(void) {
#ifdef DIFFTX_DPBF16
    return bwd_form && !difftx_amx();
#else
    return 0;
#endif
}
#ifdef DIFFTX_DPBF16
#define DOT_GEMM_AT(...) dot_gemm_at(__VA_ARGS__)
#else
#define DOT_GEMM_AT(...) ((void)0)
#endif

int difftx_attn_backward_bf16(DIFFTX_ATTN_BACKWARD_BF16_ARGS) {
    if (!difftx_bf16_attention() || d % 32 || dv % 32 || chunk % 32) return 0;
    const int at = bwd_at_form(); /* dK, dV row-major through dot_gemm_at (else transposed, as on AMX) */
    const int64_t kpad_all = PAD32(nk), rep = H / Hk, cpad = PAD32(chunk);
    const int64_t nblk = (N + chunk - 1) / chunk;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        tiles_begin();
        const int64_t kpa = kpad_all;
        /* the task's K and V, packed by the thread that reads them (while they are in its cache) */
        uint16_t *kt = (uint16_t *)malloc((size_t)(MK * kpa * d) * 2); /* K^T: S = Q K^T */
        uint16_t *kn = (uint16_t *)malloc((size_t)(MK * kpa * d) * 2); /* K: dQ = dS K */
        uint16_t *vt = (uint16_t *)malloc((size_t)(kpa * dv) * 2);     /* V^T: dP = dO V^T */
        float *S = (float *)malloc((size_t)(M * MAP_SLAB * kpa) * sizeof(float)); /* P_m, one slab's rows */
        float *G = (float *)malloc((size_t)(MAP_SLAB * kpa) * sizeof(float));     /* dP, one slab's rows */
        float *acc = (float *)malloc((size_t)((MK * d + dv) * kpa) * sizeof(float)); /* dK (or ^T) per K slice, dV */
        float *O = (float *)malloc((size_t)(cpad * d) * sizeof(float));
        uint16_t *Qb = (uint16_t *)malloc((size_t)(M * cpad * d) * 2), *QT = (uint16_t *)malloc((size_t)(cpad * d) * 2);
        uint16_t *dOb = (uint16_t *)malloc((size_t)(cpad * dv) * 2), *dOT = (uint16_t *)malloc((size_t)(cpad * dv) * 2);
        uint16_t *Ab = (uint16_t *)malloc((size_t)(M * cpad * kpa) * 2); /* dS_m in bf16 */
        uint16_t *Bv = (uint16_t *)malloc((size_t)(cpad * kpa) * 2);     /* packed: the combined map, then dS_m */
        const int ok = kt && kn && vt && S && G && acc && O && Qb && QT && dOb && dOT && Ab && Bv;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < B * Hk; t++) {
            if (!ok) continue;
            const int64_t b = t / Hk, hk = t % Hk;
            float *dVT = acc + MK * d * kpa;
            for (int64_t m = 0; m < MK; m++) {
                const uint16_t *km = k + ((b * MK + m) * Hk + hk) * ks;
                pack_bt(km, kr, nk, kpa, d, kt + m * kpa * d);
                pack_bn(km, 0, kr, nk, kpa, d, kn + m * kpa * d);
            }
            pack_bt(v + b * vsb + hk * vsh, vr, nk, kpa, dv, vt);
            memset(acc, 0, (size_t)((MK * d + dv) * kpa) * sizeof(float));
            for (int64_t h = hk * rep; h < (hk + 1) * rep; h++) {
                for (int64_t blk = 0; blk < nblk; blk++) {
                    const int64_t i0 = blk * chunk, i1 = i0 + chunk < N ? i0 + chunk : N, c = i1 - i0, cp = PAD32(c);
                    /* keys [k0, k0 + ke), the maps' columns [0, ke) (the forward's) */
                    const int64_t k0 = attn_block_first(window, q_start, i0);
                    const int64_t ke = attn_visible(causal, window, q_start, i1 - 1, nk) - k0, kp = PAD32(ke);
                    const int64_t diag = causal ? q_start + i0 - k0 : -1;
                    for (int64_t m = 0; m < M; m++)
                        copy_rows_bf16(q + (((b * M + m) * H + h) * N + i0) * d, d, c, cp, d, Qb + m * cpad * d);
                    copy_rows_bf16(dout + ((b * N + i0) * H + h) * dv, H * dv, c, cp, dv, dOb);
                    float lrow[2] = {0.0f, 0.0f};
                    for (int64_t i = 0; i < cp; i++) {
                        const int64_t si = i % MAP_SLAB; /* the row within its slab (see MAP_SLAB) */
                        if (si == 0) { /* the slab's maps again, and its dP = dO V^T */
                            const int64_t rows = cp - i < MAP_SLAB ? cp - i : MAP_SLAB, nd = diag >= 0 ? diag + i : -1;
                            for (int64_t m = 0; m < M; m++)
                                bf16_gemm(rows, kp, d, Qb + (m * cpad + i) * d, d,
                                          kt + (m % MK) * kpa * d + k0 / 16 * (d / 32) * TILE, d / 32,
                                          S + m * MAP_SLAB * kp, kp, 0, -1, nd);
                            bf16_gemm(rows, kp, dv, dOb + i * dv, dv, vt + k0 / 16 * (dv / 32) * TILE, dv / 32, G, kp, 0,
                                      -1, nd);
                        }
                        /* P1 (and P2) from the saved log-sum-exp */
                        float *p0 = S + si * kp, *p1 = S + (MAP_SLAB + si) * kp;
                        const int64_t n = i < c ? attn_visible(causal, window, q_start, i0 + i, nk) - k0 : 0;
                        const int64_t lo = i < c ? attn_first(window, q_start, i0 + i) - k0 : 0; /* outside: [0, lo) */
                        lrow[i & 1] = M == 2 && n ? (lam_rows ? lam_rows[(b * H + h) * N + i0 + i] : lam) : 0.0f;
                        if (n) {
                            const int64_t row = (b * M * H + h) * N + i0 + i;
                            if (lo) {
                                memset(p0, 0, (size_t)lo * sizeof(float));
                                if (M == 2) memset(p1, 0, (size_t)lo * sizeof(float));
                            }
                            exp_lse_row_scaled(p0 + lo, n - lo, scale, lse[row]);
                            if (M == 2) exp_lse_row_scaled(p1 + lo, n - lo, scale, lse[row + H * N]);
                        }
                        memset(p0 + n, 0, (size_t)(kp - n) * sizeof(float));
                        if (M == 2) memset(p1 + n, 0, (size_t)(kp - n) * sizeof(float));
                        if (i & 1) /* rows i - 1 and i (one slab): G = P1 - lambda P2 in float32, packed for dV as
                                    * pack_bn would */
                            for (int64_t j = 0; j < kp / 16; j++) {
                                uint16_t *o = Bv + (j * (cp / 32) + i / 32) * TILE + (i % 32) / 2 * 32;
                                const float *a0 = S + (si - 1) * kp + j * 16, *b0 = a0 + kp;
                                vf ga = *(const vf *)a0, gb = *(const vf *)b0;
                                if (M == 2) {
                                    ga = ga - lrow[0] * *(const vf *)(a0 + MAP_SLAB * kp);
                                    gb = gb - lrow[1] * *(const vf *)(b0 + MAP_SLAB * kp);
                                }
                                *(vu *)o = vround_bf16_pairs(ga, gb);
                            }
                        /* dS_m = w_m P_m (dP - rowsum(P_m dP)), w = 1, -lambda: bf16 */
                        if (i >= c) {
                            for (int64_t m = 0; m < M; m++) memset(Ab + (m * cpad + i) * kp, 0, (size_t)kp * 2);
                            continue;
                        }
                        const float *g = G + si * kp;
                        float r0 = 0.0f;
#pragma omp simd reduction(+ : r0)
                        for (int64_t j = 0; j < n; j++) r0 += p0[j] * g[j];
                        ds_row_bf16(p0, g, r0, 1.0f, n, kp, Ab + i * kp);
                        if (M == 2) {
                            float r1 = 0.0f;
#pragma omp simd reduction(+ : r1)
                            for (int64_t j = 0; j < n; j++) r1 += p1[j] * g[j];
                            rs2[(b * H + h) * N + i0 + i] = r1;
                            const float w1 = -(lam_rows ? lam_rows[(b * H + h) * N + i0 + i] : lam);
                            ds_row_bf16(p1, g, r1, w1, n, kp, Ab + (cpad + i) * kp);
                        }
                    }
                    if (at) { /* dV += G^T dO */
                        pack_bn(dOb, 0, dv, cp, cp, dv, dOT);
                        DOT_GEMM_AT(kp, dv, Bv, dOT, cp / 32, dVT + k0 * dv, dv, diag);
                    } else { /* dV^T += dO^T G */
                        transpose_bf16(dOb, dv, cp, cp, dv, dOT);
                        bf16_gemm(dv, kp, cp, dOT, cp, Bv, cp / 32, dVT + k0, kpa, 1, -1, -1);
                    }
                    for (int64_t m = 0; m < M; m++) {
                        const uint16_t *Am = Ab + m * cpad * kp;
                        /* dQ = scale dS K */
                        bf16_gemm(cp, d, kp, Am, kp, kn + (m % MK) * kpa * d + k0 / 32 * TILE, kpa / 32, O, d, 0, diag,
                                  -1);
                        uint16_t *dqm = dq + (((b * M + m) * H + h) * N + i0) * d;
                        for (int64_t i = 0; i < c; i++) row_to_bf16(O + i * d, scale, NULL, 0.0f, dqm + i * d, d, d);
                        /* dK += dS^T Q, or dK^T += Q^T dS (scale at the end); a shared K (MK 1): both maps'
                         * products into its one accumulator */
                        pack_bn(Am, 0, kp, cp, cp, kp, Bv);
                        if (at) {
                            pack_bn(Qb + m * cpad * d, 0, d, cp, cp, d, QT);
                            DOT_GEMM_AT(kp, d, Bv, QT, cp / 32, acc + (m % MK) * d * kpa + k0 * d, d, diag);
                        } else {
                            transpose_bf16(Qb + m * cpad * d, d, cp, cp, d, QT);
                            bf16_gemm(d, kp, cp, QT, cp, Bv, cp / 32, acc + (m % MK) * d * kpa + k0, kpa, 1, -1, -1);
                        }
                    }
                }
            }
            if (at) {
                for (int64_t m = 0; m < MK; m++) {
                    uint16_t *dkm = dk + ((b * MK + m) * Hk + hk) * nk * d;
                    for (int64_t j = 0; j < nk; j++) row_to_bf16(acc + m * d * kpa + j * d, scale, NULL, 0.0f, dkm + j * d, d, d);
                }
                for (int64_t j = 0; j < nk; j++)
                    row_to_bf16(dVT + j * dv, 1.0f, NULL, 0.0f, dv_ + b * dvsb + hk * dvsh + j * dvr, dv, dv);
            } else {
                for (int64_t m = 0; m < MK; m++)
                    transpose_out(acc + m * d * kpa, kpa, nk, d, scale, dk + ((b * MK + m) * Hk + hk) * nk * d, d);
                transpose_out(dVT, kpa, nk, dv, 1.0f, dv_ + b * dvsb + hk * dvsh, dvr);
            }
        }
        free(kt);
        free(kn);
        free(vt);
        free(S);
        free(G);
        free(acc);
        free(O);
        free(Qb);
        free(QT);
        free(dOb);
        free(dOT);
        free(Ab);
        free(Bv);
        tiles_end();
    }
    return !failed;
}
#else
int difftx_bf16_attention(void) { return 0; }
int difftx_attn_bwd_form(int f) {
    (void)f;
    return 0;
}
int difftx_transpose_bf16(const uint16_t *src, int64_t lds, int64_t rows, int64_t cols, uint16_t *dst, int64_t ldd,
                          int nthreads) {
    return 0;
}
int difftx_transpose_bf16_f32(const uint16_t *src, int64_t lds, int64_t rows, int64_t cols, float *dst, int64_t ldd,
                              int nthreads) {
    return 0;
}
int difftx_attn_forward_bf16(DIFFTX_ATTN_FORWARD_BF16_ARGS) {
    return 0;
}
int difftx_attn_backward_bf16(DIFFTX_ATTN_BACKWARD_BF16_ARGS) {
    return 0;
}
#endif

/* ---------------------------------------------------------------- bf16 linear layers on AVX512-BF16
 * A Linear layer's three training products (y = x W^T, dx = dy W, dW = dy^T x) in bf16 with float32
 * accumulation, on vdpbf16ps, where AMX is not here (AMD Zen 4, Intel Cooper Lake).  torch's bf16 GEMM
 * (oneDNN, torch 2.13) runs the small preset's shapes at 172-199 GFLOP/s on one Zen 4 core inside a training
 * step, 185-210 alone; this register block (dot_gemm's: 8 rows x 32 columns over the whole contraction, A
 * rows read in place, B packed as the attention kernel packs it) at 210-225 alone.  The packing reads a
 * float32 weight directly (autocast's cast to bf16 rounds the same way, nearest-even), a weight gradient is
 * written in the weight's dtype from the float32 sums, and dx of several projections of one input
 * accumulates in float32 across their products (in registers: difftx_dot_linear_sum). */
#ifdef DIFFTX_DPBF16
#define LIN_MR 8 /* rows per register block (dot_block's most) */
#define LIN_IB 64 /* rows per thread task: its A rows stay in L1/L2 while every column strip passes */

/* C (M x N) = A (M x K bf16 rows, lda) B (packed: strip j of 16 columns at Bp + j kst TILE, kst = ceil(K / 32)
 * tiles, the last one half used when K is an odd multiple of 16), N and K multiples of 16, into cb (bf16, ldb) or
 * cf (float32, ldc; acc: +=), + bias (float32, N) when given.  Threads take blocks of LIN_IB rows (of column
 * pairs when there are fewer row blocks than threads); each column strip pair is read once per block, its
 * rows 8 at a time; an odd last strip alone.
 *
 * A weight gradient's two operands both run over the tokens: dW = dY^T X needs dY^T's token pairs side by side
 * and X packed along the tokens.  Two options spare the passes that made them (a transpose of dY, a pack of X,
 * each reading its whole tensor back from memory):
 * - pack_a (row-major A only; M a multiple of 32): the call also writes A packed as a B operand for a product
 *   over its rows (difftx_pack_rows(A, M)'s layout), each block of rows packed by the thread that multiplies
 *   it, while they are in its cache.  The forward's x and the dx product's dY come out packed this way.
 * - a_packed: A is such a packed operand of a matrix Y (K rows, a multiple of 32, of M columns) and the
 *   product is Y^T B: row m of A is Y's column m, whose token pairs sit 32 elements apart (lda is ignored). */
int difftx_dot_linear(const uint16_t *A, int64_t lda, int64_t M, const uint16_t *Bp, int64_t K, int64_t N,
                      float *cf, int64_t ldc, int acc, uint16_t *cb, int64_t ldb, const float *bias, int a_packed,
                      uint16_t *pack_a, int nthreads) {
    if (N % 16 || K % 16 || K < 16 || N < 16 || (!cf && !cb)) return 0;
    if ((a_packed && (K % 32 || M % 16 || pack_a)) || (pack_a && M % 32)) return 0;
    const int64_t kt = K / 32, half = K % 32 != 0, kst = kt + half, pairs = (N + 31) / 32;
    const int64_t rb = (M + LIN_IB - 1) / LIN_IB;
    const int64_t cbs = rb >= nthreads ? 1 : pairs; /* column blocks: strip pairs split when rows are too few */
    const int64_t per = (pairs + cbs - 1) / cbs;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t ib = 0; ib < rb; ib++)
        for (int64_t jb = 0; jb < cbs; jb++) {
            const int64_t i1 = (ib + 1) * LIN_IB < M ? (ib + 1) * LIN_IB : M;
            const int64_t p1 = (jb + 1) * per < pairs ? (jb + 1) * per : pairs;
            if (pack_a && jb == 0) /* this block's rows, whole 32-row tiles (LIN_IB is a multiple of 32) */
                for (int64_t kk = ib * LIN_IB / 32; kk < i1 / 32; kk++) pack_bn_tile(A, 0, lda, M, M / 32, kk, K, pack_a);
            for (int64_t j = jb * per * 32; j < p1 * 32; j += 32) {
                const uint16_t *b0 = Bp + (j / 16) * kst * TILE;
                const float *bj = bias ? bias + j : NULL;
                const int two = N - j >= 32;
                for (int64_t i = ib * LIN_IB; i < i1; i += LIN_MR) {
                    /* packed A: rows i .. i + 7 lie in one 16-column strip of Y, 2 elements apart */
                    const uint16_t *a = a_packed ? A + (i / 16) * kt * TILE + (i % 16) * 2 : A + i * lda;
                    float *c = cf ? cf + i * ldc + j : NULL;
                    uint16_t *o = cb ? cb + i * ldb + j : NULL;
#define LIN_CASE(MR)                                                                          \
    case MR:                                                                                  \
        if (two) dot_block(MR, 2, a, lda, 2, b0, kst, kt, half, c, ldc, acc, o, ldb, bj);      \
        else dot_block(MR, 1, a, lda, 2, b0, kst, kt, half, c, ldc, acc, o, ldb, bj);          \
        break;
                    if (a_packed) { /* M a multiple of 16: whole blocks of 8 rows */
                        if (two) dot_block(LIN_MR, 2, a, 2, 32, b0, kst, kt, half, c, ldc, acc, o, ldb, bj);
                        else dot_block(LIN_MR, 1, a, 2, 32, b0, kst, kt, half, c, ldc, acc, o, ldb, bj);
                    } else {
                        switch (i1 - i < LIN_MR ? i1 - i : LIN_MR) { /* constant counts keep the block in registers */
                            LIN_CASE(8)
                            LIN_CASE(7)
                            LIN_CASE(6)
                            LIN_CASE(5)
                            LIN_CASE(4)
                            LIN_CASE(3)
                            LIN_CASE(2)
                            default: LIN_CASE(1)
                        }
                    }
#undef LIN_CASE
                }
            }
        }
    return 1;
}

/* C (M x N) = sum over s < nseg of A_s (M x K_s bf16 rows, row stride lda[s]) B_s (packed for K_s as in
 * difftx_dot_linear), into cb (bf16, ldb) or cf (float32, ldc): dx of several projections of one input
 * (dx = dY_q W_q + dY_k W_k + dY_v W_v) summed in registers and written once, where a chain of products
 * would store and reload the float32 sums between them (the same bits).  pack_a[s] (or NULL; M a multiple of
 * 32): A_s packed along its rows there too, as difftx_dot_linear's pack_a.  N and every K_s multiples of 16;
 * nseg at most DOT_SEGS. */
#define DOT_SEGS 8
int difftx_dot_linear_sum(int nseg, const uint16_t *const *A, const int64_t *lda, int64_t M, const uint16_t *const *Bp,
                          const int64_t *K, int64_t N, float *cf, int64_t ldc, uint16_t *cb, int64_t ldb,
                          uint16_t *const *pack_a, int nthreads) {
    if (nseg < 1 || nseg > DOT_SEGS || N % 16 || N < 16 || (!cf && !cb)) return 0;
    int64_t kst[DOT_SEGS], kts[DOT_SEGS];
    int halves[DOT_SEGS], packs = 0;
    for (int sg = 0; sg < nseg; sg++) {
        if (K[sg] % 16 || K[sg] < 16) return 0;
        kts[sg] = K[sg] / 32;
        halves[sg] = K[sg] % 32 != 0;
        kst[sg] = kts[sg] + halves[sg];
        packs |= pack_a && pack_a[sg];
    }
    if (packs && M % 32) return 0;
    const int64_t pairs = (N + 31) / 32, rb = (M + LIN_IB - 1) / LIN_IB;
    const int64_t cbs = rb >= nthreads ? 1 : pairs, per = (pairs + cbs - 1) / cbs;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t ib = 0; ib < rb; ib++)
        for (int64_t jb = 0; jb < cbs; jb++) {
            const int64_t i1 = (ib + 1) * LIN_IB < M ? (ib + 1) * LIN_IB : M;
            const int64_t p1 = (jb + 1) * per < pairs ? (jb + 1) * per : pairs;
            if (packs && jb == 0)
                for (int sg = 0; sg < nseg; sg++)
                    if (pack_a[sg])
                        for (int64_t kk = ib * LIN_IB / 32; kk < i1 / 32; kk++)
                            pack_bn_tile(A[sg], 0, lda[sg], M, M / 32, kk, K[sg], pack_a[sg]);
            for (int64_t j = jb * per * 32; j < p1 * 32; j += 32) {
                const uint16_t *bs[DOT_SEGS];
                for (int sg = 0; sg < nseg; sg++) bs[sg] = Bp[sg] + (j / 16) * kst[sg] * TILE;
                const int two = N - j >= 32;
                for (int64_t i = ib * LIN_IB; i < i1; i += LIN_MR) {
                    const uint16_t *as[DOT_SEGS];
                    for (int sg = 0; sg < nseg; sg++) as[sg] = A[sg] + i * lda[sg];
                    float *c = cf ? cf + i * ldc + j : NULL;
                    uint16_t *o = cb ? cb + i * ldb + j : NULL;
#define SUM_CASE(MR)                                                                                \
    case MR:                                                                                        \
        if (two) dot_block_segs(MR, 2, nseg, as, lda, bs, kst, kts, halves, c, ldc, o, ldb);        \
        else dot_block_segs(MR, 1, nseg, as, lda, bs, kst, kts, halves, c, ldc, o, ldb);            \
        break;
                    switch (i1 - i < LIN_MR ? i1 - i : LIN_MR) {
                        SUM_CASE(8)
                        SUM_CASE(7)
                        SUM_CASE(6)
                        SUM_CASE(5)
                        SUM_CASE(4)
                        SUM_CASE(3)
                        SUM_CASE(2)
                        default: SUM_CASE(1)
                    }
#undef SUM_CASE
                }
            }
        }
    return 1;
}
#undef DOT_SEGS

/* B = W^T packed for a product over W's columns (pack_bt's layout): W (n rows of k, row stride ldw; float32 when
 * w_f32, rounded to bf16 nearest-even, else bf16), n and k multiples of 16 (returns 0 otherwise; an odd multiple
 * of 16 of k leaves the last tile's second half zero).  Threads take strips. */
int difftx_pack_wt(const void *w, int w_f32, int64_t ldw, int64_t n, int64_t k, uint16_t *out, int nthreads) {
    if (n % 16 || k % 16) return 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n / 16; j++) pack_bt_strip(w, w_f32, ldw, n, k, j, out);
    return 1;
}

/* B = X packed for a product over X's rows: X (n rows of w, row stride ldx; float32 when x_f32, else bf16),
 * rows past n up to npad rounded up to 32 zero, npad and w multiples of 16 (returns 0 otherwise).  Threads take
 * tiles. */
int difftx_pack_rows(const void *x, int x_f32, int64_t ldx, int64_t n, int64_t npad, int64_t w, uint16_t *out,
                     int nthreads) {
    if (npad % 16 || w % 16 || n > npad) return 0;
    const int64_t kt = (npad + 31) / 32; /* rows from n up to 32 kt are zero */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t kk = 0; kk < kt; kk++) pack_bn_tile(x, x_f32, ldx, n, kt, kk, w, out);
    return 1;
}
#undef LIN_MR
#undef LIN_IB
#else
int difftx_dot_linear_sum(int nseg, const uint16_t *const *A, const int64_t *lda, int64_t M, const uint16_t *const *Bp,
                          const int64_t *K, int64_t N, float *cf, int64_t ldc, uint16_t *cb, int64_t ldb,
                          uint16_t *const *pack_a, int nthreads) {
    return 0;
}
int difftx_dot_linear(const uint16_t *A, int64_t lda, int64_t M, const uint16_t *Bp, int64_t kt, int64_t N,
                      float *cf, int64_t ldc, int acc, uint16_t *cb, int64_t ldb, const float *bias, int a_packed,
                      uint16_t *pack_a, int nthreads) {
    return 0;
}
int difftx_pack_wt(const void *w, int w_f32, int64_t ldw, int64_t n, int64_t k, uint16_t *out, int nthreads) {
    return 0;
}
int difftx_pack_rows(const void *x, int x_f32, int64_t ldx, int64_t n, int64_t npad, int64_t w, uint16_t *out,
                     int nthreads) {
    return 0;
}
#endif
