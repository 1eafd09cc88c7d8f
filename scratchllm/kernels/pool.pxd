"""The kernels' thread pool: scratchllm/kernels/pool.pyx."""

ctypedef void (*task_fn)(void *ctx, long task) noexcept nogil

# Run fn(ctx, 0..n-1) on the calling thread and up to threads - 1 helpers; returns when all ran.
cdef void run(task_fn fn, void *ctx, long n, int threads) noexcept nogil

# The thread count set by set_num_threads (one per core until then).
cdef int num_threads() noexcept nogil
