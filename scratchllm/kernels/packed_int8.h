/* The int8-activation GEMM: x rounded to 8 bits per run of 32 values, then integer dot products
   against the quantized panels (packed_gemm.h's layouts), the way llama.cpp multiplies. Included
   by scratchllm/kernels/packed_gemm.pyx beside packed_gemm.h.

   Why: the exact path turns every weight into its float32 value (an FMA) before the product's FMA,
   so a decode step is bound by that arithmetic rather than by memory. Here a weight costs a
   quarter of one instruction (vpdpbusd multiplies and sums 4 bytes per 32-bit lane; AVX2's
   vpmaddubsw + vpmaddwd do the same in two), and the float work is per 32 weights, not per weight.
   The price: x is rounded to 8 bits, so the logits are close to float32's, not equal
   (scratchllm/bench/accuracy.py measures how close, beside llama.cpp's).

   The rounding of x (one definition, mirrored by packed_gemm.quantize_x8's NumPy reference):
   for each row and each run of 32 values, amax = max |x|, d = amax / 127, and
   q = rint(x * (127 / amax)) (nearest, ties to even; q = 0 where amax = 0), |q| <= 127; the
   kernels also take s = d * sum(q) and sum(q). A weight w = dw (u - z) (a zero point z) or
   w = dw u + m, u >= 0 the panel's integer, gives per group of 32 k and column
     sum_k x_k w_k ~= d dw (sum_k q_k u_k - z sum(q))        (integer, then one FMA)
                   or d dw sum_k q_k u_k + m s                (two FMAs).
   Every output element is one chain of float operations over its groups in order, block by
   block (PG_I8_KC), the same whatever the tile, the thread count or the instruction set: a row's
   result does not depend on the other rows of the batch (batch invariance), and AVX2, AVX-512
   and AVX512-VNNI builds give the same bits. */
#ifndef SCRATCHLLM_PACKED_INT8_H
#define SCRATCHLLM_PACKED_INT8_H

#include <math.h>
#include <stdlib.h>
#include "packed_gemm.h"

/* ---- x rounded for integer products ---- */

/* x's rows rounded: per row and group of 32 values, Q = q1 (one level) or Q = 256 q1 + q2 (two
   levels: q2 rounds what q1 left over, 256 times finer), x ~= d Q; q1 and q2 int8 [M, K] (q2 NULL
   for one level) in the panel kind's k order (pg_x8_block), d the scale, sum = sum(Q) and
   s = d * sum(Q) per group. */
typedef struct {
    int8_t *q, *q2;
    float *d, *s;
    int32_t *sum, *sum16;     /* sum(Q) per group of 32, and per half group of 16 [M, K/16] */
    long M, K;
} pg_x8;

/* k orders of q within each run of 8: PG_X8_NATURAL (8-bit panels: 4 consecutive k per 32-bit
   lane) or PG_X8_EVEN_ODD (4-bit word panels: a word's low nibbles are rows 0, 2, 4, 6 of its
   8, the high nibbles rows 1, 3, 5, 7; so q holds x's rows 0 2 4 6 1 3 5 7). */
enum { PG_X8_NATURAL = 0, PG_X8_EVEN_ODD = 1 };

/* One run of 32 values. amax = max |x|, d1 = amax / 127, inv = 127 / amax (0 where amax = 0),
   q1 = rint(x inv) (nearest, ties to even); two levels: r = x - q1 d1 (one FMA: rounded once),
   q2 = rint(r (256 inv)) clamped to +-127. The same scalar and lane operations on every
   instruction set, so every build rounds x alike. A NaN in the run makes d1 NaN (and an
   infinity makes it infinite): the products come out NaN, where the exact path's would too.
   The vector paths put the values in the k order first (a permutation within runs of 8: the
   rounding is lane by lane, the sums do not depend on the order) and store the bytes in place. */
static inline void pg_x8_scales(float amax, int nan, int two, float *scale, float *inv, float *inv2) {
    *scale = nan ? NAN : amax / 127.0f;
    *inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *inv2 = *inv * 256.0f;
    (void)two;
}

/* the run's d, s = d sum(Q), sum(Q) and the sums of its halves, from the halves' sums */
static inline void pg_x8_sums(const int32_t half[2], float scale, int two, float *d, float *s, int32_t *sum,
                              int32_t *sum16) {
    int32_t total = half[0] + half[1];
    float dq = two ? scale * (1.0f / 256) : scale;  /* exact: a power of two */
    *d = dq;
    *s = dq * (float)total;
    *sum = total;
    sum16[0] = half[0];
    sum16[1] = half[1];
}

