"""Matrix multiply four ways, slowest to fastest: the same C = A @ B at every level of the stack.

- `naive`: the pure-Python triple loop (the design article's) over lists. Every a[i][k] is a pointer chase to a
  boxed float, so it runs at tens of MFLOP/s whatever the cache does.
- `numpy`: `a @ b`, which NumPy hands to OpenBLAS's hand-written assembly GEMM.
- `tiled`: our Cython kernel (`_matmul.gemm`): packed panels, cache blocks, register tile.
- `cublas`: CuPy's `a @ b` on a GPU (cuBLAS); `cublas_unavailable()` says why not, if not.

`naive` works on nested lists (it is the design article's code); the others take and return NumPy arrays
(`cublas` copies to the device and back, so its time includes the transfers unless the caller
passes CuPy arrays).
"""

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.errors import ConfigError


def naive(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    """[m][k], [k][n] -> [m][n] with the i-j-k loop of the design article, as lists of Python floats."""
    m, k, n = len(a), len(b), len(b[0]) if b else 0
    if any(len(row) != k for row in a):
        raise ConfigError(f"naive: A's rows must have {k} elements (B has {k} rows)")
    result = [[0.0] * n for _ in range(m)]
    for i in range(m):
        for j in range(n):
            for p in range(k):
                result[i][j] += a[i][p] * b[p][j]
    return result


def numpy(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """[m, k] @ [k, n] -> [m, n] through NumPy's BLAS."""
    c: npt.NDArray[Any] = np.matmul(a, b)
    return c


@dataclass(frozen=True)
class Tiles:
    """Cache blocks of the Cython kernel (its register tile, 6 x 32, is fixed at compile time).

    Defaults measured on Zen 4 at n=1024, one thread, all candidates interleaved in one run
    (docs/kernels.md): kc=512 beats kc=256 by ~8% and kc=128 by ~15%, although a 512 x 32 panel
    of B is 64 KiB, twice L1: L2 streams it fast enough, and a longer kc spreads the load and
    store of each 6 x 32 tile of C over more multiply-adds. mc barely matters between 96 and 288.
    """

    mc: int = 192  # rows of A per block, kept packed in L2 (rounded up to a multiple of 6): 384 KiB
    kc: int = 512  # depth of a block
    nc: int = 4096  # columns of B per block, kept packed in L3 (rounded up to a multiple of 32)

    def __post_init__(self) -> None:
        if min(self.mc, self.kc, self.nc) < 1:
            raise ConfigError(f"tile sizes must be >= 1, got {self}")


def _gemm() -> ModuleType:
    try:
        from scratchllm.kernels import _matmul
    except ImportError as e:  # the extension is built in place by `make build`
        raise ConfigError("the Cython kernels are not built: run `make build`") from e
    return _matmul


def tiled(a: npt.ArrayLike, b: npt.ArrayLike, tiles: Tiles = Tiles(), threads: int = 1) -> npt.NDArray[np.float32]:
    """[m, k] @ [k, n] -> [m, n] float32 with our Cython kernel; any strides, no copies of A or B.

    Inputs that are not float32 are converted (the kernel computes in float32 only).
    """
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    a32 = np.asarray(a, dtype=np.float32)
    b32 = np.asarray(b, dtype=np.float32)
    if a32.ndim != 2 or b32.ndim != 2 or a32.shape[1] != b32.shape[0]:
        raise ConfigError(f"tiled: shapes {a32.shape} and {b32.shape} do not multiply")
    c: npt.NDArray[np.float32] = _gemm().gemm(a32, b32, tiles.mc, tiles.kc, tiles.nc, threads)
    return c


def cublas_unavailable() -> str | None:
    """None when CuPy can run cuBLAS here, else the reason it cannot (for skips and the bench)."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        return "no GPU (CuPy is not installed)"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no GPU (CUDA sees no device)"
    except Exception as e:  # noqa: BLE001 - CuPy's CUDARuntimeError, or any driver failure: no GPU here
        return f"no GPU ({type(e).__name__}: {e})"
    return None


def cublas(a: Any, b: Any) -> Any:  # NumPy or CuPy arrays (CuPy has no type stubs)
    """[m, k] @ [k, n] -> [m, n] on the GPU; NumPy in, NumPy out (CuPy arrays stay on the device)."""
    reason = cublas_unavailable()
    if reason:
        raise ConfigError(f"cublas: {reason}")
    cupy = importlib.import_module("cupy")
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return cupy.asnumpy(cupy.matmul(cupy.asarray(a), cupy.asarray(b)))
    return cupy.matmul(a, b)


IMPLEMENTATIONS = {"naive": naive, "numpy": numpy, "tiled": tiled, "cublas": cublas}
