/* The native vector of the kernels (one zmm of 16 floats with AVX-512, a ymm of 8 with AVX, an
   xmm of 4 with SSE only) and the vector exp they share (paged attention's softmax, pointwise's
   SwiGLU gate). Kernels are written in it, never in wider GCC vectors: on AVX2 a 16-lane vector
   type was split into halves through the stack and ran several times slower. Where a kernel's
   sums must not depend on the instruction set, it keeps 16 running lanes as 16 / VL native
   vectors (SCRATCHLLM_NV16). */
#ifndef SCRATCHLLM_SIMD_H
#define SCRATCHLLM_SIMD_H

#include <string.h>

/* The native vector: one register of SCRATCHLLM_VL floats (a zmm of 16 with AVX-512, a ymm of 8
   with AVX, an xmm of 4 with SSE only). Kernels whose tile must fit the register file (the packed GEMM) are written in it. */
#if defined(__AVX512F__)
#define SCRATCHLLM_VL 16
#elif defined(__AVX__)
#define SCRATCHLLM_VL 8
#else
#define SCRATCHLLM_VL 4
#endif
typedef float scratchllm_vf __attribute__((vector_size(4 * SCRATCHLLM_VL)));
typedef int scratchllm_vi __attribute__((vector_size(4 * SCRATCHLLM_VL)));
#define SCRATCHLLM_NV16 (16 / SCRATCHLLM_VL)  /* native vectors per 16 lanes */

/* mask ? a : b, lane by lane (C has no vector ?:); mask lanes are all ones or all zeros. */
static inline scratchllm_vf scratchllm_select(scratchllm_vi mask, scratchllm_vf a, scratchllm_vf b) {
    scratchllm_vi ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* exp(x) for x <= 0, lane by lane: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor polynomial to
   r^6 (relative error < 2e-7, below float32's resolution of a softmax weight), 2^n by
   writing n into the exponent bits. libm's expf is one call per element and does not
   vectorize without -ffast-math; this does. Below -87 the result is flushed to 0. */
static inline scratchllm_vf scratchllm_exp(scratchllm_vf x) {
    scratchllm_vi tiny = x < -87.0f;  /* lanes of all ones where true */
    x = scratchllm_select(tiny, (scratchllm_vf){0} - 87.0f, x);  /* keeps n in int range */
    scratchllm_vf y = x * 1.4426950408889634f - 0.5f;
    scratchllm_vi n = __builtin_convertvector(y, scratchllm_vi);  /* truncation: round(x log2 e) */
    scratchllm_vf nf = __builtin_convertvector(n, scratchllm_vf);
    scratchllm_vf r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
    scratchllm_vf p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    scratchllm_vi bits = ((n + 127) << 23) & ~tiny;  /* x < -87: no exponent bits, p * 0 */
    scratchllm_vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* Make GCC treat v (one native vector) as computed here: an empty asm that "changes" it, so the
   operations before it are rounded on their own and never contracted into an FMA with what
   follows. "v" is any SSE/AVX register (x/y/zmm0-31 with AVX-512, 0-15 without). */
#define SCRATCHLLM_OPAQUE(v) __asm__("" : "+v"(v))

/* The extensions this translation unit is compiled for, as /proc/cpuinfo names them (a string
   literal; scratchllm/kernels/cpu_features.py records the same from the compiler at build time). */
#ifdef __AVX__
#define SCRATCHLLM_F_AVX " avx"
#else
#define SCRATCHLLM_F_AVX ""
#endif
#ifdef __AVX2__
#define SCRATCHLLM_F_AVX2 " avx2"
#else
#define SCRATCHLLM_F_AVX2 ""
#endif
#ifdef __FMA__
#define SCRATCHLLM_F_FMA " fma"
#else
#define SCRATCHLLM_F_FMA ""
#endif
#ifdef __F16C__
#define SCRATCHLLM_F_F16C " f16c"
#else
#define SCRATCHLLM_F_F16C ""
#endif
#ifdef __AVX512F__
#define SCRATCHLLM_F_AVX512F " avx512f"
#else
#define SCRATCHLLM_F_AVX512F ""
#endif
#ifdef __AVX512BW__
#define SCRATCHLLM_F_AVX512BW " avx512bw"
#else
#define SCRATCHLLM_F_AVX512BW ""
#endif
#ifdef __AVX512VL__
#define SCRATCHLLM_F_AVX512VL " avx512vl"
#else
#define SCRATCHLLM_F_AVX512VL ""
#endif
#ifdef __AVX512BF16__
#define SCRATCHLLM_F_AVX512_BF16 " avx512_bf16"
#else
#define SCRATCHLLM_F_AVX512_BF16 ""
#endif
#define SCRATCHLLM_COMPILED_FEATURES SCRATCHLLM_F_AVX SCRATCHLLM_F_AVX2 SCRATCHLLM_F_FMA SCRATCHLLM_F_F16C SCRATCHLLM_F_AVX512F SCRATCHLLM_F_AVX512BW SCRATCHLLM_F_AVX512VL SCRATCHLLM_F_AVX512_BF16

#endif
