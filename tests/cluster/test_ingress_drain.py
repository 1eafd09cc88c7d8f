"""The ingress's drain (SIGTERM) waits for the HTTP side, not only the engine's: a replica that has
sent a stream's last event leaves the response open while its events are still being written to
a slow proxy. Draining on the engine's count alone let Serve shut down mid-stream (seen in CI)."""

import asyncio
import json

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

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
        engine_done = engine.stats()["running"] == 0
        await request
        return left, whole, engine_done

    try:
        left, whole, engine_done = asyncio.run(main())
    finally:
        engine.shutdown(drain=False)
    assert engine_done
    assert left == 0
    assert whole.rstrip().endswith(b"data: [DONE]"), whole[-200:]  # the drain returned after the last bytes
