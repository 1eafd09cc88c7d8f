"""Adds OpenAI's `usage.prompt_tokens_details.cached_tokens` to the ingress's replies.

The server's routes build `usage` without it; the engine reports it per request
(RequestMetrics.cached_tokens) and RemoteEngine keeps it under the request id, which is the
reply's "id" (one prompt) or "<id>-<i>" (several). This pure-ASGI wrapper rewrites the reply
that carries `usage`: the JSON body of an unstreamed reply (its Content-Length corrected), or
the usage chunk of a stream (`stream_options.include_usage`). Other bytes pass through as they
are, so streaming is not buffered.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from typing import Any

SSE_PREFIX = b"data: "


def cached_for(store: Mapping[str, int], reply_id: str) -> int | None:
    """Cached prompt tokens of the reply's request(s), or None if the engine reported none."""
    if reply_id in store:
        return store[reply_id]
    i, total = 0, None
    while f"{reply_id}-{i}" in store:
        total = (total or 0) + store[f"{reply_id}-{i}"]
        i += 1
    return total


def with_cached(body: dict[str, Any], store: Mapping[str, int]) -> dict[str, Any]:
    usage = body.get("usage")
    if isinstance(usage, dict) and isinstance(body.get("id"), str):
        cached = cached_for(store, body["id"])
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


class CachedTokensUsage:
    def __init__(self, app: Callable[..., Any], store: Callable[[], Mapping[str, int]]):
        self.app, self.store = app, store

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        parts: list[bytes] = []

        async def rewrite(message: dict[str, Any]) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if headers.get(b"content-type", b"").startswith(b"application/json"):
                    start = message  # held until the whole body is here: its length may change
                    return
            elif message["type"] == "http.response.body" and start is not None:
                parts.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                body = b"".join(parts)
                with contextlib.suppress(ValueError, AttributeError):  # not a JSON object: sent as it came
                    body = json.dumps(with_cached(json.loads(body), self.store())).encode()
                sent_headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
                sent_headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": sent_headers})
                await send({"type": "http.response.body", "body": body})
                return
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk.startswith(SSE_PREFIX) and b'"usage"' in chunk:
                    try:
                        event = json.loads(chunk[len(SSE_PREFIX):])
                        chunk = SSE_PREFIX + json.dumps(with_cached(event, self.store())).encode() + b"\n\n"
                        message = {**message, "body": chunk}
                    except ValueError:
                        pass
            await send(message)

        await self.app(scope, receive, rewrite)
