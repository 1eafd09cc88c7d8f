"""Streams reach the event loop without a thread per request: 64 concurrent SSE streams leave
the process's thread count where it was."""

import asyncio
import json
import threading

import httpx

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend

N = 64


async def _open_streams(url: str, during: list[int]) -> list[int]:
    started = asyncio.Event()
    first_seen = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def one(client, i):
        nonlocal first_seen
        body = {"model": "fake", "prompt": f"p{i}", "max_tokens": 150, "stream": True, "ignore_eos": True}
        chunks, finish = 0, None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 1:
                        first_seen += 1
                        if first_seen == N:
                            started.set()
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return finish

    async def sample():
        await started.wait()  # every stream is open and has produced a token
        during.append(threading.active_count())

    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(N)), sample())
    return results[:N]


def test_64_streams_add_no_threads(serve):
    model, embedder = fake_backend(step_ms=5.0, max_running=N, num_blocks=4096)
    app = create_app(model, embedder, ServerConfig(max_in_flight=N + 8))
    with serve(app) as url:
        httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "warm", "max_tokens": 2})
        before = threading.active_count()
        during: list[int] = []
        finishes = asyncio.run(_open_streams(url, during))
        after = threading.active_count()
    assert finishes == ["length"] * N  # every stream ran to its end
    assert during and during[0] <= before + 1, (before, during)  # not one thread per stream
    assert after <= before + 1
