"""The server's side of the trace: every streamed chunk's serialization and send are spans in
the ring, keyed by the request id the client sees; and LLM(trace=...) writes the ring."""

import json

import httpx

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from scratchllm.trace import Phase, TraceWriter, request_key
from scratchllm.trace.views.analysis import Trace
from tests.server.conftest import live_server


def test_streamed_chunks_are_serialize_and_send_spans(tmp_path):
    model, embedder = fake_backend(step_ms=0.5)
    ring = tmp_path / "server.ring"
    with TraceWriter(ring) as writer, live_server(create_app(model, embedder, ServerConfig(), trace=writer)) as url:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        rid = json.loads(lines[0][6:])["id"]
    trace = Trace.load(ring)
    spans = trace.spans[trace.spans["request"] == request_key(rid)]
    serialize = spans[spans["phase"] == Phase.SERIALIZE]
    send = spans[spans["phase"] == Phase.NETWORK_SEND]
    chunks = len(lines) - 1  # every data line but [DONE] was serialized by us
    assert len(serialize) == chunks and len(send) == len(lines)
    assert (serialize["end_ns"] >= serialize["start_ns"]).all() and (send["end_ns"] >= send["start_ns"]).all()
    assert sorted(send["index"].tolist()) == list(range(len(lines)))


def test_llm_writes_the_ring(tmp_path):
    from scratchllm import LLM, SamplingParams

    ring = tmp_path / "llm.ring"
    llm = LLM("default", trace=str(ring))
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    llm.shutdown()
    trace = Trace.load(ring)
    assert trace.tokens["token_id"].tolist() == out.token_ids and len(trace.steps) >= 4
