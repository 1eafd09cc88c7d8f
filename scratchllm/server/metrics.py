"""GET /metrics: Prometheus histograms of every request's phases, and the engine's gauges, under
the names vLLM exports, so dashboards and gateways that read vLLM read us too.

Names: `<prefix>time_to_first_token_seconds`, `inter_token_latency_seconds`,
`e2e_request_latency_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds`,
`request_decode_time_seconds` (histograms); `num_requests_running`, `num_requests_waiting`,
`kv_cache_usage_perc` (0..1) (gauges); `num_preemptions_total`, `request_success_total` (label
`finished_reason`), `prompt_tokens_total`, `generation_tokens_total`, `prefix_cache_queries_total`,
`prefix_cache_hits_total` (counters); every series has the label `model_name`. The prefix is
"scratchllm:" (`serve --metrics-prefix vllm:` gives exactly vLLM's names, for a dashboard or an
endpoint picker configured for vLLM). With speculative decoding, vLLM's counters
`spec_decode_num_drafts_total`, `_num_draft_tokens_total`, `_num_accepted_tokens_total` and
`_num_emitted_tokens_total` (accepted / draft tokens is the acceptance rate). Ours besides:
requests_in_flight, requests_rejected_total, kv_blocks_used / _peak / _total, kv_cache_used_bytes /
_peak_bytes, priority_adjusted_total.

A server of several models (server/registry.py) has one page: each family once, a series per
model (`model_name`), as vLLM's page lists its models. A model that loads on demand also has
model_loaded (1 or 0), model_loads_total, model_unloads_total and model_load_seconds (its last
load); while it is unloaded its engine gauges are absent and its counters and histograms stay.

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

from scratchllm.engine.protocol import EngineStats, RequestMetrics

disable_created_metrics()  # the *_created series double the page and no dashboard reads them

DEFAULT_PREFIX = "scratchllm:"
# Seconds. TTFT and e2e span from a few ms (fake engine, loopback) to minutes (long CPU decodes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)


def check_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", prefix):
        raise ValueError(f"a metrics prefix is letters, digits, '_' and ':' (not starting with a digit): {prefix!r}")
    return prefix


class MetricFamilies:
    """One app's Prometheus registry and its metric families, shared by every model it serves:
    each family is created once and each model adds its own series to it (label `model_name`),
    as one vLLM page lists several models. One collector reads every model's engine gauges at
    scrape time (a family yielded twice would be two families of one name on the page)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.registry = CollectorRegistry()
        self.prefix = p = check_prefix(prefix)
        r = self.registry

        def hist(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(p + name, doc, ["model_name"], registry=r, buckets=buckets)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(p + name, doc, ["model_name", *labels], registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens of a request", TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled")
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token")
        self.decode = hist("request_decode_time_seconds", "First token to last token")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.success = counter("request_success", "Finished requests by finish reason", "finished_reason")
        self.rejected = counter("requests_rejected", "Requests refused before the engine saw them", "reason")
        self.models: list[ServerMetrics] = []  # in the order they were added: the page's order
        r.register(_EngineCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def no_engine() -> None:
    """The engine stats of a model with no engine (not loaded, or unloaded): none."""
    return None


class ServerMetrics:
    """One served model's series in its app's MetricFamilies (a family of its own when none is
    given: a server of one model). `engine_stats` is read at scrape time; the model registry
    (server/registry.py) swaps it as the model loads and unloads and keeps `loaded` and the
    load counts, which the page shows as model_loaded, model_loads_total and model_unloads_total."""

    ttft: Any  # the model's children of the families (prometheus_client's labelled Histogram / Counter)
    itl: Any
    e2e: Any
    queue: Any
    prefill: Any
    decode: Any
    prompt_tokens: Any
    generation_tokens: Any

    def __init__(self, engine_stats: Callable[[], EngineStats | None] = no_engine, model_name: str = "",
                 prefix: str = DEFAULT_PREFIX, families: MetricFamilies | None = None, generates: bool = True) -> None:
        self.families = families or MetricFamilies(prefix)
        f, self.model_name, self.engine_stats = self.families, model_name, engine_stats
        self.registry, self.prefix = f.registry, f.prefix
        self.generates = generates  # False for an embedding model: only its load state is exported
        if generates:  # each series exists from the start (a scrape shows 0, not nothing, before traffic)
            self.ttft, self.itl = f.ttft.labels(model_name), f.itl.labels(model_name)
            self.e2e, self.queue = f.e2e.labels(model_name), f.queue.labels(model_name)
            self.prefill, self.decode = f.prefill.labels(model_name), f.decode.labels(model_name)
            self.prompt_tokens = f.prompt_tokens.labels(model_name)
            self.generation_tokens = f.generation_tokens.labels(model_name)
        self.in_flight = 0  # requests this server holds in the engine (running + waiting there)
        self.tokens_out = 0  # tokens streamed to clients since start (the periodic stats line's rate)
        self.peak_kv_blocks = 0
        self.loaded: bool | None = None  # None: not managed by a model registry (no load series)
        self.loads = self.unloads = 0
        self.load_seconds = 0.0  # the last load's duration
        f.models.append(self)

    def finished(self, reason: str) -> None:
        self.families.success.labels(self.model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self.families.rejected.labels(self.model_name, reason).inc()

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
        return self.families.render()


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
    """Gauges from each model's engine_stats() at scrape time, one family per name with a series
    per model. Unknown keys are simply not exported; an unloaded model exports only its load state."""

    def __init__(self, families: MetricFamilies) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, model: str,
                value: float) -> None:
            family = out.get(name)
            if family is None:
                family = out[name] = kind(self.families.prefix + name, doc, labels=["model_name"])
            family.add_metric([model], float(value))

        for s in self.families.models:
            if s.loaded is not None:
                add(GaugeMetricFamily, "model_loaded", "1 while the model is loaded, 0 while it is not", s.model_name,
                    s.loaded)
                add(CounterMetricFamily, "model_loads", "Times the model was loaded", s.model_name, s.loads)
                add(CounterMetricFamily, "model_unloads", "Times the model was unloaded after its keep-alive",
                    s.model_name, s.unloads)
                add(GaugeMetricFamily, "model_load_seconds", "How long the model's last load took", s.model_name,
                    s.load_seconds)
            if s.generates and s.loaded is not False:
                self._engine(s, add)
        yield from out.values()

    @staticmethod
    def _engine(s: ServerMetrics, add_to: Callable[[type[Any], str, str, str, float], None]) -> None:
        def add(kind: type[Any], name: str, doc: str, value: float) -> None:
            add_to(kind, name, doc, s.model_name, value)

        stats: EngineStats | None = None
        for _ in range(3):
            # stats() reads the engine's structures from this thread while the engine thread
            # changes them; a read that races a change (a container resized mid-iteration) is
            # simply retried, and a scrape never takes the server down.
            try:
                stats = s.engine_stats()
                break
            except Exception:  # noqa: BLE001 - a read that raced the engine thread: retried
                continue
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        add(gauge, "requests_in_flight", "Requests the HTTP server holds in the engine", s.in_flight)
        if stats is None:
            return
        add(gauge, "num_requests_running", "Requests in the running batch", stats.running)
        add(gauge, "num_requests_waiting", "Requests waiting to run", stats.waiting)
        used, total = stats.kv_blocks_used, stats.kv_blocks_total
        if used is not None:
            s.peak_kv_blocks = max(s.peak_kv_blocks, used, stats.kv_blocks_peak or 0)
            add(gauge, "kv_blocks_used", "KV-cache blocks held by requests", used)
            add(gauge, "kv_blocks_peak", "Most KV-cache blocks held at once since start", s.peak_kv_blocks)
        if total:
            add(gauge, "kv_blocks_total", "KV-cache blocks in the pool", total)
            add(gauge, "kv_cache_usage_perc", "Share of KV-cache blocks in use (0 to 1)", (used or 0) / total)
        block_bytes = stats.kv_block_bytes
        if block_bytes and used is not None:
            add(gauge, "kv_cache_used_bytes", "Bytes of KV cache held by requests", used * block_bytes)
            add(gauge, "kv_cache_peak_bytes", "Most bytes of KV cache held at once since start",
                s.peak_kv_blocks * block_bytes)
        if stats.kv_bytes_per_token:
            add(gauge, "kv_cache_bytes_per_token", "Bytes of K and V one token of context takes, every layer, at the "
                "KV-cache dtype (--kv-cache-dtype)", stats.kv_bytes_per_token)
        if stats.kv_bytes_resident is not None:
            add(gauge, "kv_cache_resident_bytes", "Bytes of the KV pool the work has made resident (blocks ever "
                "written; the rest of the pool is address space only)", stats.kv_bytes_resident)
        if stats.prefix_cache_free_blocks is not None:
            add(gauge, "prefix_cache_free_blocks", "Free KV blocks that still hold a cached prefix",
                stats.prefix_cache_free_blocks)
        for value, name, doc in (
                (stats.preemptions, "num_preemptions", "Requests preempted (recomputed) for lack of blocks"),
                (stats.prefix_cache_queries, "prefix_cache_queries", "Prompt blocks looked up in the cache"),
                (stats.prefix_cache_hits, "prefix_cache_hits", "Prompt blocks found in the prefix cache"),
                (stats.priority_adjusted, "priority_adjusted",
                 "Requests whose priority the evaluation feedback moved"),
                (stats.spec_decode_num_drafts, "spec_decode_num_drafts",
                 "Speculative decoding: verifications of drafted tokens"),
                (stats.spec_decode_num_draft_tokens, "spec_decode_num_draft_tokens",
                 "Speculative decoding: tokens drafted and verified"),
                (stats.spec_decode_num_accepted_tokens, "spec_decode_num_accepted_tokens",
                 "Speculative decoding: drafted tokens the model accepted"),
                (stats.spec_decode_num_emitted_tokens, "spec_decode_num_emitted_tokens",
                 "Speculative decoding: tokens the verifications emitted (accepted, and the model's own one each)")):
            if value is not None:
                add(counter, name, doc, value)
