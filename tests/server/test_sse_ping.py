"""SSE keep-alive: a stream that waits longer than sse_ping_interval_s between chunks gets
`: ping` comment lines, which the official `openai` client skips (its chunks parse as without)."""

import httpx
import openai
import pytest

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def slow_server(serve_module):
    """A fake engine taking 150 ms a token, pinging after 30 ms without a chunk."""
    model, embedder = fake_backend(step_ms=150.0)
    with serve_module(create_app(model, embedder, ServerConfig(sse_ping_interval_s=0.03))) as url:
        yield url


def test_pings_come_between_chunks_while_the_stream_waits(slow_server):
    with httpx.stream("POST", slow_server + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=20) as r:
        lines = [line for line in r.iter_lines() if line]
    pings = [i for i, line in enumerate(lines) if line == ": ping"]
    data = [line for line in lines if line.startswith("data: ")]
    assert len(pings) >= 4, lines  # 150 ms a token, a ping every 30 ms
    assert data[-1] == "data: [DONE]" and all(line in (": ping",) or line.startswith("data: ") for line in lines)


def test_the_openai_client_parses_a_pinged_stream(slow_server):
    client = openai.OpenAI(base_url=slow_server + "/v1", api_key="unused", max_retries=0, timeout=20)
    whole = client.chat.completions.create(**BODY)
    chunks = list(client.chat.completions.create(**BODY, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_no_pings_when_off(serve):
    model, embedder = fake_backend(step_ms=60.0)
    body = {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True}
    with (serve(create_app(model, embedder, ServerConfig(sse_ping_interval_s=0))) as url,
          httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as r):
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and ": ping" not in lines