static inline void pg_x8_block(const float *x, int8_t *q, int8_t *q2, float *d, float *s, int32_t *sum,
                               int32_t *sum16, int order) {
    float scale, inv, inv2;
    int32_t half[2];  /* sum(Q) of rows 0..15 and 16..31 */
#if PG_VL == 16
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 v[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const int nan = (_mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q)) != 0;
    pg_x8_scales(amax, nan, q2 != NULL, &scale, &inv, &inv2);
    if (order == PG_X8_EVEN_ODD) {
        const __m512i eo = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
        v[0] = _mm512_permutexvar_ps(eo, v[0]);
        v[1] = _mm512_permutexvar_ps(eo, v[1]);
    }
    for (int i = 0; i < 2; i++) {
        __m512 a = _mm512_roundscale_ps(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)), rn);
        __m128i ia8 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a));  /* integral: exact */
        __m512i sums = _mm512_slli_epi32(_mm512_cvtepi8_epi32(ia8), q2 ? 8 : 0);  /* the bytes' sum, as stored */
        _mm_storeu_si128((__m128i *)(q + 16 * i), ia8);
        if (q2) {
            __m512 r = _mm512_fnmadd_ps(a, _mm512_set1_ps(scale), v[i]);
            __m512 b = _mm512_roundscale_ps(_mm512_mul_ps(r, _mm512_set1_ps(inv2)), rn);
            __m512i ib = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(b, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f)));
            _mm_storeu_si128((__m128i *)(q2 + 16 * i), _mm512_cvtepi32_epi8(ib));
            sums = _mm512_add_epi32(sums, ib);
        }
        half[i] = _mm512_reduce_add_epi32(sums);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4], mx, un;
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                       _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q), _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
                      _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q), _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    pg_x8_scales(_mm_cvtss_f32(m4), _mm256_movemask_ps(un) != 0, q2 != NULL, &scale, &inv, &inv2);
    if (order == PG_X8_EVEN_ODD) {
        const __m256i eo = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_permutevar8x32_ps(v[i], eo);
    }
    __m256i i1[4], i2[4], hs[2];
    for (int i = 0; i < 4; i++) {
        __m256 a = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)), rn);
        i1[i] = _mm256_cvtps_epi32(a);
        if (q2) {
            __m256 r = _mm256_fnmadd_ps(a, _mm256_set1_ps(scale), v[i]);
            __m256 b = _mm256_round_ps(_mm256_mul_ps(r, _mm256_set1_ps(inv2)), rn);
            i2[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(b, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f)));
        }
    }
    for (int h = 0; h < 2; h++) {
        hs[h] = _mm256_add_epi32(i1[2 * h], i1[2 * h + 1]);
        if (q2)
            hs[h] = _mm256_add_epi32(_mm256_slli_epi32(hs[h], 8), _mm256_add_epi32(i2[2 * h], i2[2 * h + 1]));
        __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(hs[h]), _mm256_extracti128_si256(hs[h], 1));
        h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0x4E));
        h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0xB1));
        half[h] = _mm_cvtsi128_si32(h4);
    }
    /* the packs work within 128-bit lanes: dwords of bytes v0[0:4] v1[0:4] v2[0:4] v3[0:4] |
       v0[4:8] v1[4:8] v2[4:8] v3[4:8], put back in order by one permutation */
    const __m256i order8 = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int level = 0; level < (q2 ? 2 : 1); level++) {
        __m256i *iv = level ? i2 : i1;
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256((__m256i *)(level ? q2 : q), _mm256_permutevar8x32_epi32(p, order8));
    }
#else
    float amax = 0.0f;
    int nan = 0;  /* a NaN in x makes the run's scale NaN, so that the products carry it as the exact path's do */
    for (int i = 0; i < 32; i++) {
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        nan |= x[i] != x[i];
    }
    pg_x8_scales(amax, nan, q2 != NULL, &scale, &inv, &inv2);
    half[0] = half[1] = 0;
    for (int i = 0; i < 32; i++) {
        /* value i goes to place i of the run (natural) or, within its run of 8, to the even-odd place */
        int at = order == PG_X8_EVEN_ODD ? (i & ~7) + ((i & 1) ? 4 : 0) + ((i & 7) >> 1) : i;
        float a = rintf(x[i] * inv);  /* the rounding mode's nearest, ties to even */
        q[at] = (int8_t)a;
        half[i / 16] += q2 ? 256 * (int32_t)a : (int32_t)a;
        if (q2) {
            float b = rintf(fmaf(-a, scale, x[i]) * inv2);
            q2[at] = (int8_t)(b < -127.0f ? -127.0f : b > 127.0f ? 127.0f : b);
            half[i / 16] += q2[at];
        }
    }
#endif
    pg_x8_sums(half, scale, q2 != NULL, d, s, sum, sum16);
}

/* x's M x K rounded values in this thread's buffer (grown as needed, kept for the next product:
   a decode step rounds ~100 rows of x, each of a few KiB); -1 where memory ran out. The buffer
   is the calling thread's, so two threads multiplying at once never share one. two: two levels. */
static int pg_x8_reserve(pg_x8 *x, long M, long K, int two, int slot) {
    static __thread char *bufs[2] = {NULL, NULL};  /* slot: one per k order, for a matrix of both kinds */
    static __thread size_t caps[2] = {0, 0};
    char *buf = bufs[slot];
    size_t cap = caps[slot];
    size_t groups = (size_t)M * (size_t)(K / 32), need = (size_t)M * (size_t)K * 2 + 5 * 4 * groups + 64;
    if (need > cap) {
        char *grown = (char *)realloc(buf, need);
        if (!grown)
            return -1;
        bufs[slot] = buf = grown;
        caps[slot] = cap = need;
    }
    char *at = (char *)(((uintptr_t)buf + 3) & ~(uintptr_t)3);
    x->d = (float *)at;
    x->s = x->d + groups;
    x->sum = (int32_t *)(x->s + groups);
    x->sum16 = x->sum + groups;
    x->q = (int8_t *)(x->sum16 + 2 * groups);
    x->q2 = two ? x->q + (size_t)M * (size_t)K : NULL;
    x->M = M;
    x->K = K;
    return 0;
}

typedef struct {
    const float *x;  /* [M, K] */
    pg_x8 out;
    int order;
    long rows_per_task;
} pg_x8_job;

