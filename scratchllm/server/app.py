"""The FastAPI app: routes, admission control, body limits and OpenAI-style errors.

`create_app(model, embedder=None, config=ServerConfig())` takes a ServedModel whose engine is
an EngineClient (engine/protocol.py), not a model path: the continuous engine, the static
baseline or the fake engine plug in the same way (server/backend.py builds them). Several
models: `create_app(registry, config=...)` with a ModelRegistry (server/registry.py), which
loads each on first use and unloads it when idle; every route gets its model from the registry
by the request's `model` name (`request.app.state.models`). Layout:
uvicorn's event loop owns every socket, parses, tokenizes and streams; the engine steps in its
own thread and wakes the loop once per event (no thread per request).

Drain (SIGTERM, driven by cli/serve_cmd.py): `Drain.start()` turns every new request away with
503 + Retry-After + Connection: close while the listening socket stays open (a load balancer
still routing here gets an answer it can retry elsewhere, not a refused connection), /health
answers 503 too, /metrics is still served, and the requests already in flight run to their end.
`Drain.cut()` ends those that are left: a stream gets an SSE error event, a reply not yet
started a 503; either way the request's generation is closed and its KV blocks freed.
"""

import asyncio
import atexit
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scratchllm.engine.protocol import EngineClient
from scratchllm.server import access, chat_page, openapi, profiles, routes
from scratchllm.server.batch_runner import BatchRunner
from scratchllm.server.batch_store import BatchStore
from scratchllm.server.metrics import MetricFamilies, ServerMetrics
from scratchllm.server.protocol import APIError
from scratchllm.server.registry import ModelLeases, ModelRegistry
from scratchllm.server.sse import sse
from scratchllm.server.state import Capture, RequestClassMap, ServedEmbedder, ServedModel, ServerConfig, ServerState
from scratchllm.trace.writer import TraceWriter

# create_app's arguments, defined in state.py, are imported from here as well
__all__ = ["create_app", "ServedModel", "ServedEmbedder", "ServerConfig", "ModelRegistry"]

logger = logging.getLogger(__name__)
DEFAULT_CONFIG = ServerConfig()  # frozen: one shared default


async def _report_stats(registry: ModelRegistry, interval_s: float) -> None:
    """Every interval_s, while tokens flow: one INFO line per loaded model of throughput, queue and KV use."""
    last: dict[str, tuple[int, float]] = {}
    several = len(registry.names("generate")) > 1
    while True:
        await asyncio.sleep(interval_s)
        for entry in registry.models():
            state = entry.state
            if state is None:
                continue
            now, tokens = time.monotonic(), state.metrics.tokens_out
            last_tokens, then = last.get(entry.name, (0, now - interval_s))
            last[entry.name] = (tokens, now)
            if tokens == last_tokens or state.served is None or not logger.isEnabledFor(logging.INFO):
                continue
            stats = state.served.engine.stats()
            used, total = stats.kv_blocks_used or 0, stats.kv_blocks_total or 0
            logger.info("%sgeneration %.1f tok/s, running %d, waiting %d, in flight %d, KV %.1f%%",
                        f"{entry.name}: " if several else "", (tokens - last_tokens) / (now - then),
                        stats.running, stats.waiting, state.metrics.in_flight, 100.0 * used / total if total else 0.0)


