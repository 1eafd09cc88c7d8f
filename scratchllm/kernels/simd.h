/* 16-lane float vectors in GCC's vector extension (one zmm with AVX-512, two ymm with AVX2) and
   the vector exp the kernels share (paged attention's softmax, pointwise's SwiGLU gate). */
#ifndef SCRATCHLLM_SIMD_H
#define SCRATCHLLM_SIMD_H

#include <string.h>

typedef float scratchllm_v16 __attribute__((vector_size(64)));
typedef int scratchllm_v16i __attribute__((vector_size(64)));

/* mask ? a : b, lane by lane (C has no vector ?:); mask lanes are all ones or all zeros. */
static inline scratchllm_v16 scratchllm_select16(scratchllm_v16i mask, scratchllm_v16 a, scratchllm_v16 b) {
    scratchllm_v16i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* exp(x) for x <= 0, 16 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor polynomial to
   r^6 (relative error < 2e-7, below float32's resolution of a softmax weight), 2^n by
   writing n into the exponent bits. libm's expf is one call per element and does not
   vectorize without -ffast-math; this does. Below -87 the result is flushed to 0. */
static inline scratchllm_v16 scratchllm_exp16(scratchllm_v16 x) {
    scratchllm_v16i tiny = x < -87.0f;  /* lanes of all ones where true */
    x = scratchllm_select16(tiny, (scratchllm_v16){0} - 87.0f, x);  /* keeps n in int range */
    scratchllm_v16 y = x * 1.4426950408889634f - 0.5f;
    scratchllm_v16i n = __builtin_convertvector(y, scratchllm_v16i);  /* truncation: round(x log2 e) */
    scratchllm_v16 nf = __builtin_convertvector(n, scratchllm_v16);
    scratchllm_v16 r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
    scratchllm_v16 p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    scratchllm_v16i bits = ((n + 127) << 23) & ~tiny;  /* x < -87: no exponent bits, p * 0 */
    scratchllm_v16 two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* The native vector: one register of SCRATCHLLM_VL floats (a zmm of 16 with AVX-512, a ymm of 8
   with AVX, an xmm of 4 with SSE only). Kernels whose tile must fit the register file (the packed GEMM) are written in it. */
#if defined(__AVX512F__)
#define SCRATCHLLM_VL 16
#elif defined(__AVX__)
#define SCRATCHLLM_VL 8
#else
#define SCRATCHLLM_VL 4
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
typedef float scratchllm_vf __attribute__((vector_size(4 * SCRATCHLLM_VL)));

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