static void pg_x8_task(void *ctx, long t) {
    const pg_x8_job *j = (const pg_x8_job *)ctx;
    const pg_x8 *o = &j->out;
    long G = o->K / 32, end = (t + 1) * j->rows_per_task;
    for (long r = t * j->rows_per_task; r < end && r < o->M; r++)
        for (long g = 0; g < G; g++) {
            long at = r * o->K + 32 * g;
            pg_x8_block(j->x + at, o->q + at, o->q2 ? o->q2 + at : NULL, o->d + r * G + g, o->s + r * G + g,
                        o->sum + r * G + g, o->sum16 + 2 * (r * G + g), j->order);
        }
}

/* ---- integer dot products, per instruction set ----
   PG_INT_DOT_INSTR: 1 where the build has a dot-product instruction (vpdpbusd: AVX512-VNNI,
   AVX-VNNI), 0 where it composes one (vpmaddubsw + vpmaddwd) or runs C. With the instruction the
   integer products beat the exact path at every batch size measured; without it, "int16" costs
   about as much per weight as the exact path's two FMAs once the rows are many (a prefill), and
   the loader keeps the exact path as the default (models/loader.auto_dtype, docs/kernels.md).
   pg_iv: NR / 2 columns' 32-bit lanes (a native vector). pg_dot(acc, u, s): acc += the sum of
   each lane's four u8 x s8 products. With VNNI that is vpdpbusd into 32-bit lanes; without,
   vpmaddubsw sums pairs into 16-bit lanes and pg_dot_finish widens them once per group (no
   saturation: the micro-kernel's comment bounds what a 16-bit lane holds; pg_dot_wide and
   pg_dot8 widen at once where it would not fit). */
#if PG_VL == 16 && defined(__AVX512BW__)
typedef __m512i pg_iv;
#define PG_IV_ZERO _mm512_setzero_si512()
#define pg_iv_load(p) _mm512_loadu_si512((const void *)(p))
#define pg_iv_set1 _mm512_set1_epi32
#define pg_iv_and _mm512_and_si512
#define pg_iv_or _mm512_or_si512
#define pg_iv_srl(a, n) _mm512_srli_epi32(a, n)
#define pg_iv_sll(a, n) _mm512_slli_epi32(a, n)
#define pg_iv_sub _mm512_sub_epi32
#define pg_iv_add _mm512_add_epi32
#define pg_iv_to_vec(a) ((pg_vec)_mm512_cvtepi32_ps(a))
#if defined(__AVX512VNNI__)
#define PG_DOT_VNNI 1
#define PG_INT_DOT_INSTR 1
#define PG_INT8_DOT "vpdpbusd zmm (AVX512-VNNI)"
#define pg_dot(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define pg_dot_finish(acc) (acc)
#else
#define PG_DOT_VNNI 0
#define PG_INT_DOT_INSTR 0
#define PG_INT8_DOT "vpmaddubsw + vpmaddwd zmm (AVX512BW)"
#define pg_dot(acc, u, s) _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s))
#define pg_dot_finish(acc) _mm512_madd_epi16(acc, _mm512_set1_epi16(1))
#endif
#elif PG_VL == 8 && defined(__AVX2__)
typedef __m256i pg_iv;
#define PG_IV_ZERO _mm256_setzero_si256()
#define pg_iv_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define pg_iv_set1 _mm256_set1_epi32
#define pg_iv_and _mm256_and_si256
#define pg_iv_or _mm256_or_si256
#define pg_iv_srl(a, n) _mm256_srli_epi32(a, n)
#define pg_iv_sll(a, n) _mm256_slli_epi32(a, n)
#define pg_iv_sub _mm256_sub_epi32
#define pg_iv_add _mm256_add_epi32
#define pg_iv_to_vec(a) ((pg_vec)_mm256_cvtepi32_ps(a))
#if defined(__AVXVNNI__)
#define PG_DOT_VNNI 1
#define PG_INT_DOT_INSTR 1
#define PG_INT8_DOT "vpdpbusd ymm (AVX-VNNI)"
#define pg_dot(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define pg_dot_finish(acc) (acc)
#else
#define PG_DOT_VNNI 0
#define PG_INT_DOT_INSTR 0
#define PG_INT8_DOT "vpmaddubsw + vpmaddwd ymm (AVX2)"
#define pg_dot(acc, u, s) _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s))
#define pg_dot_finish(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
#endif
#else  /* portable C: the same integers and the same float operations, a lane at a time */
typedef scratchllm_vi pg_iv;
typedef unsigned int pg_uv __attribute__((vector_size(4 * PG_VL)));
#define PG_IV_ZERO ((pg_iv){0})
static inline pg_iv pg_iv_load(const void *p) { pg_iv v; memcpy(&v, p, sizeof v); return v; }
#define pg_iv_set1(v) ((pg_iv){0} + (int)(v))
#define pg_iv_and(a, b) ((a) & (b))
#define pg_iv_or(a, b) ((a) | (b))
#define pg_iv_srl(a, n) ((pg_iv)((pg_uv)(a) >> (n)))
#define pg_iv_sll(a, n) ((pg_iv)((pg_uv)(a) << (n)))
#define pg_iv_sub(a, b) ((a) - (b))
#define pg_iv_add(a, b) ((a) + (b))
#define pg_iv_to_vec(a) __builtin_convertvector(a, pg_vec)
#define PG_DOT_VNNI 1
#define PG_INT_DOT_INSTR 0
#define PG_INT8_DOT "C"
static inline pg_iv pg_dot(pg_iv acc, pg_iv u, pg_iv s) {
    uint8_t ub[4 * PG_VL];
    int8_t sb[4 * PG_VL];
    memcpy(ub, &u, sizeof ub);
    memcpy(sb, &s, sizeof sb);
    for (int l = 0; l < PG_VL; l++)
        for (int b = 0; b < 4; b++)
            acc[l] += ub[4 * l + b] * sb[4 * l + b];
    return acc;
}
#define pg_dot_finish(acc) (acc)
#endif

