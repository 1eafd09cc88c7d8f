"""`scratchllm bench cluster`: its model file against the safetensors library, its oracle on a
sequence worked by hand, and (slow) a short run on the shared Ray cluster."""

import argparse

import numpy as np
import pytest
from safetensors.numpy import load_file

from scratchllm.bench import cluster as bench_cluster


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    bench_cluster.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_tiny_model_file_reads_back_with_the_safetensors_library_and_our_loader(tmp_path):
    from scratchllm.models import load_model

    folder = bench_cluster.write_tiny_llama(tmp_path / "m", seed=3, vocab=64, hidden=32, layers=1, inter=48, ctx=128)
    reference = load_file(str(folder / "model.safetensors"))
    assert reference["lm_head.weight"].shape == (64, 32) and len(reference) == 3 + 9
    model = load_model(str(folder))
    assert model.config.vocab_size == 64 and model.config.max_position_embeddings == 128
    rng = np.random.default_rng(3)  # the first tensor written is the embedding, drawn first
    np.testing.assert_array_equal(reference["model.embed_tokens.weight"],
                                  rng.standard_normal((64, 32)).astype(np.float32))


def test_the_oracle_counts_every_repeat_of_a_system_prompt():
    a, b = list(range(40)), list(range(100, 140))
    requests = [(0, a + [1]), (1, b + [2]), (0, a + [3, 4]), (0, a + [5]), (1, b + [6])]
    best = bench_cluster.oracle(requests, system_len=40)
    assert best["hit_rate"] == 3 / 5  # all but the first of each system prompt
    assert best["cached_fraction"] == 3 * 32 / sum(len(p) for _, p in requests)  # 40 tokens: 2 full blocks


def test_several_runs_give_medians_and_the_ratios_spread():
    def run(ours, rr, ours_ttft, rr_ttft):
        return {"prefix": {"strategy": "prefix", "hit_rate": ours, "ttft_ms_mean": ours_ttft},
                "round_robin": {"strategy": "round_robin", "hit_rate": rr, "ttft_ms_mean": rr_ttft}}

    best = {"hit_rate": 0.9, "cached_fraction": 0.8}
    s = bench_cluster.summarize([run(0.81, 0.6, 100, 150), run(0.9, 0.5, 120, 240), run(0.72, 0.6, 90, 90)], best)
    assert [r["ratios"]["hit_rate_vs_oracle"] for r in s["runs"]] == pytest.approx([0.9, 1.0, 0.8])
    assert s["ratios"]["hit_rate_vs_oracle"] == pytest.approx(0.9)  # the median run's
    assert s["spread"]["hit_rate_vs_oracle"] == pytest.approx({"min": 0.8, "max": 1.0})
    assert s["spread"]["ttft_mean_round_robin_over_ours"] == pytest.approx({"min": 1.0, "max": 2.0})
    assert s["figures"]["prefix"] == {"strategy": "prefix", "hit_rate": 0.81, "ttft_ms_mean": 100}
    one = bench_cluster.summarize([run(0.81, 0.6, 100, 150)], best)
    assert one["figures"]["round_robin"]["hit_rate"] == 0.6 and one["ratios"]["hit_rate_vs_round_robin"] == 1.35
    two = bench_cluster.summarize([run(0.81, 0.6, 100.0, 150.0), run(0.9, 0.5, 120.0, 240.0)], best)
    assert two["figures"]["prefix"]["ttft_ms_mean"] == 110  # a time's median: the mean of the middle two
    assert two["figures"]["prefix"]["hit_rate"] == pytest.approx(0.855)


def test_a_count_s_median_is_one_run_s_count():
    runs = [{"prefix": {"strategy": "prefix", "hit_rate": 0.8, "ttft_ms_mean": 90.0, "kv_blocks_total": n}}
            for n in (112, 224)]
    s = bench_cluster.summarize(runs, {"hit_rate": 0.9, "cached_fraction": 0.8})
    blocks = s["figures"]["prefix"]["kv_blocks_total"]
    assert blocks == 112 and isinstance(blocks, int)


def test_the_workload_is_seeded_and_shares_exactly_the_system_prompts():
    args = parse(["--systems", "3", "--per-system", "4", "--system-len", "32", "--user-len", "5,9"])
    one, two = bench_cluster.workload(args, 500), bench_cluster.workload(args, 500)
    assert one == two and len(one) == 12
    by_system = {}
    for s, prompt in one:
        by_system.setdefault(s, []).append(prompt)
    assert all(len({tuple(p[:32]) for p in ps}) == 1 for ps in by_system.values())
    assert len({tuple(ps[0][:32]) for ps in by_system.values()}) == 3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_client_the_router_reaches_the_oracle_and_predicts_every_hit(ray_cluster):
    args = parse(["--systems", "2", "--per-system", "3", "--system-len", "64", "--user-len", "4,8",
                  "--concurrency", "1", "--kv-blocks", "64", "--max-tokens", "2", "--strategies",
                  "prefix,round_robin"])
    result = bench_cluster.run(args)
    ours, rr = result["figures"]["prefix"], result["figures"]["round_robin"]
    assert ours["requests"] == rr["requests"] == 6 and ours["aborted"] == 0
    # one request at a time: every repeat lands where its system prompt is cached
    assert ours["hit_rate"] == result["oracle"]["hit_rate"] == 4 / 6
    assert ours["prediction_exact"] == 1.0
    assert "KV-block router" in bench_cluster.render(result)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_json_on_stdout_is_the_json_alone():
    """`bench cluster --json` on a Ray cluster of its own: Ray's own lines (its raylets' errors as
    Serve's actors are killed at shutdown, its log lines) go to stderr, stdout parses as JSON."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import scratchllm

    root = Path(scratchllm.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "local"}
    proc = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "bench", "cluster", "--json", "--systems", "1",
                           "--per-system", "2", "--system-len", "32", "--user-len", "2,4", "--max-tokens", "1",
                           "--concurrency", "1", "--kv-blocks", "16", "--strategies", "prefix"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bench"] == "cluster" and result["figures"]["prefix"]["requests"] == 2


@pytest.mark.parametrize("flag", ["--runs", "--replicas", "--concurrency"])
def test_a_count_below_one_is_one_line_before_ray_starts(flag, capsys):
    from scratchllm.cli.main import main

    assert main(["bench", "cluster", flag, "0"]) == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
