"""What every benchmark shares: timing with medians, the facts of the machine it ran on, and the
decode bound's two numbers (the memory bandwidth measured, the weight bytes a decode step reads)."""

import argparse
import os
import platform
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # for the annotation only: every benchmark imports this module, not all load a model
    from scratchllm.models.config import ModelConfig
    from scratchllm.models.llama_params import LlamaParams


class LoadedModel(Protocol):
    """What the benchmarks use of a decoder as load_model returns it (LlamaModel, GPT2Model): the
    engine's Model (its config and packed forward), its packed weights, and what load_model
    records on it."""

    config: "ModelConfig"
    @property
    def params(self) -> "LlamaParams | dict[str, Any]":  # LlamaModel's (models/llama_params.py), GPT-2's dict
        ...

    path: str  # the file or folder it was loaded from
    format: str  # "gguf", "safetensors", ...
    dtype: str  # what dtype "auto" resolved to
    panels_from_cache: bool  # its panels were mapped from the panel cache, packed by an earlier load

    def forward(self, input_ids: npt.NDArray[np.integer[Any]], positions: npt.NDArray[np.integer[Any]],
                attention: Any, logits_rows: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
                ) -> npt.NDArray[np.float32]: ...


class MachineFacts(TypedDict):
    cpu: str
    cores: int | None
    python: str
    numpy: str
    blas: list[str]  # each BLAS library: its API, version and thread count
    platform: str
    kernels: str | None  # the level of our kernels that ran (scratchllm/kernels/cpu_features.py)


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype, as `serve`, `LLM(kv_cache_dtype=...)` and every bench that runs the engine take it."""
    from scratchllm.engine.kv_sizing import DEFAULT_KV_DTYPE, KV_DTYPE_CHOICES

    parser.add_argument("--kv-cache-dtype", choices=KV_DTYPE_CHOICES, default="auto",
                        help=f"the KV cache's element type (default auto = {DEFAULT_KV_DTYPE}); int8 keeps a "
                             "float32 scale per block and KV head. Smaller: fewer bytes per token of context")


def status_mb(pid: int | str, field: str) -> float | None:
    """A process's /proc status memory field (VmRSS, VmHWM: its peak) in MB; pid "self" for this
    process. None once it is gone (or has no memory: a zombie). For a peak, not getrusage's
    ru_maxrss: on Linux a child starts with its parent's peak at fork."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":")), None)
    except (FileNotFoundError, ProcessLookupError):
        return None


def require_at_least_one(args: argparse.Namespace, *names: str) -> None:
    """Refuse, naming the flag, any of these counts below 1 (before a bench does any work)."""
    from scratchllm.errors import ConfigError

    for name in names:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


def machine_facts() -> MachineFacts:
    """Enough to tell two runs' machines apart: CPU model, cores, NumPy and its BLAS (the `bench` extra
    names it), the level of our kernels."""
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
    from scratchllm.kernels import LEVEL

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas,
        "platform": platform.platform(),
        "kernels": LEVEL,
    }


def measure_bandwidth(mb: int, repeat: int) -> dict[str, float]:
    """Bytes/s of reading a large float32 array: np.sum (1 thread) and BLAS gemv (all BLAS threads).
    "sum_1thread_cpu" divides by the summing thread's own CPU time instead of wall time."""
    a = np.ones((mb * 2**20 // 4096, 1024), dtype=np.float32)  # rows of 4 KiB; fills the pages now
    x = np.ones(1024, dtype=np.float32)
    out: dict[str, float] = {}
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


def weight_bytes_per_token(model: LoadedModel) -> int:
    """Bytes of weights one decode step reads: every matrix and norm once, the LM head once
    (tied embeddings are read as the LM head; the embedding row lookup is negligible)."""
    from scratchllm.models.llama_params import LlamaParams

    p = model.params
    assert isinstance(p, LlamaParams), "a Llama-family model's weights"
    total = sum(a.nbytes for layer in p.layers for a in layer.tensors().values())
    return int(total + p.norm.nbytes + p.lm_head.nbytes)