/* pg_dot8(acc, u, s): the same for 8-bit panels, whose bytes u = q + 128 reach 255. vpdpbusd takes
   them as they are (acc gains 128 sum(s) beside sum(q s): PG_Q8_Z = 128, the zero point the
   epilogue subtracts); vpmaddubsw would saturate (2 x 255 x 127 > 2^15), so without VNNI the
   bytes go back to q and multiply as |q| by s with q's sign (pairs <= 2 x 128 x 127), widened to
   32 bits at once (PG_Q8_Z = 0). */
#if PG_DOT_VNNI
#define PG_Q8_Z 128
#define pg_dot8(acc, u, s) pg_dot(acc, u, s)
#elif PG_VL == 16
#define PG_Q8_Z 0
static inline __attribute__((always_inline)) pg_iv pg_dot8(pg_iv acc, pg_iv u, pg_iv s) {
    pg_iv q = _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80));
    pg_iv sq = _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(q), _mm512_setzero_si512(), s);  /* s with q's sign */
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(q), sq),
                                                   _mm512_set1_epi16(1)));
}
#else
#define PG_Q8_Z 0
static inline __attribute__((always_inline)) pg_iv pg_dot8(pg_iv acc, pg_iv u, pg_iv s) {
    pg_iv q = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(s, q)),
                                                   _mm256_set1_epi16(1)));
}
#endif

/* ---- the micro-kernel, per kind of panel ----
   A step is 8 rows of k (step ks: rows 8 ks .. 8 ks + 7): per half of the panel (NR / 2 columns)
   two byte vectors, b0 holding the rows x's bytes 0..3 of the step stand for, b1 those of 4..7.
   PG_I8_Q4 (Q4Panels: Q4_0, Q4_1; and PG_I8_Q4K, Q4_K's KPanels): the step is a word row; word &
     0x0F0F0F0F holds its rows 0 2 4 6, (word >> 4) & 0x0F0F0F0F rows 1 3 5 7: x in even-odd
     order. Per group of 32 k a 16-bit lane (no VNNI) sums 8 x 2 products <= 8 x 2 x 15 x 127
     = 30480 < 2^15.
   PG_I8_Q6K (Q6_K's KPanels): the same low nibbles, each byte's bits 4 and 5 from the high-bit
     word of the step's 16 rows (one shift and one AND per vector); u <= 63, so without VNNI the
     16-bit pairs are widened at once (pg_dot_wide). Its scale groups are 16 rows: 2 steps.
   PG_I8_Q5K (Q5_K's, Q5_0's, Q5_1's KPanels): the low nibbles and bit 4 from the group's high-bit
     word; u <= 31, widened at once too; the group's d and m as the exact path has them
     (Q5_0's m = -16 d: an offset here, not a zero point).
   PG_I8_Q3K, PG_I8_Q2K (Q3_K's, Q2_K's KPanels): u <= 7 in the nibbles, as PG_I8_Q4's; Q6_K's
     groups of 16 (Q2_K's with mins: m dx sum16(Q)).
   PG_I8_Q8 (Q8Panels): the step is two word rows of 4 rows each, biased bytes: x in order.
   Two levels: each byte vector meets q1's bytes and q2's, into two integer sums combined per
   scale group as 256 sum(q1 u) + sum(q2 u) = sum(Q u): |.| < 256 x 32 x 255 x 128 < 2^31. */
enum { PG_I8_Q4 = 0, PG_I8_Q8 = 1, PG_I8_Q4K = 2, PG_I8_Q6K = 3, PG_I8_Q5K = 4, PG_I8_Q3K = 5, PG_I8_Q2K = 6 };

/* Register budget: per row of a tile 2 float accumulators and, per half of a pass, 1 integer
   sum per level; per pass 2 byte vectors per half, 2 broadcasts of x per level, 1 mask.
   AVX-512 (32 zmm) takes both halves per pass: 4 R + 7 (one level: R <= 6), 6 R + 9 (two:
   R <= 3). AVX2 (16 ymm) one half per pass: 3 R + 5 (R <= 3), 4 R + 7 (R <= 2). Beside them a
   scale group's d (and m) of both halves: panels with offsets (m) hold 4 more vectors, and a
   6-row tile of them spills (35 of 32), so up to PG_I8_FEW_ROWS rows of x they tile at most
   PG_I8_MAXR1M: with 5, 16 rows of Q4_K and Q5_K ran 3-10% faster; Q6_K (no offsets) ran 3%
   slower with 5 (docs/kernels.md). */
#if PG_VL == 16
#define PG_I8_HALVES 2
#define PG_I8_MAXR1 6
#define PG_I8_MAXR1M 5
#define PG_I8_MAXR2 3
#define PG_I8_CASES1(C, a, b) C(a, 1, b) C(a, 2, b) C(a, 3, b) C(a, 4, b) C(a, 5, b) C(a, 6, b)
#define PG_I8_CASES2(C, a, b) C(a, 1, b) C(a, 2, b) C(a, 3, b)
#else
#define PG_I8_HALVES 1
#define PG_I8_MAXR1 3
#define PG_I8_MAXR1M 3
#define PG_I8_MAXR2 2
#define PG_I8_CASES1(C, a, b) C(a, 1, b) C(a, 2, b) C(a, 3, b)
#define PG_I8_CASES2(C, a, b) C(a, 1, b) C(a, 2, b)
#endif
#define PG_I8_KC 512  /* k per block of a panel: 4-bit 8 KiB, 8-bit 16 KiB, read once per row tile from L1 */

