"""Paged attention's C entry point for other kernels (scratchllm/kernels/paged_attention.pyx)."""

# A step's tokens as `paged_attention` takes them: token i belongs to row token_seq[i] of the block
# tables [S, MB] and sits at position token_pos[i]; max_ctx as layout_context returned it (the
# layout must have passed layout_context against the pool).
cdef struct PagedLayout:
    const int *block_tables
    const int *token_seq
    const int *token_pos
    Py_ssize_t N, MB, max_ctx

# One layer: `paged_attention` (the same bits) on raw arrays. q [N, H, D], k and v [N, KVH, D] at
# element strides (s0, s1, s2); k_cache [num_blocks, KVH, D, BS] and v_cache [num_blocks, BS, KVH,
# D] C-contiguous; out [N, H, D] C-contiguous.
cdef void attend(const float *q, Py_ssize_t qs0, Py_ssize_t qs1, Py_ssize_t qs2,
                 const float *k, Py_ssize_t ks0, Py_ssize_t ks1, Py_ssize_t ks2,
                 const float *v, Py_ssize_t vs0, Py_ssize_t vs1, Py_ssize_t vs2,
                 float *k_cache, float *v_cache, const PagedLayout *layout,
                 Py_ssize_t H, Py_ssize_t KVH, Py_ssize_t D, Py_ssize_t BS, float scale, float *out,
                 int num_threads) noexcept nogil

# The same with a layer's sliding window (0: the whole context; w: a token at position p sees
# positions p - w + 1..p) and tanh soft-capping of its scores (0: off).
cdef void attend_layer(const float *q, Py_ssize_t qs0, Py_ssize_t qs1, Py_ssize_t qs2,
                       const float *k, Py_ssize_t ks0, Py_ssize_t ks1, Py_ssize_t ks2,
                       const float *v, Py_ssize_t vs0, Py_ssize_t vs1, Py_ssize_t vs2,
                       float *k_cache, float *v_cache, const PagedLayout *layout, Py_ssize_t window, float softcap,
                       Py_ssize_t H, Py_ssize_t KVH, Py_ssize_t D, Py_ssize_t BS, float scale, float *out,
                       int num_threads) noexcept nogil
