"""The elementwise kernels' C entry points for other kernels (scratchllm/kernels/pointwise.pyx).
Each does what the Python function of the same name does, bit for bit; ld*: row strides in floats."""

# out [N, C] = rms_norm(x [N, C]) * w [C]
cdef void rms_norm_rows(const float *x, Py_ssize_t ldx, const float *w, float eps, float *out, Py_ssize_t ldo,
                        Py_ssize_t N, Py_ssize_t C) noexcept nogil

# x [N, C] += h, then out = rms_norm(x) * w
cdef void add_rms_norm_rows(float *x, Py_ssize_t ldx, const float *h, Py_ssize_t ldh, const float *w, float eps,
                            float *out, Py_ssize_t ldo, Py_ssize_t N, Py_ssize_t C) noexcept nogil

# out [N, I] = silu(gate) * up of gate_up [N, 2 I]
cdef void silu_mul_rows(const float *gate_up, Py_ssize_t ldg, float *out, Py_ssize_t ldo, Py_ssize_t N,
                        Py_ssize_t I) noexcept nogil

# out [N, I] = gelu_tanh(gate) * up of gate_up [N, 2 I] (GeGLU)
cdef void gelu_tanh_mul_rows(const float *gate_up, Py_ssize_t ldg, float *out, Py_ssize_t ldo, Py_ssize_t N,
                             Py_ssize_t I) noexcept nogil

# the first `heads` heads of x (rows ldr apart, heads ldh apart, D contiguous) rotated in place by
# cos, sin [N, D/2]
cdef void rope_rows(float *x, Py_ssize_t ldr, Py_ssize_t ldh, Py_ssize_t N, Py_ssize_t heads, Py_ssize_t D,
                    const float *cos, Py_ssize_t ldc, const float *sin, Py_ssize_t lds) noexcept nogil
