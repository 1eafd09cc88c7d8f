"""What every benchmark shares: timing with medians, the facts of the machine it ran on, and the
decode bound's two numbers (the memory bandwidth measured, the weight bytes a decode step reads)."""

import os
import platform
import statistics
import time

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


def measure_bandwidth(mb: int, repeat: int) -> dict:
    """Bytes/s of reading a large float32 array: np.sum (1 thread) and BLAS gemv (all BLAS threads).
    "sum_1thread_cpu" divides by the summing thread's own CPU time instead of wall time."""
    a = np.ones((mb * 2**20 // 4096, 1024), dtype=np.float32)  # rows of 4 KiB; fills the pages now
    x = np.ones(1024, dtype=np.float32)
    out = {}
    for name, fn in (("sum_1thread", lambda: a.sum(dtype=np.float32)), ("gemv_blas", lambda: a @ x)):
        fn()
        times, cpu = [], []
        for _ in range(max(repeat, 3)):
            t, c = time.perf_counter(), time.thread_time()
            fn()
            times.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
        out[name] = a.nbytes / median(times)
        if name == "sum_1thread":
            out["sum_1thread_cpu"] = a.nbytes / median(cpu)
    return out


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every matrix and norm once, the LM head once
    (tied embeddings are read as the LM head; the embedding row lookup is negligible)."""
    p = model.params
    total = sum(a.nbytes for layer in p["layers"] for a in layer.values())
    return total + p["norm"].nbytes + p["lm_head"].nbytes
