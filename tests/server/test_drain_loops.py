"""The drain state works for an app served by one event loop after another (TestClient, tests
that call asyncio.run twice): an asyncio.Event made on the first loop used to fail on the second,
which the gate read as a cut drain, so every request after the first loop's got a 503."""

import asyncio

import httpx

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend


async def _post(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3})


def test_requests_from_a_second_event_loop_are_served():
    model, embedder = fake_backend(step_ms=0.0)
    app = create_app(model, embedder, ServerConfig())
    try:
        assert [asyncio.run(_post(app)).status_code for _ in range(3)] == [200, 200, 200]
    finally:
        model.engine.shutdown(False)
