# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -ffp-contract=fast
"""y = x @ W for a weight matrix packed once, at load time: the GEMM of every linear layer.

Why not NumPy's `x @ w`: OpenBLAS copies ("packs") the whole of B into its panel layout on
*every* call. For a prefill of 512 rows that copy is noise; for a decode step of 1-64 rows it is
the main cost: the weights are read, written and read again, and at 16 rows OpenBLAS reaches
about 68 GFLOP/s on this machine's two cores, a third of what the FMA units can do. Weights never
change, so we pack them once and the kernel streams them exactly once per call.

Packed layouts (one panel = NR = 32 output columns, zero-padded at the right edge):
  float32:  [P, K, 32]        panel p, row k holds W[k, 32p : 32p+32]: two zmm per k.
  bfloat16: [P, K/2, 32, 2]   uint16; row k2 holds, for each of the 32 columns, the pair
                              (W[2 k2, j], W[2 k2 + 1, j]) side by side: the operand order of
                              AVX512-BF16's vdpbf16ps, which multiplies 16 such pairs by one
                              broadcast pair of x and adds both products into 16 fp32 lanes.
                              (K is zero-padded to even.)

Loop nest of `matmul`. Panels are the tasks of our own thread pool (scratchllm/kernels/pool.pyx),
not of OpenMP: a thread descheduled by another process just takes fewer panels instead of
stalling every matmul at a barrier.

    for panel p (32 columns of y)                       -> a pool task
      for kc block of K (the panel's kc x 32 rows)      -> L1: 256 rows (bf16: pairs) = 32 KiB
        for row tile of x (<= MAXR rows)                -> the block is re-read from L1
          micro-kernel: R x 32 accumulators in 2R zmm registers, one pass over the block

Why R <= 12: Zen 4 has 32 zmm registers; 12 rows x 2 accumulators + 2 of W + 1 broadcast of x is
27 live registers, no spills. Rows are split into balanced tiles (16 rows = 8 + 8, not 12 + 4).
Every weight element loaded feeds R FMAs, so at R = 1 (single-stream decode) the kernel streams
memory and at R >= 8 it is FMA-bound.

bfloat16 keeps fp32's 8-bit exponent and cuts the mantissa to 8 bits (relative rounding
error <= 2^-9). In this mode x is rounded to bfloat16 too (round to nearest even) and the
products are summed in fp32: half the weight bytes and twice the multiplies per instruction.
Without AVX512-BF16 the same numbers come from a plain C loop (slow, for correctness only).
"""

import numpy as np

from scratchllm.kernels import pool as pool_module

from scratchllm.kernels cimport pool
from libc.stdint cimport uint16_t, uint32_t
from libc.stdlib cimport free, malloc


cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__AVX512BF16__) && defined(__AVX512F__)
    #include <immintrin.h>
    #define SCRATCHLLM_BF16_DOT 1
    #else
    #define SCRATCHLLM_BF16_DOT 0
    #endif
    #define PG_NR 32
    #define PG_MAXR 12

    #include "simd.h"  /* scratchllm_v16 */

    /* Add (or, when `first`, store) the R x 32 tile acc into c, only its first `cols` columns. */
    static inline __attribute__((always_inline)) void pg_store(const int R, scratchllm_v16 *acc, float *c, long ldc,
                                                              int cols, int first) {
        for (int r = 0; r < R; r++) {
            float *cr = c + r * ldc;
            if (cols == PG_NR) {
                scratchllm_v16 lo = acc[2 * r], hi = acc[2 * r + 1];
                if (!first) {
                    scratchllm_v16 c0, c1;
                    memcpy(&c0, cr, sizeof c0);
                    memcpy(&c1, cr + 16, sizeof c1);
                    lo += c0;
                    hi += c1;
                }
                memcpy(cr, &lo, sizeof lo);
                memcpy(cr + 16, &hi, sizeof hi);
            } else {  /* the right edge of the matrix: only cols < 32 columns are real */
                float tmp[PG_NR];
                memcpy(tmp, &acc[2 * r], sizeof(scratchllm_v16));
                memcpy(tmp + 16, &acc[2 * r + 1], sizeof(scratchllm_v16));
                for (int j = 0; j < cols; j++)
                    cr[j] = first ? tmp[j] : cr[j] + tmp[j];
            }
        }
    }

    /* c[0:R, 0:cols] (+)= x[0:R, 0:kc] @ panel[0:kc, 0:32]; x rows lda apart. R is a constant
       at every call site (see pg_micro_f32), so GCC unrolls the r loops and keeps acc in registers. */
    static inline __attribute__((always_inline)) void pg_micro_f32_r(const int R, const float *x, long lda,
                                                                    const float *panel, long kc, float *c,
                                                                    long ldc, int cols, int first) {
        scratchllm_v16 acc[2 * PG_MAXR];
        for (int r = 0; r < 2 * R; r++)
            acc[r] = (scratchllm_v16){0};
        for (long k = 0; k < kc; k++) {
            scratchllm_v16 w0, w1;
            memcpy(&w0, panel + k * PG_NR, sizeof w0);
            memcpy(&w1, panel + k * PG_NR + 16, sizeof w1);
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
        PG_CASE(1) PG_CASE(2) PG_CASE(3) PG_CASE(4) PG_CASE(5) PG_CASE(6)
        PG_CASE(7) PG_CASE(8) PG_CASE(9) PG_CASE(10) PG_CASE(11) PG_CASE(12)
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
        scratchllm_v16 a[2 * PG_MAXR];
        memcpy(a, acc, 2 * R * sizeof(scratchllm_v16));
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
        scratchllm_v16 acc[2 * PG_MAXR];
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
        PG_CASE(1) PG_CASE(2) PG_CASE(3) PG_CASE(4) PG_CASE(5) PG_CASE(6)
        PG_CASE(7) PG_CASE(8) PG_CASE(9) PG_CASE(10) PG_CASE(11) PG_CASE(12)
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

    /* ---- one GEMM as pool tasks: task p computes the 32 columns of panel p, every row ---- */
    typedef struct {
        const float *x;           /* float32: x [M, K] */
        const uint32_t *x2;       /* bfloat16: x as pairs [M, K2] */
        const void *panels;       /* [P, K, 32] float32 or [P, K2, 32, 2] uint16 */
        float *c;                 /* [M, n] */
        long M, K, K2, n, kc;
    } pg_gemm_job;

    static inline void pg_tile(long M, long t, long ntiles, long *r0, int *rows) {
        long base = M / ntiles, extra = M % ntiles;
        *r0 = t * base + (t < extra ? t : extra);
        *rows = (int)(base + (t < extra ? 1 : 0));
    }

    static void pg_gemm_f32_task(void *ctx, long p) {
        const pg_gemm_job *j = (const pg_gemm_job *)ctx;
        const float *panel = (const float *)j->panels + p * j->K * PG_NR;
        long ntiles = (j->M + PG_MAXR - 1) / PG_MAXR, r0;
        int rows, cols = j->n - p * PG_NR < PG_NR ? (int)(j->n - p * PG_NR) : PG_NR;
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
        int rows, cols = j->n - p * PG_NR < PG_NR ? (int)(j->n - p * PG_NR) : PG_NR;
        for (long k0 = 0; k0 < j->K2; k0 += j->kc) {
            long kcur = j->K2 - k0 < j->kc ? j->K2 - k0 : j->kc;
            for (long t = 0; t < ntiles; t++) {
                pg_tile(j->M, t, ntiles, &r0, &rows);
                pg_micro_bf16(rows, j->x2 + r0 * j->K2 + k0, j->K2, panel + k0 * 2 * PG_NR, kcur,
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
    """
    int SCRATCHLLM_BF16_DOT
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


NR = PG_NR
MAXR = PG_MAXR
HAVE_AVX512_BF16 = bool(SCRATCHLLM_BF16_DOT)
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
    return to_bfloat16(padded.reshape(K2, 2, P, PG_NR).transpose(2, 0, 3, 1))  # [P, K2, 32, 2]


def unpack(panels, Py_ssize_t k, Py_ssize_t n) -> np.ndarray:
    """Panels -> the [k, n] float32 matrix they hold (a copy; bfloat16 values widen exactly)."""
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
    if panels.dtype == np.uint16:  # [P, K2, 32, 2] -> [len, K2, 2]
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
    if panels.dtype == np.uint16:
        if panels.ndim != 4 or panels.shape[1] * 2 not in (K, K + 1) or panels.shape[2:] != (PG_NR, 2):
            raise ValueError(f"bfloat16 panels {panels.shape} do not fit x of shape {x.shape}")
        _matmul_bf16(x, panels, n, out)
    else:
        if panels.ndim != 3 or panels.shape[1] != K or panels.shape[2] != PG_NR:
            raise ValueError(f"float32 panels {panels.shape} do not fit x of shape {x.shape}")
        _matmul_f32(x, panels, n, out)
    return out


KC = 256  # rows (bfloat16: pairs) of K per block of a panel: 256 x 32 x 4 B = 32 KiB, L1's size


cdef inline int _threads_for(long work) noexcept nogil:
    # a few microseconds of work is not worth waking a helper
    return 1 if work < (1 << 18) else pool.num_threads()


cdef void _matmul_f32(const float[:, ::1] x, const float[:, :, ::1] panels, Py_ssize_t n, float[:, ::1] c):
    cdef pg_gemm_job job
    job.x, job.x2, job.panels, job.c = &x[0, 0], NULL, &panels[0, 0, 0], &c[0, 0]
    job.M, job.K, job.K2, job.n, job.kc = x.shape[0], x.shape[1], 0, n, KC
    with nogil:
        pool.run(pg_gemm_f32_task, &job, panels.shape[0], _threads_for(job.M * job.K * n))


cdef void _matmul_bf16(const float[:, ::1] x, const uint16_t[:, :, :, ::1] panels, Py_ssize_t n,
                       float[:, ::1] c):
    cdef pg_gemm_job job
    cdef Py_ssize_t M = x.shape[0], K2 = panels.shape[1]
    cdef uint32_t *x2 = <uint32_t *> malloc(M * K2 * sizeof(uint32_t))
    if x2 == NULL:
        raise MemoryError()
    job.x, job.x2, job.panels, job.c = &x[0, 0], x2, &panels[0, 0, 0, 0], &c[0, 0]
    job.M, job.K, job.K2, job.n, job.kc = M, x.shape[1], K2, n, KC
    try:
        with nogil:
            pg_round_x(&x[0, 0], x2, M, x.shape[1], K2)
            pool.run(pg_gemm_bf16_task, &job, panels.shape[0], _threads_for(job.M * job.K * n))
    finally:
        free(x2)
