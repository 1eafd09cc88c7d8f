"""GET /metrics: Prometheus histograms of every request's phases, and the engine's gauges.

Histograms are observed once per finished request from the engine's own RequestMetrics (queue,
prefill, decode, TTFT, e2e) and per token from arrival times on the event loop (inter-token
latency, which is what a streaming client feels). Gauges are read from `engine.stats()` at
scrape time by a custom collector, so they are never stale and cost nothing between scrapes.
Each app gets its own CollectorRegistry: several servers (tests) live in one process.
"""

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from scratchllm.engine.protocol import RequestMetrics

disable_created_metrics()  # the *_created series double the page and no dashboard reads them

PREFIX = "scratchllm_"
# Seconds. TTFT and e2e span from a few ms (fake engine, loopback) to minutes (long CPU decodes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]] = lambda: {}) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, registry=r, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                        TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled")
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token")
        self.decode = hist("request_decode_time_seconds", "First token to last token")
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter(PREFIX + "requests_finished", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused before the engine saw them",
                                ["reason"], registry=r)
        r.register(_EngineCollector(engine_stats, self))
        self.in_flight = 0  # requests this server holds in the engine (running + waiting there)
        self.tokens_out = 0  # tokens streamed to clients since start (the periodic stats line's rate)
        self.peak_kv_blocks = 0

    def observe_finished(self, metrics: RequestMetrics | None, finish_reason: str) -> None:
        self.requests.labels(finish_reason).inc()
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
            except Exception:  # noqa: BLE001
                continue
        yield _gauge("requests_in_flight", "Requests the HTTP server holds in the engine", self.server.in_flight)
        for key, doc in (("running", "Requests in the running batch"), ("waiting", "Requests waiting to run")):
            if key in stats:
                yield _gauge(f"num_requests_{key}", doc, stats[key])
        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        if used is not None:
            self.server.peak_kv_blocks = max(self.server.peak_kv_blocks, used, stats.get("kv_blocks_peak", 0))
            yield _gauge("kv_blocks_used", "KV-cache blocks held by requests", used)
            yield _gauge("kv_blocks_peak", "Most KV-cache blocks held at once since start",
                         self.server.peak_kv_blocks)
        if total:
            yield _gauge("kv_blocks_total", "KV-cache blocks in the pool", total)
            yield _gauge("kv_cache_usage_ratio", "Share of KV-cache blocks in use", (used or 0) / total)
        block_bytes = stats.get("kv_block_bytes")
        if block_bytes and used is not None:
            yield _gauge("kv_cache_used_bytes", "Bytes of KV cache held by requests", used * block_bytes)
            yield _gauge("kv_cache_peak_bytes", "Most bytes of KV cache held at once since start",
                         self.server.peak_kv_blocks * block_bytes)
        if "preemptions" in stats:
            c = CounterMetricFamily(PREFIX + "preemptions", "Requests preempted (recomputed) for lack of blocks")
            c.add_metric([], stats["preemptions"])
            yield c


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(PREFIX + name, doc)
    g.add_metric([], float(value))
    return g
