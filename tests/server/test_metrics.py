"""GET /metrics: the histograms and gauges the issue lists, consistent with the responses served."""

import re

import httpx

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"]


def scrape(url) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(scratchllm_\S+) (\S+)$", text, re.M)}


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
        assert f"scratchllm_{h}_bucket{{le=\"+Inf\"}}" in m, h
    for h in HISTOGRAMS[2:] + HISTOGRAMS[:1]:
        assert m[f"scratchllm_{h}_count"] == 5, h
    # one gap fewer than tokens per request
    assert m["scratchllm_inter_token_latency_seconds_count"] == sum(u["completion_tokens"] - 1 for u in usages)
    assert m["scratchllm_generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    assert m["scratchllm_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert m['scratchllm_requests_finished_total{finish_reason="length"}'] == 5
    assert m["scratchllm_num_requests_running"] == 0 and m["scratchllm_num_requests_waiting"] == 0
    assert m["scratchllm_kv_blocks_used"] == 0 and m["scratchllm_kv_blocks_total"] == 64
    assert m["scratchllm_kv_blocks_peak"] >= 1  # held while the requests ran
    assert m["scratchllm_kv_cache_peak_bytes"] == m["scratchllm_kv_blocks_peak"] * model.engine.block_bytes
    assert m["scratchllm_kv_cache_usage_ratio"] == 0
    assert m["scratchllm_preemptions_total"] == 0
