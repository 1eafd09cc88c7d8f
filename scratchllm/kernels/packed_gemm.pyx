# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -ffp-contract=fast
"""y = x @ W for a weight matrix packed once, at load time: the GEMM of every linear layer.

Why not NumPy's `x @ w`: OpenBLAS copies ("packs") the whole of B into its panel layout on
*every* call. For a prefill of 512 rows that copy is noise; for a decode step of 1-64 rows it is
the main cost: the weights are read, written and read again, and at 16 rows OpenBLAS reaches
about 68 GFLOP/s on this machine's two cores, a third of what the FMA units can do. Weights never
change, so we pack them once and the kernel streams them exactly once per call.

Packed layouts (one panel = NR output columns, zero-padded at the right edge). NR is two native
vectors, fixed when the extension is compiled: 32 with AVX-512 (two zmm), 16 with AVX2 (two ymm).
The packing functions below follow the NR of the build, so panels are made and used by one build.
  float32:  [P, K, NR]        panel p, row k holds W[k, NR p : NR p + NR]: two vectors per k.
  bfloat16: [P, K/2, NR, 2]   uint16; row k2 holds, for each of the NR columns, the pair
                              (W[2 k2, j], W[2 k2 + 1, j]) side by side: the operand order of
                              AVX512-BF16's vdpbf16ps, which multiplies 16 such pairs by one
                              broadcast pair of x and adds both products into 16 fp32 lanes.
                              (K is zero-padded to even.)

Loop nest of `matmul`. Panels are the tasks of our own thread pool (scratchllm/kernels/pool.pyx),
not of OpenMP: a thread descheduled by another process just takes fewer panels instead of
stalling every matmul at a barrier.

    for panel p (NR columns of y)                       -> a pool task
      for kc block of K (the panel's kc x NR rows)      -> L1: 256 rows x NR x 4 B = 32 / 16 KiB
        for row tile of x (<= MAXR rows)                -> the block is re-read from L1
          micro-kernel: R x NR accumulators in 2R vector registers, one pass over the block

Why R <= MAXR: the 2R accumulators, the panel row's 2 vectors and 1 broadcast of x must fit the
register file or the accumulators spill to the stack on every k. AVX-512 has 32 zmm: R <= 12,
27 live. AVX2 has 16 ymm: R <= 6, 15 live (a 12 x 16 tile of ymm halves would need 48 and runs
30x slower). Rows are split into balanced tiles (16 rows = 8 + 8, not 12 + 4).
Every weight element loaded feeds R FMAs, so at R = 1 (single-stream decode) the kernel streams
memory and at R >= MAXR / 2 it is FMA-bound.

Every output element is one chain of FMAs over k in order, block by block (kc = 256), whatever NR
and MAXR are: the tile shape changes which elements are computed together, never the sums, so
float32 results are the same on both instruction sets.

bfloat16 keeps fp32's 8-bit exponent and cuts the mantissa to 8 bits (relative rounding
error <= 2^-9). In this mode x is rounded to bfloat16 too (round to nearest even) and the
products are summed in fp32: half the weight bytes and twice the multiplies per instruction.
Without AVX512-BF16 the same numbers come from a plain C loop (slow, for correctness only).

Quantized panels (Q4Panels, Q8Panels: a GGUF file's blocks) are widened in registers to exactly
the float32 values the float32 path holds, and then multiplied by the float32 kernel's FMAs, in
its order. So a weight costs two FMAs (d * q + m, then the product's), plus the unpacking: about
6 cycles per 32 weights of one row on Zen 3 (4-bit), where an integer dot product on x quantized to
8 bits (llama.cpp's way) costs less than half of that. The price of logits equal to float32's
bit for bit; at one row the product is bound by this arithmetic more than by memory.
"""

from typing import NamedTuple

import numpy as np

from scratchllm.kernels import pool as pool_module

from scratchllm.kernels cimport pool
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc


