"""Cython kernels (built by `make build`) and the pure-Python models that explain them.

The kernels whose speed depends on the instruction set are built for several x86-64 levels in one
install (cpu_features.py). Importing the package chooses the level this CPU runs (CHOICE; forced
by SCRATCHLLM_CPU_LEVEL) and puts its folder first on the package's path: `from scratchllm.kernels
import packed_gemm` then loads that level's module. A CPU that runs none, or a forced level it
cannot run, is a clear UnsupportedCPUError (an ImportError) instead of a crash."""

from scratchllm.kernels import cpu_features as _cpu_features

CHOICE = _cpu_features.current()
if CHOICE.level is not None:
    __path__.insert(0, str(CHOICE.level.folder))
LEVEL = CHOICE.level.name if CHOICE.level is not None else None
BUILD_FEATURES = list(CHOICE.level.features) if CHOICE.level is not None else []
