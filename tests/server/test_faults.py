"""Faults under load: a bounded queue (429 + Retry-After), clients that hang up, SIGTERM drains.

All bounded: at most a dozen requests, each a second or less, loopback only.
"""

import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from scratchllm.bench.http_client import parse_metrics
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend


def slow_app(max_in_flight=4, step_ms=20.0, max_running=2):
    model, embedder = fake_backend(step_ms=step_ms, max_running=max_running)
    return create_app(model, embedder, ServerConfig(max_in_flight=max_in_flight))


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def metric(text: str, name: str) -> float:
    """A sample of the page, read with prometheus_client's parser; labels sorted by name."""
    samples = parse_metrics(text)
    assert name in samples, f"{name} not in /metrics"
    return samples[name]


def test_flood_gets_429_with_retry_after_and_admitted_requests_finish(serve):
    app = slow_app(max_in_flight=4)
    with serve(app) as url:
        body = {"model": "fake", "prompt": "flood", "max_tokens": 10, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=20),
                                      range(12)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429} and codes.count(200) >= 4, codes
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_exceeded"
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"
        scraped = httpx.get(url + "/metrics").text
        refused = metric(scraped, 'scratchllm:requests_rejected_total{model_name="fake",reason="queue_full"}')
        assert refused == codes.count(429)
        # The official client sees a RateLimitError when the server is full.
        state = app.state.server
        state.metrics.in_flight = state.config.max_in_flight  # hold every slot
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model="fake", prompt="x", max_tokens=1)
        finally:
            state.metrics.in_flight = 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(serve):
    app = slow_app(step_ms=20.0)
    engine = app.state.server.model.engine
    with serve(app) as url:
        body = {"model": "fake", "messages": [{"role": "user", "content": "long"}], "max_tokens": 500,
                "stream": True}
        with httpx.Client(timeout=20) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens in, then hang up
            assert any(line.startswith("data: ") for line in got)
            assert engine.stats().kv_blocks_used > 0
        wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.finished["abort"] == 1)
        assert engine.finished["length"] == 0  # it did not run on to its 500 tokens
        wait_until(lambda: app.state.server.metrics.in_flight == 0)
        scraped = httpx.get(url + "/metrics").text
        assert metric(scraped, 'scratchllm:kv_blocks_used{model_name="fake"}') == 0
        assert metric(scraped, 'scratchllm:request_success_total{finished_reason="abort",model_name="fake"}') == 1


def test_disconnect_while_waiting_for_a_plain_response_aborts(serve):
    app = slow_app(step_ms=20.0)
    engine = app.state.server.model.engine
    with serve(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 500}, timeout=0.3)
        wait_until(lambda: engine.finished["abort"] == 1 and engine.stats().kv_blocks_used == 0)
        assert app.state.server.metrics.in_flight == 0


def test_sigterm_drains_in_flight_streams_then_exits():
    proc = subprocess.Popen([sys.executable, "-m", "scratchllm.cli.main", "serve", "--fake-engine", "--port", "0",
                             "--fake-step-ms", "20", "--embedding-model", "none"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"http://\S+", line).group(0)
        body = {"model": "fake", "prompt": "drain me", "max_tokens": 60, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=20) as c:
            wait_until(lambda: _healthy(c, url), timeout=20)
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                events = [next(lines) for _ in range(4)]
                proc.send_signal(signal.SIGTERM)  # mid-stream
                events += list(lines)
        events = [e for e in events if e]  # drop the blank lines between events
        data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert events[-1] == "data: [DONE]"
        assert data[-1]["usage"]["completion_tokens"] == 60
        assert [d["choices"][0]["finish_reason"] for d in data if d["choices"]][-1] == "length"
        assert proc.wait(timeout=15) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def _healthy(client, url) -> bool:
    try:
        return client.get(url + "/health").status_code == 200
    except httpx.ConnectError:
        return False


class _FailingEngine:
    """Wraps the fake: every stream breaks after two events, as an engine fault would."""

    def __init__(self, inner):
        self.inner = inner

    def submit(self, ids, params, request_id=None):
        stream = self.inner.submit(ids, params, request_id)

        class Broken:
            request_id = stream.request_id

            @property
            def finished(self):
                return stream.finished

            async def __aiter__(self):
                n = 0
                async for event in stream:
                    if n == 2:
                        stream.abort()
                        raise RuntimeError("kernel exploded")
                    n += 1
                    yield event

            def abort(self):
                stream.abort()

        return Broken()

    def submit_group(self, ids, params, request_ids=None):
        return [self.submit(ids, p, rid) for p, rid in zip(params, request_ids or [None] * len(params), strict=True)]

    def abort(self, request_id):
        self.inner.abort(request_id)

    def stats(self):
        return self.inner.stats()

    def shutdown(self, drain=True):
        self.inner.shutdown(drain)


def test_engine_failure_mid_stream_reaches_the_client_as_an_error(serve):
    model, embedder = fake_backend(step_ms=1.0)
    model.engine = _FailingEngine(model.engine)
    with serve(create_app(model, embedder)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="kernel exploded"):
            for _ in client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=20, stream=True):
                pass
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 20})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        wait_until(lambda: model.engine.inner.stats().kv_blocks_used == 0)
        assert httpx.get(url + "/health").status_code == 200
