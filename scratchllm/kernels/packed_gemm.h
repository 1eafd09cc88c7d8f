/* The packed GEMM's C: register tiles, micro-kernels, the GEMM as pool tasks, the quantized
   panels' kernels and the repacking of a GGUF file's blocks into panels. Included by
   scratchllm/kernels/packed_gemm.pyx, whose `cdef extern from "packed_gemm.h"` declares what
   Cython calls. */
#ifndef SCRATCHLLM_PACKED_GEMM_H
#define SCRATCHLLM_PACKED_GEMM_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SCRATCHLLM_BF16_DOT 1
#else
#define SCRATCHLLM_BF16_DOT 0
#endif
#include "simd.h"  /* scratchllm_vf: one register of SCRATCHLLM_VL floats */

/* The register tile, per instruction set: a panel is two vectors wide (NR = 2 VL columns) and a
   tile has up to MAXR rows, so the 2 MAXR accumulators, the panel row's two vectors and one
   broadcast of x fit the register file. AVX-512: 32 zmm, 12 x 32 (24 + 2 + 1 = 27 live);
   AVX2: 16 ymm, 6 x 16 (12 + 2 + 1 = 15 live). More rows would spill the accumulators. */
typedef scratchllm_vf pg_vec;
#define PG_VL SCRATCHLLM_VL
#define PG_NR (2 * PG_VL)
#if SCRATCHLLM_VL == 16
#define PG_MAXR 12
#define PG_CASES PG_CASE(1) PG_CASE(2) PG_CASE(3) PG_CASE(4) PG_CASE(5) PG_CASE(6)                      PG_CASE(7) PG_CASE(8) PG_CASE(9) PG_CASE(10) PG_CASE(11) PG_CASE(12)
#else
#define PG_MAXR 6
#define PG_CASES PG_CASE(1) PG_CASE(2) PG_CASE(3) PG_CASE(4) PG_CASE(5) PG_CASE(6)
#endif
/* PG_CASES: one switch case per tile height R = 1..PG_MAXR, each R a constant in its body */

/* Add (or, when `first`, store) the R x 32 tile acc into c, only its first `cols` columns. */
static inline __attribute__((always_inline)) void pg_store(const int R, pg_vec *acc, float *c, long ldc,
                                                          int cols, int first) {
    for (int r = 0; r < R; r++) {
        float *cr = c + r * ldc;
        if (cols == PG_NR) {
            pg_vec lo = acc[2 * r], hi = acc[2 * r + 1];
            if (!first) {
                pg_vec c0, c1;
                memcpy(&c0, cr, sizeof c0);
                memcpy(&c1, cr + PG_VL, sizeof c1);
                lo += c0;
                hi += c1;
            }
            memcpy(cr, &lo, sizeof lo);
            memcpy(cr + PG_VL, &hi, sizeof hi);
        } else {  /* the right edge of the matrix: only cols < NR columns are real */
            float tmp[PG_NR];
            memcpy(tmp, &acc[2 * r], sizeof(pg_vec));
            memcpy(tmp + PG_VL, &acc[2 * r + 1], sizeof(pg_vec));
            for (int j = 0; j < cols; j++)
                cr[j] = first ? tmp[j] : cr[j] + tmp[j];
        }
    }
}

/* c[0:R, 0:cols] (+)= x[0:R, 0:kc] @ panel[0:kc, 0:NR]; x rows lda apart. R is a constant
   at every call site (see pg_micro_f32), so GCC unrolls the r loops and keeps acc in registers. */
static inline __attribute__((always_inline)) void pg_micro_f32_r(const int R, const float *x, long lda,
                                                                const float *panel, long kc, float *c,
                                                                long ldc, int cols, int first) {
    pg_vec acc[2 * PG_MAXR];
    for (int r = 0; r < 2 * R; r++)
        acc[r] = (pg_vec){0};
    for (long k = 0; k < kc; k++) {
        pg_vec w0, w1;
        memcpy(&w0, panel + k * PG_NR, sizeof w0);
        memcpy(&w1, panel + k * PG_NR + PG_VL, sizeof w1);
        for (int r = 0; r < R; r++) {
            float xr = x[r * lda + k];
            acc[2 * r] += xr * w0;
            acc[2 * r + 1] += xr * w1;
        }
    }
    pg_store(R, acc, c, ldc, cols, first);
}

static void pg_micro_f32(int R, const float *x, long lda, const float *panel, long kc, float *c, long ldc,
                         int cols, int first) {
    switch (R) {
#define PG_CASE(n) case n: pg_micro_f32_r(n, x, lda, panel, kc, c, ldc, cols, first); break;
    PG_CASES
#undef PG_CASE
    }
}

/* bfloat16: x2 holds x's rows as bf16 pairs (one uint32 per two k), lda2 pairs apart; the
   panel is kc2 rows of 32 column pairs. */
#if SCRATCHLLM_BF16_DOT
static inline __attribute__((always_inline)) void pg_micro_bf16_r(const int R, const uint32_t *x2, long lda2,
                                                                 const uint16_t *panel, long kc2, float *c,
                                                                 long ldc, int cols, int first) {
    __m512 acc[2 * PG_MAXR];
    for (int r = 0; r < 2 * R; r++)
        acc[r] = _mm512_setzero_ps();
    for (long k = 0; k < kc2; k++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(panel + k * 2 * PG_NR));
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(panel + k * 2 * PG_NR + PG_NR));
        for (int r = 0; r < R; r++) {
            __m512bh xr = (__m512bh)_mm512_set1_epi32((int)x2[r * lda2 + k]);
            acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], xr, w0);
            acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], xr, w1);
        }
    }
    pg_vec a[2 * PG_MAXR];
    memcpy(a, acc, 2 * R * sizeof(pg_vec));
    pg_store(R, a, c, ldc, cols, first);
}
#else
static inline float pg_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Portable twin: the same products (bf16 values are exact in fp32), one lane at a time.
   vdpbf16ps adds the pair's two products to the lane in one step; here they are added in
   order, so sums may differ in the last bit. */
static inline void pg_micro_bf16_r(const int R, const uint32_t *x2, long lda2, const uint16_t *panel,
                                   long kc2, float *c, long ldc, int cols, int first) {
    pg_vec acc[2 * PG_MAXR];
    float *lanes = (float *)acc;
    memset(acc, 0, sizeof acc);
    for (long k = 0; k < kc2; k++)
        for (int r = 0; r < R; r++) {
            uint32_t pair = x2[r * lda2 + k];
            float x0 = pg_bf16_to_f32((uint16_t)(pair & 0xFFFF)), x1 = pg_bf16_to_f32((uint16_t)(pair >> 16));
            for (int j = 0; j < PG_NR; j++)
                lanes[r * PG_NR + j] += x0 * pg_bf16_to_f32(panel[(k * PG_NR + j) * 2])
                                      + x1 * pg_bf16_to_f32(panel[(k * PG_NR + j) * 2 + 1]);
        }
    pg_store(R, acc, c, ldc, cols, first);
}
#endif

static void pg_micro_bf16(int R, const uint32_t *x2, long lda2, const uint16_t *panel, long kc2, float *c,
                          long ldc, int cols, int first) {
    switch (R) {
#define PG_CASE(n) case n: pg_micro_bf16_r(n, x2, lda2, panel, kc2, c, ldc, cols, first); break;
    PG_CASES
#undef PG_CASE
    }
}

/* fp32 -> bf16, round to nearest even (what vcvtneps2bf16 does); a NaN stays a (quiet) NaN
   instead of rounding into infinity. */
static inline uint16_t pg_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* ---- one GEMM as pool tasks: task p computes the NR columns of panel p, every row ---- */
typedef struct {
    const float *x;           /* float32: x [M, K] */
    const uint32_t *x2;       /* bfloat16: x as pairs [M, K2] */
    const void *panels;       /* [P, K, NR] float32 or [P, K2, NR, 2] uint16 */
    float *c;                 /* [M, n] */
    long M, K, K2, n, kc;
} pg_gemm_job;

/* Columns of y that panel p holds: 32, or fewer at the right edge. */
static inline int pg_panel_cols(long n, long p) {
    return n - p * PG_NR < PG_NR ? (int)(n - p * PG_NR) : PG_NR;
}

static inline void pg_tile(long M, long t, long ntiles, long *r0, int *rows) {
    long base = M / ntiles, extra = M % ntiles;
    *r0 = t * base + (t < extra ? t : extra);
    *rows = (int)(base + (t < extra ? 1 : 0));
}

