/* Paged attention's C: a block's scores, its weighted values and the softmax's exp, in the native
   vector. Included by scratchllm/kernels/paged_attention.pyx, whose `cdef extern from
   "paged_attention.h"` declares what Cython calls; like every Cython module's C, after Python.h
   (Py_ssize_t). */
#ifndef SCRATCHLLM_PAGED_ATTENTION_H
#define SCRATCHLLM_PAGED_ATTENTION_H

#include <math.h>  /* tanhf, nearbyintf */
#include <stdint.h>
#include "simd.h"  /* scratchllm_vf, scratchllm_select, scratchllm_exp */
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  /* vcvtph2ps, vcvtps2ph; vpmovsxbd / vpmovzxwd: GCC's __builtin_convertvector of
                           narrow integers went element by element through general registers */
#endif
#define SCRATCHLLM_INLINE static inline __attribute__((always_inline))

/* The KV cache's element types ("kinds"), read in place by the loops below: a block's keys or
   values are converted to float32 in registers as they are loaded, never copied out. float16 and
   bfloat16 widen exactly; int8 holds round(x / scale) for one float32 scale per (block, kv head),
   and the scale is applied once per block to its 16 scores (keys) or to its probabilities
   (values), not per element. */
#define SCRATCHLLM_KV_F32 0
#define SCRATCHLLM_KV_F16 1
#define SCRATCHLLM_KV_BF16 2
#define SCRATCHLLM_KV_I8 3

static const Py_ssize_t scratchllm_kv_itemsize[4] = {4, 2, 2, 1};

/* IEEE half -> float, exactly (subnormals, infinities and NaNs included): the path without F16C. */
static inline float scratchllm_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> IEEE half, rounded to nearest even (what vcvtps2ph with mode 0 and NumPy's astype do). */
static inline uint16_t scratchllm_float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t x, sign, e;
    memcpy(&x, &f, sizeof x);
    sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u)  /* inf or NaN (a quiet one) */
        return (uint16_t)(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0));
    if (x >= 0x477ff000u)  /* rounds past 65504: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (x < 0x38800000u) {  /* below the smallest normal half: a subnormal (or 0), in units of 2^-24 */
        e = x >> 23;
        if (e < 102) return (uint16_t)sign;  /* below half of 2^-24 */
        uint32_t man = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;  /* value = man * 2^(e - 150) */
        uint32_t q = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        q += rest > half || (rest == half && (q & 1u));
        return (uint16_t)(sign | q);
    }
    uint32_t r = x + 0xc8000fffu + ((x >> 13) & 1u);  /* rebias exponent by -112 << 23, round to even */
    return (uint16_t)(sign | (r >> 13));
#endif
}

/* float -> bfloat16 (its top 16 bits), rounded to nearest even; NaN stays a quiet NaN. */
static inline uint16_t scratchllm_float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static inline float scratchllm_bf16_to_float(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* Element i of a cache of `kind`, as float32 (int8: before its scale). For the plain loops. */
static inline float scratchllm_kv_get(const void *base, Py_ssize_t i, int kind) {
    switch (kind) {
        case SCRATCHLLM_KV_F16: return scratchllm_half_to_float(((const uint16_t *)base)[i]);
        case SCRATCHLLM_KV_BF16: return scratchllm_bf16_to_float(((const uint16_t *)base)[i]);
        case SCRATCHLLM_KV_I8: return (float)((const int8_t *)base)[i];
        default: return ((const float *)base)[i];
    }
}

/* One native vector of floats from SCRATCHLLM_VL elements of `kind` at element i of base. `kind`
   is a constant wherever this is inlined, so the branches fold away. */
SCRATCHLLM_INLINE scratchllm_vf scratchllm_kv_load(const void *base, Py_ssize_t i, const int kind) {
    scratchllm_vf x;
    if (kind == SCRATCHLLM_KV_F16) {
#if SCRATCHLLM_VL == 16
        x = (scratchllm_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
#elif SCRATCHLLM_VL == 8 && defined(__F16C__)
        x = (scratchllm_vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
#else
        for (int l = 0; l < SCRATCHLLM_VL; l++) x[l] = scratchllm_half_to_float(((const uint16_t *)base)[i + l]);
#endif
    } else if (kind == SCRATCHLLM_KV_BF16) {
#if SCRATCHLLM_VL == 16
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
        x = (scratchllm_vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#elif SCRATCHLLM_VL == 8 && defined(__AVX2__)
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
        x = (scratchllm_vf)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#else
        for (int l = 0; l < SCRATCHLLM_VL; l++) x[l] = scratchllm_bf16_to_float(((const uint16_t *)base)[i + l]);
#endif
    } else if (kind == SCRATCHLLM_KV_I8) {
#if SCRATCHLLM_VL == 16
        x = (scratchllm_vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + i))));
#elif SCRATCHLLM_VL == 8 && defined(__AVX2__)
        x = (scratchllm_vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + i))));