class BodyLimit:
    """Pure ASGI: refuse a body over the limit from its Content-Length, or while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not routes.body_limited(scope["path"]):
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"request body is larger than {self.max_bytes} bytes", code="body_too_large")
        for key, value in scope["headers"]:
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                response = JSONResponse(too_large.body(), status_code=413, headers={"Connection": "close"})
                return await response(scope, receive, send)
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_large  # turned into a 413 by the APIError handler
            return message

        await self.app(scope, limited_receive, send)


DRAIN_RETRY_AFTER_S = 2  # what a request turned away by a draining server is told
SHUTTING_DOWN = "the server is shutting down"


class Drain:
    """The drain's state, shared by the server loop that starts and cuts it and the DrainGate
    middleware that acts on it. Touched only on the event loop's thread (a signal handler only
    sets flags that the loop reads)."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # requests the gate let in that have not finished
        self.refused = 0  # requests turned away with 503 while draining
        self.cut_requests = 0  # requests ended by cut()
        self._was_cut = False
        # made on the loop that first waits: an app may be served by one event loop after another
        # (tests, TestClient), and an asyncio.Event belongs to the first loop that waits on it
        self._cut: asyncio.Event | None = None
        self._cut_loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.draining = True

    def cut(self) -> None:
        """End every request still in flight (the drain's deadline, or a second signal)."""
        self.draining = True
        self._was_cut = True
        if self._cut is not None:
            self._cut.set()

    async def wait_cut(self) -> None:
        loop = asyncio.get_running_loop()
        if self._cut is None or self._cut_loop is not loop:
            self._cut, self._cut_loop = asyncio.Event(), loop
            if self._was_cut:
                self._cut.set()
        await self._cut.wait()

    @property
    def was_cut(self) -> bool:
        return self._was_cut

    @property
    def idle(self) -> bool:
        return self.active == 0


class DrainGate:
    """Pure ASGI, outside the routes: counts the requests in flight, refuses new ones while
    draining, and ends the ones in flight when the drain is cut."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        drain = self.drain
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if drain.draining and scope["path"] != "/metrics":
            drain.refused += 1
            refused = APIError(503, f"{SHUTTING_DOWN}; retry (another replica, or this one once restarted)",
                               type="server_error", code="shutting_down")
            response = JSONResponse(refused.body(), status_code=503,
                                    headers={"Retry-After": str(DRAIN_RETRY_AFTER_S), "Connection": "close"})
            return await response(scope, receive, send)
        sent: list[Message] = []  # the response's start message, then its last body message

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start" or not message.get("more_body", False):
                sent.append(message)
            await send(message)

        drain.active += 1
        handler = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        cut = asyncio.ensure_future(drain.wait_cut())
        try:
            await asyncio.wait({handler, cut}, return_when=asyncio.FIRST_COMPLETED)
            if handler.done():
                return handler.result()
            drain.cut_requests += 1
            handler.cancel()  # its finally blocks close the generation: the engine aborts it
            with contextlib.suppress(asyncio.CancelledError):
                await handler
            await _cut_response(sent, send)
        finally:
            drain.active -= 1
            cut.cancel()
            if not handler.done():  # this task itself was cancelled (the ASGI server gave up on it)
                handler.cancel()


async def _cut_response(sent: list[Message], send: Send) -> None:
    """The end of a response cut by the drain: an SSE error event for a stream, a 503 for a
    reply not yet begun, nothing for one already whole (any other begun body just ends: its
    connection is closed). `sent`: the response's start message and last body message so far."""
    error = APIError(503, f"{SHUTTING_DOWN}: the request was cut before it finished", type="server_error",
                     code="shutting_down")
    if len(sent) > 1:
        return
    if not sent:
        body = JSONResponse(error.body()).body
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(DRAIN_RETRY_AFTER_S).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
        return
    content_type = dict(sent[0].get("headers", [])).get(b"content-type", b"")
    if content_type.startswith(b"text/event-stream"):
        await send({"type": "http.response.body", "body": sse(error.body()), "more_body": False})


