"""The packed GEMM's C entry points for other kernels (scratchllm/kernels/packed_gemm.pyx)."""

# One packed matrix as the kernels read it: float32 panels (kind 32: q is the panels), or
# quantized ones (kind 8: Q8Panels; kind 4: Q4Panels or Q4_K KPanels; kind 6: Q6_K KPanels; d and
# m as float16 bits; exact as
# Q8Panels.exact; half: Q8Panels with float16 d and no m, m NULL). K rows in, n columns out,
# P panels of NR columns. act8: 0, the exact path; 1 or 2: x is rounded to integers per 32 values
# in one or two 8-bit levels ("int8", "int16") and multiplied with integer dot products
# (packed_int8.h).
cdef struct GemmWeight:
    int kind
    int exact
    int half
    int act8
    const void *q
    const void *d
    const void *m
    Py_ssize_t K, n, P
    # K-quant panels (kernels/kpanels.py; kind 4: Q4_K, 6: Q6_K): kq 1 (Q4_K) or 2 (Q6_K), 0 for
    # the others; their high bits, group scales and mins, float16 super-block scales (d, m NULL)
    int kq
    const void *qh
    const void *sc
    const void *mn
    const void *D
    const void *Dmin

# w's fields from a PackedWeight (its panels and its activations, "float32" or "int8") or from
# panels alone (float32 activations) of n columns (float32, Q8Panels or Q4Panels); raises
# TypeError for other panels (bfloat16) and ValueError where the panels cannot hold n columns.
cdef int bind_weight(object panels, Py_ssize_t n, GemmWeight *w) except -1

# c [M, n] = x [M, K] @ w, both C-contiguous: `matmul`'s arithmetic (the same bits), on the pool.
cdef void gemm(const GemmWeight *w, const float *x, Py_ssize_t M, float *c) noexcept nogil