static void pg_gemm_f32_task(void *ctx, long p) {
    const pg_gemm_job *j = (const pg_gemm_job *)ctx;
    const float *panel = (const float *)j->panels + p * j->K * PG_NR;
    long ntiles = (j->M + PG_MAXR - 1) / PG_MAXR, r0;
    int rows, cols = pg_panel_cols(j->n, p);
    for (long k0 = 0; k0 < j->K; k0 += j->kc) {
        long kcur = j->K - k0 < j->kc ? j->K - k0 : j->kc;
        for (long t = 0; t < ntiles; t++) {
            pg_tile(j->M, t, ntiles, &r0, &rows);
            pg_micro_f32(rows, j->x + r0 * j->K + k0, j->K, panel + k0 * PG_NR, kcur,
                         j->c + r0 * j->n + p * PG_NR, j->n, cols, k0 == 0);
        }
    }
}

static void pg_gemm_bf16_task(void *ctx, long p) {
    const pg_gemm_job *j = (const pg_gemm_job *)ctx;
    const uint16_t *panel = (const uint16_t *)j->panels + p * j->K2 * 2 * PG_NR;
    long ntiles = (j->M + PG_MAXR - 1) / PG_MAXR, r0;
    int rows, cols = pg_panel_cols(j->n, p);
    for (long k0 = 0; k0 < j->K2; k0 += j->kc) {
        long kcur = j->K2 - k0 < j->kc ? j->K2 - k0 : j->kc;
        for (long t = 0; t < ntiles; t++) {
            pg_tile(j->M, t, ntiles, &r0, &rows);
            pg_micro_bf16(rows, j->x2 + r0 * j->K2 + k0, j->K2, panel + k0 * 2 * PG_NR, kcur,
                          j->c + r0 * j->n + p * PG_NR, j->n, cols, k0 == 0);
        }
    }
}

/* a * b + c rounded once, lane by lane: an FMA by instruction, never left to the compiler's
   choice of contracting (or not) where the rounding matters. */
