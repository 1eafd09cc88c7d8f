"""`scratchllm bench matmul` runs end to end on tiny sizes and reports what it measured."""

import argparse
import json
import subprocess
import sys

import pytest

from scratchllm.bench import matmul as bench
from scratchllm.errors import ConfigError


def _args(**overrides):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    defaults = {"sizes": "3,64,300", "threads": "1", "repeat": 1, "naive_max": 64, "sim_max_n": 64,
                "sweep": "16,64", "sim_tiles": "8,24", "json": False}
    for key, value in {**defaults, **overrides}.items():
        setattr(args, key, value)
    return args


def test_run_and_render():
    result = bench.run(_args())
    rows = {(r["impl"], r["n"], r["threads"]): r for r in result["figures"]}
    for n in (3, 64):
        for impl in ("naive", "numpy", "tiled"):
            row = rows[(impl, n, 1)]
            assert row["ms"] > 0 and row["gflops"] > 0
            assert abs(row["gflops"] - 2 * n**3 / (row["ms"] / 1e3) / 1e9) < 1e-9 * row["gflops"] + 1e-12
        assert rows[("naive", n, 1)]["miss"].startswith(("sim:", "perf:"))
        assert rows[("numpy", n, 1)]["miss"].startswith(("n/a", "perf:"))
        assert ("cublas", n, 0) in rows
    assert ("naive", 300, 1) not in rows  # over --naive-max
    assert rows[("tiled", 300, 1)]["miss"] == "n/a (n > --sim-max-n)"
    assert set(result["ratios"]) == {f"tiled/numpy GFLOP/s n={n} threads=1{how}" for n in (3, 64, 300)
                                     for how in ("", ", CPU time")}
    sweeps = {s["n"]: s for s in result["sweep"]}  # only n >= 64 is swept
    assert set(sweeps) == {64, 300}
    sweep = sweeps[64]
    assert {16, 64} <= set(sweep["gflops_by_tile"])
    assert sweep["best_tile"] == max(sweep["gflops_by_tile"], key=sweep["gflops_by_tile"].get)
    sim = result["sim_sweep"]
    assert set(sim["l1_misses_per_fma"]) == {8, 24} and sim["predicted_tile"] >= 1
    text = bench.render(result)
    needles = ("GFLOP/s", "tiled/numpy", "tile sweep n=64", "(the design article's figures)",
               "simulated published case")
    for needle in needles:
        assert needle in text
    json.dumps(result, default=str)  # what --json prints


def test_perf_csv_parsing():
    ok = ("123456,,L1-dcache-loads,1000,100.00,,\n"
          "789,,L1-dcache-load-misses,1000,100.00,0.64,of all L1-dcache accesses\n")
    assert bench.parse_perf_csv(ok) == (123456, 789)
    unsupported = "<not supported>,,L1-dcache-loads,0,100.00,,\n<not supported>,,L1-dcache-load-misses,0,100.00,,\n"
    assert bench.parse_perf_csv(unsupported) is None
    assert bench.parse_perf_csv("") is None


def test_bad_flags_are_config_errors():
    with pytest.raises(ConfigError):
        bench.run(_args(sizes="3,x"))
    with pytest.raises(ConfigError):
        bench.run(_args(threads="0"))


def test_cli_json():
    out = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "bench", "matmul", "--sizes", "5",
                          "--threads", "1", "--repeat", "1", "--sweep", "", "--sim-tiles", "", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {r["impl"] for r in result["figures"]} == {"naive", "numpy", "tiled", "cublas"}


@pytest.mark.parametrize("impl", ["numpy", "tiled"])
def test_perf_workload_runs(impl):
    # The program `perf stat` would count (this container cannot read the counters): it must run.
    code = bench._PERF_SNIPPET.format(n=40, threads=1, reps=2, impl=impl)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
