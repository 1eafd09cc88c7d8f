"""GET /metrics: the latency histograms, token counters and KV-cache gauges, under scratchllm: and
vllm: names, consistent with the responses served."""

import httpx

from scratchllm.bench.http_client import parse_metrics
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"]


def scrape(url) -> dict[str, float]:
    """Every sample, read with prometheus_client's parser: name{labels sorted} -> value."""
    return parse_metrics(httpx.get(url + "/metrics").text)


L = '{model_name="fake"}'  # every series carries the served model's name


def test_metrics_count_what_was_served(serve):
    model, embedder = fake_backend(step_ms=1.0, max_running=4, num_blocks=64)
    with serve(create_app(model, embedder, ServerConfig())) as url:
        usages = []
        for i in range(5):
            r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "m" * (i + 1),
                                                          "max_tokens": 7 + i, "temperature": 0})
            usages.append(r.json()["usage"])
        m = scrape(url)
    for h in HISTOGRAMS:
        assert f'scratchllm:{h}_bucket{{le="+Inf",model_name="fake"}}' in m, h
    for h in HISTOGRAMS[2:] + HISTOGRAMS[:1]:
        assert m[f"scratchllm:{h}_count{L}"] == 5, h
    # one gap fewer than tokens per request
    assert m[f"scratchllm:inter_token_latency_seconds_count{L}"] == sum(u["completion_tokens"] - 1 for u in usages)
    assert m[f"scratchllm:generation_tokens_total{L}"] == sum(u["completion_tokens"] for u in usages)
    assert m[f"scratchllm:prompt_tokens_total{L}"] == sum(u["prompt_tokens"] for u in usages)
    assert m['scratchllm:request_success_total{finished_reason="length",model_name="fake"}'] == 5
    assert m[f"scratchllm:num_requests_running{L}"] == 0 and m[f"scratchllm:num_requests_waiting{L}"] == 0
    assert m[f"scratchllm:kv_blocks_used{L}"] == 0 and m[f"scratchllm:kv_blocks_total{L}"] == 64
    assert m[f"scratchllm:kv_blocks_peak{L}"] >= 1  # held while the requests ran
    assert m[f"scratchllm:kv_cache_peak_bytes{L}"] == m[f"scratchllm:kv_blocks_peak{L}"] * model.engine.block_bytes
    assert m[f"scratchllm:kv_cache_usage_perc{L}"] == 0
    assert m[f"scratchllm:num_preemptions_total{L}"] == 0


def test_vllm_names_for_dashboards_and_gateways(serve):
    """With the vllm: prefix the page has the exact series a vLLM dashboard or an endpoint
    picker reads: queue depth and KV use per model."""
    model, embedder = fake_backend(step_ms=1.0, max_running=4, num_blocks=64)
    with serve(create_app(model, embedder, ServerConfig(metrics_prefix="vllm:"))) as url:
        httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 3})
        m = scrape(url)
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "e2e_request_latency_seconds_count", "inter_token_latency_seconds_count"):
        assert f"vllm:{name}{L}" in m, name
    assert m['vllm:request_success_total{finished_reason="length",model_name="fake"}'] == 1
    assert not any(k.startswith("scratchllm:") for k in m)