/* Q6_K: bits 2 v, 2 v + 1 of each byte of the high-bit word H moved to bits 4, 5. */
static inline __attribute__((always_inline)) pg_iv pg_q6k_high(pg_iv H, const int v) {
    const pg_iv mask = pg_iv_set1(0x30303030);
    return pg_iv_and(v == 0 ? pg_iv_sll(H, 4) : v == 1 ? pg_iv_sll(H, 2) : v == 2 ? H : pg_iv_srl(H, 2), mask);
}

/* Q5_K: bit v of each byte of the high-bit word H moved to bit 4. */
static inline __attribute__((always_inline)) pg_iv pg_q5k_high(pg_iv H, const int v) {
    const pg_iv mask = pg_iv_set1(0x10101010);
    return pg_iv_and(v < 4 ? pg_iv_sll(H, 4 - v) : v == 4 ? H : pg_iv_srl(H, v - 4), mask);
}

/* Step ks of the panel, half h: b[0] and b[1]. */
static inline __attribute__((always_inline)) void pg_i8_step(const int kind, const uint8_t *q, const uint8_t *qh,
                                                            long ks, int h, pg_iv b[2]) {
    if (kind == PG_I8_Q8) {
        const uint8_t *wp = q + 8 * ks * PG_NR + h * 4 * PG_VL;
        b[0] = pg_iv_load(wp);
        b[1] = pg_iv_load(wp + 4 * PG_NR);
        return;
    }
    const pg_iv low = pg_iv_set1(0x0F0F0F0F);
    pg_iv w = pg_iv_load(q + ks * 4 * PG_NR + h * 4 * PG_VL);
    b[0] = pg_iv_and(w, low);
    b[1] = pg_iv_and(pg_iv_srl(w, 4), low);
    if (kind == PG_I8_Q6K) {  /* word row ks % 2 of the 16 rows' high-bit word ks / 2 */
        pg_iv H = pg_iv_load(qh + (ks / 2) * 4 * PG_NR + h * 4 * PG_VL);
        const int v = 2 * (int)(ks % 2);
        b[0] = pg_iv_or(b[0], pg_q6k_high(H, v));
        b[1] = pg_iv_or(b[1], pg_q6k_high(H, v + 1));
    }
    if (kind == PG_I8_Q5K) {  /* word row ks % 4 of the 32 rows' high-bit word ks / 4 */
        pg_iv H = pg_iv_load(qh + (ks / 4) * 4 * PG_NR + h * 4 * PG_VL);
        const int v = 2 * (int)(ks % 4);
        b[0] = pg_iv_or(b[0], pg_q5k_high(H, v));
        b[1] = pg_iv_or(b[1], pg_q5k_high(H, v + 1));
    }
}

/* Where several row tiles share a block, the first is the one that reads the panel from memory:
   at each step it prefetches (into L2) the bytes of the step PG_I8_PF_STEPS ahead, two blocks on,
   a line or two a step. The hardware prefetcher alone leaves that tile waiting at every block:
   with it, 16 rows ran 8-16% faster on one thread (Q4_K; Q6_K, whose high bits are a second
   stream, 8-11%) and a 16-sequence decode step of the 1.5B about 20% faster on two. Prefetching
   the scales too, or all of a block at once, made the products slower, and so did prefetching
   in a single tile (one row, decode: the hardware's stream is all that memory's bandwidth
   allows there) (docs/kernels.md). A task's panels lie one after another, so the steps past a
   panel's end are the next panel's; none past the task's last panel (limit: its steps from q),
   which another thread may be reading. */
#define PG_I8_PF_STEPS (2 * PG_I8_KC / 8)

/* Rows of x up to which a product tiles offsets' panels in PG_I8_MAXR1M rows and prefetches:
   a batch of sequences decoding. Above (a prefill) the two together cost more than they gave:
   250 rows of Q5_K ran 0.78-0.83x and Q4_K 0.89-0.91x with them. (Their tiles run a function of
   their own, pg_i8_tile_pf: with one function for both, 500 rows still ran 0.85-0.96x.) */
#define PG_I8_FEW_ROWS 24
static inline __attribute__((always_inline)) void pg_i8_prefetch(const int kind, const uint8_t *q, const uint8_t *qh,
                                                                long ks, long limit) {
    const long at = ks + PG_I8_PF_STEPS;
    if (at >= limit)
        return;
    const int bytes = kind == PG_I8_Q8 ? 8 * PG_NR : 4 * PG_NR;  /* a step's bytes: 8 rows of k, NR columns */
    for (int o = 0; o < bytes; o += 64)
        __builtin_prefetch(q + at * bytes + o, 0, 2);
    if (kind == PG_I8_Q6K)  /* a word a column per 2 steps */
        __builtin_prefetch(qh + at * 2 * PG_NR, 0, 2);
    if (kind == PG_I8_Q5K)  /* a word a column per 4 steps */
        __builtin_prefetch(qh + at * PG_NR, 0, 2);
}

/* Scale group sg's scales (and offsets) of the panel's two halves: float16 d, m (4-bit panels, a
   file's Q8_0), float32 (8-bit panels with offsets), or a K-quant's D sc and -(Dmin mn). */