cdef extern from *:
    """
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
    #define PG_CASES PG_CASE(1) PG_CASE(2) PG_CASE(3) PG_CASE(4) PG_CASE(5) PG_CASE(6) \
                     PG_CASE(7) PG_CASE(8) PG_CASE(9) PG_CASE(10) PG_CASE(11) PG_CASE(12)
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

    /* PG_VL int8 -> PG_VL floats (exact). GCC does not vectorize __builtin_convertvector from int8,
       so this is the sign extension and conversion spelled out. */
    static inline __attribute__((always_inline)) void pg_int8_to_f32(const int8_t *q, pg_vec *out) {
    #if PG_VL == 16
        __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        memcpy(out, &f, sizeof f);
    #elif defined(__AVX2__)
        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
        memcpy(out, &f, sizeof f);
    #else
        float f[PG_VL];
        for (int i = 0; i < PG_VL; i++) f[i] = (float)q[i];
        memcpy(out, f, sizeof f);
    #endif
    }

    /* ---- quantized panels, w = d * q + m per quantization group of 32 rows and column ----
       8-bit: q int8 [P, K, NR], d and m float32 [P, K/32, NR].
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

    /* d * a + m as ggml's (and our loader's) dequantization computes it: the product rounded, then
       the sum rounded; so the GEMM is bit-identical to the float32 kernel on the dequantized matrix.
       `exact`: the caller knows d * a is exact in float32 (4-bit panels: an 11-bit float16 d times a
       4-bit a has at most 15 significant bits), so rounding it changes nothing and one FMA (which
       rounds d * a + m once) gives the same float; GCC contracts it. Otherwise (8-bit panels take
       any float32 d) the empty asm stops GCC from contracting the two operations into an FMA. */
    static inline __attribute__((always_inline)) void pg_scale_row(pg_vec a, pg_vec b, const pg_q8_group *s,
                                                                  pg_vec *w0, pg_vec *w1, const int exact) {
        a *= s->d0;
        b *= s->d1;
        if (!exact) {
            SCRATCHLLM_OPAQUE(a);  /* round the products here */
            SCRATCHLLM_OPAQUE(b);
        }
        *w0 = a + s->m0;
        *w1 = b + s->m1;
    }

    /* Row k of an 8-bit panel as NR floats. `exact`: the panels' d are float16 values (a GGUF
       file's), so d * q is exact and one FMA gives d * q + m (see pg_scale_row). */
    static inline __attribute__((always_inline)) void pg_q8_row(const int8_t *qrow, const pg_q8_group *s,
                                                               pg_vec *w0, pg_vec *w1, const int exact) {
        pg_vec a, b;
        pg_int8_to_f32(qrow, &a);
        pg_int8_to_f32(qrow + PG_VL, &b);
        pg_scale_row(a, b, s, w0, w1, exact);
    }

    /* A 4-bit group's scales for the word rows: d 16^-u for u = 0..3 (exact: a power of two times
       a float16 value stays a normal float), and m. Row 8 r + t of a column is
       q 16^(t % 4) = (word >> (t < 4 ? 0 : 16)) & (0xF << 4 (t % 4)), converted exactly (< 2^16),
       times d 16^-(t % 4): d q exactly; plus m, rounded once: ggml's d * q + m, bit for bit. */
    typedef struct { pg_vec s0[4], s1[4], m0, m1; } pg_q4_group;
    typedef scratchllm_vi pg_vi;  /* signed: AVX2 converts signed ints to floats in one instruction */

    static inline __attribute__((always_inline)) pg_q4_group pg_q4_scales(const uint16_t *d, const uint16_t *m,
                                                                         long g) {
        pg_q8_group b = pg_q4_group_at(d, m, g);
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
    #define PG_Q4_ROWS(BODY) PG_Q4_ROW(0, BODY) PG_Q4_ROW(1, BODY) PG_Q4_ROW(2, BODY) PG_Q4_ROW(3, BODY) \
                             PG_Q4_ROW(4, BODY) PG_Q4_ROW(5, BODY) PG_Q4_ROW(6, BODY) PG_Q4_ROW(7, BODY)

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
    #define PG_Q4_ASM_VEC(Q, T, S_OFF, S, M, A) \\
        "vpand %%ymm" #Q ", %%ymm12, %%ymm" #T "\\n\\t" \\
        "vcvtdq2ps %%ymm" #T ", %%ymm" #T "\\n\\t" \\
        "vfmadd132ps " #S_OFF "(%[" #S "]), %[" #M "], %%ymm" #T "\\n\\t" \\
        "vfmadd231ps %%ymm" #T ", %%ymm13, %[" #A "]\\n\\t"
    /* Row t of the word row: x[t] at X_OFF, mask u = t % 4 at MASK_OFF, the halves' scales
       d 16^-u at S_OFF0 and S_OFF1 of each panel's pg_q4_group. */
    #define PG_Q4_ASM_ROW(X_OFF, MASK_OFF, S_OFF0, S_OFF1) \\
        "vbroadcastss " #X_OFF "(%[x]), %%ymm13\\n\\t" \\
        "vmovdqa " #MASK_OFF "(%[masks]), %%ymm12\\n\\t" \\
        PG_Q4_ASM_VEC(8, 14, S_OFF0, s0, m00, a00) PG_Q4_ASM_VEC(9, 15, S_OFF1, s0, m01, a01) \\
        PG_Q4_ASM_VEC(10, 14, S_OFF0, s1, m10, a10) PG_Q4_ASM_VEC(11, 15, S_OFF1, s1, m11, a11)
    /* Rows 4..7: the same masks on the words shifted right by 16. */
    #define PG_Q4_ASM_SHIFT16 \\
        "vpsrld $16, %%ymm8, %%ymm8\\n\\t" "vpsrld $16, %%ymm9, %%ymm9\\n\\t" \\
        "vpsrld $16, %%ymm10, %%ymm10\\n\\t" "vpsrld $16, %%ymm11, %%ymm11\\n\\t"
    static inline __attribute__((always_inline)) void pg_q4_pair_words(const uint8_t *qa, const uint8_t *qb,
                                                                      const float *x, const pg_q4_group *sa,
                                                                      const pg_q4_group *sb, pg_vec *acc) {
        pg_vec a00 = acc[0], a01 = acc[1], a10 = acc[2], a11 = acc[3];
        __asm__("vmovdqu 0(%[q0]), %%ymm8\\n\\t" "vmovdqu 32(%[q0]), %%ymm9\\n\\t"
                "vmovdqu 0(%[q1]), %%ymm10\\n\\t" "vmovdqu 32(%[q1]), %%ymm11\\n\\t"
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

    /* A panel's quantized data (bits 8 or 4) and the offsets of row k and group g in it.
       half (8-bit only): d is float16 and there is no m (pg_q8h_group_at). */
    typedef struct { const void *q, *d, *m; int bits, exact, half; } pg_qpanel;  /* exact: see pg_q8_row */

    static inline __attribute__((always_inline)) pg_q8_group pg_group(const pg_qpanel *a, long g) {  /* 8-bit */
        return a->half ? pg_q8h_group_at((const uint16_t *)a->d, g)
                       : pg_q8_group_at((const float *)a->d, (const float *)a->m, g);
    }

    static inline long pg_scale_size(int bits, int half) {  /* bytes of one d (or m) */
        return bits == 8 && !half ? sizeof(float) : sizeof(uint16_t);
    }

    static inline pg_qpanel pg_qpanel_from(const pg_qpanel *a, long k0) {  /* the panel from row k0 on */
        pg_qpanel b = *a;
        long scale = pg_scale_size(a->bits, a->half);
        b.q = (const char *)a->q + (a->bits == 8 ? k0 : k0 / 2) * PG_NR;
        b.d = (const char *)a->d + (k0 / 32) * PG_NR * scale;
        b.m = a->m ? (const char *)a->m + (k0 / 32) * PG_NR * scale : NULL;
        return b;
    }

    /* Rows 0..kc-1 of a panel block into buf [kc, NR] float32 (kc a multiple of 32). */
    static void pg_dequant_block(const pg_qpanel *a, long kc, float *buf) {
        for (long g = 0; g < kc / 32; g++) {
            if (a->bits == 4) {
                pg_q4_group s = pg_q4_scales((const uint16_t *)a->d, (const uint16_t *)a->m, g);
                for (long r = 4 * g; r < 4 * g + 4; r++) {
                    pg_q4_words v = pg_q4_words_at((const uint8_t *)a->q, r);
                    float *row = buf + 8 * r * PG_NR;
                    PG_Q4_ROWS(memcpy(row + tt * PG_NR, &w0, sizeof w0); memcpy(row + tt * PG_NR + PG_VL, &w1, sizeof w1);)
                }
                continue;
            }
            pg_q8_group s = pg_group(a, g);
            for (long k = 32 * g; k < 32 * g + 32; k++) {
                pg_vec w[2];
                pg_q8_row((const int8_t *)a->q + k * PG_NR, &s, &w[0], &w[1], a->exact);
                memcpy(buf + k * PG_NR, w, sizeof w);  /* row k, NR floats */
            }
        }
    }

    /* One row tile (M <= PG_MAXR): dequantize each row of the panel into registers and use it
       at once, so the panel streams from memory without pauses (a block-then-compute loop would
       let the prefetcher stall between blocks). bits and exact are constants at every call site. */
    static inline __attribute__((always_inline)) void pg_micro_q_r(const int R, const int bits, const int exact,
                                                                  const float *x,
                                                                  long lda, const pg_qpanel *a, long kc, float *c,
                                                                  long ldc, int cols, int first) {
        pg_vec acc[2 * PG_MAXR];
        for (int r = 0; r < 2 * R; r++)
            acc[r] = (pg_vec){0};
        for (long g = 0; g < kc / 32; g++) {
            if (bits == 4) {  /* a word row is eight rows of k, in order */
                pg_q4_group s = pg_q4_scales((const uint16_t *)a->d, (const uint16_t *)a->m, g);
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
            pg_q8_group s = pg_group(a, g);
            for (long k = 32 * g; k < 32 * g + 32; k++) {  /* one row at a time: 2 R + 2 + 1 live vectors */
                pg_vec w0, w1;
                pg_q8_row((const int8_t *)a->q + k * PG_NR, &s, &w0, &w1, exact);
                for (int r = 0; r < R; r++) {
                    float xr = x[r * lda + k];
                    acc[2 * r] += xr * w0;
                    acc[2 * r + 1] += xr * w1;
                }
            }
        }
        pg_store(R, acc, c, ldc, cols, first);
    }

    static void pg_micro_q(int R, const float *x, long lda, const pg_qpanel *a, long kc, float *c, long ldc,
                           int cols, int first) {
        if (a->bits == 8 && a->exact) {
            switch (R) {
    #define PG_CASE(n) case n: pg_micro_q_r(n, 8, 1, x, lda, a, kc, c, ldc, cols, first); break;
            PG_CASES
    #undef PG_CASE
            }
        } else if (a->bits == 8) {
            switch (R) {
    #define PG_CASE(n) case n: pg_micro_q_r(n, 8, 0, x, lda, a, kc, c, ldc, cols, first); break;
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
        const void *q;            /* 8-bit: int8 [P, K, NR]; 4-bit: uint8 [P, K/2, NR] */
        const void *d, *m;        /* [P, K/32, NR]: float32 (8-bit) or float16 (4-bit, 8-bit half) */
        float *c;                 /* [M, n] */
        long M, K, n, kc, P, chunk, fused_tiles;
        int bits, exact, half;    /* half: 8-bit with float16 d and no m (NULL) */
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
        if (j->M == 1)
            for (; p + 1 < end; p += 2)
                pg_gemm_q8_pair(j, p);
        for (; p < end; p++)
            pg_gemm_q8_panel(j, p, buf);
    }

    static inline pg_qpanel pg_whole_panel(const pg_q8_job *j, long p) {  /* panel p, from row 0 */
        long scale = pg_scale_size(j->bits, j->half), groups = p * (j->K / 32) * PG_NR;
        pg_qpanel whole = {(const char *)j->q + p * (j->bits == 8 ? j->K : j->K / 2) * PG_NR,
                           (const char *)j->d + groups * scale, j->m ? (const char *)j->m + groups * scale : NULL,
                           j->bits, j->exact, j->half};
        return whole;
    }

    /* One row of x against panels p and p + 1 at once: their four accumulator chains are
       independent, so one panel's FMA latency overlaps the other's unpacking (about 12% faster
       single-stream on Zen 3). Every output is still one chain over k in order, block by block:
       the same sums as pg_gemm_q8_panel. */
    static inline __attribute__((always_inline)) void pg_micro_q1x2_r(const int bits, const int exact,
                                                                      const float *x, const pg_qpanel *a,
                                                                      const pg_qpanel *b, long kc, float *c,
                                                                      int cols_b, int first, long ahead) {
        pg_vec acc[4];
        for (int r = 0; r < 4; r++)
            acc[r] = (pg_vec){0};
        for (long g = 0; g < kc / 32; g++) {
            if (bits == 4) {
                pg_q4_group sa = pg_q4_scales((const uint16_t *)a->d, (const uint16_t *)a->m, g),
                            sb = pg_q4_scales((const uint16_t *)b->d, (const uint16_t *)b->m, g);
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
    #define PG_PAIR_ROW(t) { pg_vec wa0, wa1, wb0, wb1; float xk = x[8 * r + (t)]; \
                    pg_q4_row(&va, (t), &sa, &wa0, &wa1); pg_q4_row(&vb, (t), &sb, &wb0, &wb1); \
                    acc[0] += xk * wa0; acc[1] += xk * wa1; acc[2] += xk * wb0; acc[3] += xk * wb1; }
                    PG_PAIR_ROW(0) PG_PAIR_ROW(1) PG_PAIR_ROW(2) PG_PAIR_ROW(3)
                    PG_PAIR_ROW(4) PG_PAIR_ROW(5) PG_PAIR_ROW(6) PG_PAIR_ROW(7)
    #undef PG_PAIR_ROW
                }
                continue;
            }
            pg_q8_group sa = pg_group(a, g), sb = pg_group(b, g);
            for (long k = 32 * g; k < 32 * g + 32; k++) {
                pg_vec w0, w1, w2, w3;
                pg_q8_row((const int8_t *)a->q + k * PG_NR, &sa, &w0, &w1, exact);
                pg_q8_row((const int8_t *)b->q + k * PG_NR, &sb, &w2, &w3, exact);
                acc[0] += x[k] * w0;
                acc[1] += x[k] * w1;
                acc[2] += x[k] * w2;
                acc[3] += x[k] * w3;
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
            else if (j->exact)
                pg_micro_q1x2_r(8, 1, x, &a, &b, kcur, c, cols_b, k0 == 0, 0);
            else
                pg_micro_q1x2_r(8, 0, x, &a, &b, kcur, c, cols_b, k0 == 0, 0);
        }
    }

    /* One row of x against four 8-bit panels without offsets (a file's Q8_0, w = d * q, exact):
       eight accumulator chains, so that neither the FMA latency nor the register file binds (two
       panels at a time left 4 chains for 8 FMAs per k, and their scales spilled). The group's
       scales are widened once into ds, in L1, and read by the multiplies from there. w = d * q
       is one rounding-free multiply (d * q + 0 would only turn a -0 weight into +0, which adds
       the same to every sum), then the float32 kernel's FMA: every output is one chain over k in
       order, block by block, the same sums as pg_gemm_q8_panel. */
    static void pg_gemm_q8h_quad(const pg_q8_job *j, long p) {
        const long K = j->K, G = K / 32;
        const int8_t *q[4];
        const uint16_t *d[4];
        float ds[8][PG_VL] __attribute__((aligned(64)));
        for (int i = 0; i < 4; i++) {
            q[i] = (const int8_t *)j->q + (p + i) * K * PG_NR;
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
                    pg_vec h0, h1;
                    pg_f16_to_f32(d[i] + g * PG_NR, &h0);
                    pg_f16_to_f32(d[i] + g * PG_NR + PG_VL, &h1);
                    memcpy(ds[2 * i], &h0, sizeof h0);
                    memcpy(ds[2 * i + 1], &h1, sizeof h1);
                }
                for (long k = 32 * g; k < 32 * g + 32; k++) {
                    float xk = j->x[k];
                    if (!(k & 3))  /* the next four panels' line of rows k..k+3: see pg_gemm_q8_pair */
                        for (int i = 0; i < 4; i++)
                            __builtin_prefetch(q[i] + k * PG_NR + 4 * K * PG_NR);
                    for (int i = 0; i < 4; i++) {
                        pg_vec a, b, da, db;
                        pg_int8_to_f32(q[i] + k * PG_NR, &a);
                        pg_int8_to_f32(q[i] + k * PG_NR + PG_VL, &b);
                        memcpy(&da, ds[2 * i], sizeof da);
                        memcpy(&db, ds[2 * i + 1], sizeof db);
                        a *= da;
                        b *= db;
                        acc[2 * i] += xk * a;
                        acc[2 * i + 1] += xk * b;
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
            int fused = ntiles <= j->fused_tiles;  /* dequantize in registers, no buffer (tile 2+: q from L1) */
            if (!fused)
                pg_dequant_block(&block, kcur, buf);
            for (long t = 0; t < ntiles; t++) {
                pg_tile(j->M, t, ntiles, &r0, &rows);
                if (fused)
                    pg_micro_q(rows, j->x + r0 * j->K + k0, j->K, &block, kcur, j->c + r0 * j->n + p * PG_NR,
                               j->n, cols, k0 == 0);
                else
                    pg_micro_f32(rows, j->x + r0 * j->K + k0, j->K, buf, kcur,
                                 j->c + r0 * j->n + p * PG_NR, j->n, cols, k0 == 0);
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
        uint8_t *q;               /* Q4: [P, K/2, NR] nibble pairs; Q8_0: int8 [P, K, NR] */
        uint16_t *d, *m;          /* [P, K/32, NR] float16 bits (m NULL: Q8_0, or Q4_0 only) */
        int overflow;             /* set (atomically) when a Q4_0 scale's -8 d is beyond float16 */
    } pg_repack_job;

    /* Where byte row k2 (rows 2 k2, 2 k2 + 1 of k) of column j lies in a 4-bit panel's words: byte
       k2 % 4 of word (k2 / 4, j). */
    #define PG_Q4_AT(k2, j) (((k2) / 4 * PG_NR + (j)) * 4 + (k2) % 4)

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
            for (long jj = 0; jj < rows; jj++) {
                long o = p * PG_NR + jj;
                const uint8_t *qs = pg_repack_scales(j, o, g, (p * G + g) * PG_NR + jj);
                if (j->types[o] == PG_Q8_0) {
                    int8_t *q = (int8_t *)j->q + (p * j->K + 32 * g) * PG_NR + jj;
                    for (int i = 0; i < 32; i++)
                        q[i * PG_NR] = (int8_t)qs[i];
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
    """
    int SCRATCHLLM_BF16_DOT
    const char *SCRATCHLLM_COMPILED_FEATURES
    int PG_NR
    int PG_MAXR
    void pg_micro_f32(int R, const float *x, long lda, const float *panel, long kc, float *c, long ldc,
                      int cols, int first) noexcept nogil
    void pg_micro_bf16(int R, const uint32_t *x2, long lda2, const uint16_t *panel, long kc2, float *c, long ldc,
                       int cols, int first) noexcept nogil
    uint16_t pg_f32_to_bf16(float f) noexcept nogil
    ctypedef struct pg_gemm_job:
        const float *x
        const uint32_t *x2
        const void *panels
        float *c
        long M, K, K2, n, kc
    void pg_gemm_f32_task(void *ctx, long p) noexcept nogil
    void pg_gemm_bf16_task(void *ctx, long p) noexcept nogil
    void pg_round_x(const float *x, uint32_t *x2, long M, long K, long K2) noexcept nogil
    ctypedef struct pg_q8_job:
        const float *x
        const void *q
        const void *d
        const void *m
        float *c
        long M, K, n, kc, P, chunk, fused_tiles
        int bits, exact, half
    void pg_gemm_q8_task(void *ctx, long p) noexcept nogil
    int PG_Q4_0, PG_Q4_1, PG_Q8_0
    ctypedef struct pg_repack_job:
        const uint8_t *const *rows
        const uint8_t *types
        long N, K
        uint8_t *q
        uint16_t *d
        uint16_t *m
        int overflow
    void pg_repack_task(void *ctx, long p) noexcept nogil


