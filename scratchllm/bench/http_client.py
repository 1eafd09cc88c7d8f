"""The load generator's HTTP client: httpx, with each Server-Sent Event timestamped as it arrives.

Load testing needs the moment each token reaches the client. httpx hands over bytes as they come
off the socket, whatever the framing (chunked, sized, or a stream delimited by the connection's
close); lines end with LF or CRLF. Events follow the SSE rules: `data:` with
or without the space, several data lines joined by newlines, a blank line dispatches; the event's
time is when its last line arrived. https and any headers (an API key) work as httpx does them.
Metrics are read with prometheus_client's own parser, labels kept. A server whose /metrics is
missing, refused or not Prometheus text (llama-server without --metrics answers 501 with JSON)
gives no metrics and a note saying why: a load test of any OpenAI-compatible server never fails
for it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes = b""  # non-streamed body (errors, plain JSON)
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (monotonic arrival, SSE JSON)
    done: bool = False  # saw `data: [DONE]`

    def json(self) -> Any:
        return json.loads(self.body)


def new_client(timeout: float = 600.0, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """One client (and its connection pool) for a whole run; no limit on concurrent connections."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, headers=headers)


async def request(client: httpx.AsyncClient, url: str, method: str = "GET", body: dict[str, Any] | None = None,
                  timeout: float | None = None) -> Reply:
    """One HTTP request; an SSE response (text/event-stream) is parsed into timestamped events."""
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    async with client.stream(method, url, json=body, **kwargs) as response:
        reply = Reply(response.status_code, {k.lower(): v for k, v in response.headers.items()})
        if not reply.headers.get("content-type", "").startswith("text/event-stream"):
            reply.body = await response.aread()
            return reply
        # Raw bytes, split here: httpx's text line iterator costs enough per chunk that a load
        # generator reading 64 streams falls behind the server and stamps bursts of events
        # with one time (measured: inter-token p50 0.03 ms instead of the server's 5 ms).
        data: list[bytes] = []
        pending = b""
        async for raw in response.aiter_raw():
            now = time.monotonic()
            *lines, pending = (pending + raw).split(b"\n")
            for line in lines:
                line = line.rstrip(b"\r")  # CRLF
                if not line:
                    _dispatch(reply, data, now)
                    data = []
                elif line.startswith(b"data:"):
                    value = line[5:]
                    data.append(value[1:] if value.startswith(b" ") else value)
                # other fields (event:, id:, retry:) and comments (":...") carry nothing we read
        if pending.rstrip(b"\r").startswith(b"data:"):  # a last line without its newline
            value = pending.rstrip(b"\r")[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        _dispatch(reply, data, time.monotonic())  # a last event without its blank line
    return reply


def _dispatch(reply: Reply, data: list[bytes], now: float) -> None:
    if not data:
        return
    payload = b"\n".join(data)
    if payload == b"[DONE]":
        reply.done = True
    else:
        reply.events.append((now, json.loads(payload)))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample: value}; a labelled sample is keyed `name{a="x",b="y"}`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def metric(metrics: dict[str, float], name: str) -> float | None:
    """The value of `name` whatever the server's prefix ("scratchllm:", "vllm:", ...) and labels:
    the sum over its labelled series (one per model), or None if the server has no such series."""
    values = [v for key, v in metrics.items()
              if (bare := key.split("{", 1)[0]) == name or bare.endswith((":" + name, "_" + name))]
    return sum(values) if values else None


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's /metrics, or {} when it has none to read (see scrape_metrics_noted)."""
    return (await scrape_metrics_noted(client, url))[0]


async def scrape_metrics_noted(client: httpx.AsyncClient, url: str) -> tuple[dict[str, float], str | None]:
    """(metrics, None), or ({}, why not): no answer, a status other than 200, or a body that is not
    Prometheus text."""
    try:
        reply = await request(client, url + "/metrics", timeout=30)
    except (httpx.HTTPError, OSError) as err:
        return {}, f"/metrics did not answer: {type(err).__name__}: {err}"
    if reply.status != 200:
        return {}, f"/metrics answered {reply.status}: {reply.body.decode(errors='replace').strip()[:120]}"
    try:
        return parse_metrics(reply.body.decode(errors="replace")), None
    except (ValueError, TypeError, IndexError, KeyError) as err:
        return {}, f"/metrics is not Prometheus text ({type(err).__name__}: {str(err)[:80]})"
