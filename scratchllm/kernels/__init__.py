"""Cython kernels (built in place by `make build`) and the pure-Python models that explain them.

Importing the package first checks that this CPU has every instruction-set extension the kernels
were compiled for (see cpu_features.py): a clear UnsupportedCPUError instead of a crash."""

from scratchllm.kernels import cpu_features as _cpu_features

BUILD_FEATURES = _cpu_features.check()
