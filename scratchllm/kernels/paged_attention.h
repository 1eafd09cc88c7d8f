/* Paged attention's C: a block's scores, its weighted values and the softmax's exp, in the native
   vector. Included by scratchllm/kernels/paged_attention.pyx, whose `cdef extern from
   "paged_attention.h"` declares what Cython calls; like every Cython module's C, after Python.h
   (Py_ssize_t). */
#ifndef SCRATCHLLM_PAGED_ATTENTION_H
#define SCRATCHLLM_PAGED_ATTENTION_H

#include <math.h>  /* tanhf */
#include "simd.h"  /* scratchllm_vf, scratchllm_select, scratchllm_exp */
#define SCRATCHLLM_INLINE static inline __attribute__((always_inline))

/* The inner loops are written in the native vector (scratchllm_vf: SCRATCHLLM_VL floats, one
   zmm with AVX-512, one ymm with AVX2), a block's 16 keys being SA_NV of them. Written in
   16-lane vectors instead, GCC split every operation into ymm halves through the stack on
   AVX2, and a decode layer's attention took 40 us instead of a few. How many heads and value
   columns one pass keeps in registers follows the register file (32 zmm or 16 ymm); the sums
   are the same either way: each score is a chain over even d plus a chain over odd d, each
   value column a chain over t in order. */
#define SA_VL SCRATCHLLM_VL
#define SA_NV SCRATCHLLM_NV16
#if SA_VL == 16
#define SA_HEADS 4   /* heads per pass of the scores: 2 x 4 accumulators + 2 keys */
#else
#define SA_HEADS 2   /* 2 x 2 x 2 ymm accumulators + 4 for the keys */
#endif

/* s[j * ss + 0:16] = K_block . q_j for n <= SA_HEADS heads j; kt is the block's keys transposed,
   [D][16]. Each key row is loaded once for the n heads; the accumulators (even and odd d)
   stay in registers for the whole d loop: no horizontal sum, and enough independent FMA
   chains to cover the FMA latency. n is a constant at every call, so the loops unroll. */
SCRATCHLLM_INLINE void scratchllm_scores_n(const float *q, const float *kt, float *s, Py_ssize_t ss,
                                           Py_ssize_t D, const int n) {
    scratchllm_vf a0[SA_HEADS][SA_NV], a1[SA_HEADS][SA_NV], k0[SA_NV], k1[SA_NV];
    Py_ssize_t d = 0;
    for (int j = 0; j < n; j++)
        for (int u = 0; u < SA_NV; u++) a0[j][u] = a1[j][u] = (scratchllm_vf){0};
    for (; d + 1 < D; d += 2) {
        for (int u = 0; u < SA_NV; u++) {  /* one vector at a time: a whole-array memcpy went through the stack */
            memcpy(&k0[u], kt + d * 16 + u * SA_VL, sizeof k0[u]);
            memcpy(&k1[u], kt + (d + 1) * 16 + u * SA_VL, sizeof k1[u]);
        }
        for (int j = 0; j < n; j++)
            for (int u = 0; u < SA_NV; u++) {
                a0[j][u] += q[j * D + d] * k0[u];
                a1[j][u] += q[j * D + d + 1] * k1[u];
            }
    }
    if (d < D) {  /* odd D */
        for (int u = 0; u < SA_NV; u++) memcpy(&k0[u], kt + d * 16 + u * SA_VL, sizeof k0[u]);
        for (int j = 0; j < n; j++)
            for (int u = 0; u < SA_NV; u++) a0[j][u] += q[j * D + d] * k0[u];
    }
    for (int j = 0; j < n; j++)
        for (int u = 0; u < SA_NV; u++) {
            a0[j][u] += a1[j][u];
            memcpy(s + j * ss + u * SA_VL, &a0[j][u], sizeof a0[j][u]);
        }
}

/* The scores of G query heads (q: [G][D]) against one block of 16 keys, SA_HEADS at a time. */
static inline void scratchllm_block_scores16(const float *q, Py_ssize_t G, const float *kt, float *s,
                                             Py_ssize_t ss, Py_ssize_t D) {
    for (Py_ssize_t j = 0; j < G; j += SA_HEADS) {
        switch (G - j) {
            case 1: scratchllm_scores_n(q + j * D, kt, s + j * ss, ss, D, 1); break;
#if SA_HEADS == 4
            case 2: scratchllm_scores_n(q + j * D, kt, s + j * ss, ss, D, 2); break;
            case 3: scratchllm_scores_n(q + j * D, kt, s + j * ss, ss, D, 3); break;
#endif
            default: scratchllm_scores_n(q + j * D, kt, s + j * ss, ss, D, SA_HEADS);
        }
    }
}

/* acc[j * D + c : + w VL] += sum over t < m of p[j * ps + t] * v[t * vs + c : + w VL], for n <= 4
   heads j and w native vectors of columns: the n x w accumulators stay in registers over the
   m value rows, each row loaded once for the n heads. */
