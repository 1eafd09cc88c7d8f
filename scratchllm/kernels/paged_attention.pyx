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

Work split: one work item = (token, kv head); OpenMP threads take items dynamically (a long
prefill's late tokens cost more than its early ones). Inside an item the G = H / KVH query
heads sharing that kv head are served together, so each key and value row is read once per
group instead of G times (GQA). Softmax is two-pass over a per-thread score buffer: scores and
their max, then exp, sum and the weighted sum of values.
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
    cdef Py_ssize_t i, h, kvh, t, p, item, blk, off, hh, d, s_idx, max_ctx = 0
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
    # 2. attention, one (token, kv head) per work item
    with nogil, parallel(num_threads=nt):
        scores = <float*>malloc(G * max_ctx * sizeof(float))
        qs = <float*>malloc(G * D * sizeof(float))
        for item in prange(N * KVH, schedule="dynamic"):
            i = item // KVH
            kvh = item % KVH
            s_idx = token_seq[i]
            p = token_pos[i]
            # the G query heads of this kv head, pre-scaled by 1/sqrt(D)
            for hh in range(G):
                for d in range(D):
                    qs[hh * D + d] = q[i, kvh * G + hh, d] * scale
            for t in range(p + 1):
                krow = &k_cache[block_tables[s_idx, t // BS], t % BS, kvh, 0]
                for hh in range(G):
                    scores[hh * max_ctx + t] = dot(&qs[hh * D], krow, D)
            for hh in range(G):
                h = kvh * G + hh
                m = -INFINITY
                for t in range(p + 1):
                    if scores[hh * max_ctx + t] > m:
                        m = scores[hh * max_ctx + t]
                tot = 0.0
                for t in range(p + 1):
                    w = expf(scores[hh * max_ctx + t] - m)
                    scores[hh * max_ctx + t] = w
                    tot = tot + w
                inv = 1.0 / tot
                for t in range(p + 1):
                    scores[hh * max_ctx + t] = scores[hh * max_ctx + t] * inv
                for d in range(D):
                    out[i, h, d] = 0.0
            for t in range(p + 1):
                vrow = &v_cache[block_tables[s_idx, t // BS], t % BS, kvh, 0]
                for hh in range(G):
                    h = kvh * G + hh
                    w = scores[hh * max_ctx + t]
                    for d in range(D):
                        out[i, h, d] += w * vrow[d]
        free(scores)
        free(qs)


def copy_blocks(float[:, :, :, ::1] cache, const long[:, ::1] pairs):
    """cache[dst] = cache[src] for each (src, dst) row: the copy of copy-on-write."""
    cdef Py_ssize_t r, n = cache.shape[1] * cache.shape[2] * cache.shape[3]
    for r in range(pairs.shape[0]):
        memcpy(&cache[pairs[r, 1], 0, 0, 0], &cache[pairs[r, 0], 0, 0, 0], n * sizeof(float))