NR = PG_NR
MAXR = PG_MAXR
HAVE_AVX512_BF16 = bool(SCRATCHLLM_BF16_DOT)
COMPILED_FEATURES = tuple(SCRATCHLLM_COMPILED_FEATURES.decode().split())  # as /proc/cpuinfo names them
DTYPES = ("float32", "bfloat16")

set_num_threads, get_num_threads = pool_module.set_num_threads, pool_module.get_num_threads  # the pool's


def to_bfloat16(x) -> np.ndarray:
    """float32 array -> uint16 array of its bfloat16 bits (round to nearest even)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def from_bfloat16(h) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def pack(w, str dtype="float32") -> np.ndarray:
    """The [K, N] matrix w (any strides, e.g. a transposed view) -> its panels (layouts above)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    K, N = w.shape
    P = -(-N // PG_NR)
    if dtype == "float32":
        panels = np.zeros((P, K, PG_NR), dtype=np.float32)
        full = N // PG_NR
        panels[:full] = w[:, : full * PG_NR].reshape(K, full, PG_NR).transpose(1, 0, 2)
        if full < P:
            panels[full, :, : N - full * PG_NR] = w[:, full * PG_NR :]
        return panels
    K2 = -(-K // 2)
    padded = np.zeros((2 * K2, P * PG_NR), dtype=np.float32)
    padded[:K, :N] = w
    return to_bfloat16(padded.reshape(K2, 2, P, PG_NR).transpose(2, 0, 3, 1))  # [P, K2, NR, 2]


def _scaled(q, d, m) -> np.ndarray:
    """q [A, K, C] (any integer type), d and m [A, K/32, C] -> float32 d * q + m, d and m holding one
    value per 32 consecutive k: the kernel's (and ggml's) operations, the product rounded first.
    m None: no offset."""
    A, K, C = q.shape
    w = q.astype(np.float32).reshape(A, K // 32, 32, C)
    w *= d.astype(np.float32)[:, :, None, :]
    if m is not None:
        w += m.astype(np.float32)[:, :, None, :]
    return w.reshape(A, K, C)


def _check_groups(q, d, m) -> tuple[int, int]:
    K, N = q.shape
    if K % 32 or d.shape != (K // 32, N) or m.shape != (K // 32, N):
        raise ValueError(f"q {q.shape} needs K % 32 == 0 and d, m of shape {(K // 32, N)}; got {d.shape}, {m.shape}")
    return K, N


def _column_panels(a, Py_ssize_t P, dtype) -> np.ndarray:
    """[rows, N] -> [P, rows, NR] of `dtype`, columns zero-padded to whole panels."""
    out = np.zeros((a.shape[0], P * PG_NR), dtype=dtype)
    out[:, : a.shape[1]] = a
    return np.ascontiguousarray(out.reshape(a.shape[0], P, PG_NR).transpose(1, 0, 2))


class Q8Panels(NamedTuple):
    """Quantized panels: w[k, j] = d * q + m with q int8 and, per 32 rows of k and per column, a
    float32 scale d and offset m. GGUF's Q8_0 (m = 0), Q4_0 (q - 8, m = 0) and Q4_1 (q in 0..15)
    all fit, value for value: see `pack_q8`."""

    q: np.ndarray  # [P, K, NR] int8
    d: np.ndarray  # [P, K/32, NR] float32, or float16 where m is None
    m: np.ndarray | None  # [P, K/32, NR] float32, or None: no offset (GGUF's Q8_0, as pack_blocks keeps it)
    exact: bool = False  # every d is a float16 value, so d * q is exact and the kernel may fuse d * q + m

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)

    @property
    def dtype(self):
        return self.q.dtype

    def dequantize(self) -> np.ndarray:
        """[P, K, NR] float32."""
        return _scaled(self.q, self.d, self.m)

    def columns(self, p, j) -> np.ndarray:
        """Columns j of panels p (arrays of equal length L) -> [L, K] float32."""
        m = None if self.m is None else self.m[p, :, j][..., None]
        return _scaled(self.q[p, :, j][..., None], self.d[p, :, j][..., None], m)[..., 0]


def _q4_offsets(d, m) -> np.ndarray:
    """4-bit panels' offsets m as float32; m None (Q4_0 panels): -8 d, exact, as the kernel makes it."""
    return d.astype(np.float32) * np.float32(-8) if m is None else m.astype(np.float32)


class Q4Panels(NamedTuple):
    """4-bit panels: w[k, j] = d * q + m, q in 0..15 two to a byte (rows 2 k2 and 2 k2 + 1 of a column
    share byte k2), d and m float16 per 32 rows of k and per column. GGUF's Q4_1 value for value, and
    Q4_0 with m = -8 d (exact: d * q and d * (q - 8) are exact in float32, so d * q + m rounds to
    the same float). Half a byte per weight in memory, as in the file: see `pack_q4`. m None: Q4_0
    panels (pack_blocks), whose m = -8 d the kernel makes instead of reading it.

    Byte order: in words. Each run of 4 byte rows (8 rows of k) holds NR 32-bit words, one per
    column, the 4 bytes of column j's word being its byte rows in order; `byte_rows` gives the
    plain [P, K/2, NR] order. The kernel reads a row of k from a word with one AND."""

    q4: np.ndarray  # [P, K/2, NR] uint8, in words (see above)
    d: np.ndarray  # [P, K/32, NR] float16
    m: np.ndarray | None  # [P, K/32, NR] float16, or None: -8 d (Q4_0)

    @property
    def nbytes(self) -> int:
        return self.q4.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)

    def offsets(self) -> np.ndarray:
        """m as float32, made from d where the panels store none (-8 d is exact)."""
        return _q4_offsets(self.d, self.m)

    @property
    def dtype(self):
        return self.q4.dtype

    def byte_rows(self) -> np.ndarray:
        """[P, K/2, NR] uint8: byte (k2, j) = q[2 k2, j] | q[2 k2 + 1, j] << 4 (a copy)."""
        return _byte_rows(self.q4)

    def dequantize(self) -> np.ndarray:
        """[P, K, NR] float32."""
        P, K2, _ = self.q4.shape
        b = self.byte_rows()
        nibbles = np.stack([b & 0x0F, b >> 4], axis=2).reshape(P, 2 * K2, PG_NR)
        return _scaled(nibbles, self.d, self.offsets())

    def columns(self, p, j) -> np.ndarray:
        """Columns j of panels p (arrays of equal length L) -> [L, K] float32."""
        P, K2, _ = self.q4.shape
        b = self.q4.reshape(P, K2 // 4, PG_NR, 4)[p, :, j].reshape(len(p), K2)  # [L, K/2] in byte-row order
        nibbles = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(len(b), -1)
        m = _q4_offsets(self.d[p, :, j], None if self.m is None else self.m[p, :, j])
        return _scaled(nibbles[..., None], self.d[p, :, j][..., None], m[..., None])[..., 0]


def pack_q8(q, d, m) -> Q8Panels:
    """q int8 [K, N] (any strides), d and m float32 [K/32, N]: w[k, j] = d[k // 32, j] * q[k, j] +
    m[k // 32, j] -> its Q8Panels (columns zero-padded to whole panels: q = d = m = 0)."""
    K, N = _check_groups(q, d, m)
    P = -(-N // PG_NR)
    d32 = np.asarray(d, dtype=np.float32)
    with np.errstate(over="ignore"):
        exact = bool(np.array_equal(d32.astype(np.float16).astype(np.float32), d32))  # 11 bits x 8 bits: exact
    return Q8Panels(_column_panels(q, P, np.int8), _column_panels(d, P, np.float32), _column_panels(m, P, np.float32),
                    exact)


def _byte_rows(q4) -> np.ndarray:
    """4-bit panels' bytes in words -> [P, K/2, NR] in byte-row order (a copy)."""
    P, K2, NR = q4.shape
    return np.ascontiguousarray(q4.reshape(P, K2 // 4, NR, 4).transpose(0, 1, 3, 2)).reshape(P, K2, NR)


def _words(rows) -> np.ndarray:
    """[P, K/2, NR] bytes in byte-row order -> the same bytes in words (Q4Panels' order)."""
    P, K2, NR = rows.shape
    return np.ascontiguousarray(rows.reshape(P, K2 // 4, 4, NR).transpose(0, 1, 3, 2)).reshape(P, K2, NR)


def pack_q4(q, d, m) -> Q4Panels:
    """q uint8 in 0..15 [K, N] (any strides), d and m float16 [K/32, N]: w = d * q + m -> its
    Q4Panels (columns zero-padded to whole panels)."""
    K, N = _check_groups(q, d, m)
    P = -(-N // PG_NR)
    qp = _column_panels(q, P, np.uint8)  # [P, K, NR]
    assert qp.max(initial=0) < 16, "4-bit values"
    return Q4Panels(_words(qp[:, 0::2] | (qp[:, 1::2] << 4)), _column_panels(d, P, np.float16),
                    _column_panels(m, P, np.float16))


BLOCK_TYPES = {"Q4_0": PG_Q4_0, "Q4_1": PG_Q4_1, "Q8_0": PG_Q8_0}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def pack_blocks(parts, Py_ssize_t K, alloc=np.zeros):
    """Panels straight from a GGUF file's blocks: `parts` is a list of (type name, raw uint8 array
    [rows, K / 32 * block bytes] (a view of the mapped file), row order or None), fused along the
    output columns in order; `row order` r means output row i is stored row r[i]. Q4_0 and Q4_1
    parts -> Q4Panels (Q4_0 parts only: no offsets stored, the kernel makes -8 d; Q4_0 beside Q4_1:
    None if a Q4_0 scale's -8 d overflows float16, see ggml_quants.as_q4); Q8_0 parts only ->
    Q8Panels (no offsets). The bytes are moved once, by the kernel pool's threads; no
    temporary as large as the matrix is made. `alloc(shape, dtype)` makes the zeroed output arrays
    (models.arena.PanelArena.zeros puts a model's panels in huge pages)."""
    if K % 32:
        raise ValueError(f"K = {K} is not a whole number of 32-weight blocks")
    kinds = {t for t, _, _ in parts}
    if not kinds <= set(BLOCK_TYPES) or ("Q8_0" in kinds and len(kinds) > 1):
        raise ValueError(f"pack_blocks takes Q4_0/Q4_1 parts or Q8_0 parts, not {sorted(kinds)}")
    addresses, types = [], []
    for type_name, raw, order in parts:
        row_bytes = K // 32 * BLOCK_BYTES[type_name]
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != row_bytes or not raw.flags.c_contiguous:
            raise ValueError(f"{type_name} rows must be C-contiguous uint8 [rows, {row_bytes}], got {raw.shape}")
        rows = np.arange(raw.shape[0]) if order is None else np.asarray(order)
        if rows.shape != (raw.shape[0],) or (len(rows) and (rows.min() < 0 or rows.max() >= raw.shape[0])):
            raise ValueError("the row order must be a permutation of the part's rows")
        addresses.append(raw.ctypes.data + rows.astype(np.uint64) * np.uint64(row_bytes))
        types.append(np.full(raw.shape[0], BLOCK_TYPES[type_name], dtype=np.uint8))
    cdef const unsigned long long[::1] addr = np.ascontiguousarray(np.concatenate(addresses), dtype=np.uint64)
    type_ids = np.concatenate(types)
    cdef const uint8_t[::1] kind = type_ids
    cdef Py_ssize_t N = addr.shape[0], P = (N + PG_NR - 1) // PG_NR  # C division here: no -(-N // NR)
    q8 = "Q8_0" in kinds
    q = alloc((P, K if q8 else K // 2, PG_NR), np.int8 if q8 else np.uint8)
    d = alloc((P, K // 32, PG_NR), np.uint16)
    offsets = "Q4_1" in kinds  # Q8_0 has none and Q4_0's are -8 d: stored only beside Q4_1's
    cdef Py_ssize_t m_panels = P if offsets else 1, m_groups = K // 32 if offsets else 1
    m = alloc((m_panels, m_groups, PG_NR), np.uint16)
    cdef uint8_t[:, :, ::1] qv = q.view(np.uint8)
    cdef uint16_t[:, :, ::1] dv = d, mv = m
    cdef pg_repack_job job
    job.rows, job.types, job.N, job.K = <const uint8_t *const *> &addr[0], &kind[0], N, K
    job.q, job.d, job.m, job.overflow = &qv[0, 0, 0], &dv[0, 0, 0], &mv[0, 0, 0] if offsets else NULL, 0
    with nogil:
        pool.run(pg_repack_task, &job, P, pool.num_threads())
    d16 = d.view(np.float16)
    if q8:  # Q8_0: value = d * q exactly (an 11-bit d times an 8-bit q), no offset: the file's bytes
        return Q8Panels(q, d16, None, True)
    if not offsets:  # Q4_0 only
        return Q4Panels(q, d16, None)
    if job.overflow:  # a Q4_0 row's m = -8 d (exact, as in as_q4) does not fit float16
        return None
    return Q4Panels(q, d16, m.view(np.float16))


def unpack(panels, Py_ssize_t k, Py_ssize_t n) -> np.ndarray:
    """Panels -> the [k, n] float32 matrix they hold (a copy; bfloat16 values widen exactly)."""
    if isinstance(panels, (Q8Panels, Q4Panels)):
        panels = panels.dequantize()
    P = panels.shape[0]
    if panels.dtype == np.uint16:
        w = from_bfloat16(panels).transpose(1, 3, 0, 2).reshape(2 * panels.shape[1], P * PG_NR)
    else:
        w = panels.transpose(1, 0, 2).reshape(k, P * PG_NR)
    return np.ascontiguousarray(w[:k, :n])


def columns(panels, Py_ssize_t k, ids) -> np.ndarray:
    """Columns `ids` of the packed [k, n] matrix as rows: [len(ids), k] float32 (W[:, ids].T).
    This is how an embedding lookup reads a tied LM head."""
    ids = np.asarray(ids, dtype=np.int64)
    p, j = ids // PG_NR, ids % PG_NR
    if isinstance(panels, (Q8Panels, Q4Panels)):  # [len, K]: d * q + m, in the kernel's order
        return panels.columns(p, j)
    if panels.dtype == np.uint16:  # [P, K2, NR, 2] -> [len, K2, 2]
        return np.ascontiguousarray(from_bfloat16(panels[p, :, j]).reshape(len(ids), -1)[:, :k])
    return np.ascontiguousarray(panels[p, :, j])


def matmul(x, panels, Py_ssize_t n, out=None) -> np.ndarray:
    """x [M, K] float32 @ the packed [K, n] matrix -> out [M, n] float32 (new unless given)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D, got shape {x.shape}")
    M, K = x.shape
    if out is None:
        out = np.empty((M, n), dtype=np.float32)
    elif out.shape != (M, n) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 [{M}, {n}] array")
    if M == 0:
        return out
    if isinstance(panels, np.ndarray) and panels.dtype == np.uint16:
        if panels.ndim != 4 or panels.shape[1] * 2 not in (K, K + 1) or panels.shape[2:] != (PG_NR, 2):
            raise ValueError(f"bfloat16 panels {panels.shape} do not fit x of shape {x.shape}")
        _matmul_bf16(x, panels, n, out)
    else:
        _matmul(panels, x, n, out)
    return out


cdef enum:
    _Q8_TASKS_PER_THREAD = 8  # quantized GEMM: tasks per thread (each a run of adjacent panels)
    # One row (decode): fewer, longer runs. A thread's next task is rarely the adjacent one (tasks
    # are claimed in turn), so each task start is a stream the prefetchers have not seen; 2 per
    # thread still lets a thread finish another's share when one is slow. Measured alternating in
    # one process (default model, 2 threads): decode +6-10% over 8, also with a busy loop on a core.
    _Q8_TASKS_PER_THREAD_ROW = 2
    _Q8_FUSED_TILES = 2  # up to 2 row tiles dequantize in registers (tile 2 re-reads q from L1); more use the buffer
    _KC = 256  # rows (bfloat16: pairs) of K per block of a panel: 256 x 32 x 4 B = 32 KiB, L1's size
Q8_TASKS_PER_THREAD, Q8_FUSED_TILES, KC = _Q8_TASKS_PER_THREAD, _Q8_FUSED_TILES, _KC
assert KC % 32 == 0 and KC <= 256, "blocks of whole quantization groups that fit a task's buffer"


cdef inline int _threads_for(long work) noexcept nogil:
    # a few microseconds of work is not worth waking a helper
    return 1 if work < (1 << 18) else pool.num_threads()


cdef int bind_weight(object panels, Py_ssize_t n, GemmWeight *w) except -1:
    cdef const float[:, :, ::1] f32
    cdef Py_ssize_t width  # NR of the build that made the panels: it must be this build's
    cdef const uint8_t[:, :, ::1] q4
    cdef const int8_t[:, :, ::1] q8
    cdef const uint16_t[:, :, ::1] d16, m16
    cdef const float[:, :, ::1] d32, m32
    if isinstance(panels, Q4Panels):
        q4, d16 = panels.q4, panels.d.view(np.uint16)
        w.q, w.d, w.m, w.kind, w.exact, w.half = &q4[0, 0, 0], &d16[0, 0, 0], NULL, 4, 1, 0
        if panels.m is not None:
            m16 = panels.m.view(np.uint16)
            w.m = &m16[0, 0, 0]
        w.P, w.K, width = q4.shape[0], 2 * q4.shape[1], q4.shape[2]
    elif isinstance(panels, Q8Panels) and panels.m is None:  # float16 d, no offset (Q8_0)
        if panels.d.dtype != np.float16 or not panels.exact:
            raise ValueError("8-bit panels without offsets take float16 scales")
        q8, d16 = panels.q, panels.d.view(np.uint16)
        w.q, w.d, w.m, w.kind, w.exact, w.half = &q8[0, 0, 0], &d16[0, 0, 0], NULL, 8, 1, 1
        w.P, w.K, width = q8.shape[0], q8.shape[1], q8.shape[2]
    elif isinstance(panels, Q8Panels):
        q8, d32, m32 = panels.q, panels.d, panels.m
        w.q, w.d, w.m, w.kind, w.exact, w.half = &q8[0, 0, 0], &d32[0, 0, 0], &m32[0, 0, 0], 8, panels.exact, 0
        w.P, w.K, width = q8.shape[0], q8.shape[1], q8.shape[2]
    elif isinstance(panels, np.ndarray) and panels.dtype == np.float32:
        f32 = panels
        w.q, w.d, w.m, w.kind, w.exact, w.half = &f32[0, 0, 0], NULL, NULL, 32, 0, 0
        w.P, w.K, width = f32.shape[0], f32.shape[1], f32.shape[2]
    else:
        raise TypeError(f"float32, Q8Panels or Q4Panels panels, not {type(panels).__name__} "
                        f"{getattr(panels, 'dtype', '')}")
    if width != PG_NR or (w.kind != 32 and w.K % 32) or not (0 < n <= w.P * PG_NR):
        raise ValueError(f"panels of {w.P} x {w.K} x {width} do not fit {n} columns of this build's "
                         f"{PG_NR}-wide panels" + ("" if w.kind == 32 else " in whole 32-row groups"))
    w.n = n
    return 0


cdef void gemm(const GemmWeight *w, const float *x, Py_ssize_t M, float *c) noexcept nogil:
    cdef pg_gemm_job fjob
    cdef pg_q8_job job
    cdef int threads = _threads_for(M * w.K * w.n)
    cdef long step
    if M == 0:
        return
    if w.kind == 32:
        fjob.x, fjob.x2, fjob.panels, fjob.c = x, NULL, w.q, c
        fjob.M, fjob.K, fjob.K2, fjob.n, fjob.kc = M, w.K, 0, w.n, _KC
        pool.run(pg_gemm_f32_task, &fjob, w.P, threads)
        return
    job.x, job.q, job.d, job.m, job.c, job.bits, job.exact, job.half = x, w.q, w.d, w.m, c, w.kind, w.exact, w.half
    job.M, job.K, job.n, job.kc = M, w.K, w.n, _KC  # the float32 kernel's blocks: the same sums
    job.P = w.P
    job.fused_tiles = _Q8_FUSED_TILES
    job.chunk = job.P // ((_Q8_TASKS_PER_THREAD_ROW if M == 1 else _Q8_TASKS_PER_THREAD) * threads)
    if job.chunk < 1:
        job.chunk = 1  # enough tasks to even out the threads
    if job.M == 1:  # a single row takes panels in pairs (pg_gemm_q8_pair), or fours (pg_gemm_q8h_quad)
        step = 4 if w.half else 2
        job.chunk = (job.chunk + step - 1) // step * step
    pool.run(pg_gemm_q8_task, &job, (job.P + job.chunk - 1) // job.chunk, threads)


cdef void _matmul(panels, const float[:, ::1] x, Py_ssize_t n, float[:, ::1] c) except *:
    cdef GemmWeight w
    bind_weight(panels, n, &w)
    if w.K != x.shape[1]:
        raise ValueError(f"panels of {w.P} x {w.K} do not fit x of shape {tuple(x.shape)[:2]}")
    with nogil:
        gemm(&w, &x[0, 0], x.shape[0], &c[0, 0])


cdef void _matmul_bf16(const float[:, ::1] x, const uint16_t[:, :, :, ::1] panels, Py_ssize_t n,
                       float[:, ::1] c):
    cdef pg_gemm_job job
    cdef Py_ssize_t M = x.shape[0], K2 = panels.shape[1]
    cdef uint32_t *x2 = <uint32_t *> malloc(M * K2 * sizeof(uint32_t))
    if x2 == NULL:
        raise MemoryError()
    job.x, job.x2, job.panels, job.c = &x[0, 0], x2, &panels[0, 0, 0, 0], &c[0, 0]
    job.M, job.K, job.K2, job.n, job.kc = M, x.shape[1], K2, n, _KC
    try:
        with nogil:
            pg_round_x(&x[0, 0], x2, M, x.shape[1], K2)
            pool.run(pg_gemm_bf16_task, &job, panels.shape[0], _threads_for(job.M * job.K * n))
    finally:
        free(x2)


cdef class QuantizedGemm:
    """`matmul` for one quantized matrix with its checks and buffer lookups done once, at the first
    product: a call then acquires only x and out. At decode sizes the general `matmul` spent about
    5 us per 4-bit call before any arithmetic (121 calls a token), most of it in acquiring the
    three panel arrays and viewing the float16 scales as integers."""
    cdef object panels  # keeps the arrays alive: the pointers in w point into them
    cdef GemmWeight w

    def __init__(self, panels, Py_ssize_t n):
        if not isinstance(panels, (Q4Panels, Q8Panels)):
            raise TypeError(f"QuantizedGemm takes Q4Panels or Q8Panels, not {type(panels).__name__}")
        bind_weight(panels, n, &self.w)
        self.panels = panels

    @property
    def K(self):
        return self.w.K

    @property
    def n(self):
        return self.w.n

    @property
    def P(self):
        return self.w.P

    def __call__(self, const float[:, ::1] x, float[:, ::1] out):
        """out [M, n] = x [M, K] @ the matrix (x C-contiguous float32, as the model's buffers are)."""
        if x.shape[1] != self.w.K or out.shape[0] != x.shape[0] or out.shape[1] != self.w.n:
            raise ValueError(f"x {tuple(x.shape)[:2]} and out {tuple(out.shape)[:2]} do not fit a "
                             f"[{self.w.K}, {self.w.n}] matrix")
        if x.shape[0]:
            with nogil:
                gemm(&self.w, &x[0, 0], x.shape[0], &out[0, 0])
        return out.base if out.base is not None else out
