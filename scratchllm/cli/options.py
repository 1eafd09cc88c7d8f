"""Options that several commands take, defined once so their meaning and help agree."""

import argparse


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """--threads: the process's compute threads (our matmul and attention pool, and BLAS)."""
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads: our matmul and attention kernels and NumPy's BLAS (default: one per "
                        "core); 1 is often faster when other jobs share the cores")
