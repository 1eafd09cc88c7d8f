/* The elementwise kernels' C: SwiGLU's silu(g) * u, GeGLU's gelu_tanh(g) * u, RMSNorm of a row and the rotary embedding of
   a head. Included by scratchllm/kernels/pointwise.pyx, whose `cdef extern from "pointwise.h"`
   declares what Cython calls. */
#ifndef SCRATCHLLM_POINTWISE_H
#define SCRATCHLLM_POINTWISE_H

#include <math.h>
#include "simd.h"  /* scratchllm_vf, scratchllm_select, scratchllm_exp */
#define PW_VL SCRATCHLLM_VL

/* out[0:n] = silu(g) * u, silu(g) = g * sigmoid(g); sigmoid from e = exp(-|g|) <= 1, which
   cannot overflow: 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0. Whole groups of 16 take the
   vector path and the rest libm's expf, on every instruction set alike. */
static void pw_silu_mul(const float *g, const float *u, float *out, long n) {
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int l = 0; l < 16; l += PW_VL) {
            scratchllm_vf gv, uv;
            memcpy(&gv, g + i + l, sizeof gv);
            memcpy(&uv, u + i + l, sizeof uv);
            scratchllm_vi neg = gv < 0.0f;
            scratchllm_vf a = scratchllm_select(neg, gv, -gv);  /* -|g| */
            scratchllm_vf e = scratchllm_exp(a);
            scratchllm_vf one = (scratchllm_vf){0} + 1.0f;
            scratchllm_vf sig = scratchllm_select(neg, e, one) / (1.0f + e);
            scratchllm_vf o = gv * sig * uv;
            memcpy(out + i + l, &o, sizeof o);
        }
    }
    for (; i < n; i++) {
        float e = expf(-fabsf(g[i]));
        float sig = (g[i] < 0.0f ? e : 1.0f) / (1.0f + e);
        out[i] = g[i] * sig * u[i];
    }
}

/* out[0:n] = gelu_tanh(g) * u, GeGLU (Gemma): gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2/pi)
   (g + 0.044715 g^3), computed as g * sigmoid(2 y), the same function (0.5 (1 + tanh y) = sigmoid(2 y)),
   with pw_silu_mul's sigmoid, which cannot overflow. Whole groups of 16 take the vector path and
   the rest libm's expf. */
static void pw_gelu_tanh_mul(const float *g, const float *u, float *out, long n) {
    const float c = 1.5957691216057308f;  /* 2 sqrt(2 / pi) */
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int l = 0; l < 16; l += PW_VL) {
            scratchllm_vf gv, uv;
            memcpy(&gv, g + i + l, sizeof gv);
            memcpy(&uv, u + i + l, sizeof uv);
            scratchllm_vf z = c * (gv + 0.044715f * (gv * gv * gv));
            scratchllm_vi neg = z < 0.0f;
            scratchllm_vf a = scratchllm_select(neg, z, -z);  /* -|z| */
            scratchllm_vf e = scratchllm_exp(a);
            scratchllm_vf one = (scratchllm_vf){0} + 1.0f;
            scratchllm_vf sig = scratchllm_select(neg, e, one) / (1.0f + e);
            scratchllm_vf o = gv * sig * uv;
            memcpy(out + i + l, &o, sizeof o);
        }
    }
    for (; i < n; i++) {
        float z = c * (g[i] + 0.044715f * (g[i] * g[i] * g[i]));
        float e = expf(-fabsf(z));
        float sig = (z < 0.0f ? e : 1.0f) / (1.0f + e);
        out[i] = g[i] * sig * u[i];
    }
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
