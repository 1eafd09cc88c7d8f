"""The ingress's drain (SIGTERM) waits for the HTTP side, not only the engine's: a replica that has
sent a stream's last event leaves the response open while its events are still being written to
a slow proxy, and draining on the engine's count alone would let Serve shut down mid-stream. And
`start`'s own half: a signal that comes while `serve.run` is still waiting for the last replica
(the ingress already answers /health and streams then) drains through the deployed application's
handle; before that fix such a SIGTERM shut Serve down mid-stream (seen in CI, in
test_process.py)."""

import asyncio
import io
import json
import types

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from scratchllm.cluster import app as cluster_app
from scratchllm.cluster.app import ClusterSpec, Ingress
from scratchllm.cluster.replica import ReplicaSpec
from scratchllm.engine.fake import FakeEngine
from tests.engine.test_conformance import LocalReplicas


def test_drain_waits_for_the_last_bytes_of_a_response_behind_a_slow_send():
    engine = FakeEngine(step_ms=0.5)
    ingress = Ingress(LocalReplicas(engine), ClusterSpec(replica=ReplicaSpec(), embedding_model=None))
    app = ingress.__serve_build_asgi_app__()
    body = json.dumps({"model": "fake", "prompt": "drain me", "max_tokens": 40, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent: list[bytes] = []

    bodies = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():  # the body once, then a client that stays connected
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()

    async def slow_send(message):  # a proxy that takes 20 ms per chunk: the engine ends long before
        if message["type"] == "http.response.body":
            await asyncio.sleep(0.02)
            sent.append(message.get("body", b""))

    async def main():
        request = asyncio.ensure_future(app(scope, receive, slow_send))
        while not sent:
            await asyncio.sleep(0.005)
        left = await ingress.drain(30)
        whole = b"".join(sent)
        engine_done = engine.stats().running == 0
        await request
        return left, whole, engine_done

    try:
        left, whole, engine_done = asyncio.run(main())
    finally:
        engine.shutdown(drain=False)
    assert engine_done
    assert left == 0
    assert whole.rstrip().endswith(b"data: [DONE]"), whole[-200:]  # the drain returned after the last bytes


class _Handle:
    """A deployment handle whose drain call returns `left`, or raises `error` when it is awaited."""

    def __init__(self, left: int = 0, error: Exception | None = None):
        self.calls: list[tuple[float, float]] = []

        def remote(timeout_s: float):
            def result(timeout_s: float) -> int:
                self.calls.append((drain_timeout, timeout_s))
                if error is not None:
                    raise error
                return left

            drain_timeout = timeout_s
            return types.SimpleNamespace(result=result)

        self.drain = types.SimpleNamespace(remote=remote)


def test_start_drains_through_the_handle_and_says_what_was_cut(monkeypatch):
    monkeypatch.setattr(cluster_app, "PROXY_FLUSH_S", 0.0)
    say = io.StringIO()
    handle = _Handle(left=2)
    assert cluster_app._drain(handle, 5.0, say) == 2
    assert handle.calls == [(5.0, 35.0)]  # the ingress waits 5 s; the driver waits 30 s longer for its answer
    assert cluster_app._drain(None, 5.0, say) == 0  # nothing was deployed: nothing to drain
    assert say.getvalue() == ""


def test_an_ingress_that_cannot_be_drained_is_one_line_and_the_shutdown_goes_on(monkeypatch):
    monkeypatch.setattr(cluster_app, "PROXY_FLUSH_S", 0.0)
    say = io.StringIO()
    assert cluster_app._drain(_Handle(error=TimeoutError("no answer in 35 s")), 5.0, say) == 0
    assert say.getvalue() == ("scratchllm serve: the ingress could not be drained (TimeoutError: no answer in 35 s); "
                              "shutting down\n")
