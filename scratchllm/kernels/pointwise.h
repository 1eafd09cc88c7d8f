/* The elementwise kernels' C: SwiGLU's silu(g) * u, GeGLU's gelu_tanh(g) * u, RMSNorm of a row and the rotary embedding of
   a head. Included by scratchllm/kernels/pointwise.pyx, whose `cdef extern from "pointwise.h"`
   declares what Cython calls. */
#ifndef SCRATCHLLM_POINTWISE_H
#define SCRATCHLLM_POINTWISE_H

#include <math.h>
#include "simd.h"  /* scratchllm_vf, scratchllm_select, scratchllm_exp */
#define PW_VL SCRATCHLLM_VL

/* sigmoid(z) from e = exp(-|z|) <= 1, which cannot overflow: 1 / (1 + e) for z >= 0, e / (1 + e)
   for z < 0; sixteen lanes on the vector path, libm's expf on the scalar one. */
static inline scratchllm_vf pw_sigmoid_v(scratchllm_vf z) {
    scratchllm_vi neg = z < 0.0f;
    scratchllm_vf e = scratchllm_exp(scratchllm_select(neg, z, -z));  /* exp(-|z|) */
    scratchllm_vf one = (scratchllm_vf){0} + 1.0f;
    return scratchllm_select(neg, e, one) / (1.0f + e);
}

static inline float pw_sigmoid(float z) {
    float e = expf(-fabsf(z));
    return (z < 0.0f ? e : 1.0f) / (1.0f + e);
}

/* out[0:n] = act(g) * u, act(g) = g * sigmoid(z): SwiGLU's silu (z = g) or, with `gelu`, GeGLU's
   tanh GELU (Gemma): 0.5 g (1 + tanh(y)) with y = sqrt(2/pi) (g + 0.044715 g^3), which is the same
   function as g * sigmoid(2 y). Whole groups of 16 take the vector path and the rest libm's expf,
   on every instruction set alike. */
static inline void pw_gated(const float *g, const float *u, float *out, long n, int gelu) {
    const float c = 1.5957691216057308f;  /* 2 sqrt(2 / pi) */
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int l = 0; l < 16; l += PW_VL) {
            scratchllm_vf gv, uv;
            memcpy(&gv, g + i + l, sizeof gv);
            memcpy(&uv, u + i + l, sizeof uv);
            scratchllm_vf z = gelu ? c * (gv + 0.044715f * (gv * gv * gv)) : gv;
            scratchllm_vf o = gv * pw_sigmoid_v(z) * uv;
            memcpy(out + i + l, &o, sizeof o);
        }
    }
    for (; i < n; i++) {
        float z = gelu ? c * (g[i] + 0.044715f * (g[i] * g[i] * g[i])) : g[i];
        out[i] = g[i] * pw_sigmoid(z) * u[i];
    }
}

static void pw_silu_mul(const float *g, const float *u, float *out, long n) {
    pw_gated(g, u, out, n, 0);
}

static void pw_gelu_tanh_mul(const float *g, const float *u, float *out, long n) {
    pw_gated(g, u, out, n, 1);
}

/* out = x / sqrt(mean(x^2) + eps) * w, one row of n. The sum of squares runs in 16 lanes
   (SCRATCHLLM_NV16 native vectors), summed in lane order: the same float on every ISA. */
static void pw_rms_norm(const float *x, const float *w, float eps, float *out, long n) {
    scratchllm_vf acc[SCRATCHLLM_NV16];
    for (int u = 0; u < SCRATCHLLM_NV16; u++) acc[u] = (scratchllm_vf){0};
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int u = 0; u < SCRATCHLLM_NV16; u++) {
            scratchllm_vf v;
            memcpy(&v, x + i + u * PW_VL, sizeof v);
            acc[u] += v * v;
        }
    }
    float ss = 0.0f;
    for (int u = 0; u < SCRATCHLLM_NV16; u++)
        for (int j = 0; j < PW_VL; j++)
            ss += acc[u][j];
    for (; i < n; i++)
        ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++)
        out[i] = x[i] * inv * w[i];
}

/* Rotate-half rotary embedding of one head in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). */
static void pw_rope_head(float *x, const float *c, const float *s, long half) {
    for (long i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

#endif