SCRATCHLLM_INLINE void scratchllm_pv_nw(const float *p, Py_ssize_t ps, const float *v, Py_ssize_t vs,
                                        Py_ssize_t m, float *acc, Py_ssize_t D, Py_ssize_t c,
                                        const int n, const int w) {
    scratchllm_vf a[4][8], x;
    for (int j = 0; j < n; j++)
        for (int u = 0; u < w; u++) memcpy(&a[j][u], acc + j * D + c + SA_VL * u, sizeof x);
    for (Py_ssize_t t = 0; t < m; t++) {
        for (int u = 0; u < w; u++) {
            memcpy(&x, v + t * vs + c + SA_VL * u, sizeof x);
            for (int j = 0; j < n; j++) a[j][u] += p[j * ps + t] * x;
        }
    }
    for (int j = 0; j < n; j++)
        for (int u = 0; u < w; u++) memcpy(acc + j * D + c + SA_VL * u, &a[j][u], sizeof x);
}

/* Columns per pass: n x w accumulators within 16 of the register file (AVX-512: 4 x 4 zmm;
   AVX2: 12 ymm or fewer), then single vectors for what is left of D. */
SCRATCHLLM_INLINE void scratchllm_pv_n(const float *p, Py_ssize_t ps, const float *v, Py_ssize_t vs,
                                       Py_ssize_t m, float *acc, Py_ssize_t D, const int n) {
#if SA_VL == 16
    const int w = 4;
#else
    const int w = n == 1 ? 8 : n == 2 ? 6 : n == 3 ? 4 : 3;
#endif
    Py_ssize_t c = 0;
    for (; c + w * SA_VL <= D; c += w * SA_VL) scratchllm_pv_nw(p, ps, v, vs, m, acc, D, c, n, w);
    for (; c < D; c += SA_VL) scratchllm_pv_nw(p, ps, v, vs, m, acc, D, c, n, 1);
}

/* The weighted values of one block (m rows of D floats, row stride vs) for G heads, D % 16 == 0. */
static inline void scratchllm_block_values16(const float *p, Py_ssize_t ps, Py_ssize_t G, const float *v,
                                             Py_ssize_t vs, Py_ssize_t m, float *acc, Py_ssize_t D) {
    for (Py_ssize_t j = 0; j < G; j += 4) {
        switch (G - j) {
            case 1: scratchllm_pv_n(p + j * ps, ps, v, vs, m, acc + j * D, D, 1); break;
            case 2: scratchllm_pv_n(p + j * ps, ps, v, vs, m, acc + j * D, D, 2); break;
            case 3: scratchllm_pv_n(p + j * ps, ps, v, vs, m, acc + j * D, D, 3); break;
            default: scratchllm_pv_n(p + j * ps, ps, v, vs, m, acc + j * D, D, 4);
        }
    }
}


/* s[0:n] = exp(s - max(s[0:n])); returns the sum, taken over 16 running lanes (SA_NV native
   vectors) summed in lane order, the same on every instruction set. s has room for n
   rounded up to 16. */
static inline float scratchllm_exp_rows(float *s, Py_ssize_t n) {
    Py_ssize_t n16 = (n + 15) / 16 * 16, i;
    float m = -3.0e38f, sum = 0.0f;
    scratchllm_vf mx[SA_NV], acc[SA_NV];
    for (i = n; i < n16; i++) s[i] = -3.0e38f;  /* the tail of the last vector */
    for (int u = 0; u < SA_NV; u++) {
        mx[u] = (scratchllm_vf){0} - 3.0e38f;
        acc[u] = (scratchllm_vf){0};
    }
    for (i = 0; i < n16; i += 16)  /* running maxima lane by lane: no chain through every element */
        for (int u = 0; u < SA_NV; u++) {
            scratchllm_vf v;
            memcpy(&v, s + i + u * SA_VL, sizeof v);
            mx[u] = scratchllm_select(v > mx[u], v, mx[u]);
        }
    for (int u = 0; u < SA_NV; u++)
        for (int l = 0; l < SA_VL; l++) m = mx[u][l] > m ? mx[u][l] : m;
    for (i = 0; i < n16; i += 16)
        for (int u = 0; u < SA_NV; u++) {
            scratchllm_vf v;
            memcpy(&v, s + i + u * SA_VL, sizeof v);
            v = scratchllm_exp(v - m);
            acc[u] += v;
            memcpy(s + i + u * SA_VL, &v, sizeof v);
        }
    for (int u = 0; u < SA_NV; u++)
        for (int l = 0; l < SA_VL; l++) sum += acc[u][l];
    return sum;
}

/* Gemma 2's soft-capping of attention scores, s = cap * tanh(s / cap), on s[0:n] (after the
   scale, before the mask and the softmax). */
static inline void scratchllm_softcap_rows(float *s, Py_ssize_t n, float cap) {
    for (Py_ssize_t i = 0; i < n; i++) s[i] = cap * tanhf(s[i] / cap);
}

/* s[0:n] = a score that exp_rows turns into exactly 0: the keys before a sliding window's
   start that share its first block. */
static inline void scratchllm_mask_rows(float *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) s[i] = -3.0e38f;
}

#endif