static inline __attribute__((always_inline)) pg_vec pg_fma(pg_vec a, pg_vec b, pg_vec c) {
#if PG_VL == 16
    return (pg_vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif PG_VL == 8 && defined(__FMA__)
    return (pg_vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int i = 0; i < PG_VL; i++)
        c[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return c;
#endif
}

/* ---- quantized panels, w = d * q + m per quantization group of 32 rows and column ----
   8-bit: q uint8 [P, K, NR] in words of 4 rows: for each run of 4 rows of k (k = 4 r .. 4 r + 3)
          the NR columns' 32-bit words lie one after another, byte t of word (r, j) holding
          q[4 r + t, j] + 128 (the int8 biased to an unsigned byte). d and m float32 [P, K/32, NR],
          or d float16 and no m (half: a file's Q8_0). Why words of biased bytes: a 32-bit lane
          holds 4 consecutive k of a column, what an integer dot product instruction multiplies
          with 4 bytes of x (packed_int8.h); and row t of a word is one AND away (pg_q8_weight).
   4-bit: q4 uint8 [P, K/2, NR] in words: for each run of 8 rows of k (k = 8 r .. 8 r + 7) the
          NR columns' 32-bit words lie one after another, word (r, j) = sum over t of
          q[8 r + t, j] << 4 t, q in 0..15 (so its byte s holds rows 8 r + 2 s and 8 r + 2 s + 1,
          low nibble first). d and m float16 [P, K/32, NR] (the file's own half-precision scales;
          Q4_0's offset of -8 is m = -8 d, exact). Per 32 weights of a column: 16 + 4 bytes, Q4_1's
          20. Why words: row t of a word is one AND away (after one shift by 16 for t >= 4), where
          a byte per column needed a byte shuffle per 8 columns, and shuffles and shifts take the
          ports the FMAs need (docs/kernels.md). */
/* The scales and offsets of quantization group g (rows 32g..32g+31) for the panel's NR columns. */
typedef struct { pg_vec d0, d1, m0, m1; } pg_q8_group;

static inline __attribute__((always_inline)) pg_q8_group pg_q8_group_at(const float *d, const float *m, long g) {
    pg_q8_group s;
    memcpy(&s.d0, d + g * PG_NR, sizeof s.d0);
    memcpy(&s.d1, d + g * PG_NR + PG_VL, sizeof s.d1);
    memcpy(&s.m0, m + g * PG_NR, sizeof s.m0);
    memcpy(&s.m1, m + g * PG_NR + PG_VL, sizeof s.m1);
    return s;
}

/* PG_VL float16 -> PG_VL float32 (exact: every half is a float). */
static inline __attribute__((always_inline)) void pg_f16_to_f32(const uint16_t *h, pg_vec *out) {
#if PG_VL == 16
    __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
    memcpy(out, &f, sizeof f);
#elif PG_VL == 8 && defined(__F16C__)
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
    memcpy(out, &f, sizeof f);
#else
    float f[PG_VL];
    for (int i = 0; i < PG_VL; i++) {
        uint32_t s = (uint32_t)(h[i] & 0x8000) << 16, e = (h[i] >> 10) & 0x1F, mant = h[i] & 0x3FF, u;
        if (e == 0) {  /* zero or subnormal: mant * 2^-24, exact */
            float v = (float)mant * (1.0f / 16777216.0f);
            memcpy(&u, &v, sizeof u);
            u |= s;
        } else {
            u = s | (e == 31 ? 0x7F800000u : (e + 112) << 23) | mant << 13;
        }
        memcpy(&f[i], &u, sizeof u);
    }
    memcpy(out, f, sizeof f);
#endif
}

/* m NULL: Q4_0 panels, whose offset -8 d is made here (exact in float32: a power of two times
   a half), the same float that a stored m would widen to. */
static inline __attribute__((always_inline)) pg_q8_group pg_q4_group_at(const uint16_t *d, const uint16_t *m,
                                                                       long g) {
    pg_q8_group s;
    pg_f16_to_f32(d + g * PG_NR, &s.d0);
    pg_f16_to_f32(d + g * PG_NR + PG_VL, &s.d1);
    if (m) {
        pg_f16_to_f32(m + g * PG_NR, &s.m0);
        pg_f16_to_f32(m + g * PG_NR + PG_VL, &s.m1);
    } else {
        s.m0 = s.d0 * -8.0f;
        s.m1 = s.d1 * -8.0f;
    }
    return s;
}

typedef scratchllm_vi pg_vi;  /* signed: AVX2 converts signed ints to floats in one instruction */
typedef unsigned int pg_vu __attribute__((vector_size(4 * PG_VL)));

/* An 8-bit group's scales for its word rows: s[t] = d 256^-t for rows t = 0, 1, 2 of a word
   and d for row 3 (see pg_q8_weight), and m (zero where the panels have none). d 256^-t is
   exact: the panels' scales are 0 or at least 2^-100 in magnitude (pack_q8 checks), so no
   scaled copy is subnormal. */
typedef struct { pg_vec s0[4], s1[4], z0, z1, m0, m1; } pg_q8_scales;  /* z: -128 d */

static inline __attribute__((always_inline)) pg_q8_scales pg_q8_scales_of(const pg_q8_group *g) {
    pg_q8_scales s;
    const float step[4] = {1.0f, 1.0f / 256, 1.0f / 65536, 1.0f};
    for (int t = 0; t < 4; t++) {
        s.s0[t] = g->d0 * step[t];
        s.s1[t] = g->d1 * step[t];
    }
    s.z0 = g->d0 * -128.0f;
    s.z1 = g->d1 * -128.0f;
    s.m0 = g->m0;
    s.m1 = g->m1;
    return s;
}

/* Row t of an 8-bit word row as floats, v the words of NR / 2 columns, by `mode`:
   PG_Q8_NO_M (a file's Q8_0: float16 d, no offset): (q + 128) 256^t is one AND for t < 3 (the
     top byte is shifted down instead: its bits would make the lane negative), converted
     exactly, and fma((q + 128) 256^t, d 256^-t, -128 d) is d q: d (q + 128) and 128 d are exact
     for a float16 d, so the one rounding is of the exact d q, which is a float. ggml's d * q.
   PG_Q8_M_EXACT (offsets, float16 d): q 256^t is the AND less the bias, converted; times
     d 256^-t plus m in one FMA: d q is exact, so its one rounding is ggml's d * q + m.
   PG_Q8_M (offsets, any d): the same q 256^t, times d 256^-t rounded on its own (the empty asm
     keeps GCC from fusing it with the sum), then + m: ggml's two roundings, bit for bit. */
enum { PG_Q8_NO_M = 0, PG_Q8_M_EXACT = 1, PG_Q8_M = 2 };

static inline __attribute__((always_inline)) pg_vec pg_q8_weight(pg_vi v, const int t, pg_vec s, pg_vec z,
                                                               pg_vec m, const int mode) {
    pg_vi u = t == 3 ? (pg_vi)((pg_vu)v >> 24) : v & (0xFF << (8 * t));
    if (mode == PG_Q8_NO_M)
        return pg_fma(__builtin_convertvector(u, pg_vec), s, z);
    pg_vec w = __builtin_convertvector(u - (128 << (8 * (t == 3 ? 0 : t))), pg_vec) * s;
    if (mode == PG_Q8_M)
        SCRATCHLLM_OPAQUE(w);
    return w + m;
}

/* The mode of a panel's 8-bit weights (pg_q8_weight). */
#define PG_Q8_MODE(half, exact) ((half) ? PG_Q8_NO_M : (exact) ? PG_Q8_M_EXACT : PG_Q8_M)

/* The words of 8-bit word row r (rows 4 r .. 4 r + 3) of a panel, the NR columns' two halves. */
static inline __attribute__((always_inline)) void pg_q8_words_at(const uint8_t *q, long r, pg_vi *v0, pg_vi *v1) {
    memcpy(v0, q + r * 4 * PG_NR, sizeof *v0);
    memcpy(v1, q + r * 4 * PG_NR + 4 * PG_VL, sizeof *v1);
}

/* PG_Q8_ROWS(BODY): BODY once per row t = 0..3 of a word row, with w0, w1 that row's weights
   (v0, v1: the word row's words, s: the group's pg_q8_scales, mode in scope). */
#define PG_Q8_ROW(t, BODY) { const int tt = (t); \
    pg_vec w0 = pg_q8_weight(v0, tt, s.s0[tt], s.z0, s.m0, mode), w1 = pg_q8_weight(v1, tt, s.s1[tt], s.z1, s.m1, mode); \
    BODY }
#define PG_Q8_ROWS(BODY) PG_Q8_ROW(0, BODY) PG_Q8_ROW(1, BODY) PG_Q8_ROW(2, BODY) PG_Q8_ROW(3, BODY)

/* A 4-bit group's scales for the word rows: d 16^-u for u = 0..3 (exact: a power of two times
   a float16 value stays a normal float), and m. Row 8 r + t of a column is
   q 16^(t % 4) = (word >> (t < 4 ? 0 : 16)) & (0xF << 4 (t % 4)), converted exactly (< 2^16),
   times d 16^-(t % 4): d q exactly; plus m, rounded once: ggml's d * q + m, bit for bit. */
typedef struct { pg_vec s0[4], s1[4], m0, m1; } pg_q4_group;

static inline __attribute__((always_inline)) pg_q4_group pg_q4_scales_of(pg_q8_group b) {
    pg_q4_group s;
    float u = 1.0f;
    for (int i = 0; i < 4; i++, u *= 0.0625f) {
        s.s0[i] = b.d0 * u;
        s.s1[i] = b.d1 * u;
    }
    s.m0 = b.m0;
    s.m1 = b.m1;
    return s;
}

static inline __attribute__((always_inline)) pg_q4_group pg_q4_scales(const uint16_t *d, const uint16_t *m,
                                                                     long g) {
    return pg_q4_scales_of(pg_q4_group_at(d, m, g));
}

/* PG_VL bytes -> PG_VL floats (exact): unsigned (sgn 0) or signed (sgn 1). */
static inline __attribute__((always_inline)) pg_vec pg_bytes_to_f32(const void *p, const int sgn) {
#if PG_VL == 16
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (pg_vec)_mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif PG_VL == 8 && defined(__AVX2__)
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (pg_vec)_mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    pg_vec f;
    for (int i = 0; i < PG_VL; i++)
        f[i] = sgn ? (float)((const int8_t *)p)[i] : (float)((const uint8_t *)p)[i];
    return f;
#endif
}

/* ---- K-quant panels (kernels/kpanels.py: Q4_K, Q6_K) ----
   q (the panel's q4) holds the low 4 bits in the 4-bit panels' words; per super-block of 256 rows
   and column a float16 D (and Dmin), per group (Q4_K: 32 rows, Q6_K: 16) and column an integer
   scale sc (and min mn); Q6_K's high 2 bits in qh, one word per 16 rows and column (row
   8 r + 2 j + p in bits 2 v of byte j, v = 2 r + p). A group's scale D sc and offset -(Dmin mn)
   are exact float32 products, as ggml makes them. */
enum { PG_K_NONE = 0, PG_K_Q4K = 1, PG_K_Q6K = 2, PG_K_Q5K = 3, PG_K_Q3K = 4, PG_K_Q2K = 5, PG_K_Q50 = 6, PG_K_Q51 = 7 };
typedef struct {
    int kind;
    const uint8_t *qh;        /* high bits: Q6_K [P, K/4, NR], Q5_K [P, K/8, NR] */
    const void *sc;           /* [P, K/group, NR]: uint8 (Q4_K, Q5_K, Q2_K), int8 (Q6_K, Q3_K) */
    const uint8_t *mn;        /* Q4_K, Q5_K, Q2_K: [P, K/group, NR] */
    const uint16_t *D, *Dmin; /* float16 [P, K/256, NR]; Dmin: Q4_K, Q5_K, Q2_K. Q5_0, Q5_1: their d
                                 (and Q5_1's m) per 32 [P, K/32, NR], no sc or mn */
} pg_kq;

/* Rows per float16 scale D: a super-block's 256, or Q5_0's and Q5_1's group of 32. */
#define PG_KQ_DROWS(kind) ((kind) == PG_K_Q50 || (kind) == PG_K_Q51 ? 32 : 256)

/* Rows per scale group: 16 for Q6_K, Q3_K, Q2_K, 32 for the others. */
#define PG_KQ_GROUP(kind) ((kind) == PG_K_Q6K || (kind) == PG_K_Q3K || (kind) == PG_K_Q2K ? 16 : 32)

/* Bytes of high-bit words per row of k and column: Q6_K one word per 16 rows, Q5_K per 32. */
#define PG_KQ_QH_DIV(kind) ((kind) == PG_K_Q6K ? 4 : 8)

/* Q4_K (or Q5_K) group g (rows 32 g .. 32 g + 31 from the panel pointers' row 0, a super-block's
   first): d = D sc and m = -(Dmin mn) for the NR columns. */
static inline __attribute__((always_inline)) pg_q8_group pg_q4k_group_at(const pg_kq *k, long g) {
    pg_q8_group b;
    pg_vec D0, D1, M0, M1;
    pg_f16_to_f32(k->D + (g / 8) * PG_NR, &D0);
    pg_f16_to_f32(k->D + (g / 8) * PG_NR + PG_VL, &D1);
    pg_f16_to_f32(k->Dmin + (g / 8) * PG_NR, &M0);
    pg_f16_to_f32(k->Dmin + (g / 8) * PG_NR + PG_VL, &M1);
    const uint8_t *sc = (const uint8_t *)k->sc + g * PG_NR, *mn = k->mn + g * PG_NR;
    b.d0 = D0 * pg_bytes_to_f32(sc, 0);
    b.d1 = D1 * pg_bytes_to_f32(sc + PG_VL, 0);
    b.m0 = -(M0 * pg_bytes_to_f32(mn, 0));
    b.m1 = -(M1 * pg_bytes_to_f32(mn + PG_VL, 0));
    return b;
}

/* A group g of 16 rows (Q6_K, Q3_K, Q2_K): d = D sc for the NR columns (D of super-block g / 16;
   sc signed but Q2_K's), and Q2_K's m = -(Dmin mn) (m0, m1 untouched for the others). */
static inline __attribute__((always_inline)) void pg_k16_scales_at(const pg_kq *k, long g, pg_vec *d0, pg_vec *d1,
                                                                  pg_vec *m0, pg_vec *m1) {
    pg_vec D0, D1;
    const int sgn = k->kind != PG_K_Q2K;
    pg_f16_to_f32(k->D + (g / 16) * PG_NR, &D0);
    pg_f16_to_f32(k->D + (g / 16) * PG_NR + PG_VL, &D1);
    const uint8_t *sc = (const uint8_t *)k->sc + g * PG_NR;
    *d0 = D0 * pg_bytes_to_f32(sc, sgn);
    *d1 = D1 * pg_bytes_to_f32(sc + PG_VL, sgn);
    if (k->kind == PG_K_Q2K) {
        pg_vec M0, M1;
        pg_f16_to_f32(k->Dmin + (g / 16) * PG_NR, &M0);
        pg_f16_to_f32(k->Dmin + (g / 16) * PG_NR + PG_VL, &M1);
        *m0 = -(M0 * pg_bytes_to_f32(k->mn + g * PG_NR, 0));
        *m1 = -(M1 * pg_bytes_to_f32(k->mn + g * PG_NR + PG_VL, 0));
    }
}

/* A 5-bit group g's d and offset: Q5_K's D sc and -(Dmin mn); Q5_0's float16 d and -16 d (exact);
   Q5_1's d and m. */
static inline __attribute__((always_inline)) pg_q8_group pg_q5_group_at(const pg_kq *k, long g) {
    if (k->kind == PG_K_Q5K)
        return pg_q4k_group_at(k, g);
    pg_q8_group b;
    pg_f16_to_f32(k->D + g * PG_NR, &b.d0);
    pg_f16_to_f32(k->D + g * PG_NR + PG_VL, &b.d1);
    if (k->kind == PG_K_Q51) {
        pg_f16_to_f32(k->Dmin + g * PG_NR, &b.m0);
        pg_f16_to_f32(k->Dmin + g * PG_NR + PG_VL, &b.m1);
    } else {
        b.m0 = b.d0 * -16.0f;
        b.m1 = b.d1 * -16.0f;
    }
    return b;
}

/* The K-quant pointers from row k0 on (k0 a multiple of 256). */
static inline pg_kq pg_kq_from(const pg_kq *k, long k0) {
    pg_kq b = *k;
    if (k->kind == PG_K_NONE)
        return b;
    long groups = k0 / PG_KQ_GROUP(k->kind), drows = PG_KQ_DROWS(k->kind);
    b.sc = k->sc ? (const uint8_t *)k->sc + groups * PG_NR : NULL;
    b.mn = k->mn ? k->mn + groups * PG_NR : NULL;
    b.qh = k->qh ? k->qh + k0 / PG_KQ_QH_DIV(k->kind) * PG_NR : NULL;
    b.D = k->D + (k0 / drows) * PG_NR;
    b.Dmin = k->Dmin ? k->Dmin + (k0 / drows) * PG_NR : NULL;
    return b;
}

/* The words of word row r (NR columns: two native vectors); hi: the same shifted right by 16
   (an arithmetic shift: the sign bits it brings in lie above every mask). */
typedef struct { pg_vi lo0, lo1, hi0, hi1; } pg_q4_words;

static inline __attribute__((always_inline)) pg_q4_words pg_q4_words_at(const uint8_t *q, long r) {
    pg_q4_words v;
    memcpy(&v.lo0, q + r * 4 * PG_NR, sizeof v.lo0);
    memcpy(&v.lo1, q + r * 4 * PG_NR + 4 * PG_VL, sizeof v.lo1);
    v.hi0 = v.lo0 >> 16;
    v.hi1 = v.lo1 >> 16;
    return v;
}

/* Row 8 r + t of the panel as NR floats (t a constant at every call site). */
static inline __attribute__((always_inline)) void pg_q4_row(const pg_q4_words *v, const int t,
                                                           const pg_q4_group *s, pg_vec *w0, pg_vec *w1) {
    const int u = t % 4;
    const pg_vi mask = (pg_vi){0} + (0xF << (4 * u));
    pg_vec f0 = __builtin_convertvector((t < 4 ? v->lo0 : v->hi0) & mask, pg_vec);
    pg_vec f1 = __builtin_convertvector((t < 4 ? v->lo1 : v->hi1) & mask, pg_vec);
    *w0 = f0 * s->s0[u] + s->m0;  /* d q is exact: one FMA, or a product and a sum, give the same */
    *w1 = f1 * s->s1[u] + s->m1;
}

/* PG_Q4_ROWS(BODY): BODY once per row t = 0..7 of word row r, with w0, w1 that row's weights
   (v and s in scope: the row's words and the group's scales). */
#define PG_Q4_ROW(t, BODY) { pg_vec w0, w1; const int tt = (t); pg_q4_row(&v, tt, &s, &w0, &w1); BODY }
#define PG_Q4_ROWS(BODY) PG_Q4_ROW(0, BODY) PG_Q4_ROW(1, BODY) PG_Q4_ROW(2, BODY) PG_Q4_ROW(3, BODY)                              PG_Q4_ROW(4, BODY) PG_Q4_ROW(5, BODY) PG_Q4_ROW(6, BODY) PG_Q4_ROW(7, BODY)

#if PG_VL == 8 && defined(__AVX2__) && defined(__FMA__)
/* pg_q4_pair_words in AVX2 assembly: the two panels' 4 words in registers for all 8 rows (the
   C below reads them once per row: about 2 loads of 32 bytes per cycle is the limit here, see
   docs/kernels.md), 4 accumulators, 4 offsets, the mask, x and 2 temporaries: all 16 ymm.
   The same operations in the same order as the C: one AND, one conversion, one FMA for
   d 16^-u q 16^u + m, one FMA into the column's chain, per 8 columns and row. */
static const int32_t pg_q4_masks[4][8] __attribute__((aligned(32))) = {
    {0xF, 0xF, 0xF, 0xF, 0xF, 0xF, 0xF, 0xF}, {0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0},
    {0xF00, 0xF00, 0xF00, 0xF00, 0xF00, 0xF00, 0xF00, 0xF00},
    {0xF000, 0xF000, 0xF000, 0xF000, 0xF000, 0xF000, 0xF000, 0xF000}};
#define PG_Q4_PAIR_ASM 1
_Static_assert(sizeof(pg_vec) == 32 && offsetof(pg_q4_group, s1) == 128, "the assembly's scale offsets");
/* One vector of 8 columns of one row: word register Q masked (ymm12), converted, times its
   scale at S_OFF(%[S]) plus offset M, then into accumulator A; T a temporary. */
#define PG_Q4_ASM_VEC(Q, T, S_OFF, S, M, A) \
    "vpand %%ymm" #Q ", %%ymm12, %%ymm" #T "\n\t" \
    "vcvtdq2ps %%ymm" #T ", %%ymm" #T "\n\t" \
    "vfmadd132ps " #S_OFF "(%[" #S "]), %[" #M "], %%ymm" #T "\n\t" \
    "vfmadd231ps %%ymm" #T ", %%ymm13, %[" #A "]\n\t"
/* Row t of the word row: x[t] at X_OFF, mask u = t % 4 at MASK_OFF, the halves' scales
   d 16^-u at S_OFF0 and S_OFF1 of each panel's pg_q4_group. */
#define PG_Q4_ASM_ROW(X_OFF, MASK_OFF, S_OFF0, S_OFF1) \
    "vbroadcastss " #X_OFF "(%[x]), %%ymm13\n\t" \
    "vmovdqa " #MASK_OFF "(%[masks]), %%ymm12\n\t" \
    PG_Q4_ASM_VEC(8, 14, S_OFF0, s0, m00, a00) PG_Q4_ASM_VEC(9, 15, S_OFF1, s0, m01, a01) \
    PG_Q4_ASM_VEC(10, 14, S_OFF0, s1, m10, a10) PG_Q4_ASM_VEC(11, 15, S_OFF1, s1, m11, a11)
/* Rows 4..7: the same masks on the words shifted right by 16. */
#define PG_Q4_ASM_SHIFT16 \
    "vpsrld $16, %%ymm8, %%ymm8\n\t" "vpsrld $16, %%ymm9, %%ymm9\n\t" \
    "vpsrld $16, %%ymm10, %%ymm10\n\t" "vpsrld $16, %%ymm11, %%ymm11\n\t"
static inline __attribute__((always_inline)) void pg_q4_pair_words(const uint8_t *qa, const uint8_t *qb,
                                                                  const float *x, const pg_q4_group *sa,
                                                                  const pg_q4_group *sb, pg_vec *acc) {
    pg_vec a00 = acc[0], a01 = acc[1], a10 = acc[2], a11 = acc[3];
    __asm__("vmovdqu 0(%[q0]), %%ymm8\n\t" "vmovdqu 32(%[q0]), %%ymm9\n\t"
            "vmovdqu 0(%[q1]), %%ymm10\n\t" "vmovdqu 32(%[q1]), %%ymm11\n\t"
            PG_Q4_ASM_ROW(0, 0, 0, 128)
            PG_Q4_ASM_ROW(4, 32, 32, 160)
            PG_Q4_ASM_ROW(8, 64, 64, 192)
            PG_Q4_ASM_ROW(12, 96, 96, 224)
            PG_Q4_ASM_SHIFT16
            PG_Q4_ASM_ROW(16, 0, 0, 128)
            PG_Q4_ASM_ROW(20, 32, 32, 160)
            PG_Q4_ASM_ROW(24, 64, 64, 192)
            PG_Q4_ASM_ROW(28, 96, 96, 224)
            : [a00] "+x"(a00), [a01] "+x"(a01), [a10] "+x"(a10), [a11] "+x"(a11)
            : [m00] "x"(sa->m0), [m01] "x"(sa->m1), [m10] "x"(sb->m0), [m11] "x"(sb->m1), [q0] "r"(qa),
              [q1] "r"(qb), [x] "r"(x), [s0] "r"(sa->s0), [s1] "r"(sb->s0), [masks] "r"(pg_q4_masks),
              "m"(*(const char (*)[64])qa), "m"(*(const char (*)[64])qb), "m"(*(const float (*)[8])x),
              "m"(*sa), "m"(*sb)
            : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
    acc[0] = a00;
    acc[1] = a01;
    acc[2] = a10;
    acc[3] = a11;
}
#endif

/* 8-bit panels with float16 scales and no offset (a GGUF file's Q8_0: w = d * q): the group's
   d widened, m zero, so the arithmetic is that of float32 scales with m = 0. */
static inline __attribute__((always_inline)) pg_q8_group pg_q8h_group_at(const uint16_t *d, long g) {
    pg_q8_group s;
    pg_f16_to_f32(d + g * PG_NR, &s.d0);
    pg_f16_to_f32(d + g * PG_NR + PG_VL, &s.d1);
    s.m0 = s.m1 = (pg_vec){0};
    return s;
}

/* A panel's quantized data (bits 8 or 4; 5, 6: Q5_K, Q6_K) and the offsets of row k and group g in it.
   half (8-bit only): d is float16 and there is no m (pg_q8h_group_at). exact: Q8Panels.exact.
   k: K-quant panels' scales (k.kind PG_K_NONE: d and m hold them). */
typedef struct { const void *q, *d, *m; int bits, exact, half; pg_kq k; } pg_qpanel;

/* A 4-bit panel's group g: its float16 d and m, or a Q4_K panel's D sc and -(Dmin mn). */
static inline __attribute__((always_inline)) pg_q4_group pg_q4_scales_at(const pg_qpanel *a, long g) {
    if (a->k.kind == PG_K_Q4K)
        return pg_q4_scales_of(pg_q4k_group_at(&a->k, g));
    return pg_q4_scales((const uint16_t *)a->d, (const uint16_t *)a->m, g);
}

static inline __attribute__((always_inline)) pg_q8_scales pg_group(const pg_qpanel *a, long g) {  /* 8-bit */
    pg_q8_group b = a->half ? pg_q8h_group_at((const uint16_t *)a->d, g)
                            : pg_q8_group_at((const float *)a->d, (const float *)a->m, g);
    return pg_q8_scales_of(&b);
}

static inline long pg_scale_size(int bits, int half) {  /* bytes of one d (or m) */
    return bits == 8 && !half ? sizeof(float) : sizeof(uint16_t);
}

static inline pg_qpanel pg_qpanel_from(const pg_qpanel *a, long k0) {  /* the panel from row k0 on */
    pg_qpanel b = *a;
    long scale = pg_scale_size(a->bits, a->half);
    b.q = (const char *)a->q + (a->bits == 8 ? k0 : k0 / 2) * PG_NR;
    b.d = a->d ? (const char *)a->d + (k0 / 32) * PG_NR * scale : NULL;
    b.m = a->m ? (const char *)a->m + (k0 / 32) * PG_NR * scale : NULL;
    b.k = pg_kq_from(&a->k, k0);
    return b;
}

/* Rows 16 g .. 16 g + 15 of a panel of 16-row groups into buf (rows 16 g on), w = fma(u, d, z):
   Q6_K u = low | high << 4, d = D sc, z = -32 d (the exact d (u - 32): at most 11 + 7 + 5
   significant bits); Q3_K u = low, z = -4 d (exact too); Q2_K u = low, z = -(Dmin mn) (D sc u
   exact, so the one rounding is ggml's). ggml's values. */
static void pg_k16_rows(const pg_qpanel *a, long g, float *buf) {
    pg_vec d[2], z[2];
    pg_k16_scales_at(&a->k, g, &d[0], &d[1], &z[0], &z[1]);
    if (a->k.kind != PG_K_Q2K)
        for (int h = 0; h < 2; h++)
            z[h] = d[h] * (a->k.kind == PG_K_Q6K ? -32.0f : -4.0f);
    for (int h = 0; h < 2; h++) {
        pg_vi H = (pg_vi){0}, w[2];
        if (a->k.kind == PG_K_Q6K)
            memcpy(&H, a->k.qh + g * 4 * PG_NR + h * 4 * PG_VL, sizeof H);
        for (int r = 0; r < 2; r++)
            memcpy(&w[r], (const uint8_t *)a->q + (2 * g + r) * 4 * PG_NR + h * 4 * PG_VL, sizeof w[r]);
        for (int i = 0; i < 16; i++) {
            const int r = i / 8, t = i % 8, at = 8 * (t / 2) + 2 * (2 * r + t % 2);
            pg_vi u = (pg_vi)(((pg_vu)w[r] >> (4 * t)) & 0xF) | (pg_vi)((((pg_vu)H >> at) & 3) << 4);
            pg_vec wt = pg_fma(__builtin_convertvector(u, pg_vec), d[h], z[h]);
            memcpy(buf + (16 * g + i) * PG_NR + h * PG_VL, &wt, sizeof wt);
        }
    }
}

/* Rows 32 g .. 32 g + 31 of a 5-bit panel (Q5_K, Q5_0, Q5_1) into buf (rows 32 g on): u = low |
   high << 4, w = fma(u, d, m) (pg_q5_group_at): d u is exact (at most 11 + 6 + 5 significant
   bits), so the one rounding is ggml's (D sc) u - Dmin mn, d (u - 16) (exact itself), d u + m. */
static void pg_q5k_rows(const pg_qpanel *a, long g, float *buf) {
    pg_q8_group s = pg_q5_group_at(&a->k, g);
    pg_vec d[2] = {s.d0, s.d1}, m[2] = {s.m0, s.m1};
    for (int h = 0; h < 2; h++) {
        pg_vi H;
        memcpy(&H, a->k.qh + g * 4 * PG_NR + h * 4 * PG_VL, sizeof H);
        for (int i = 0; i < 32; i++) {
            const int r = i / 8, t = i % 8, at = 8 * (t / 2) + 2 * r + t % 2;
            pg_vi w;
            memcpy(&w, (const uint8_t *)a->q + (4 * g + r) * 4 * PG_NR + h * 4 * PG_VL, sizeof w);
            pg_vi u = (pg_vi)(((pg_vu)w >> (4 * t)) & 0xF) | (pg_vi)((((pg_vu)H >> at) & 1) << 4);
            pg_vec wt = pg_fma(__builtin_convertvector(u, pg_vec), d[h], m[h]);
            memcpy(buf + (32 * g + i) * PG_NR + h * PG_VL, &wt, sizeof wt);
        }
    }
}

/* Rows 0..kc-1 of a panel block into buf [kc, NR] float32 (kc a multiple of 32). */
static void pg_dequant_block(const pg_qpanel *a, long kc, float *buf) {
    for (long g = 0; g < kc / 32; g++) {
        if (a->bits == 5) {
            pg_q5k_rows(a, g, buf);
            continue;
        }
        if (a->bits == 6) {  /* Q6_K, Q3_K, Q2_K */
            pg_k16_rows(a, 2 * g, buf);
            pg_k16_rows(a, 2 * g + 1, buf);
            continue;
        }
        if (a->bits == 4) {
            pg_q4_group s = pg_q4_scales_at(a, g);
            for (long r = 4 * g; r < 4 * g + 4; r++) {
                pg_q4_words v = pg_q4_words_at((const uint8_t *)a->q, r);
                float *row = buf + 8 * r * PG_NR;
                PG_Q4_ROWS(memcpy(row + tt * PG_NR, &w0, sizeof w0); memcpy(row + tt * PG_NR + PG_VL, &w1, sizeof w1);)
            }
            continue;
        }
        pg_q8_scales s = pg_group(a, g);
        const int mode = PG_Q8_MODE(a->half, a->exact);
        for (long r = 8 * g; r < 8 * g + 8; r++) {
            pg_vi v0, v1;
            pg_q8_words_at((const uint8_t *)a->q, r, &v0, &v1);
            float *row = buf + 4 * r * PG_NR;
            PG_Q8_ROWS(memcpy(row + tt * PG_NR, &w0, sizeof w0); memcpy(row + tt * PG_NR + PG_VL, &w1, sizeof w1);)
        }
    }
}

/* One row tile (M <= PG_MAXR): dequantize each row of the panel into registers and use it
   at once, so the panel streams from memory without pauses (a block-then-compute loop would
   let the prefetcher stall between blocks). bits and mode (8-bit: pg_q8_weight's) are constants
   at every call site. */
static inline __attribute__((always_inline)) void pg_micro_q_r(const int R, const int bits, const int mode,
                                                              const float *x,
                                                              long lda, const pg_qpanel *a, long kc, float *c,
                                                              long ldc, int cols, int first) {
    pg_vec acc[2 * PG_MAXR];
    for (int r = 0; r < 2 * R; r++)
        acc[r] = (pg_vec){0};
    for (long g = 0; g < kc / 32; g++) {
        if (bits == 4) {  /* a word row is eight rows of k, in order */
            pg_q4_group s = pg_q4_scales_at(a, g);
            for (long r8 = 4 * g; r8 < 4 * g + 4; r8++) {
                pg_q4_words v = pg_q4_words_at((const uint8_t *)a->q, r8);
                PG_Q4_ROWS(for (int r = 0; r < R; r++) {
                               float xr = x[r * lda + 8 * r8 + tt];
                               acc[2 * r] += xr * w0;
                               acc[2 * r + 1] += xr * w1;
                           })
            }
            continue;
        }
        pg_q8_scales s = pg_group(a, g);
        for (long r4 = 8 * g; r4 < 8 * g + 8; r4++) {  /* a word row is four rows of k, in order */
            pg_vi v0, v1;
            pg_q8_words_at((const uint8_t *)a->q, r4, &v0, &v1);
            PG_Q8_ROWS(for (int r = 0; r < R; r++) {
                           float xr = x[r * lda + 4 * r4 + tt];
                           acc[2 * r] += xr * w0;
                           acc[2 * r + 1] += xr * w1;
                       })
        }
    }
    pg_store(R, acc, c, ldc, cols, first);
}

static void pg_micro_q(int R, const float *x, long lda, const pg_qpanel *a, long kc, float *c, long ldc,
                       int cols, int first) {
    int mode = PG_Q8_MODE(a->half, a->exact);
    if (a->bits == 8 && mode == PG_Q8_M) {
        switch (R) {
#define PG_CASE(n) case n: pg_micro_q_r(n, 8, PG_Q8_M, x, lda, a, kc, c, ldc, cols, first); break;
        PG_CASES
#undef PG_CASE
        }
    } else if (a->bits == 8 && mode == PG_Q8_M_EXACT) {
        switch (R) {
#define PG_CASE(n) case n: pg_micro_q_r(n, 8, PG_Q8_M_EXACT, x, lda, a, kc, c, ldc, cols, first); break;
        PG_CASES
#undef PG_CASE
        }
    } else if (a->bits == 8) {
        switch (R) {
#define PG_CASE(n) case n: pg_micro_q_r(n, 8, PG_Q8_NO_M, x, lda, a, kc, c, ldc, cols, first); break;
        PG_CASES
#undef PG_CASE
        }
    } else {
        switch (R) {
#define PG_CASE(n) case n: pg_micro_q_r(n, 4, 1, x, lda, a, kc, c, ldc, cols, first); break;
        PG_CASES
#undef PG_CASE
        }
    }
}

typedef struct {
    const float *x;           /* [M, K] */
    const void *q;            /* 8-bit: uint8 [P, K, NR] in words of biased bytes; 4-bit: uint8 [P, K/2, NR] in words */
    const void *d, *m;        /* [P, K/32, NR]: float32 (8-bit) or float16 (4-bit, 8-bit half) */
    float *c;                 /* [M, n] columns of rows ldc apart */
    long M, K, n, ldc, kc, P, chunk, fused_tiles;
    int bits, exact, half;    /* half: 8-bit with float16 d and no m (NULL); bits 5: Q5_K, 6: Q6_K, Q3_K, Q2_K */
    pg_kq k;                  /* K-quant panels (k.kind != PG_K_NONE): their scales, d and m NULL */
} pg_q8_job;

static void pg_gemm_q8_panel(const pg_q8_job *j, long p, float *buf);
static void pg_gemm_q8_pair(const pg_q8_job *j, long p);
static void pg_gemm_q8h_quad(const pg_q8_job *j, long p);

/* Task t: panels t*chunk .. (t+1)*chunk - 1, which lie one after another in memory: a thread
   streams them as one run instead of a short one per panel. One row of x (single-stream
   decode) takes the panels two at a time. */
static void pg_gemm_q8_task(void *ctx, long t) {
    const pg_q8_job *j = (const pg_q8_job *)ctx;
    static __thread float buf[256 * PG_NR] __attribute__((aligned(64)));  /* one block, in L1 */
    long end = (t + 1) * j->chunk < j->P ? (t + 1) * j->chunk : j->P, p = t * j->chunk;
    if (j->M == 1 && j->half)
        for (; p + 3 < end; p += 4)
            pg_gemm_q8h_quad(j, p);
    if (j->M == 1 && j->bits < 5)  /* Q5_K, Q6_K: a block at a time through the buffer */
        for (; p + 1 < end; p += 2)
            pg_gemm_q8_pair(j, p);
    for (; p < end; p++)
        pg_gemm_q8_panel(j, p, buf);
}

/* The K-quant pointers of panel p (K rows). */
static inline pg_kq pg_kq_panel(const pg_kq *k, long K, long p) {
    pg_kq b = *k;
    if (k->kind == PG_K_NONE)
        return b;
    long groups = K / PG_KQ_GROUP(k->kind), drows = PG_KQ_DROWS(k->kind);
    b.sc = k->sc ? (const uint8_t *)k->sc + p * groups * PG_NR : NULL;
    b.mn = k->mn ? k->mn + p * groups * PG_NR : NULL;
    b.qh = k->qh ? k->qh + p * (K / PG_KQ_QH_DIV(k->kind)) * PG_NR : NULL;
    b.D = k->D + p * (K / drows) * PG_NR;
    b.Dmin = k->Dmin ? k->Dmin + p * (K / drows) * PG_NR : NULL;
    return b;
}

static inline pg_qpanel pg_whole_panel(const pg_q8_job *j, long p) {  /* panel p, from row 0 */
    long scale = pg_scale_size(j->bits, j->half), groups = p * (j->K / 32) * PG_NR;
    pg_qpanel whole = {(const char *)j->q + p * (j->bits == 8 ? j->K : j->K / 2) * PG_NR,
                       j->d ? (const char *)j->d + groups * scale : NULL,
                       j->m ? (const char *)j->m + groups * scale : NULL,
                       j->bits, j->exact, j->half, pg_kq_panel(&j->k, j->K, p)};
    return whole;
}

/* One row of x against panels p and p + 1 at once: their four accumulator chains are
   independent, so one panel's FMA latency overlaps the other's unpacking (about 12% faster
   single-stream on Zen 3). Every output is still one chain over k in order, block by block:
   the same sums as pg_gemm_q8_panel. */
static inline __attribute__((always_inline)) void pg_micro_q1x2_r(const int bits, const int mode,
                                                                  const float *x, const pg_qpanel *a,
                                                                  const pg_qpanel *b, long kc, float *c,
                                                                  int cols_b, int first, long ahead) {
    pg_vec acc[4];
    for (int r = 0; r < 4; r++)
        acc[r] = (pg_vec){0};
    for (long g = 0; g < kc / 32; g++) {
        if (bits == 4) {
            pg_q4_group sa = pg_q4_scales_at(a, g), sb = pg_q4_scales_at(b, g);
            for (long r = 4 * g; r < 4 * g + 4; r++) {
                /* the next pair's row r, a pair's time ahead: see pg_gemm_q8_pair */
                __builtin_prefetch((const char *)a->q + r * 4 * PG_NR + ahead);
                __builtin_prefetch((const char *)b->q + r * 4 * PG_NR + ahead);
#ifdef PG_Q4_PAIR_ASM
                pg_q4_pair_words((const uint8_t *)a->q + r * 4 * PG_NR, (const uint8_t *)b->q + r * 4 * PG_NR,
                                 x + 8 * r, &sa, &sb, acc);
                continue;
#endif
                pg_q4_words va = pg_q4_words_at((const uint8_t *)a->q, r),
                            vb = pg_q4_words_at((const uint8_t *)b->q, r);
#define PG_PAIR_ROW(t) { pg_vec wa0, wa1, wb0, wb1; float xk = x[8 * r + (t)];                     pg_q4_row(&va, (t), &sa, &wa0, &wa1); pg_q4_row(&vb, (t), &sb, &wb0, &wb1);                     acc[0] += xk * wa0; acc[1] += xk * wa1; acc[2] += xk * wb0; acc[3] += xk * wb1; }
                PG_PAIR_ROW(0) PG_PAIR_ROW(1) PG_PAIR_ROW(2) PG_PAIR_ROW(3)
                PG_PAIR_ROW(4) PG_PAIR_ROW(5) PG_PAIR_ROW(6) PG_PAIR_ROW(7)
#undef PG_PAIR_ROW
            }
            continue;
        }
        pg_q8_scales sa = pg_group(a, g), sb = pg_group(b, g);
        for (long r = 8 * g; r < 8 * g + 8; r++) {
            pg_vi a0, a1, b0, b1;
            pg_q8_words_at((const uint8_t *)a->q, r, &a0, &a1);
            pg_q8_words_at((const uint8_t *)b->q, r, &b0, &b1);
            for (int t = 0; t < 4; t++) {
                float xk = x[4 * r + t];
                acc[0] += xk * pg_q8_weight(a0, t, sa.s0[t], sa.z0, sa.m0, mode);
                acc[1] += xk * pg_q8_weight(a1, t, sa.s1[t], sa.z1, sa.m1, mode);
                acc[2] += xk * pg_q8_weight(b0, t, sb.s0[t], sb.z0, sb.m0, mode);
                acc[3] += xk * pg_q8_weight(b1, t, sb.s1[t], sb.z1, sb.m1, mode);
            }
        }
    }
    pg_store(1, acc, c, 0, PG_NR, first);  /* panel p is whole: another one follows it */
    pg_store(1, acc + 2, c + PG_NR, 0, cols_b, first);
}

/* A task streams its panels in order, but a pair reads two of them at once, so the pair after
   it starts one stream where the hardware prefetcher was following none: each row of the pair
   prefetches the same row of the next pair (4-bit; the quad loop below does the same for the
   next four panels). Measured on Zen 3, from memory, alternating in one process: the 4-bit
   matrices of a decode step 12-16% faster on one thread, 2-4% on two; the Q8_0 LM head 5-15%
   faster on two; a default-model decode step 5-9% faster on two threads. */
static void pg_gemm_q8_pair(const pg_q8_job *j, long p) {
    pg_qpanel wa = pg_whole_panel(j, p), wb = pg_whole_panel(j, p + 1);
    int cols_b = pg_panel_cols(j->n, p + 1);
    for (long k0 = 0; k0 < j->K; k0 += j->kc) {
        long kcur = j->K - k0 < j->kc ? j->K - k0 : j->kc;
        pg_qpanel a = pg_qpanel_from(&wa, k0), b = pg_qpanel_from(&wb, k0);
        const float *x = j->x + k0;
        float *c = j->c + p * PG_NR;
        if (j->bits == 4)
            pg_micro_q1x2_r(4, 1, x, &a, &b, kcur, c, cols_b, k0 == 0, 2 * (j->K / 2) * PG_NR);
        else if (j->half)
            pg_micro_q1x2_r(8, PG_Q8_NO_M, x, &a, &b, kcur, c, cols_b, k0 == 0, 0);
        else if (j->exact)
            pg_micro_q1x2_r(8, PG_Q8_M_EXACT, x, &a, &b, kcur, c, cols_b, k0 == 0, 0);
        else
            pg_micro_q1x2_r(8, PG_Q8_M, x, &a, &b, kcur, c, cols_b, k0 == 0, 0);
    }
}

/* One row of x against four 8-bit panels without offsets (a file's Q8_0, w = d * q, exact):
   eight accumulator chains, so that neither the FMA latency nor the register file binds (two
   panels at a time left 4 chains for 8 FMAs per k, and their scales spilled). The group's
   scales (pg_q8_scales: four scaled copies of d and -128 d per half panel) are made once into
   ds, in L1, and read by the weights' FMAs from there. Then the float32 kernel's FMA: every
   output is one chain over k in order, block by block, the same sums as pg_gemm_q8_panel. */
static void pg_gemm_q8h_quad(const pg_q8_job *j, long p) {
    const long K = j->K, G = K / 32;
    const uint8_t *q[4];
    const uint16_t *d[4];
    pg_q8_scales ds[4];
    for (int i = 0; i < 4; i++) {
        q[i] = (const uint8_t *)j->q + (p + i) * K * PG_NR;
        d[i] = (const uint16_t *)j->d + (p + i) * G * PG_NR;
    }
    float *c = j->c + p * PG_NR;
    int cols_last = pg_panel_cols(j->n, p + 3);
    for (long k0 = 0; k0 < K; k0 += j->kc) {
        long kend = K - k0 < j->kc ? K : k0 + j->kc;
        pg_vec acc[8];
        for (int r = 0; r < 8; r++)
            acc[r] = (pg_vec){0};
        for (long g = k0 / 32; g < kend / 32; g++) {
            for (int i = 0; i < 4; i++) {
                pg_q8_group b = pg_q8h_group_at(d[i], g);
                ds[i] = pg_q8_scales_of(&b);
            }
            for (long r = 8 * g; r < 8 * g + 8; r++) {
                /* the next four panels' line of this word row: see pg_gemm_q8_pair */
                for (int i = 0; i < 4; i++)
                    __builtin_prefetch(q[i] + r * 4 * PG_NR + 4 * K * PG_NR);
                pg_vi v[8];
                for (int i = 0; i < 4; i++)
                    pg_q8_words_at(q[i], r, &v[2 * i], &v[2 * i + 1]);
                for (int t = 0; t < 4; t++) {
                    float xk = j->x[4 * r + t];
                    for (int i = 0; i < 4; i++) {
                        acc[2 * i] += xk * pg_q8_weight(v[2 * i], t, ds[i].s0[t], ds[i].z0, ds[i].m0, PG_Q8_NO_M);
                        acc[2 * i + 1] += xk * pg_q8_weight(v[2 * i + 1], t, ds[i].s1[t], ds[i].z1, ds[i].m1,
                                                            PG_Q8_NO_M);
                    }
                }
            }
        }
        for (int i = 0; i < 4; i++)
            pg_store(1, acc + 2 * i, c + i * PG_NR, 0, i == 3 ? cols_last : PG_NR, k0 == 0);
    }
}

static void pg_gemm_q8_panel(const pg_q8_job *j, long p, float *buf) {
    pg_qpanel whole = pg_whole_panel(j, p);
    long ntiles = (j->M + PG_MAXR - 1) / PG_MAXR, r0;
    int rows, cols = pg_panel_cols(j->n, p);
    for (long k0 = 0; k0 < j->K; k0 += j->kc) {  /* blocks as the float32 kernel sums them */
        long kcur = j->K - k0 < j->kc ? j->K - k0 : j->kc;
        pg_qpanel block = pg_qpanel_from(&whole, k0);
        /* dequantize in registers, no buffer (tile 2+: q from L1); Q5_K, Q6_K always through the buffer */
        int fused = ntiles <= j->fused_tiles && j->bits != 5 && j->bits != 6;
        if (!fused)
            pg_dequant_block(&block, kcur, buf);
        for (long t = 0; t < ntiles; t++) {
            pg_tile(j->M, t, ntiles, &r0, &rows);
            if (fused)
                pg_micro_q(rows, j->x + r0 * j->K + k0, j->K, &block, kcur, j->c + r0 * j->ldc + p * PG_NR,
                           j->ldc, cols, k0 == 0);
            else
                pg_micro_f32(rows, j->x + r0 * j->K + k0, j->K, buf, kcur,
                             j->c + r0 * j->ldc + p * PG_NR, j->ldc, cols, k0 == 0);
        }
    }
}

/* x rounded to bfloat16 pairs: x2 [M, K2] (K zero-padded to the panels' even 2 K2). */
static void pg_round_x(const float *x, uint32_t *x2, long M, long K, long K2) {
    uint16_t *h = (uint16_t *)x2;
    for (long i = 0; i < M; i++) {
        for (long k = 0; k < K; k++)
            h[i * 2 * K2 + k] = pg_f32_to_bf16(x[i * K + k]);
        for (long k = K; k < 2 * K2; k++)
            h[i * 2 * K2 + k] = 0;
    }
}

/* ---- panels straight from a GGUF file's blocks (load time): bytes moved, nothing computed ----
   rows[o]: address of weight row o's first block (column o of y = x @ W), types[o]: its block
   type (PG_Q4_0, PG_Q4_1, PG_Q8_0). A block holds 32 consecutive k of one row: f16 d, (Q4_1:
   f16 m,) then Q4: 16 bytes, byte i = q[i] | q[16 + i] << 4; Q8_0: 32 int8. Task p fills panel
   p (its NR rows, the right edge's missing ones stay the zeros they were allocated as). */
enum { PG_Q4_0 = 0, PG_Q4_1 = 1, PG_Q8_0 = 2 };
typedef struct {
    const uint8_t *const *rows;
    const uint8_t *types;
    long N, K;
    uint8_t *q;               /* Q4: [P, K/2, NR] nibble pairs in words; Q8_0: [P, K, NR] biased bytes in words */
    uint16_t *d, *m;          /* [P, K/32, NR] float16 bits (m NULL: Q8_0, or Q4_0 only) */
    int overflow;             /* set (atomically) when a Q4_0 scale's -8 d is beyond float16 */
} pg_repack_job;

/* Where byte row k2 (rows 2 k2, 2 k2 + 1 of k) of column j lies in a 4-bit panel's words: byte
   k2 % 4 of word (k2 / 4, j). */
#define PG_Q4_AT(k2, j) (((k2) / 4 * PG_NR + (j)) * 4 + (k2) % 4)
/* Where row k of column j lies in an 8-bit panel's words: byte k % 4 of word (k / 4, j). */
#define PG_Q8_AT(k, j) (((k) / 4 * PG_NR + (j)) * 4 + (k) % 4)

/* -8 d for a float16 d, as float16 bits: exact (a power of two times a half) unless it
   overflows, which returns 0xFFFF (not a value -8 d can take: that is a NaN pattern). */
static inline uint16_t pg_half_times_minus8(uint16_t h) {
    uint16_t sign = (uint16_t)((h ^ 0x8000) & 0x8000), e = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (e == 31)
        return 0xFFFF;  /* inf or NaN scale: refuse as an overflow */
    if (e == 0) {  /* zero or subnormal: mant 2^-24, times 8 is mant << 3 units */
        uint32_t v = (uint32_t)mant << 3;
        if (v < 0x400)
            return sign | (uint16_t)v;
        int shift = 0;  /* normalize: v = 1.f x 2^shift units of 2^-24 */
        while (v >= 0x800) { v >>= 1; shift++; }  /* v < 0x2000 here: at most 2 steps */
        return sign | (uint16_t)((1 + shift) << 10) | (uint16_t)(v & 0x3FF);
    }
    if (e + 3 >= 31)
        return 0xFFFF;
    return sign | (uint16_t)((e + 3) << 10) | mant;
}

/* Row o's block g: its scale (and offset) into the panel's d, m at `at`; returns its quants. */
static inline const uint8_t *pg_repack_scales(const pg_repack_job *j, long o, long g, long at) {
    int type = j->types[o];
    long bs = type == PG_Q8_0 ? 34 : type == PG_Q4_1 ? 20 : 18;
    const uint8_t *blk = j->rows[o] + g * bs;
    memcpy(&j->d[at], blk, 2);
    if (type == PG_Q4_1)
        memcpy(&j->m[at], blk + 2, 2);
    if (type == PG_Q4_0 && j->m) {  /* beside Q4_1 parts: its m = -8 d stored like theirs */
        uint16_t m8 = pg_half_times_minus8(j->d[at]);
        if (m8 == 0xFFFF)
            __atomic_store_n((int *)&j->overflow, 1, __ATOMIC_RELAXED);
        j->m[at] = m8;
    }
    return blk + (type == PG_Q4_1 ? 4 : 2);
}

#if PG_NR == 16 && defined(__AVX2__)
/* A Q4 block's 16 bytes (byte i = q[i] | q[16 + i] << 4) -> this column's 16 bytes of the
   panel's byte rows 16 g .. 16 g + 15: byte t = q[2t] | q[2t + 1] << 4. */
static inline __m128i pg_q4_column_bytes(const uint8_t *qs) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i odd = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    /* the odd bytes' nibbles shifted up within their byte (their high nibbles are 0) */
    __m128i l = _mm_or_si128(_mm_shuffle_epi8(lo, even), _mm_slli_epi16(_mm_shuffle_epi8(lo, odd), 4));
    __m128i h = _mm_or_si128(_mm_shuffle_epi8(hi, even), _mm_slli_epi16(_mm_shuffle_epi8(hi, odd), 4));
    return _mm_unpacklo_epi64(l, h);
}

/* r[i] byte j -> r[j] byte i: 16 x 16 bytes in four rounds of unpacks. */
static inline void pg_transpose16(__m128i r[16]) {
    __m128i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        a[i + 8] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        b[i + 4] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
        b[i + 8] = _mm_unpacklo_epi16(a[8 + 2 * i], a[8 + 2 * i + 1]);
        b[i + 12] = _mm_unpackhi_epi16(a[8 + 2 * i], a[8 + 2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 4; h++) {
            a[h * 4 + i] = _mm_unpacklo_epi32(b[h * 4 + 2 * i], b[h * 4 + 2 * i + 1]);
            a[h * 4 + i + 2] = _mm_unpackhi_epi32(b[h * 4 + 2 * i], b[h * 4 + 2 * i + 1]);
        }
    for (int h = 0; h < 8; h++) {
        r[2 * h] = _mm_unpacklo_epi64(a[2 * h], a[2 * h + 1]);
        r[2 * h + 1] = _mm_unpackhi_epi64(a[2 * h], a[2 * h + 1]);
    }
}
#endif

static void pg_repack_task(void *ctx, long p) {
    const pg_repack_job *j = (const pg_repack_job *)ctx;
    long G = j->K / 32, rows = j->N - p * PG_NR < PG_NR ? j->N - p * PG_NR : PG_NR;
#if PG_NR == 16 && defined(__AVX2__)
    int all_q4 = rows == PG_NR;
    for (long jj = 0; jj < rows; jj++)
        all_q4 &= j->types[p * PG_NR + jj] != PG_Q8_0;
    if (all_q4) {  /* a whole 4-bit panel: each group's 16 x 16 bytes regrouped and transposed in registers */
        for (long g = 0; g < G; g++) {
            __m128i r[16];
            for (long jj = 0; jj < PG_NR; jj++)
                r[jj] = pg_q4_column_bytes(pg_repack_scales(j, p * PG_NR + jj, g, (p * G + g) * PG_NR + jj));
            pg_transpose16(r);  /* r[t]: byte row t of the group, then as words of four byte rows */
            uint8_t *q = j->q + (p * (j->K / 2) + 16 * g) * PG_NR;
            for (int w = 0; w < 4; w++) {
                __m128i ab0 = _mm_unpacklo_epi8(r[4 * w], r[4 * w + 1]), ab1 = _mm_unpackhi_epi8(r[4 * w], r[4 * w + 1]);
                __m128i cd0 = _mm_unpacklo_epi8(r[4 * w + 2], r[4 * w + 3]),
                        cd1 = _mm_unpackhi_epi8(r[4 * w + 2], r[4 * w + 3]);
                _mm_storeu_si128((__m128i *)(q + w * 64), _mm_unpacklo_epi16(ab0, cd0));       /* columns 0..3 */
                _mm_storeu_si128((__m128i *)(q + w * 64 + 16), _mm_unpackhi_epi16(ab0, cd0));  /* 4..7 */
                _mm_storeu_si128((__m128i *)(q + w * 64 + 32), _mm_unpacklo_epi16(ab1, cd1));  /* 8..11 */
                _mm_storeu_si128((__m128i *)(q + w * 64 + 48), _mm_unpackhi_epi16(ab1, cd1));  /* 12..15 */
            }
        }
        return;
    }
#endif
    /* group by group, every row of the panel: a group's output (its 16 or 32 byte rows of NR
       columns) is written whole before the next, while the panel's rows are read as NR
       sequential streams */
    for (long g = 0; g < G; g++) {
        if (rows < PG_NR && j->types[p * PG_NR] == PG_Q8_0)  /* the right edge's missing columns: q = 0 */
            for (long jj = rows; jj < PG_NR; jj++)
                for (int i = 0; i < 32; i++)
                    j->q[(p * j->K + 32 * g) * PG_NR + PG_Q8_AT(i, jj)] = 0x80;
        for (long jj = 0; jj < rows; jj++) {
            long o = p * PG_NR + jj;
            const uint8_t *qs = pg_repack_scales(j, o, g, (p * G + g) * PG_NR + jj);
            if (j->types[o] == PG_Q8_0) {  /* row i of the group, column jj: PG_Q8_AT, biased by 128 */
                uint8_t *q = j->q + (p * j->K + 32 * g) * PG_NR;
                for (int i = 0; i < 32; i++)
                    q[PG_Q8_AT(i, jj)] = (uint8_t)(qs[i] ^ 0x80);
                continue;
            }
            uint8_t *q = j->q + (p * (j->K / 2) + 16 * g) * PG_NR;  /* byte row t, column jj: PG_Q4_AT */
            for (int t = 0; t < 8; t++)  /* k = 2t, 2t + 1 < 16: low nibbles */
                q[PG_Q4_AT(t, jj)] = (uint8_t)((qs[2 * t] & 0x0F) | (qs[2 * t + 1] & 0x0F) << 4);
            for (int t = 8; t < 16; t++)  /* k = 2t, 2t + 1 >= 16: high nibbles of bytes k - 16 */
                q[PG_Q4_AT(t, jj)] = (uint8_t)((qs[2 * t - 16] >> 4) | (qs[2 * t - 15] >> 4) << 4);
        }
    }
}

#endif
