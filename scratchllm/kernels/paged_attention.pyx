# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Paged attention over block tables: packed tokens of many sequences, K/V in fixed-size blocks.

One call per layer does two things, in this order:
  1. write this step's k, v of every token into its slot of the paged pool
     (slot of position p of sequence s: block block_tables[s, p // BS], offset p % BS);
  2. for every token i (sequence s, position p) and every query head, attend causally over
     the keys at positions 0..p of sequence s, reading them through the block table where they
     lie: no gather into a contiguous copy, ever.
Writing first makes causality inside a prefill chunk free: token i sees the chunk's earlier
tokens because they are already in the pool.

Layouts (per layer), chosen for the two inner loops:
  K: [num_blocks, KVH, D, BS] - a block's keys transposed, so the 16 scores of a block are
     16 SIMD lanes: s[0:BS] += q[d] * K[blk, g, d, 0:BS]. A dot product per key would end in
     a horizontal sum per key and head, which on this CPU cost more than the multiplies.
  V: [num_blocks, BS, KVH, D] - out[h, 0:D] += p[t] * V[blk, t, g, 0:D], D lanes.
Work split: one work item = one token; OpenMP threads take items dynamically (a long prefill's
late tokens cost more than its early ones). Query head h reads kv head h // G (GQA, no copies).
Softmax over a per-thread score buffer: scores, then their max, exp (our own 16-lane
polynomial) and sum, then the weighted sum of values, divided by the sum once at the end.
"""

from cython.parallel cimport parallel, prange
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

cimport openmp


cdef inline void axpy(float w, const float* x, float* y, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t d
    for d in range(n):
        y[d] += w * x[d]


cdef extern from *:
    """
    #include <string.h>
    /* 16 float lanes in GCC's vector extension: one AVX-512 register, or two AVX2 ones. */
    typedef float scratchllm_v16 __attribute__((vector_size(64)));

    /* s[0:16] = K_block . q for one head; kt is the block's keys transposed, [D][16].
       The accumulator stays in a register for the whole d loop: 16 scores, no horizontal sum. */
    static inline void scratchllm_block_scores16(const float *q, const float *kt, float *s, Py_ssize_t D) {
        scratchllm_v16 acc = {0};
        for (Py_ssize_t d = 0; d < D; d++) {
            scratchllm_v16 k;
            memcpy(&k, kt + d * 16, sizeof k);
            acc += q[d] * k;
        }
        memcpy(s, &acc, sizeof acc);
    }

    typedef int scratchllm_v16i __attribute__((vector_size(64)));

    /* exp(x) for x <= 0, 16 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor polynomial to
       r^6 (relative error < 2e-7, below float32's resolution of a softmax weight), 2^n by
       writing n into the exponent bits. libm's expf is one call per element and does not
       vectorize without -ffast-math; this does. Below -87 the result is flushed to 0. */
    static inline scratchllm_v16 scratchllm_exp16(scratchllm_v16 x) {
        scratchllm_v16i tiny = x < -87.0f;  /* lanes of all ones where true */
        scratchllm_v16i xb, cb;
        scratchllm_v16 clamp = (scratchllm_v16){0} - 87.0f;
        memcpy(&xb, &x, sizeof xb);
        memcpy(&cb, &clamp, sizeof cb);
        xb = (xb & ~tiny) | (cb & tiny);  /* x = max(x, -87): keeps n in int range */
        memcpy(&x, &xb, sizeof x);
        scratchllm_v16 y = x * 1.4426950408889634f - 0.5f;
        scratchllm_v16i n = __builtin_convertvector(y, scratchllm_v16i);  /* truncation: round(x log2 e) */
        scratchllm_v16 nf = __builtin_convertvector(n, scratchllm_v16);
        scratchllm_v16 r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
        scratchllm_v16 p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
        scratchllm_v16i bits = (n + 127) << 23;
        bits = bits & ~tiny;  /* x < -87: no exponent bits, p * 0 below */
        scratchllm_v16 two_n;
        memcpy(&two_n, &bits, sizeof two_n);
        return p * two_n;
    }

    /* s[0:n] = exp(s - max(s[0:n])); returns the sum. s has room for n rounded up to 16. */
    static inline float scratchllm_exp_rows(float *s, Py_ssize_t n) {
        Py_ssize_t n16 = (n + 15) / 16 * 16, i;
        float m = -3.0e38f, sum = 0.0f;
        for (i = n; i < n16; i++) s[i] = -3.0e38f;  /* the tail of the last vector */
        for (i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
        scratchllm_v16 acc = {0};
        for (i = 0; i < n16; i += 16) {
            scratchllm_v16 v;
            memcpy(&v, s + i, sizeof v);
            v = scratchllm_exp16(v - m);
            acc += v;
            memcpy(s + i, &v, sizeof v);
        }
        for (i = 0; i < 16; i++) sum += acc[i];
        return sum;
    }
    """
    void block_scores16 "scratchllm_block_scores16"(const float* q, const float* kt, float* s,
                                                    Py_ssize_t D) noexcept nogil
    float exp_rows "scratchllm_exp_rows"(float* s, Py_ssize_t n) noexcept nogil


cdef inline void block_scores(const float* q, const float* kt, float* s, Py_ssize_t D,
                              Py_ssize_t BS) noexcept nogil:
    """s[0:BS] = K_block[0:BS] . q for one head: kt is the block's [D, BS] transposed keys."""
    cdef Py_ssize_t d, o
    cdef float qd
    if BS == 16:
        block_scores16(q, kt, s, D)
        return
    for o in range(BS):  # other block sizes: the plain loop
        s[o] = 0.0
    for d in range(D):
        qd = q[d]
        for o in range(BS):
            s[o] += qd * kt[d * BS + o]


def paged_attention(
    const float[:, :, :] q,  # [N, H, D] any strides: views into the model's fused qkv output
    const float[:, :, :] k,  # [N, KVH, D]
    const float[:, :, :] v,  # [N, KVH, D]
    float[:, :, :, ::1] k_cache,  # [num_blocks, KVH, D, BS]  (keys transposed per block)
    float[:, :, :, ::1] v_cache,  # [num_blocks, BS, KVH, D]
    const int[:, ::1] block_tables,  # [S, max_blocks]
    const int[::1] token_seq,  # [N] which row of block_tables
    const int[::1] token_pos,  # [N] position in its sequence
    float scale,
    float[:, :, ::1] out,  # [N, H, D]
    int num_threads=0,
):
    cdef Py_ssize_t N = q.shape[0], H = q.shape[1], D = q.shape[2]
    cdef Py_ssize_t KVH = k.shape[1], BS = v_cache.shape[1]
    cdef Py_ssize_t G = H // KVH
    cdef Py_ssize_t i, h, kvh, t, p, b, blk, off, d, s_idx, nb, max_ctx = 0
    cdef float* scores
    cdef float* qs
    cdef float* acc
    cdef float* inv_sum
    cdef const float* vrow
    cdef int nt = num_threads

    assert H == KVH * G, "query heads must group evenly over kv heads"
    assert k.shape[0] == N and v.shape[0] == N and out.shape[0] == N and token_pos.shape[0] == N
    assert k.shape[2] == D and v_cache.shape[3] == D and v_cache.shape[2] == KVH
    assert k_cache.shape[1] == KVH and k_cache.shape[2] == D and k_cache.shape[3] == BS
    assert k_cache.shape[0] == v_cache.shape[0]
    for i in range(N):
        p = token_pos[i]
        assert 0 <= p < block_tables.shape[1] * BS, "position beyond the block table"
        blk = block_tables[token_seq[i], p // BS]
        assert 0 <= blk < k_cache.shape[0], "block id out of the pool"
        if p + 1 > max_ctx:
            max_ctx = p + 1
    # whole blocks (the last one is scored in full) and whole 16-lane vectors for the softmax
    max_ctx = (max_ctx + BS - 1) // BS * BS
    max_ctx = (max_ctx + 15) // 16 * 16

    # 1. this step's keys and values into their slots
    for i in range(N):
        p = token_pos[i]
        blk = block_tables[token_seq[i], p // BS]
        off = p % BS
        for kvh in range(KVH):
            for d in range(D):
                k_cache[blk, kvh, d, off] = k[i, kvh, d]
                v_cache[blk, off, kvh, d] = v[i, kvh, d]

    if nt <= 0:
        nt = openmp.omp_get_max_threads()
    # raw pointers from here: the pools are C-contiguous
    cdef float* kc = &k_cache[0, 0, 0, 0]
    cdef float* vc = &v_cache[0, 0, 0, 0]
    cdef float* op = &out[0, 0, 0]
    cdef const int* bt = &block_tables[0, 0]
    cdef Py_ssize_t MB = block_tables.shape[1], kblock = KVH * D * BS, vrow_len = KVH * D
    # 2. attention, one token per work item
    with nogil, parallel(num_threads=nt):
        scores = <float*>malloc(H * max_ctx * sizeof(float))
        qs = <float*>malloc(H * D * sizeof(float))
        acc = <float*>malloc(H * D * sizeof(float))
        inv_sum = <float*>malloc(H * sizeof(float))
        for i in prange(N, schedule="dynamic"):
            s_idx = token_seq[i]
            p = token_pos[i]
            nb = p // BS + 1
            for h in range(H):  # queries pre-scaled by 1/sqrt(D): H x D multiplies, not H x ctx
                for d in range(D):
                    qs[h * D + d] = q[i, h, d] * scale
                    acc[h * D + d] = 0.0
            for b in range(nb):  # one table lookup per block
                blk = bt[s_idx * MB + b]
                for h in range(H):
                    block_scores(&qs[h * D], kc + blk * kblock + (h // G) * D * BS, &scores[h * max_ctx + b * BS],
                                 D, BS)
            for h in range(H):  # softmax numerators; the division by their sum comes last
                inv_sum[h] = 1.0 / exp_rows(&scores[h * max_ctx], p + 1)
            for b in range(nb):
                blk = bt[s_idx * MB + b]
                for off in range(min(BS, p + 1 - b * BS)):
                    t = b * BS + off
                    vrow = vc + (blk * BS + off) * vrow_len
                    for h in range(H):
                        axpy(scores[h * max_ctx + t], vrow + (h // G) * D, &acc[h * D], D)
            for h in range(H):
                for d in range(D):
                    op[(i * H + h) * D + d] = acc[h * D + d] * inv_sum[h]
        free(scores)
        free(qs)
        free(acc)
        free(inv_sum)


def copy_blocks(float[:, :, :, ::1] cache, const long[:, ::1] pairs):
    """cache[dst] = cache[src] for each (src, dst) row: the copy of copy-on-write (any layout
    whose first axis is the block)."""
    cdef Py_ssize_t r, n = cache.shape[1] * cache.shape[2] * cache.shape[3]
    for r in range(pairs.shape[0]):
        memcpy(&cache[pairs[r, 1], 0, 0, 0], &cache[pairs[r, 0], 0, 0, 0], n * sizeof(float))