#else
        for (int l = 0; l < SCRATCHLLM_VL; l++) x[l] = (float)((const int8_t *)base)[i + l];
#endif
    } else {
        memcpy(&x, (const float *)base + i, sizeof x);
    }
    return x;
}

/* Writes x into element i of a cache of `kind` (int8: x / scale rounded, to nearest even, and
   clamped to +-127; the caller chose the scale). */
static inline void scratchllm_kv_put(void *base, Py_ssize_t i, float x, int kind, float inv_scale) {
    switch (kind) {
        case SCRATCHLLM_KV_F16: ((uint16_t *)base)[i] = scratchllm_float_to_half(x); break;
        case SCRATCHLLM_KV_BF16: ((uint16_t *)base)[i] = scratchllm_float_to_bf16(x); break;
        case SCRATCHLLM_KV_I8: {
            float r = nearbyintf(x * inv_scale);
            ((int8_t *)base)[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            break;
        }
        default: ((float *)base)[i] = x;
    }
}

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
SCRATCHLLM_INLINE void scratchllm_scores_n(const float *q, const void *kt, float *s, Py_ssize_t ss,
                                           Py_ssize_t D, const int n, const int kind) {
    scratchllm_vf a0[SA_HEADS][SA_NV], a1[SA_HEADS][SA_NV], k0[SA_NV], k1[SA_NV];
    Py_ssize_t d = 0;
    for (int j = 0; j < n; j++)
        for (int u = 0; u < SA_NV; u++) a0[j][u] = a1[j][u] = (scratchllm_vf){0};
    for (; d + 1 < D; d += 2) {
        for (int u = 0; u < SA_NV; u++) {  /* one vector at a time: a whole-array memcpy went through the stack */
            k0[u] = scratchllm_kv_load(kt, d * 16 + u * SA_VL, kind);
            k1[u] = scratchllm_kv_load(kt, (d + 1) * 16 + u * SA_VL, kind);
        }
        for (int j = 0; j < n; j++)
            for (int u = 0; u < SA_NV; u++) {
                a0[j][u] += q[j * D + d] * k0[u];
                a1[j][u] += q[j * D + d + 1] * k1[u];
            }
    }
    if (d < D) {  /* odd D */
        for (int u = 0; u < SA_NV; u++) k0[u] = scratchllm_kv_load(kt, d * 16 + u * SA_VL, kind);
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
SCRATCHLLM_INLINE void scratchllm_block_scores16_k(const float *q, Py_ssize_t G, const void *kt, float *s,
                                                   Py_ssize_t ss, Py_ssize_t D, const int kind) {
    for (Py_ssize_t j = 0; j < G; j += SA_HEADS) {
        switch (G - j) {
            case 1: scratchllm_scores_n(q + j * D, kt, s + j * ss, ss, D, 1, kind); break;
#if SA_HEADS == 4
            case 2: scratchllm_scores_n(q + j * D, kt, s + j * ss, ss, D, 2, kind); break;
            case 3: scratchllm_scores_n(q + j * D, kt, s + j * ss, ss, D, 3, kind); break;
#endif
            default: scratchllm_scores_n(q + j * D, kt, s + j * ss, ss, D, SA_HEADS, kind);
        }
    }
}

/* The same for a cache of any kind: kt points at the block's first key element (of `kind`). */
static inline void scratchllm_block_scores16(const float *q, Py_ssize_t G, const void *kt, float *s,
                                             Py_ssize_t ss, Py_ssize_t D, int kind) {
    switch (kind) {
        case SCRATCHLLM_KV_F16: scratchllm_block_scores16_k(q, G, kt, s, ss, D, SCRATCHLLM_KV_F16); break;
        case SCRATCHLLM_KV_BF16: scratchllm_block_scores16_k(q, G, kt, s, ss, D, SCRATCHLLM_KV_BF16); break;
        case SCRATCHLLM_KV_I8: scratchllm_block_scores16_k(q, G, kt, s, ss, D, SCRATCHLLM_KV_I8); break;
        default: scratchllm_block_scores16_k(q, G, kt, s, ss, D, SCRATCHLLM_KV_F32);
    }
}

/* acc[j * D + c : + w VL] += sum over t < m of p[j * ps + t] * v[t * vs + c : + w VL], for n <= 4
   heads j and w native vectors of columns: the n x w accumulators stay in registers over the
   m value rows, each row loaded once for the n heads. */
SCRATCHLLM_INLINE void scratchllm_pv_nw(const float *p, Py_ssize_t ps, const void *v, Py_ssize_t vs,
                                        Py_ssize_t m, float *acc, Py_ssize_t D, Py_ssize_t c,
                                        const int n, const int w, const int kind) {
    scratchllm_vf a[4][8], x;
    for (int j = 0; j < n; j++)
        for (int u = 0; u < w; u++) memcpy(&a[j][u], acc + j * D + c + SA_VL * u, sizeof x);
    for (Py_ssize_t t = 0; t < m; t++) {
        for (int u = 0; u < w; u++) {
            x = scratchllm_kv_load(v, t * vs + c + SA_VL * u, kind);
            for (int j = 0; j < n; j++) a[j][u] += p[j * ps + t] * x;
        }
    }
    for (int j = 0; j < n; j++)
        for (int u = 0; u < w; u++) memcpy(acc + j * D + c + SA_VL * u, &a[j][u], sizeof x);
}

/* Columns per pass: n x w accumulators within 16 of the register file (AVX-512: 4 x 4 zmm;
   AVX2: 12 ymm or fewer), then single vectors for what is left of D. */
SCRATCHLLM_INLINE void scratchllm_pv_n(const float *p, Py_ssize_t ps, const void *v, Py_ssize_t vs,
                                       Py_ssize_t m, float *acc, Py_ssize_t D, const int n, const int kind) {
#if SA_VL == 16
    const int w = 4;
#else
    const int w = n == 1 ? 8 : n == 2 ? 6 : n == 3 ? 4 : 3;
#endif
    Py_ssize_t c = 0;
    for (; c + w * SA_VL <= D; c += w * SA_VL) scratchllm_pv_nw(p, ps, v, vs, m, acc, D, c, n, w, kind);
    for (; c < D; c += SA_VL) scratchllm_pv_nw(p, ps, v, vs, m, acc, D, c, n, 1, kind);
}

/* The weighted values of one block (m rows of D elements of `kind`, row stride vs elements) for G
   heads, D % 16 == 0. */
SCRATCHLLM_INLINE void scratchllm_block_values16_k(const float *p, Py_ssize_t ps, Py_ssize_t G, const void *v,
                                                   Py_ssize_t vs, Py_ssize_t m, float *acc, Py_ssize_t D,
                                                   const int kind) {
    for (Py_ssize_t j = 0; j < G; j += 4) {
        switch (G - j) {
            case 1: scratchllm_pv_n(p + j * ps, ps, v, vs, m, acc + j * D, D, 1, kind); break;
            case 2: scratchllm_pv_n(p + j * ps, ps, v, vs, m, acc + j * D, D, 2, kind); break;
            case 3: scratchllm_pv_n(p + j * ps, ps, v, vs, m, acc + j * D, D, 3, kind); break;
            default: scratchllm_pv_n(p + j * ps, ps, v, vs, m, acc + j * D, D, 4, kind);
        }
    }
}

static inline void scratchllm_block_values16(const float *p, Py_ssize_t ps, Py_ssize_t G, const void *v,
                                             Py_ssize_t vs, Py_ssize_t m, float *acc, Py_ssize_t D, int kind) {
    switch (kind) {
        case SCRATCHLLM_KV_F16: scratchllm_block_values16_k(p, ps, G, v, vs, m, acc, D, SCRATCHLLM_KV_F16); break;
        case SCRATCHLLM_KV_BF16: scratchllm_block_values16_k(p, ps, G, v, vs, m, acc, D, SCRATCHLLM_KV_BF16); break;
        case SCRATCHLLM_KV_I8: scratchllm_block_values16_k(p, ps, G, v, vs, m, acc, D, SCRATCHLLM_KV_I8); break;
        default: scratchllm_block_values16_k(p, ps, G, v, vs, m, acc, D, SCRATCHLLM_KV_F32);
    }
}


/* s[0:n] = exp(s - max(s[0:n])); returns the sum, taken over 16 running lanes (SA_NV native
   vectors) summed in lane order, the same on every instruction set, and writes the max to *max
   (a chunk of a split context needs it to be combined with the others). s has room for n
   rounded up to 16. */
static inline float scratchllm_exp_rows_max(float *s, Py_ssize_t n, float *max) {
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
    *max = m;
    return sum;
}

static inline float scratchllm_exp_rows(float *s, Py_ssize_t n) {
    float m;
    return scratchllm_exp_rows_max(s, n, &m);
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
