"""Who may call the server, from where, and what each call did: the API key, CORS and the
access log, as ASGI middleware around the app.

- API key (`serve --api-key` or SCRATCHLLM_API_KEY): every API route (the route table,
  server/routes.py, says which are keyless: the version probes) and any other path under /v1/ or
  /api/ need `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`); compared in
  constant time (hmac.compare_digest), so the comparison's time says nothing about how much of a
  guess was right. A missing or wrong key is a 401 in the path's error shape: OpenAI's, which
  the official client raises as AuthenticationError (under /api/, Ollama's `{"error": "..."}`).
  /health, /metrics and /version stay open (probes and scrapers carry no keys).
- CORS (`--allowed-origins`): Starlette's middleware; a preflight from a listed origin gets the
  allow headers, any other origin gets none, which a browser treats as a refusal.
- Access log: one INFO line per request (method, path, status, milliseconds, client).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from scratchllm.server.protocol import APIError

logger = logging.getLogger("scratchllm.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ErrorShape = Callable[[APIError], dict[str, Any]]


class APIKey:
    """Refuse requests without the key (see the module doc). `needs_key` and `error_shape` say,
    for a path, whether the key guards it and the body its error gets (server/routes.py)."""

    def __init__(self, app: ASGIApp, api_key: str, needs_key: Callable[[str], bool],
                 error_shape: Callable[[str], ErrorShape]):
        assert api_key, "an empty API key would accept everything"
        self.app, self.expected, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()
        self.needs_key, self.error_shape = needs_key, error_shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self.needs_key(scope["path"]):
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        header = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")  # Anthropic's clients send this
        # both compared, so the time taken does not tell which header was there
        if hmac.compare_digest(given, self.expected) | hmac.compare_digest(header, self.key):
            return await self.app(scope, receive, send)
        what = "No API key provided" if not (given or header) else "Incorrect API key provided"
        err = APIError(401, f"{what}: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') with the key this "
                            "server was started with", code="invalid_api_key")
        body = self.error_shape(scope["path"])(err)
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class AccessLog:
    """One INFO line per HTTP request, when it ends."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not logger.isEnabledFor(logging.INFO):
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            client = scope.get("client") or ("-", 0)
            logger.info("%s %s %d %.1f ms %s", scope["method"], scope["path"], status,
                        (time.perf_counter() - start) * 1e3, client[0])


def client_ip(peer: str | None, forwarded_for: str | None = None, trusted_proxies: int = 0) -> str | None:
    """The client's address. `peer` is the socket's; X-Forwarded-For counts only with
    `trusted_proxies` > 0 (each trusted proxy appends the address it saw, so the N-th from the
    right was seen by the outermost trusted one; anything left of it the client could forge)."""
    if trusted_proxies <= 0 or not forwarded_for:
        return peer
    hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
    return hops[-trusted_proxies] if len(hops) >= trusted_proxies else (hops[0] if hops else peer)


def wrap(app: FastAPI, api_key: str | None, allowed_origins: Sequence[str], needs_key: Callable[[str], bool],
         error_shape: Callable[[str], ErrorShape]) -> FastAPI:
    """The app with its access middleware, outermost first: CORS (so a preflight never needs the
    key), the log (so refusals are logged too), the key. Starlette puts the last added outermost."""
    if api_key:
        app.add_middleware(APIKey, api_key=api_key, needs_key=needs_key, error_shape=error_shape)
    app.add_middleware(AccessLog)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app
