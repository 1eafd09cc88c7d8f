"""GET /metrics: Prometheus histograms of every request's phases, and the engine's gauges, under
the names vLLM exports, so dashboards and gateways that read vLLM read us too.

Names: `<prefix>time_to_first_token_seconds`, `inter_token_latency_seconds`,
`e2e_request_latency_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds`,
`request_decode_time_seconds` (histograms); `num_requests_running`, `num_requests_waiting`,
`kv_cache_usage_perc` (0..1) (gauges); `num_preemptions_total`, `request_success_total` (label
`finished_reason`), `prompt_tokens_total`, `generation_tokens_total`, `prefix_cache_queries_total`,
`prefix_cache_hits_total` (counters); every series has the label `model_name`. The prefix is
"scratchllm:" (`serve --metrics-prefix vllm:` gives exactly vLLM's names, for a dashboard or an
endpoint picker configured for vLLM). Ours besides: requests_in_flight, requests_rejected_total,
kv_blocks_used / _peak / _total, kv_cache_used_bytes / _peak_bytes, priority_adjusted_total.

Histograms are observed once per finished request from the engine's own RequestMetrics (queue,
prefill, decode, TTFT, e2e) and per token from arrival times on the event loop (inter-token
latency, which is what a streaming client feels). Gauges are read from `engine.stats()` at
scrape time by a custom collector, so they are never stale and cost nothing between scrapes.
Each app gets its own CollectorRegistry: several servers (tests) live in one process.
"""

import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from scratchllm.engine.protocol import RequestMetrics

disable_created_metrics()  # the *_created series double the page and no dashboard reads them

DEFAULT_PREFIX = "scratchllm:"
# Seconds. TTFT and e2e span from a few ms (fake engine, loopback) to minutes (long CPU decodes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)


def check_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", prefix):
        raise ValueError(f"a metrics prefix is letters, digits, '_' and ':' (not starting with a digit): {prefix!r}")
    return prefix


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]] = lambda: {}, model_name: str = "",
                 prefix: str = DEFAULT_PREFIX) -> None:
        self.registry = CollectorRegistry()
        self.prefix, self.model_name = check_prefix(prefix), model_name
        r, p = self.registry, self.prefix

        def hist(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(p + name, doc, ["model_name"], registry=r, buckets=buckets)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(p + name, doc, ["model_name", *labels], registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token").labels(model_name)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                        TOKEN_BUCKETS).labels(model_name)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token").labels(model_name)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled").labels(model_name)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token").labels(model_name)
        self.decode = hist("request_decode_time_seconds", "First token to last token").labels(model_name)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens").labels(model_name)
        self._success = counter("request_success", "Finished requests by finish reason", "finished_reason")
        self._rejected = counter("requests_rejected", "Requests refused before the engine saw them", "reason")
        r.register(_EngineCollector(engine_stats, self))
        self.in_flight = 0  # requests this server holds in the engine (running + waiting there)
        self.tokens_out = 0  # tokens streamed to clients since start (the periodic stats line's rate)
        self.peak_kv_blocks = 0

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def observe_finished(self, metrics: RequestMetrics | None, finish_reason: str) -> None:
        self.finished(finish_reason)
        if metrics is None:
            return
        self.prompt_tokens.inc(metrics.prompt_tokens)
        self.generation_tokens.inc(metrics.completion_tokens)
        self.queue.observe(max(metrics.queue_ms, 0.0) / 1e3)
        if metrics.completion_tokens and metrics.first_token and metrics.finished and finish_reason != "abort":
            self.ttft.observe(metrics.first_token - metrics.arrival)
            self.prefill.observe(max(metrics.prefill_ms, 0.0) / 1e3)
            self.decode.observe(max(metrics.decode_ms, 0.0) / 1e3)
            self.e2e.observe(metrics.finished - metrics.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenClock:
    """Per-request inter-token latency, measured where the client sees tokens: on the loop."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.last: float | None = None

    def tick(self) -> None:
        self.metrics.tokens_out += 1
        now = time.monotonic()
        if self.last is not None:
            self.metrics.itl.observe(now - self.last)
        self.last = now


class _EngineCollector:
    """Gauges from engine.stats() at scrape time. Unknown keys are simply not exported."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]], server: ServerMetrics) -> None:
        self.engine_stats, self.server = engine_stats, server

    def collect(self) -> Iterator[Metric]:
        stats: dict[str, Any] = {}
        for _ in range(3):
            # stats() reads the engine's structures from this thread while the engine thread
            # changes them; a read that races a change (a container resized mid-iteration) is
            # simply retried, and a scrape never takes the server down.
            try:
                stats = self.engine_stats() or {}
                break
            except Exception:  # noqa: BLE001 - a read that raced the engine thread: retried
                continue
        s = self.server
        yield self._gauge("requests_in_flight", "Requests the HTTP server holds in the engine", s.in_flight)
        for key, doc in (("running", "Requests in the running batch"), ("waiting", "Requests waiting to run")):
            if key in stats:
                yield self._gauge(f"num_requests_{key}", doc, stats[key])
        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        if used is not None:
            s.peak_kv_blocks = max(s.peak_kv_blocks, used, stats.get("kv_blocks_peak", 0))
            yield self._gauge("kv_blocks_used", "KV-cache blocks held by requests", used)
            yield self._gauge("kv_blocks_peak", "Most KV-cache blocks held at once since start", s.peak_kv_blocks)
        if total:
            yield self._gauge("kv_blocks_total", "KV-cache blocks in the pool", total)
            yield self._gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (0 to 1)", (used or 0) / total)
        block_bytes = stats.get("kv_block_bytes")
        if block_bytes and used is not None:
            yield self._gauge("kv_cache_used_bytes", "Bytes of KV cache held by requests", used * block_bytes)
            yield self._gauge("kv_cache_peak_bytes", "Most bytes of KV cache held at once since start",
                              s.peak_kv_blocks * block_bytes)
        if stats.get("kv_bytes_per_token"):
            g = GaugeMetricFamily(s.prefix + "kv_cache_bytes_per_token",
                                  "Bytes of K and V one token of context takes, every layer, at the KV-cache dtype",
                                  labels=["model_name", "dtype"])
            g.add_metric([s.model_name, str(stats.get("kv_cache_dtype", ""))], float(stats["kv_bytes_per_token"]))
            yield g
        if "kv_bytes_resident" in stats:
            yield self._gauge("kv_cache_resident_bytes", "Bytes of the KV pool the work has made resident (blocks "
                              "ever written; the rest of the pool is address space only)", stats["kv_bytes_resident"])
        if "prefix_cache_free_blocks" in stats:
            yield self._gauge("prefix_cache_free_blocks", "Free KV blocks that still hold a cached prefix",
                              stats["prefix_cache_free_blocks"])
        for key, name, doc in (("preemptions", "num_preemptions", "Requests preempted (recomputed) for lack of blocks"),
                               ("prefix_cache_queries", "prefix_cache_queries", "Prompt blocks looked up in the cache"),
                               ("prefix_cache_hits", "prefix_cache_hits", "Prompt blocks found in the prefix cache"),
                               ("priority_adjusted", "priority_adjusted",
                                "Requests whose priority the evaluation feedback moved")):
            if key in stats:
                c = CounterMetricFamily(s.prefix + name, doc, labels=["model_name"])
                c.add_metric([s.model_name], stats[key])
                yield c

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(self.server.prefix + name, doc, labels=["model_name"])
        g.add_metric([self.server.model_name], float(value))
        return g
