"""Paged attention's C entry point for other kernels (scratchllm/kernels/paged_attention.pyx)."""

# A step's tokens as `paged_attention` takes them: token i belongs to row token_seq[i] of the block
# tables [S, MB] and sits at position token_pos[i]; max_ctx as layout_context returned it (the
# layout must have passed layout_context against the pool).
cdef struct PagedLayout:
    const int *block_tables
    const int *token_seq
    const int *token_pos
    Py_ssize_t N, MB, max_ctx

# The KV pools of some layers, of one element kind (0 float32, 1 float16, 2 bfloat16, 3 int8): K
# [L, num_blocks, KVH, D, BS] and V [L, num_blocks, BS, KVH, D] C-contiguous; int8 also has one
# float32 scale per (layer, block, kv head) for each, [L, num_blocks, KVH] (NULL otherwise).
cdef struct KVCache:
    char *k
    char *v
    float *k_scale
    float *v_scale
    Py_ssize_t num_layers, num_blocks, KVH, D, BS, itemsize
    int kind

# Checks the arrays (4-D: one layer, or 5-D) and fills `out` with their pointers; raises on a
# shape, kind or scale that does not fit.
cdef int kv_cache(object k_cache, object v_cache, object k_scale, object v_scale, KVCache *out) except -1

# One layer: `paged_attention` (the same bits) on raw arrays. q [N, H, D], k and v [N, KVH, D] at
# element strides (s0, s1, s2); `layer` of `kv`; out [N, H, D] C-contiguous. A layer's sliding
# window (0: the whole context; w: a token at position p sees positions p - w + 1..p) and tanh
# soft-capping of its scores (0: off).
cdef void attend_layer(const float *q, Py_ssize_t qs0, Py_ssize_t qs1, Py_ssize_t qs2,
                       const float *k, Py_ssize_t ks0, Py_ssize_t ks1, Py_ssize_t ks2,
                       const float *v, Py_ssize_t vs0, Py_ssize_t vs1, Py_ssize_t vs2,
                       const KVCache *kv, Py_ssize_t layer, const PagedLayout *layout, Py_ssize_t window,
                       float softcap, Py_ssize_t H, float scale, float *out, int num_threads) noexcept nogil
