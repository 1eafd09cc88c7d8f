"""`bench serving` against servers that are not ours: a /metrics that answers 501 with JSON (as
llama-server's does without --metrics) is reported, not fatal; runs against --url draw fresh
prompts unless --seed repeats them, and say how much a prefix cache served; the servers that
`--peer` and several --max-num-seqs start are measured with their memory; llama.cpp's programs'
outputs are read as they print them."""

import argparse
import json
import subprocess
import sys

import pytest

from scratchllm.bench import http_client, llama_tools, serving
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend


def bench_args(argv):
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args([*argv, "--no-progress"])


def metrics_refused(app):
    """`app`, except that /metrics answers as llama-server's does when started without --metrics."""
    body = json.dumps({"error": {"code": 501, "message": "This server does not support metrics endpoint.",
                                 "type": "not_supported_error"}}).encode()

    async def wrapped(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await send({"type": "http.response.start", "status": 501,
                        "headers": [(b"content-type", b"application/json; charset=utf-8")]})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return wrapped


def test_a_server_without_prometheus_metrics_is_measured_anyway(serve):
    model, embedder = fake_backend(step_ms=1.0, max_running=4)
    with serve(metrics_refused(create_app(model, embedder, ServerConfig(max_in_flight=64)))) as url:
        result = serving.run(bench_args(["--url", url, "--workload", "short", "--num-requests", "6",
                                         "--rate", "inf"]))
    f = result["figures"]
    assert f["completed"] == 6 and f["failed"] == 0 and f["ttft_ms"]["p50"] > 0
    assert f["metrics_note"].startswith("/metrics answered 501") and f["peak_kv_blocks"] == 0
    assert "no server metrics: /metrics answered 501" in serving.render(result)


def test_metrics_that_are_not_prometheus_text_give_a_note():
    import asyncio

    import httpx

    def handler(request):
        return httpx.Response(200, text='{"not": "prometheus"}\n{')

    async def scrape():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await http_client.scrape_metrics_noted(client, "http://x")

    metrics, note = asyncio.run(scrape())
    assert metrics == {} and "not Prometheus text" in note


def test_runs_against_a_url_draw_fresh_prompts_unless_a_seed_is_given(serve):
    model, embedder = fake_backend(step_ms=0.5, max_running=4)
    with serve(create_app(model, embedder, ServerConfig(max_in_flight=64))) as url:
        base = ["--url", url, "--workload", "short", "--num-requests", "3", "--rate", "inf"]
        fresh = [serving.run(bench_args(base)) for _ in range(2)]
        seeded = [serving.run(bench_args([*base, "--seed", "7"])) for _ in range(2)]
    assert fresh[0]["inputs"]["seed"] != fresh[1]["inputs"]["seed"] and fresh[0]["inputs"]["fresh_seed"]
    assert seeded[0]["inputs"]["seed"] == seeded[1]["inputs"]["seed"] == 7 and not seeded[0]["inputs"]["fresh_seed"]
    text = serving.render(fresh[0])
    assert "a fresh seed" in text and "prompt tokens from the server's prefix cache: 0 of" in text


def test_a_warm_prefix_cache_is_named():
    from scratchllm.bench import loadgen

    results = [loadgen.Result(40, 8, 200, start=0.0, ttft=0.1, e2e=0.5, cached_tokens=32) for _ in range(3)]
    run = {"results": results, "duration_s": 1.0, "probe_ms": [], "kv_samples": [], "metrics": {},
           "metrics_note": None}
    f = loadgen.summarize(run, {})
    assert f["cached_prompt_tokens"] == 96 and f["prompt_tokens"] == 120
    assert any("a warm cache" in line for line in serving._summary(f))


@pytest.mark.slow
def test_our_concurrency_trade_with_servers_started_here():
    # two of our servers (the fake engine) at two max-num-seqs, interleaved, each measured with its memory
    r = serving.run(bench_args(["--fake-engine", "--fake-step-ms", "2", "--max-num-seqs", "2,8", "--workload", "short",
                                "--num-requests", "12", "--rate", "inf", "--repeat", "1"]))
    assert r["servers"] == ["ours@2", "ours@8"] and not r["ratios"]
    for name in r["servers"]:
        f = r["figures"][name]
        assert f["failed"] == 0 and f["request_throughput"] > 0 and f["peak_rss_mb"] >= f["rss_ready_mb"] > 10
    assert r["figures"]["ours@8"]["ttft_p99"] < r["figures"]["ours@2"]["ttft_p99"]  # more at once: sooner started
    assert "TTFT/TPOT trade" in serving.render(r)


@pytest.mark.slow
@pytest.mark.skipif(llama_tools.tool("llama-server") is None, reason="llama-server not built (make peers)")
def test_llama_server_runs_beside_ours_on_the_same_file():
    r = serving.run(bench_args(["--peer", "llama-server", "--max-num-seqs", "2", "--workload", "short",
                                "--num-requests", "4", "--rate", "inf", "--repeat", "1"]))
    assert r["servers"] == ["ours@2", "llama-server@2"]
    for name in r["servers"]:
        assert r["figures"][name]["failed"] == 0 and r["figures"][name]["peak_rss_mb"] > 50
    assert r["ratios"]["ours@2"]["request_throughput"] > 0
    assert "ours / llama-server@2" in serving.render(r)


LLAMA_BENCH_JSON = """[
  {"build_commit": "0c1e570", "n_prompt": 500, "n_gen": 0, "n_threads": 2, "type_k": "f16",
   "avg_ts": 327.5, "stddev_ts": 3.1, "samples_ts": [325.1, 329.9]},
  {"build_commit": "0c1e570", "n_prompt": 0, "n_gen": 128, "n_threads": 2, "type_k": "f16",
   "avg_ts": 121.2, "stddev_ts": 0.8, "samples_ts": [120.6, 121.8]}
]"""
BATCHED_JSONL = """main: n_kv_max = 2576, n_batch = 2048
{"n_kv_max": 2576, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 128, "pl": 16, "n_kv": 2560, "t_pp": 1.5, "speed_pp": 341.3, "t_tg": 6.5, "speed_tg": 315.1, "t": 8.0, "speed": 320.0}
"""  # noqa: E501 - one line, as the program prints it


def test_llama_cpp_outputs_are_read_as_printed():
    assert llama_tools.parse_bench(LLAMA_BENCH_JSON) == {"prefill_tok_s": 327.5, "decode_tok_s": 121.2}
    row = llama_tools.parse_batched(BATCHED_JSONL)[16]
    assert row["aggregate_tok_s"] == 320.0 and row["generated_tok_s"] == 16 * 128 / 8.0
    argv = llama_tools.batched_args("m.gguf", 2, 32, 128, [1, 4, 16], 2600)
    assert argv[argv.index("-npl") + 1] == "1,4,16" and argv[argv.index("-c") + 1] == "2600"


def test_a_programs_peak_rss_is_sampled_while_it_runs():
    # a child that holds 150 MB for half a second: its peak, not this process's
    code = "import time; b = bytearray(150 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.5)"
    run = llama_tools.run_tool([sys.executable, "-c", code])
    assert 150 < run.peak_rss_mb < 400
    with pytest.raises(Exception, match="exit 3"):
        llama_tools.run_tool([sys.executable, "-c", "raise SystemExit(3)"])
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_max_num_seqs_lists_take_counts_and_our_default():
    from scratchllm.bench import serving_peer
    from scratchllm.errors import ConfigError

    assert serving_peer.max_num_seqs_list("16,32,default") == [16, 32, None]
    for bad in ("0", "16,x", "", "-4"):
        with pytest.raises(ConfigError, match="--max-num-seqs"):
            serving_peer.max_num_seqs_list(bad)
    args = bench_args(["--max-num-seqs", "default", "--serve-model", "m.gguf"])
    assert "--max-num-seqs" not in serving_peer.ours_cmd(args, None, 8)
    cmd = serving_peer.ours_cmd(args, 16, 8)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "16"
