"""One OpenTelemetry span per request, checked with the SDK's own in-memory exporter."""

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from scratchllm.engine import RequestMetrics
from scratchllm.sampling import SamplingParams
from scratchllm.trace.otlp import make_tracer, record_request


def test_a_finished_request_becomes_one_span_with_vllm_attribute_names():
    exporter = InMemorySpanExporter()
    tracer = make_tracer("unused", exporter=exporter)
    m = RequestMetrics(arrival=100.0, first_scheduled=100.25, first_token=100.75, finished=102.0, prompt_tokens=40,
                       completion_tokens=26)  # queue 250 ms, prefill 500 ms, decode 1250 ms
    record_request(tracer, "cmpl-7", "default", m, SamplingParams(max_tokens=32, temperature=0.5, top_p=0.9),
                   clock=lambda: 103.0)
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    a = span.attributes
    assert a["gen_ai.request.id"] == "cmpl-7" and a["gen_ai.response.model"] == "default"
    assert a["gen_ai.usage.prompt_tokens"] == 40 and a["gen_ai.usage.completion_tokens"] == 26
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.25)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.75)
    assert a["gen_ai.latency.e2e"] == pytest.approx(2.0)
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.5)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(1.25)
    assert a["gen_ai.request.max_tokens"] == 32 and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert (span.end_time - span.start_time) == pytest.approx(2.0e9, abs=1e3)  # arrival -> finish
    assert span.resource.attributes["service.name"] == "scratchllm"