def _temporary_folder() -> Path:
    """A folder for an app's batches when nothing is to persist (tests, embedded apps): gone at exit."""
    folder = tempfile.mkdtemp(prefix="scratchllm-batches-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder)


def create_app(model: ServedModel | ModelRegistry, embedder: ServedEmbedder | None = None,
               config: ServerConfig = DEFAULT_CONFIG, trace: TraceWriter | None = None, otlp: Any = None,
               capture: Capture | None = None, classes: RequestClassMap | None = None,
               drain: Drain | None = None) -> FastAPI:
    """The app. `model`: one loaded model (and `embedder`), or a ModelRegistry of several, loaded
    on demand; `trace`: the ring the engines write (the server adds serialize and network-send
    spans per streamed chunk); `otlp`: a tracer for one OpenTelemetry span per request;
    `capture`: where a sample of requests goes for the evaluation loop; `classes`: the map of
    request ids to classes that the engine's priority feedback hook reads; `drain`: the SIGTERM
    drain's state (app.state.drain; a new one if not given)."""
    if isinstance(model, ModelRegistry):
        assert embedder is None, "a registry's embedders are among its models"
        registry = model
    else:
        assert isinstance(model.engine, EngineClient), f"{type(model.engine).__name__} is not an EngineClient"
        registry = ModelRegistry.serving(model, embedder)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reporter = asyncio.ensure_future(_report_stats(registry, config.stats_interval_s))
        unloader = asyncio.ensure_future(registry.run_unloader())
        batches = asyncio.ensure_future(app.state.batch_runner.run_forever())  # resumes unfinished batches
        yield
        reporter.cancel()
        unloader.cancel()
        batches.cancel()
        # uvicorn has already waited for in-flight requests (SIGTERM drain); finish the engines' too.
        await registry.shutdown()

    families = MetricFamilies(config.metrics_prefix)

    def make_state(metrics: ServerMetrics) -> ServerState:
        return ServerState(None, config, metrics, trace=trace, otlp=otlp, capture=capture, classes=classes)

    registry.bind(config, families, make_state)
    profiles.load_profiles(registry)  # a served name of the user's adds what it adds (server/profiles.py)
    app = FastAPI(title="scratchllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.models = registry
    # the first generation model's state, for code that serves one model (tests, the cluster's ingress)
    generators = registry.names("generate")
    app.state.server = registry.entry(generators[0]).state if generators else None
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.state.drain = drain = drain or Drain()
    # the Batch API: its jobs (batch_store.py) and the worker that runs them through this app
    app.state.batches = BatchStore(Path(config.batch_dir) if config.batch_dir else _temporary_folder())
    app.state.batch_endpoints = routes.BATCHABLE
    app.state.batch_runner = BatchRunner(app.state.batches, app, config.api_key, config.batch_concurrency,
                                         lambda: sum(e.metrics.in_flight for e in registry.models()))

    def error(request: Request, err: APIError) -> JSONResponse:
        """The error in its path's shape (OpenAI's; Ollama's `{"error": "..."}` under /api/)."""
        body = routes.error_shape(request.url.path)(err)
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return error(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if err.status_code == 404 else "invalid_request_error"
        return error(request, APIError(err.status_code, str(err.detail), type=kind,
                                       headers=getattr(err, "headers", None)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        return error(request, APIError(500, f"internal error: {type(err).__name__}", type="server_error"))

    # response_model=None on every route: FastAPI would otherwise turn a handler's return annotation
    # into a response model (validating and re-serializing each reply, and changing /openapi.json).
    # The annotations are for the type checker; replies go out exactly as the handlers build them.
    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any]:
        return {"status": "ok", "in_flight": sum(e.metrics.in_flight for e in registry.models())}

    @app.get("/metrics", response_model=None)
    async def prometheus() -> Response:
        return Response(families.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # The API's endpoints, one row each in server/routes.py; each handler gets its model from the
    # registry by name.
    for route in routes.ROUTES:
        extra = openapi.request_body(route.body) if route.body is not None and route.in_schema else None
        app.add_api_route(route.path, route.handler, methods=[route.method], response_model=None,
                          include_in_schema=route.in_schema, openapi_extra=extra)
    openapi.install(app, [r.body for r in routes.ROUTES if r.body is not None and r.in_schema])
    chat_page.install(app)  # GET /: the chat page
    app.add_middleware(ModelLeases, registry=registry)  # a request holds its models until its response ends
    app.add_middleware(DrainGate, drain=drain)  # outside the routes and the body limit, inside the access layer
    return access.wrap(app, config.api_key, config.allowed_origins, routes.needs_key, routes.error_shape)
