"""Options that several commands take, defined once so their meaning and help agree."""

import argparse

from scratchllm.bench.common import add_kv_cache_dtype_argument

__all__ = ["add_kv_cache_dtype_argument", "add_threads_argument"]


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """--threads: the process's compute threads (our matmul and attention pool, and BLAS)."""
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads: our matmul and attention kernels and NumPy's BLAS (default: one per "
                        "core); 1 is often faster when other jobs share the cores")
