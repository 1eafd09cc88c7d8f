"""How many threads NumPy's BLAS (OpenBLAS) uses for matrix products, changed at run time.

Why it matters here: every BLAS call ends at a barrier where all its threads meet. When another
process holds one of the cores, the call waits for a thread that is not running, and a decode
step (~210 small matrix products) pays that wait 210 times: on a shared 2-core machine we measured
decode 4-15x slower with 2 BLAS threads than with 1. On an idle machine 2 threads read memory
faster (about 36 vs 25 GB/s). So the thread count is a knob (LLM(threads=...), bench --threads),
not a constant.

OpenBLAS has no environment-free Python API; NumPy loads it as a shared library, so we find that
library among this process's mappings and call its C function `openblas_set_num_threads` (under
the symbol names NumPy's bundled build uses). Where it cannot be found, the functions do nothing
and say so by returning None.
"""

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator

# (set_num_threads, get_num_threads) of the OpenBLAS NumPy uses
BlasFunctions = tuple[Callable[[int], object], Callable[[], int]]

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
            "openblas_get_num_threads")
_lib: BlasFunctions | bool | None = None  # None: not looked for yet; False: none found


def _openblas() -> BlasFunctions | None:
    global _lib
    if _lib is None:
        import numpy  # loads the library we are looking for

        _lib = False
        # Other packages (SciPy, torch) may map OpenBLAS copies of their own: NumPy's lives in its
        # install folder (numpy/ or the wheel's numpy.libs/), so those paths are tried first.
        numpy_dir = os.path.dirname(numpy.__file__)
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "openblas" in line and ".so" in line}
        except OSError:
            paths = set()
        for path in sorted(paths, key=lambda p: (not p.startswith(numpy_dir), p)):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            setter = next((getattr(lib, s) for s in _SETTERS if hasattr(lib, s)), None)
            getter = next((getattr(lib, g) for g in _GETTERS if hasattr(lib, g)), None)
            if setter is not None and getter is not None:
                setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
                _lib = (setter, getter)
                break
    return _lib if isinstance(_lib, tuple) else None


def get_blas_threads() -> int | None:
    lib = _openblas()
    return int(lib[1]()) if lib else None


def set_blas_threads(n: int | None) -> int | None:
    """Set the matmul threads, BLAS's and our packed GEMM's (scratchllm/kernels/packed_gemm.pyx),
    None or 0 = one per core; returns BLAS's previous count, None if unknown."""
    from scratchllm.kernels import packed_gemm

    packed_gemm.set_num_threads(int(n or 0))
    lib = _openblas()
    if not lib:
        return None
    previous = int(lib[1]())
    lib[0](int(n or os.cpu_count() or 1))
    return previous


@contextlib.contextmanager
def blas_threads(n: int | None) -> Iterator[int | None]:
    from scratchllm.kernels import packed_gemm

    ours = packed_gemm.get_num_threads()
    previous = set_blas_threads(n)
    try:
        yield get_blas_threads()
    finally:
        if previous is not None:
            set_blas_threads(previous)
        packed_gemm.set_num_threads(ours)


@contextlib.contextmanager
def single_blas_thread() -> Iterator[None]:
    """OpenBLAS on one thread for the duration (then as it was).

    For code whose heavy matmuls run on our own kernel pool (a Llama forward): OpenBLAS's idle
    threads keep spinning for a long while after each multi-threaded call, on the very cores the
    pool's helpers need. With OpenBLAS at 2 threads for the attention of a contiguous KV cache, a
    500-token prefill measured 410-419 tok/s; with it at 1, 532-540."""
    lib = _openblas()
    previous = int(lib[1]()) if lib else 1
    if lib and previous != 1:
        lib[0](1)
    try:
        yield
    finally:
        if lib and previous != 1:
            lib[0](previous)

