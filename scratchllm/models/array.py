"""Which array module computes: NumPy today, CuPy later (the GPU backend, not built yet).

Model code never names NumPy for array math. A function that needs a module-level call
(``exp``, ``sqrt``, ``matmul`` with ``out=``) asks ``xp = array_module(x)`` for the module its input
lives in, the way CuPy's ``get_array_module`` works, so the same forward pass runs on host arrays
or on device arrays without a global switch. Operators (``@``, ``*``, ``+``) dispatch by themselves.
Host-side work that is inherently NumPy (reading files, sampling) converts with ``to_numpy``.
"""

import sys
from types import ModuleType
from typing import Any

import numpy
import numpy.typing as npt


def array_module(*arrays: object) -> ModuleType:
    """numpy, or cupy when any argument is a CuPy array (CuPy is only looked at if imported)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and any(isinstance(a, cupy.ndarray) for a in arrays):
        return cupy
    return numpy


def to_numpy(a: Any) -> npt.NDArray[Any]:  # a NumPy or a CuPy array (CuPy has no type stubs)
    """A host NumPy array (no copy when it already is one)."""
    if isinstance(a, numpy.ndarray):
        return a
    host: npt.NDArray[Any] = a.get()  # CuPy: device -> host
    return host