static inline __attribute__((always_inline)) void pg_i8_scales(const int kind, const int f16, const void *d,
                                                              const void *m, const pg_kq *k, long sg, pg_vec dv[2],
                                                              pg_vec mv[2]) {
    if (kind == PG_I8_Q4K || kind == PG_I8_Q5K) {
        pg_q8_group b = kind == PG_I8_Q5K ? pg_q5_group_at(k, sg) : pg_q4k_group_at(k, sg);
        dv[0] = b.d0, dv[1] = b.d1, mv[0] = b.m0, mv[1] = b.m1;
        return;
    }
    if (kind == PG_I8_Q6K || kind == PG_I8_Q3K || kind == PG_I8_Q2K) {
        pg_k16_scales_at(k, sg, &dv[0], &dv[1], &mv[0], &mv[1]);
        return;
    }
    for (int h = 0; h < 2; h++) {
        if (f16) {
            pg_f16_to_f32((const uint16_t *)d + sg * PG_NR + h * PG_VL, &dv[h]);
            if (m)
                pg_f16_to_f32((const uint16_t *)m + sg * PG_NR + h * PG_VL, &mv[h]);
        } else {
            memcpy(&dv[h], (const float *)d + sg * PG_NR + h * PG_VL, sizeof dv[h]);
            if (m)
                memcpy(&mv[h], (const float *)m + sg * PG_NR + h * PG_VL, sizeof mv[h]);
        }
    }
}

/* Without VNNI, 16-bit pairs widened to 32 bits at once: for u up to 63 (Q6_K), where a scale
   group's pairs would not fit 16 bits. */
#if PG_DOT_VNNI
#define pg_dot_wide(acc, u, s) pg_dot(acc, u, s)
#elif PG_VL == 16
#define pg_dot_wide(acc, u, s) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#else
#define pg_dot_wide(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif

static inline __attribute__((always_inline)) pg_iv pg_i8_dot(const int kind, pg_iv acc, pg_iv u, pg_iv s) {
    return kind == PG_I8_Q8 ? pg_dot8(acc, u, s) : kind == PG_I8_Q6K || kind == PG_I8_Q5K ? pg_dot_wide(acc, u, s)
                                                                                            : pg_dot(acc, u, s);
}

static inline __attribute__((always_inline)) pg_iv pg_i8_finish(const int kind, pg_iv acc) {
    return kind == PG_I8_Q8 || kind == PG_I8_Q6K || kind == PG_I8_Q5K ? acc : pg_dot_finish(acc);
}

/* Rows r0 .. r0 + R - 1 of x against k = 32 g0 .. 32 g1 - 1 of one panel (q, d, m, k from its
   row 0); c[0:R, 0:cols] (+)= the products. has_m: the panels store offsets (w = d u + m, or
   for 8-bit d q + m); otherwise the zero point: w = d (u - 8) (Q4_0), d (u - 32) (Q6_K) or d q
   (Q8_0). two: x in two levels. R, kind, has_m, f16 and two are constants at every call site;
   pf: this tile prefetches (pg_i8_prefetch) the steps before pf (counted from q's), 0: none.
   Per scale group, row and column: the integer sum of Q u, less the zero point times sum(Q),
   converted, times d dx, then + m s: the float operations of every build, in the same order. */
