"""Matrix multiply four ways: ms, GFLOP/s, effective GB/s and cache miss rate per
implementation; the Cython kernel against NumPy (OpenBLAS) at equal threads, measured in one run;
a tile sweep of the Cython kernel beside the cache model's prediction; the simulator's sweep of the
design article's own case (300 x 300 float64, blocked i-j-k loop); its published row beside ours.

Timing: medians of wall time; NumPy and the Cython kernel are timed interleaved (A, B, A, B, ...)
so both see the same noise from other jobs on the cores. NumPy's threads are set with threadpoolctl.
The tile sweep (one thread) ranks blockings by the CPU time of the calling thread instead.
GB/s is the compulsory traffic (read A and B, write C once) over the time: a lower bound.
Miss rates: hardware counters when `perf stat` can read them, else the simulator (labelled).
"""

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, TypedDict, TypeVar

import numpy as np

from scratchllm.bench.common import machine_facts, median
from scratchllm.bench.references import ARTICLE_MATMUL_300 as PUBLISHED_300
from scratchllm.errors import ConfigError
from scratchllm.extras import need
from scratchllm.kernels import cachemodel, cachesim, matmul

K = TypeVar("K", bound=Hashable)


class Row(TypedDict):
    """One implementation at one size and thread count: a row of the table."""

    impl: str  # naive | numpy | tiled | cublas
    n: int
    threads: int  # 0 for the GPU
    ms: float | None  # None: not measured here (no GPU)
    gflops: float | None
    gbps: float | None
    miss: str  # the miss rate, and where it comes from


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from e
    if any(v < 1 for v in values):
        raise ConfigError(f"values must be >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="3,300,1024", help="square sizes n (default 3,300,1024)")
    parser.add_argument("--threads", default="1,2", help="thread counts for NumPy and ours, equal per row")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per figure (median)")
    parser.add_argument("--naive-max", type=int, default=300, help="largest n for the pure-Python loop")
    parser.add_argument("--sweep", default="12,24,32,48,64,96,128,192,256,384",
                        help="square tiles T (mc = kc = T) for the Cython sweep; empty to skip")
    parser.add_argument("--sim-max-n", type=int, default=300, help="largest n whose loops are simulated")
    parser.add_argument("--sim-tiles", default="8,16,24,32,40,48,64",
                        help="tiles for the simulated published case (300x300 float64, blocked loop); empty to skip")


def _timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds per call; fast calls are batched so one timing lasts >= 5 ms."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first > 1.0:  # the pure-Python loop at n=300: one run says enough
        return first
    batch = max(1, int(0.005 / max(first, 1e-7)))
    times: list[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - start) / batch)
    return median(times)


