"""One OpenTelemetry span per finished request, with the attribute names vLLM's tracing uses
(gen_ai.latency.time_in_queue, gen_ai.latency.time_to_first_token, ...), so dashboards built
for it read ours. Latencies are in seconds, as there.

The span is made when the request finishes, from its RequestMetrics: nothing is held open while
the request runs (an OTel span is exported only when it ends, so a crash would lose every open
one; the trace ring is what survives a crash). Exporting is the SDK's batch processor's job, on
its own thread.

Needs opentelemetry-sdk, and for an endpoint opentelemetry-exporter-otlp-proto-http; both are
imported only when a tracer is made, so the rest of scratchllm runs without them.
"""

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from scratchllm.errors import ConfigError

if TYPE_CHECKING:  # an optional dependency, imported where a tracer is made
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

SPAN_NAME = "llm_request"
# attribute names, as vLLM's SpanAttributes spells them
REQUEST_ID = "gen_ai.request.id"
RESPONSE_MODEL = "gen_ai.response.model"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
N = "gen_ai.request.n"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"
TIME_IN_INFERENCE = "gen_ai.latency.time_in_model_inference"

Attribute = str | int | float


class Metrics(Protocol):
    """What a span is made from: the engine's RequestMetrics (monotonic seconds, durations in ms)."""

    @property
    def arrival(self) -> float: ...
    @property
    def first_token(self) -> float | None: ...
    @property
    def finished(self) -> float | None: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def queue_ms(self) -> float: ...
    @property
    def prefill_ms(self) -> float: ...
    @property
    def decode_ms(self) -> float: ...


class Params(Protocol):
    """The sampling parameters a span reports (SamplingParams)."""

    @property
    def max_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...


def request_attributes(request_id: str, model: str, metrics: Metrics,
                       params: Params | None = None) -> dict[str, Attribute]:
    """The span's attributes from a finished request's RequestMetrics (and SamplingParams)."""
    attrs: dict[str, Attribute]
    attrs = {REQUEST_ID: str(request_id), RESPONSE_MODEL: model, PROMPT_TOKENS: metrics.prompt_tokens,
             COMPLETION_TOKENS: metrics.completion_tokens, N: 1,
             TIME_IN_QUEUE: metrics.queue_ms / 1e3, TIME_IN_PREFILL: metrics.prefill_ms / 1e3,
             TIME_IN_DECODE: metrics.decode_ms / 1e3,
             TIME_IN_INFERENCE: (metrics.prefill_ms + metrics.decode_ms) / 1e3}
    if metrics.first_token is not None:
        attrs[TIME_TO_FIRST_TOKEN] = metrics.first_token - metrics.arrival
    if metrics.finished is not None:
        attrs[E2E] = metrics.finished - metrics.arrival
    if params is not None:
        attrs.update({MAX_TOKENS: params.max_tokens, TEMPERATURE: params.temperature, TOP_P: params.top_p})
    return attrs


def record_request(tracer: "Tracer", request_id: str, model: str, metrics: Metrics, params: Params | None = None,
                   clock: Callable[[], float] = time.monotonic) -> None:
    """Start and end the request's span at its arrival and finish. RequestMetrics times are on
    the monotonic clock `clock`; spans want the wall clock: shift by the offset between them now."""
    from opentelemetry.trace import SpanKind

    offset_ns = time.time_ns() - round(clock() * 1e9)

    def wall(t: float) -> int:
        return round(t * 1e9) + offset_ns

    end = metrics.finished if metrics.finished is not None else clock()
    span = tracer.start_span(SPAN_NAME, kind=SpanKind.SERVER, start_time=wall(metrics.arrival),
                             attributes=request_attributes(request_id, model, metrics, params))
    span.end(end_time=wall(end))


def make_tracer(endpoint: str, exporter: "SpanExporter | None" = None) -> "Tracer":
    """A tracer whose spans go to `endpoint` (OTLP over HTTP/protobuf, e.g.
    http://localhost:4318/v1/traces), or to `exporter` (a SpanExporter, e.g. the SDK's in-memory
    one in tests)."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise ConfigError("OTLP traces need the OpenTelemetry SDK: pip install opentelemetry-sdk") from None
    provider = TracerProvider(resource=Resource.create({"service.name": "scratchllm"}))
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError("--otlp-traces-endpoint needs the OTLP exporter: pip install "
                              "opentelemetry-exporter-otlp-proto-http") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("scratchllm")