static inline __attribute__((always_inline)) void pg_i8_r(const int R, const int kind, const int has_m, const int f16,
                                                         const int two, const pg_x8 *x, long r0, const uint8_t *q,
                                                         const void *d, const void *m, const pg_kq *k, long g0,
                                                         long g1, const pg_vec *pre, float *c, long ldc, int cols,
                                                         int first, long pf) {
    const long G = x->K / 32;
    const int gsize = kind == PG_I8_Q6K || kind == PG_I8_Q3K || kind == PG_I8_Q2K ? 16 : 32, steps = gsize / 8;
    const int zero = kind == PG_I8_Q8 ? PG_Q8_Z : kind == PG_I8_Q6K ? 32 : kind == PG_I8_Q3K ? 4 : has_m ? 0 : 8;
    pg_vec acc[2 * PG_I8_MAXR1];
    for (int i = 0; i < 2 * R; i++)
        acc[i] = (pg_vec){0};
    for (long sg = g0 * 32 / gsize; sg < g1 * 32 / gsize; sg++) {
        pg_vec dv[2], mv[2] = {(pg_vec){0}, (pg_vec){0}};
        if (pre) {  /* made once for all of the block's row tiles (pg_i8_prepare) */
            const pg_vec *at = pre + 4 * (sg - g0 * 32 / gsize);
            dv[0] = at[0], dv[1] = at[1], mv[0] = at[2], mv[1] = at[3];
        } else {
            pg_i8_scales(kind, f16, d, has_m ? m : NULL, k, sg, dv, mv);
        }
        for (int h0 = 0; h0 < 2; h0 += PG_I8_HALVES) {
            pg_iv is[PG_I8_HALVES * PG_I8_MAXR1], is2[PG_I8_HALVES * PG_I8_MAXR1];
            for (int i = 0; i < PG_I8_HALVES * R; i++)
                is[i] = is2[i] = PG_IV_ZERO;
            for (int st = 0; st < steps; st++) {
                const long ks = sg * steps + st;
                pg_iv b[2 * PG_I8_HALVES];
                if (pf && h0 == 0)
                    pg_i8_prefetch(kind, q, k->qh, ks, pf);
                for (int hh = 0; hh < PG_I8_HALVES; hh++)
                    pg_i8_step(kind, q, k->qh, ks, h0 + hh, b + 2 * hh);
                for (int r = 0; r < R; r++) {
                    long at = (r0 + r) * x->K + 8 * ks;
                    int32_t lo, hi;
                    memcpy(&lo, x->q + at, 4);
                    memcpy(&hi, x->q + at + 4, 4);
                    pg_iv xlo = pg_iv_set1(lo), xhi = pg_iv_set1(hi);
                    for (int hh = 0; hh < PG_I8_HALVES; hh++)
                        is[PG_I8_HALVES * r + hh] = pg_i8_dot(kind, pg_i8_dot(kind, is[PG_I8_HALVES * r + hh], b[2 * hh], xlo),
                                                              b[2 * hh + 1], xhi);
                    if (two) {
                        memcpy(&lo, x->q2 + at, 4);
                        memcpy(&hi, x->q2 + at + 4, 4);
                        pg_iv ylo = pg_iv_set1(lo), yhi = pg_iv_set1(hi);
                        for (int hh = 0; hh < PG_I8_HALVES; hh++)
                            is2[PG_I8_HALVES * r + hh] = pg_i8_dot(
                                kind, pg_i8_dot(kind, is2[PG_I8_HALVES * r + hh], b[2 * hh], ylo), b[2 * hh + 1], yhi);
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                long at = (r0 + r) * G + sg * gsize / 32;
                int32_t total = gsize == 16 ? x->sum16[(r0 + r) * 2 * G + sg] : x->sum[at];
                /* s: dx sum(Q) of the group (16 rows: made here, dx times its half's sum) */
                pg_vec xd = (pg_vec){0} + x->d[at], xs = (pg_vec){0} + (gsize == 16 ? x->d[at] * (float)total : x->s[at]);
                for (int hh = 0; hh < PG_I8_HALVES; hh++) {
                    pg_iv i = pg_i8_finish(kind, is[PG_I8_HALVES * r + hh]);
                    if (two)
                        i = pg_iv_add(pg_iv_sll(i, 8), pg_i8_finish(kind, is2[PG_I8_HALVES * r + hh]));
                    if (zero)
                        i = pg_iv_sub(i, pg_iv_set1(zero * total));
                    const int h = h0 + hh;
                    acc[2 * r + h] = pg_fma(pg_iv_to_vec(i), dv[h] * xd, acc[2 * r + h]);
                    if (has_m)
                        acc[2 * r + h] = pg_fma(mv[h], xs, acc[2 * r + h]);
                }
            }
        }
    }
    pg_store(R, acc, c, ldc, cols, first);
}

/* The panel kinds there are: 4-bit (offsets or not, float16 scales), 8-bit float16 without
   offsets (Q8_0), 8-bit float32 with offsets, Q4_K, Q6_K, Q5_K, Q3_K, Q2_K. */
enum { PG_I8_Q4_0 = 0, PG_I8_Q4_1 = 1, PG_I8_Q8_0 = 2, PG_I8_Q8_F32 = 3, PG_I8_Q4_K = 4, PG_I8_Q6_K = 5,
       PG_I8_Q5_K = 6, PG_I8_Q3_K = 7, PG_I8_Q2_K = 8 };

/* The kinds whose panels store offsets (w = d u + m): pg_i8_r's has_m. */
#define PG_I8_OFFSETS(v) ((v) == PG_I8_Q4_1 || (v) == PG_I8_Q8_F32 || (v) == PG_I8_Q4_K || (v) == PG_I8_Q5_K || \
                          (v) == PG_I8_Q2_K)

/* One row tile: pg_i8_r at the tile's constants. pg_i8_tile_pf is the same for the tiles that
   prefetch (pf, pg_i8_r's); the others, every tile of a prefill's product among them, run
   pg_i8_tile, the code they ran before prefetching came in: with one function for both (the
   prefetch test a runtime branch, or a constant 0 at the calls that do not prefetch), 500 rows
   ran 0.85-0.96x as fast as with this one. */
#define PG_I8_CALL(v, kind, f16, two, n, pfv) \
    case ((v) * 2 + (two)) * 16 + n: \
        pg_i8_r(n, kind, PG_I8_OFFSETS(v), f16, two, x, r0, q, d, m, k, g0, g1, pre, c, ldc, cols, first, pfv); \
        break;
#define PG_I8_CALLS(two, n, pfv) PG_I8_CALL(PG_I8_Q4_0, PG_I8_Q4, 1, two, n, pfv) \
    PG_I8_CALL(PG_I8_Q4_1, PG_I8_Q4, 1, two, n, pfv) PG_I8_CALL(PG_I8_Q8_0, PG_I8_Q8, 1, two, n, pfv) \
    PG_I8_CALL(PG_I8_Q8_F32, PG_I8_Q8, 0, two, n, pfv) PG_I8_CALL(PG_I8_Q4_K, PG_I8_Q4K, 0, two, n, pfv) \
    PG_I8_CALL(PG_I8_Q6_K, PG_I8_Q6K, 0, two, n, pfv) PG_I8_CALL(PG_I8_Q5_K, PG_I8_Q5K, 0, two, n, pfv) \
    PG_I8_CALL(PG_I8_Q3_K, PG_I8_Q3K, 0, two, n, pfv) PG_I8_CALL(PG_I8_Q2_K, PG_I8_Q2K, 0, two, n, pfv)
#define PG_I8_TILE(name, pfv, ...) \
static void name(int variant, int two, int R, const pg_x8 *x, long r0, const uint8_t *q, const void *d, \
                 const void *m, const pg_kq *k, long g0, long g1, const pg_vec *pre, float *c, long ldc, \
                 int cols, __VA_ARGS__) { \
    switch ((variant * 2 + two) * 16 + R) { \
    PG_I8_CASES1(PG_I8_CALLS, 0, pfv) PG_I8_CASES2(PG_I8_CALLS, 1, pfv) \
    } \
}
PG_I8_TILE(pg_i8_tile, 0, int first)
PG_I8_TILE(pg_i8_tile_pf, pf, int first, long pf)
#undef PG_I8_TILE
#undef PG_I8_CALLS
#undef PG_I8_CALL

/* The scales (and offsets) of scale groups sg0 .. sg1 - 1 of one panel, 4 vectors per group (d of
   both halves, then m), as pg_i8_r would make them group by group: made once per block of a
   panel when several row tiles share it. */
static void pg_i8_prepare(int variant, const void *d, const void *m, const pg_kq *k, long sg0, long sg1, pg_vec *out) {
    for (long sg = sg0; sg < sg1; sg++) {
        pg_vec *at = out + 4 * (sg - sg0);
        at[2] = at[3] = (pg_vec){0};
        switch (variant) {
#define PG_I8_PREP(v, kind, f16) \
        case v: pg_i8_scales(kind, f16, d, PG_I8_OFFSETS(v) ? m : NULL, k, sg, at, at + 2); break;
        PG_I8_PREP(PG_I8_Q4_0, PG_I8_Q4, 1) PG_I8_PREP(PG_I8_Q4_1, PG_I8_Q4, 1)
        PG_I8_PREP(PG_I8_Q8_0, PG_I8_Q8, 1) PG_I8_PREP(PG_I8_Q8_F32, PG_I8_Q8, 0)
        PG_I8_PREP(PG_I8_Q4_K, PG_I8_Q4K, 0) PG_I8_PREP(PG_I8_Q6_K, PG_I8_Q6K, 0)
        PG_I8_PREP(PG_I8_Q5_K, PG_I8_Q5K, 0) PG_I8_PREP(PG_I8_Q3_K, PG_I8_Q3K, 0)
        PG_I8_PREP(PG_I8_Q2_K, PG_I8_Q2K, 0)
#undef PG_I8_PREP
        }
    }
}

/* ---- one GEMM as pool tasks ---- */
typedef struct {
    const pg_x8 *x;
    const void *q;            /* the panels' quantized data (packed_gemm.h's layouts) */
    const void *d, *m;
    float *c;                 /* [M, n] columns of rows ldc apart */
    long n, ldc, P, chunk;
    int bits, half;           /* 4 or 8 (6: Q6_K); half: 8-bit panels with float16 d and no m */
    pg_kq k;                  /* K-quant panels' scales (k.kind PG_K_NONE: d and m hold them) */
} pg_i8_job;

/* Task t: panels t*chunk .. (t+1)*chunk - 1, one after another (one stream per thread); each
   panel block by block, row tile by row tile. */
static void pg_i8_task(void *ctx, long t) {
    const pg_i8_job *j = (const pg_i8_job *)ctx;
    const int variant = j->k.kind == PG_K_Q4K ? PG_I8_Q4_K : j->k.kind == PG_K_Q6K ? PG_I8_Q6_K :
                        j->k.kind == PG_K_Q5K || j->k.kind == PG_K_Q50 || j->k.kind == PG_K_Q51 ? PG_I8_Q5_K : j->k.kind == PG_K_Q3K ? PG_I8_Q3_K :
                        j->k.kind == PG_K_Q2K ? PG_I8_Q2_K :
                        j->bits == 4 ? (j->m ? PG_I8_Q4_1 : PG_I8_Q4_0) : j->half ? PG_I8_Q8_0 : PG_I8_Q8_F32;
    const long K = j->x->K, G = K / 32, M = j->x->M;
    const int few = M <= PG_I8_FEW_ROWS, two = j->x->q2 != NULL;
    const int maxr = two ? PG_I8_MAXR2 : few && PG_I8_OFFSETS(variant) ? PG_I8_MAXR1M : PG_I8_MAXR1;
    const long ntiles = (M + maxr - 1) / maxr;
    const long qbytes = (j->bits == 8 ? K : K / 2) * PG_NR, sbytes = (j->bits == 4 || j->half ? 2 : 4) * G * PG_NR;
    const long gsize = variant == PG_I8_Q6_K || variant == PG_I8_Q3_K || variant == PG_I8_Q2_K ? 16 : 32;
    pg_vec scales[4 * PG_I8_KC / 16] __attribute__((aligned(64)));  /* a block's groups' scales (pg_i8_prepare) */
    long end = (t + 1) * j->chunk < j->P ? (t + 1) * j->chunk : j->P;
    for (long p = t * j->chunk; p < end; p++) {
        int cols = pg_panel_cols(j->n, p);
        const uint8_t *q = (const uint8_t *)j->q + p * qbytes;
        const char *d = j->d ? (const char *)j->d + p * sbytes : NULL, *m = j->m ? (const char *)j->m + p * sbytes : NULL;
        const pg_kq k = pg_kq_panel(&j->k, K, p);
        for (long g0 = 0; g0 < G; g0 += PG_I8_KC / 32) {
            long g1 = g0 + PG_I8_KC / 32 < G ? g0 + PG_I8_KC / 32 : G, r0;
            int rows;
            const pg_vec *pre = NULL;
            if (ntiles > 1) {  /* the block's scales once, not once per row tile */
                pg_i8_prepare(variant, d, m, &k, g0 * 32 / gsize, g1 * 32 / gsize, scales);
                pre = scales;
            }
            for (long tt = 0; tt < ntiles; tt++) {
                pg_tile(M, tt, ntiles, &r0, &rows);
                float *c = j->c + r0 * j->ldc + p * PG_NR;
                if (tt == 0 && ntiles > 1 && few)
                    pg_i8_tile_pf(variant, two, rows, j->x, r0, q, d, m, &k, g0, g1, pre, c, j->ldc, cols, g0 == 0,
                                  (end - p) * (K / 8));
                else
                    pg_i8_tile(variant, two, rows, j->x, r0, q, d, m, &k, g0, g1, pre, c, j->ldc, cols, g0 == 0);
            }
        }
    }
}

#endif
