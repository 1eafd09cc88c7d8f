"""Benchmark plots from synthetic runs shaped like what `bench serving` and `bench engine` hold."""

import numpy as np
import pytest
from matplotlib import image

from scratchllm.bench.loadgen import Result
from scratchllm.bench.plots import cdf, plot_runs, rate, series_from_loadgen, series_from_times, series_from_trace


def loadgen_run(n: int, itl_s: float, seed: int) -> dict:
    """The raw dict run_load returns: Results on the monotonic clock, KV samples, duration."""
    rng = np.random.default_rng(seed)
    results, t0 = [], 5000.0
    for i in range(n):
        r = Result(prompt_tokens=32, output_tokens=20, status=200, start=t0 + 0.1 * i)
        r.ttft = float(rng.uniform(0.05, 0.2))
        r.itl = [itl_s] * 19
        r.e2e = r.ttft + sum(r.itl)
        results.append(r)
    failed = Result(prompt_tokens=32, status=500, error="boom", start=t0)
    duration = max(r.start - t0 + r.e2e for r in results)
    return {"results": [*results, failed], "duration_s": duration, "probe_ms": [1.0],
            "kv_samples": [0, 10, 30, 40, 30, 10, 0], "metrics": {}}


def test_series_from_loadgen_keeps_every_ok_token_and_latency():
    run = loadgen_run(8, 0.01, seed=0)
    s = series_from_loadgen("continuous", run)
    ok = [r for r in run["results"] if r.ok]
    assert len(s.latency_ms) == 8 and len(s.token_times_s) == 8 * 20  # the failed request is left out
    np.testing.assert_allclose(np.sort(s.latency_ms), np.sort([r.e2e * 1e3 for r in ok]))
    # the last token of request i lands at its start + e2e
    assert s.token_times_s.max() == pytest.approx(max(r.start - 5000.0 + r.e2e for r in ok))
    assert s.kv_times_s[0] == 0 and s.kv_times_s[-1] == pytest.approx(run["duration_s"])


def test_cdf_and_rate_against_numpy():
    values = np.random.default_rng(1).exponential(10, 500)
    x, y = cdf(values)
    for q in (10, 50, 90):  # the CDF reaches q% at NumPy's q-th percentile (inverted_cdf: a sample)
        assert x[np.searchsorted(y, q / 100)] == pytest.approx(np.percentile(values, q, method="inverted_cdf"))
    times = np.random.default_rng(2).uniform(0, 10, 1000)
    centres, per_s = rate(times, 0.5)
    assert per_s.sum() * 0.5 == 1000 and len(centres) == 20
    np.testing.assert_allclose(per_s, np.histogram(times, bins=np.arange(0, 10.5, 0.5))[0] / 0.5)


def test_static_vs_continuous_png_has_the_asked_size(tmp_path):
    static = series_from_loadgen("static", loadgen_run(10, 0.03, seed=3))
    continuous = series_from_loadgen("continuous", loadgen_run(10, 0.01, seed=4))
    engine = series_from_times("engine", [0, 0, 0.5], [1.0, 2.0, 1.5], token_times_s=np.linspace(0, 2, 50),
                               kv_samples=[(0, 0), (1, 12), (2, 0)])
    np.testing.assert_allclose(engine.latency_ms, [1000, 2000, 1000])
    out = plot_runs([static, continuous, engine], tmp_path / "p.png", title="static vs continuous", width=1200,
                    height=400)
    assert image.imread(out).shape[:2] == (400, 1200)


def test_series_from_a_trace_ring(tmp_path):
    from scratchllm.trace.views.analysis import Trace
    from tests.trace.synthetic import Sim

    Sim(lengths=[10, 20, 30]).write(tmp_path / "t.ring")
    s = series_from_trace("traced", Trace.load(tmp_path / "t.ring"))
    np.testing.assert_allclose(np.sort(s.latency_ms), [100, 200, 300])  # 10 ms steps, all arrive at 0
    assert len(s.token_times_s) == 60 and len(s.kv_blocks) == 30 and len(s.ttft_ms) == 3
    assert image.imread(plot_runs([s], tmp_path / "t.png")).shape[:2] == (450, 1500)
