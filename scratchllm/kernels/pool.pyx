# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The thread pool every parallel kernel of ours runs on (the packed GEMM, paged attention).

Why not OpenMP: an OpenMP parallel region ends at a barrier every thread must reach. When another
process holds a core, the thread on it reaches the barrier a scheduler time slice (milliseconds)
late, and a decode step runs ~200 such regions: with a busy loop on the other core we measured
decode 25x slower with NumPy's OpenBLAS (which has the same barrier) and with OpenMP kernels.

How: a job is n independent tasks. Whoever runs (the caller or a helper thread) claims tasks one
at a time from an atomic counter, and the caller waits only for tasks already claimed. A helper
the OS has not scheduled claims nothing, so the caller simply does more of the work itself: on a
busy machine a job degrades to one thread's speed instead of stalling. See pool.h for the
protocol; nothing in it waits for a lock, so a fork()ed child (which has no helpers)
just does every task itself.

Kernels written in Cython use it with `from scratchllm.kernels cimport pool` and
`pool.run(fn, ctx, n, threads)`; fn(ctx, task) must not touch Python objects.
"""

import os

cdef extern from "pool.h":
    ctypedef void (*pg_task_fn)(void *ctx, long task) noexcept nogil
    void pg_pool_run(pg_task_fn fn, void *ctx, long n, int threads) noexcept nogil


cdef int _threads = os.cpu_count() or 1


cdef void run(task_fn fn, void *ctx, long n, int threads) noexcept nogil:
    pg_pool_run(<pg_task_fn> fn, ctx, n, threads)


cdef int num_threads() noexcept nogil:
    return _threads


def set_num_threads(int n) -> int:
    """Threads of the kernels from now on (0 = one per core); returns the previous count."""
    global _threads
    previous = _threads
    _threads = n if n > 0 else (os.cpu_count() or 1)
    return previous


def get_num_threads() -> int:
    return _threads
