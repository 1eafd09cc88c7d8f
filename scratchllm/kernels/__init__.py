"""Cython kernels (built in place by `make build`) and the pure-Python models that explain them."""
