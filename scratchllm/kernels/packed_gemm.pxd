"""The packed GEMM's C entry points for other kernels (scratchllm/kernels/packed_gemm.pyx)."""

# One run of a matrix's panels as the kernels read it: float32 panels (kind 32: q is the panels),
# or quantized ones (kind 8: Q8Panels; kind 4: Q4Panels or Q4_K KPanels; kind 6: Q6_K KPanels; d
# and m as float16 bits; exact as Q8Panels.exact; half: Q8Panels with float16 d and no m, m NULL;
# kq: the K-quant kind, 1 Q4_K or 2 Q6_K, 0 for the others, with their high bits, group scales and
# mins and float16 super-block scales; d, m NULL). P panels of NR columns give output columns
# col0 .. col0 + n - 1.
cdef struct GemmPart:
    int kind
    int exact
    int half
    int kq
    const void *q
    const void *d
    const void *m
    const void *qh
    const void *sc
    const void *mn
    const void *D
    const void *Dmin
    Py_ssize_t P, col0, n

# One packed matrix: K rows in, n columns out, P panels in all, in 1 to 4 parts (a fused matrix
# whose parts are of kinds that share no panels: packed_gemm.SegmentedPanels). act8: 0, the exact
# path; 1 or 2: x is rounded to integers per 32 values in one or two 8-bit levels ("int8",
# "int16") and multiplied with integer dot products (packed_int8.h).
cdef struct GemmWeight:
    int act8
    int nparts
    Py_ssize_t K, n, P
    GemmPart part[4]

# w's fields from a PackedWeight (its panels and its activations: dtypes.ACTIVATIONS) or from
# panels alone (float32 activations) of n columns (float32, Q8Panels, Q4Panels, KPanels or
# SegmentedPanels of them); raises TypeError for other panels (bfloat16) and ValueError where
# the panels cannot hold n columns.
cdef int bind_weight(object panels, Py_ssize_t n, GemmWeight *w) except -1

# c [M, n] = x [M, K] @ w, both C-contiguous: `matmul`'s arithmetic (the same bits), on the pool.
cdef void gemm(const GemmWeight *w, const float *x, Py_ssize_t M, float *c) noexcept nogil
