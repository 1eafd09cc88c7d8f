"""`scratchllm bench serving`: workloads, arrivals, percentiles, and a bounded run against the fake."""

import argparse
import json
import math

import numpy as np
import pytest

from scratchllm.bench import loadgen, serving
from scratchllm.cli.main import main
from scratchllm.errors import ConfigError
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend


@pytest.mark.parametrize("name", ["mixed", "short", "long-prompt"])
def test_shipped_workloads_are_seeded_and_within_their_bounds(name):
    spec = json.loads((loadgen.WORKLOAD_DIR / f"{name}.json").read_text())
    a, b = loadgen.load_workload(name), loadgen.load_workload(name)
    assert a.prompts == b.prompts and a.output_tokens == b.output_tokens  # the seed fixes everything
    assert len(a.prompts) == spec["num_requests"]
    p = spec["prompt_tokens"]
    lo, hi = p.get("low", p.get("value")), p.get("high", p.get("value"))
    assert all(lo <= len(x) <= hi for x in a.prompts)
    low, high = spec["token_id_range"]
    assert all(low <= t < high for x in a.prompts for t in x)
    c = loadgen.load_workload(name, seed=spec["seed"] + 1)
    assert c.prompts != a.prompts


def test_choice_distribution_follows_its_weights():
    w = loadgen.load_workload("mixed", num_requests=2000)
    share_long = np.mean(np.asarray(w.output_tokens) == 128)
    assert abs(share_long - 0.3) < 0.04  # binomial sd ~0.01


@pytest.mark.parametrize("shape", [1.0, 0.25])
def test_arrivals_have_the_rate_and_burstiness_asked(shape):
    t = loadgen.arrival_times(20000, rate=5.0, burstiness=shape, seed=0)
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.2) < 0.2 * 0.05
    # a gamma(k) gap has coefficient of variation 1/sqrt(k): 1 for Poisson, 2 for k = 0.25
    assert abs(gaps.std() / gaps.mean() - 1 / math.sqrt(shape)) < 0.1
    assert not loadgen.arrival_times(5, math.inf, 1.0, 0).any()


def test_percentiles_and_goodput():
    vals = np.random.default_rng(0).exponential(0.1, 1001)
    p = loadgen.percentiles(vals.tolist())
    assert p["p99"] == pytest.approx(np.percentile(vals, 99) * 1e3) and p["mean"] == pytest.approx(vals.mean() * 1e3)
    fast = loadgen.Result(10, 5, 200, start=0, ttft=0.01, e2e=0.05)
    slow = loadgen.Result(10, 5, 200, start=0, ttft=0.5, e2e=0.6)
    failed = loadgen.Result(10, status=429, error="full")
    run = {"results": [fast, slow, failed], "duration_s": 2.0, "probe_ms": [1.0], "kv_samples": [3.0],
           "metrics": {'scratchllm:kv_blocks_peak{model_name="m"}': 4.0,
                       'scratchllm:kv_cache_peak_bytes{model_name="m"}': 400.0}}
    s = loadgen.summarize(run, {"ttft_ms": 100.0, "tpot_ms": None, "e2e_ms": None})
    assert s["completed"] == 2 and s["errors"] == {"429": 1}
    assert s["request_throughput"] == 1.0 and s["goodput"] == 0.5
    assert s["tpot_ms"]["mean"] == pytest.approx(((0.05 - 0.01) / 4 + (0.6 - 0.5) / 4) / 2 * 1e3)
    assert s["peak_kv_blocks"] == 4.0 and s["peak_kv_bytes"] == 400.0


def test_unknown_workload_is_a_config_error():
    with pytest.raises(ConfigError, match="mixed"):
        loadgen.load_workload("no-such-workload")


def bench_args(**kw):
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    ns = parser.parse_args([])
    ns.no_progress = True
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_bench_against_a_live_fake_server(serve):
    model, embedder = fake_backend(step_ms=2.0, max_running=4)
    with serve(create_app(model, embedder, ServerConfig(max_in_flight=64))) as url:
        result = serving.run(bench_args(url=url, workload="short", num_requests=12, rate=50.0, concurrency=6))
    f = result["figures"]
    wl = loadgen.load_workload("short", num_requests=12, seed=result["inputs"]["seed"])  # a fresh seed per run
    assert f["completed"] == 12 and f["failed"] == 0
    # ignore_eos: every request produced exactly the output length the workload asked for
    assert f["output_tokens"] == sum(wl.output_tokens) and model.engine.finished["length"] == 12
    assert f["ttft_ms"]["p50"] > 0 and f["itl_ms"]["p50"] > 0 and f["e2e_ms"]["p99"] >= f["e2e_ms"]["p50"]
    assert 1 <= f["peak_kv_blocks"] <= model.engine.num_blocks
    assert f["request_throughput"] == pytest.approx(12 / f["duration_s"])
    text = serving.render(result)
    assert "TTFT" in text and "request/s" in text


@pytest.mark.slow
def test_compare_static_vs_continuous_on_the_fake_engine(capsys, tmp_path):
    """The whole --compare path (two server subprocesses) on the fake engine: continuous wins;
    --plot draws both runs."""
    plot = tmp_path / "runs.png"
    argv = ["bench", "serving", "--compare", "--fake-engine", "--workload", "mixed", "--num-requests", "12",
            "--max-num-seqs", "4", "--rate", "inf", "--repeat", "2", "--no-progress", "--json", "--plot", str(plot)]
    assert main(argv) == 0
    import matplotlib.image

    assert matplotlib.image.imread(plot).shape[:2] == (450, 1500)  # plot_runs' default size
    result = json.loads(capsys.readouterr().out)
    s, c = result["figures"]["static"], result["figures"]["continuous"]
    assert s["completed"] == c["completed"] == 12
    assert result["ratios"]["qps_ratio"] > 1.2 and result["ratios"]["p99_ratio"] > 1.2
    assert c["peak_kv_blocks"] < s["peak_kv_blocks"]
    assert len(s["trials_request_throughput"]) == len(c["trials_request_throughput"]) == 2
