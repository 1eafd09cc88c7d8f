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

Work split: one work item = one token; OpenMP threads take items dynamically (a long
prefill's late tokens cost more than its early ones). Inside an item all H query heads are
served from each slot's KVH x D row while it is in cache: decode is bound by reading the pool,
so every byte of it is read once per token (query head h reads kv head h // G: GQA without
copies). Softmax is two-pass over a per-thread score buffer: scores and their max, then exp,
sum and the weighted sum of values.
"""

from cython.parallel cimport parallel, prange
from libc.math cimport expf, INFINITY
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

cimport openmp

cdef enum:
    LANES = 16  # independent partial sums: lets GCC vectorize the dot product without -ffast-math


cdef inline float dot(const float* a, const float* b, Py_ssize_t n) noexcept nogil:
    cdef float acc[LANES]
    cdef Py_ssize_t j, d
    cdef float s = 0.0
    for j in range(LANES):
        acc[j] = 0.0
    d = 0
    while d + LANES <= n:
        for j in range(LANES):
            acc[j] += a[d + j] * b[d + j]
        d += LANES
    for j in range(LANES):
        s += acc[j]
    while d < n:
        s += a[d] * b[d]
        d += 1
    return s


cdef inline void axpy(float w, const float* x, float* y, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t d
    for d in range(n):
        y[d] += w * x[d]


def paged_attention(
    const float[:, :, :] q,  # [N, H, D] any strides: views into the model's fused qkv output
    const float[:, :, :] k,  # [N, KVH, D]
    const float[:, :, :] v,  # [N, KVH, D]
    float[:, :, :, ::1] k_cache,  # [num_blocks, BS, KVH, D]
    float[:, :, :, ::1] v_cache,  # [num_blocks, BS, KVH, D]
    const int[:, ::1] block_tables,  # [S, max_blocks]
    const int[::1] token_seq,  # [N] which row of block_tables
    const int[::1] token_pos,  # [N] position in its sequence
    float scale,
    float[:, :, ::1] out,  # [N, H, D]
    int num_threads=0,
):
    cdef Py_ssize_t N = q.shape[0], H = q.shape[1], D = q.shape[2]
    cdef Py_ssize_t KVH = k.shape[1], BS = k_cache.shape[1]
    cdef Py_ssize_t G = H // KVH
    cdef Py_ssize_t i, h, kvh, t, p, b, item, blk, off, hh, d, s_idx, max_ctx = 0
    cdef float* scores
    cdef float* qs
    cdef const float* krow
    cdef const float* vrow
    cdef float m, tot, w, inv
    cdef int nt = num_threads

    assert H == KVH * G, "query heads must group evenly over kv heads"
    assert k.shape[0] == N and v.shape[0] == N and out.shape[0] == N and token_pos.shape[0] == N
    assert k.shape[2] == D and k_cache.shape[3] == D and k_cache.shape[2] == KVH
    for i in range(N):
        p = token_pos[i]
        assert 0 <= p < block_tables.shape[1] * BS, "position beyond the block table"
        blk = block_tables[token_seq[i], p // BS]
        assert 0 <= blk < k_cache.shape[0], "block id out of the pool"
        if p + 1 > max_ctx:
            max_ctx = p + 1

    # 1. this step's keys and values into their slots
    for i in range(N):
        p = token_pos[i]
        blk = block_tables[token_seq[i], p // BS]
        off = p % BS
        for kvh in range(KVH):
            for d in range(D):
                k_cache[blk, off, kvh, d] = k[i, kvh, d]
                v_cache[blk, off, kvh, d] = v[i, kvh, d]

    if nt <= 0:
        nt = openmp.omp_get_max_threads()
    # raw pointers from here: the pool is C-contiguous, so a slot is base + slot * KVH * D
    cdef float* kc = &k_cache[0, 0, 0, 0]
    cdef float* vc = &v_cache[0, 0, 0, 0]
    cdef float* op = &out[0, 0, 0]
    cdef const int* bt = &block_tables[0, 0]
    cdef Py_ssize_t MB = block_tables.shape[1], row = KVH * D
    cdef float* acc
    cdef float* sc
    # 2. attention, one token per work item: a slot's KVH x D row is read whole, once
    with nogil, parallel(num_threads=nt):
        scores = <float*>malloc(H * max_ctx * sizeof(float))
        qs = <float*>malloc(H * D * sizeof(float))
        acc = <float*>malloc(H * D * sizeof(float))
        for i in prange(N, schedule="dynamic"):
            s_idx = token_seq[i]
            p = token_pos[i]
            for h in range(H):  # queries pre-scaled by 1/sqrt(D): H x D multiplies, not H x ctx
                for d in range(D):
                    qs[h * D + d] = q[i, h, d] * scale
                    acc[h * D + d] = 0.0
            # walk the table block by block: one lookup per block, no division per key
            t = 0
            for b in range(p // BS + 1):
                krow = kc + bt[s_idx * MB + b] * BS * row
                for off in range(min(BS, p + 1 - t)):
                    for h in range(H):  # query head h reads kv head h // G (GQA)
                        scores[h * max_ctx + t] = dot(&qs[h * D], krow + (h // G) * D, D)
                    krow = krow + row
                    t = t + 1
            for h in range(H):
                sc = &scores[h * max_ctx]
                m = -INFINITY
                for t in range(p + 1):
                    if sc[t] > m:
                        m = sc[t]
                tot = 0.0
                for t in range(p + 1):
                    w = expf(sc[t] - m)
                    sc[t] = w
                    tot = tot + w
                inv = 1.0 / tot
                for t in range(p + 1):
                    sc[t] = sc[t] * inv
            t = 0
            for b in range(p // BS + 1):
                vrow = vc + bt[s_idx * MB + b] * BS * row
                for off in range(min(BS, p + 1 - t)):
                    for h in range(H):
                        axpy(scores[h * max_ctx + t], vrow + (h // G) * D, &acc[h * D], D)
                    vrow = vrow + row
                    t = t + 1
            memcpy(op + i * H * D, acc, H * D * sizeof(float))
        free(scores)
        free(qs)
        free(acc)


def copy_blocks(float[:, :, :, ::1] cache, const long[:, ::1] pairs):
    """cache[dst] = cache[src] for each (src, dst) row: the copy of copy-on-write."""
    cdef Py_ssize_t r, n = cache.shape[1] * cache.shape[2] * cache.shape[3]
    for r in range(pairs.shape[0]):
        memcpy(&cache[pairs[r, 1], 0, 0, 0], &cache[pairs[r, 0], 0, 0, 0], n * sizeof(float))