def _interleaved(fns: Mapping[K, Callable[[], object]], repeat: int,
                 clock: Callable[[], float] = time.perf_counter) -> dict[K, float]:
    """name -> median seconds per call; the functions take turns within each repeat, so a burst
    from another job lands on all of them alike. Fast calls are batched to >= 5 ms per timing.

    clock=time.thread_time counts only the CPU time of this thread: for single-threaded code it
    leaves out the time the OS gave to other jobs (used by the tile sweep to rank blockings)."""
    batch: dict[K, int] = {}
    for name, fn in fns.items():
        start = clock()
        fn()
        batch[name] = max(1, int(0.005 / max(clock() - start, 1e-7)))
    times: dict[K, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = clock()
            for _ in range(batch[name]):
                fn()
            times[name].append((clock() - start) / batch[name])
    return {name: median(t) for name, t in times.items()}


def perf_counters() -> str | None:
    """None when `perf stat` can count L1 data-cache loads and misses here, else why not."""
    try:
        out = subprocess.run(["perf", "stat", "-x,", "-e", "L1-dcache-loads,L1-dcache-load-misses", "true"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable (perf: {type(e).__name__}); miss rates are simulated"
    if parse_perf_csv(out.stderr) is None:
        return "unavailable (perf: <not supported> in this container); miss rates are simulated"
    return None


def parse_perf_csv(text: str) -> tuple[int, int] | None:
    """`perf stat -x,` output -> (L1 loads, L1 misses), or None if a counter is missing or unsupported."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) >= 3 and fields[2] in ("L1-dcache-loads", "L1-dcache-load-misses"):
            if not fields[0].strip().isdigit():  # "<not supported>" or "<not counted>"
                return None
            counts[fields[2]] = int(fields[0])
    if len(counts) < 2:
        return None
    return counts["L1-dcache-loads"], counts["L1-dcache-load-misses"]


_PERF_SNIPPET = """
import numpy as np
from threadpoolctl import threadpool_limits
from scratchllm.kernels import matmul
n, threads, reps = {n}, {threads}, {reps}
a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
with threadpool_limits(threads):
    for _ in range(reps):
        matmul.numpy(a, a) if "{impl}" == "numpy" else matmul.tiled(a, a, threads=threads)
"""


def _perf_miss(impl: str, n: int, threads: int) -> str | None:
    """L1 miss rate of `impl` from hardware counters: a run with reps=R minus one with reps=0."""
    counts: list[tuple[int, int]] = []
    for reps in (0, 20):
        code = _PERF_SNIPPET.format(n=n, threads=threads, reps=reps, impl=impl)
        out = subprocess.run(["perf", "stat", "-x,", "-e", "L1-dcache-loads,L1-dcache-load-misses",
                              sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        parsed = parse_perf_csv(out.stderr)
        if parsed is None:
            return None
        counts.append(parsed)
    loads, misses = counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]
    return f"L1 {100 * misses / loads:.1f}%" if loads > 0 else None


def _simulated_miss(impl: str, n: int, caches: list[cachesim.CacheConfig], tiles: matmul.Tiles) -> str | None:
    # The loops we wrote have known address streams; OpenBLAS's and cuBLAS's are not ours to trace.
    if impl == "naive":
        rows = min(n, 3)  # row 0 warms the caches; every later row runs the same loop
        stats = cachesim.simulate(cachesim.naive_trace(n, 8, rows=rows), caches,
                                  warmup=n * (2 * n + 1) if n > 1 else 0)
    elif impl == "tiled":
        stats = cachesim.simulate(cachesim.packed_trace(n, tiles.mc, tiles.kc, tiles.nc), caches)
    else:
        return None
    return " ".join(f"{s.name} {100 * s.miss_rate:.1f}%" for s in stats[:2])


def _time_on_gpu(a: np.ndarray, b: np.ndarray, repeat: int) -> float:
    """cuBLAS seconds per call with the operands already on the device (no PCIe copies timed)."""
    import cupy

    da, db = cupy.asarray(a), cupy.asarray(b)
    sync = cupy.cuda.Device().synchronize

    def call() -> None:
        matmul.cublas(da, db)
        sync()  # kernels launch asynchronously: time until the product exists

    return _timed(call, repeat)


def _measure(args: argparse.Namespace, n: int, threads_list: list[int], caches: list[cachesim.CacheConfig],
             perf_reason: str | None, ratios: dict[str, float]) -> list[Row]:
    """The rows of the table for one size n (all implementations, every thread count)."""
    rng = np.random.default_rng(n)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    tiles = matmul.Tiles()
    flops = 2.0 * n**3
    measured: dict[tuple[str, int], tuple[float, int]] = {}  # (impl, threads) -> (seconds, bytes per element)
    if n <= args.naive_max:
        al, bl = a.astype(np.float64).tolist(), b.astype(np.float64).tolist()
        measured[("naive", 1)] = (_timed(lambda: matmul.naive(al, bl), args.repeat), 8)
    for threads in threads_list:
        with threadpool_limits(threads):
            t = _interleaved({"numpy": lambda: matmul.numpy(a, b),
                              "tiled": lambda: matmul.tiled(a, b, tiles, threads)}, args.repeat)  # noqa: B023
        measured[("numpy", threads)] = (t["numpy"], 4)
        measured[("tiled", threads)] = (t["tiled"], 4)
        ratios[f"tiled/numpy GFLOP/s n={n} threads={threads}"] = t["numpy"] / t["tiled"]
        if threads == 1:  # one thread: also by CPU time, which other jobs on the cores cannot inflate
            with threadpool_limits(1):
                cpu = _interleaved({"numpy": lambda: matmul.numpy(a, b),
                                    "tiled": lambda: matmul.tiled(a, b, tiles, 1)}, args.repeat, clock=time.thread_time)
            ratios[f"tiled/numpy GFLOP/s n={n} threads=1, CPU time"] = cpu["numpy"] / cpu["tiled"]
    gpu = matmul.cublas_unavailable()
    if gpu is None:
        measured[("cublas", 0)] = (_time_on_gpu(a, b, args.repeat), 4)
    sim = {impl: _simulated_miss(impl, n, caches, tiles) if n <= args.sim_max_n else None
           for impl in ("naive", "tiled") if any(key[0] == impl for key in measured)}
    rows: list[Row] = []
    for (impl, threads), (sec, elem) in measured.items():
        hw = _perf_miss(impl, n, threads) if perf_reason is None and impl in ("numpy", "tiled") else None
        if hw:
            miss = f"perf: {hw}"
        elif sim.get(impl):
            miss = f"sim: {sim[impl]}" + (" (1-thread order)" if threads > 1 else "")
        else:
            miss = "n/a (not our loop to simulate)" if impl in ("numpy", "cublas") else "n/a (n > --sim-max-n)"
        rows.append({"impl": impl, "n": n, "threads": threads, "ms": 1e3 * sec, "gflops": flops / sec / 1e9,
                     "gbps": 3 * n * n * elem / sec / 1e9, "miss": miss})
    if gpu is not None:
        rows.append({"impl": "cublas", "n": n, "threads": 0, "ms": None, "gflops": None, "gbps": None,
                     "miss": f"n/a ({gpu})"})
    return rows


def _sweep(args: argparse.Namespace, n: int, tiles_list: list[int]) -> dict[str, Any]:
    """The Cython kernel at square tiles mc = kc = T, one thread, beside the model's predictions."""
    rng = np.random.default_rng(n + 1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    pred = cachemodel.predict_tile(n, 4)
    candidates: dict[int | str, matmul.Tiles] = {
        t: matmul.Tiles(mc=t, kc=t) for t in sorted(set(tiles_list + [pred.tile, pred.tile_reuse])) if t <= n}
    candidates["packed"] = matmul.Tiles(mc=pred.mc, kc=pred.kc)
    candidates["default"] = matmul.Tiles()
    with threadpool_limits(1):
        # Ranked by this thread's CPU time: wall time on a shared machine mostly measures the others.
        secs = _interleaved({key: partial(matmul.tiled, a, b, tiles) for key, tiles in candidates.items()},
                            args.repeat, clock=time.thread_time)
    gf = {key: 2.0 * n**3 / sec / 1e9 for key, sec in secs.items()}
    packed, default = gf.pop("packed"), gf.pop("default")
    by_tile = gf
    return {"n": n, "gflops_by_tile": by_tile, "best_tile": max(by_tile, key=by_tile.__getitem__),
            "predicted_tile": pred.tile, "predicted_tile_reuse": pred.tile_reuse,
            "packed_prediction": [pred.mc, pred.kc], "packed_prediction_gflops": packed,
            "default_tiles_gflops": default}


def _sim_sweep(args: argparse.Namespace, caches: list[cachesim.CacheConfig]) -> dict[str, Any]:
    tiles_list = _ints(args.sim_tiles) if args.sim_tiles else []
    n, elem = 300, 8
    out: dict[int, float] = {}
    for t in tiles_list:
        stats = cachesim.simulate(cachesim.blocked_trace(n, t, elem, rows=t), caches[:1])
        out[t] = stats[0].misses / (t * n * n)  # L1 misses per multiply-add, over one band of rows
    pred = cachemodel.predict_tile(n, elem, caches[0].line_bytes, caches[0].size_bytes, caches[1].size_bytes)
    return {"n": n, "elem_bytes": elem, "l1_misses_per_fma": out, "predicted_tile": pred.tile,
            "predicted_tile_reuse": pred.tile_reuse, "reasoning": pred.reasoning,
            "best_tile": min(out, key=out.__getitem__) if out else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    need("threadpoolctl", THREADPOOLCTL_FOR)  # before any measuring
    sizes, threads_list = _ints(args.sizes), _ints(args.threads)
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {args.repeat}")
    found = cachemodel.machine_caches()
    caches = [cachesim.CacheConfig("L1", found.l1_bytes, found.line_bytes, 8),
              cachesim.CacheConfig("L2", found.l2_bytes, found.line_bytes, 8)]
    perf_reason = perf_counters()
    rows: list[Row] = []
    ratios: dict[str, float] = {}
    for n in sizes:
        rows += _measure(args, n, threads_list, caches, perf_reason, ratios)
    sweep_tiles = _ints(args.sweep) if args.sweep else []
    sweep = [_sweep(args, n, sweep_tiles) for n in sizes if n >= 64 and sweep_tiles]
    return {"inputs": {k: v for k, v in vars(args).items() if k != "func"},
            "caches": vars(found), "perf": perf_reason or "available",
            "figures": rows, "ratios": ratios, "sweep": sweep,
            "sim_sweep": _sim_sweep(args, caches), "published_300": PUBLISHED_300, "machine": machine_facts()}


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(r: dict[str, Any]) -> str:
    c = r["caches"]
    out = [f"caches ({c['source']}): L1d {c['l1_bytes'] // 1024} KiB, L2 {c['l2_bytes'] // 1024} KiB, "
           f"L3 {c['l3_bytes'] // 1024**2} MiB, line {c['line_bytes']} B; hardware counters: {r['perf']}",
           f"{'impl':<7}{'n':>6}{'thr':>4}{'ms':>11}{'GFLOP/s':>10}{'GB/s':>9}  miss rate (L1 L2)"]
    for row in r["figures"]:
        out.append(f"{row['impl']:<7}{row['n']:>6}{row['threads'] or '-':>4}{_f(row['ms'], '11.3f')}"
                   f"{_f(row['gflops'], '10.2f')}{_f(row['gbps'], '9.2f')}  {row['miss']}")
        pub = PUBLISHED_300.get(row["impl"]) if row["n"] == 300 and row["threads"] in (0, 1) else None
        if pub:
            out.append(f"{'  publ.':<7}{300:>6}{'':>4}{pub[0]:>11.2f}{2 * 300**3 / pub[0] / 1e6:>10.2f}"
                       f"{pub[1]:>9.2f}  {_f(pub[2], '.1f')}% (the design article's figures)")
    for name, ratio in r["ratios"].items():
        out.append(f"{name}: {100 * ratio:.0f}%" + (" (goal: >= 50%)" if " n=1024 " in name else ""))
    naive = [row for row in r["figures"] if row["impl"] == "naive" and row["n"] == 300]
    if naive:
        out.append(f"pure Python n=300: {naive[0]['ms'] / 1e3:.2f} s (published: 1.8 s)")
    for s in r["sweep"]:
        s = {**s, "gflops_by_tile": {int(t): g for t, g in s["gflops_by_tile"].items()}}  # JSON keys are str
        cells = "  ".join(f"{t}:{g:.0f}" for t, g in sorted(s["gflops_by_tile"].items()))
        out.append(f"tile sweep n={s['n']} (1 thread, mc = kc = T; GFLOP/s per CPU-second of the thread): {cells}")
        out.append(f"  best T={s['best_tile']}; predicted T={s['predicted_tile']} (3T^2 rule) "
                   f"{s['gflops_by_tile'][s['predicted_tile']]:.0f}, T={s['predicted_tile_reuse']} (reuse rule) "
                   f"{s['gflops_by_tile'][s['predicted_tile_reuse']]:.0f}; packed rule mc,kc={s['packed_prediction']} "
                   f"{s['packed_prediction_gflops']:.0f}; defaults {(matmul.Tiles().mc, matmul.Tiles().kc)} "
                   f"{s['default_tiles_gflops']:.0f}")
    sim = r["sim_sweep"]
    if sim["l1_misses_per_fma"]:
        cells = "  ".join(f"{t}:{m:.4f}" for t, m in sim["l1_misses_per_fma"].items())  # str or int keys
        out.append(f"simulated published case (n=300 float64, blocked i-j-k, L1 misses per multiply-add): {cells}")
        out.append(f"  simulated best T={sim['best_tile']}; model: T={sim['predicted_tile']} (3T^2 rule, "
                   f"the published 24), T={sim['predicted_tile_reuse']} (reuse rule)")
    m = r["machine"]
    out.append(f"machine: {m['cpu']}, {m['cores']} cores, numpy {m['numpy']}, {'; '.join(m['blas'])}")
    out.append("medians; other jobs on the cores make single figures noisy, the interleaved ratios less so")
    return "\n".join(out)


THREADPOOLCTL_FOR = "bench matmul (to set NumPy's BLAS threads)"


def threadpool_limits(n: int) -> AbstractContextManager[object]:
    """NumPy's BLAS threads for a block of code (threadpoolctl, the `bench` extra)."""
    limits = need("threadpoolctl", THREADPOOLCTL_FOR).threadpool_limits
    limited: AbstractContextManager[object] = limits(n)
    return limited
