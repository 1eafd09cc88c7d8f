"""What every benchmark shares: timing with medians, and the facts of the machine it ran on."""

import os
import platform
import statistics

import numpy as np


def median(values) -> float:
    return float(statistics.median(values))


def machine_facts() -> dict:
    """Enough to tell two runs' machines apart: CPU model, cores, NumPy and its BLAS."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from threadpoolctl import threadpool_info

        blas = [
            f"{info.get('internal_api')} {info.get('version')} ({info.get('num_threads')} threads)"
            for info in threadpool_info()
        ]
    except ImportError:
        blas = []
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas,
        "platform": platform.platform(),
    }
