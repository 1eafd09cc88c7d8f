"""The FastAPI app: routes, admission control, body limits and OpenAI-style errors.

`create_app(model, embedder=None, config=ServerConfig())` takes a ServedModel whose engine is
an EngineClient (engine/protocol.py), not a model path: the continuous engine, the static
baseline or the fake engine plug in the same way (server/backend.py builds them). Layout:
uvicorn's event loop owns every socket, parses, tokenizes and streams; the engine steps in its
own thread and wakes the loop once per event (no thread per request).
"""

import asyncio
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scratchllm.engine.protocol import EngineClient
from scratchllm.errors import ConfigError
from scratchllm.models.protocol import Embed
from scratchllm.server.metrics import ServerMetrics
from scratchllm.server.protocol import MIN_RETRY_AFTER_S, APIError
from scratchllm.tokenizer.protocol import TokenizerLike
from scratchllm.trace.writer import TraceWriter

logger = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """A generation backend: what the server needs of it, nothing more."""

    name: str  # the id clients send as "model" and see in /v1/models
    engine: EngineClient
    tokenizer: TokenizerLike
    max_model_len: int  # prompt + completion tokens may not exceed this
    aliases: tuple[str, ...] = ()


@dataclass
class ServedEmbedder:
    name: str
    embed: Embed  # (input_ids [B, T] int64, attention_mask [B, T]) -> [B, hidden] float32, L2-normalized
    tokenizer: TokenizerLike
    max_len: int
    aliases: tuple[str, ...] = ()


class Capture(Protocol):
    """What the server needs of the evaluation loop's capture (scratchllm.evaluate.capture):
    a deterministic sample decision on the body as sent, and one appended record per response."""

    def should_capture(self, body: bytes) -> bool: ...

    def record(self, body: bytes, model: str | None, client_ip: str | None, response_token_ids: list[int] | None,
               timings: dict[str, Any] | None, *, endpoint: str = ..., response_text: str | None = ...,
               finish_reason: str | None = ...) -> None: ...


class RequestClassMap(Protocol):
    """Request id -> request class, kept while a request is in the engine, so the priority
    feedback hook (scratchllm.evaluate.feedback) can read a queued request's class."""

    def remember(self, request_id: str, body: dict[str, Any]) -> str: ...

    def forget(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ServerConfig:
    max_in_flight: int = 64  # requests held in the engine at once (running + waiting); beyond -> 429
    max_body_bytes: int = 1 << 20  # larger bodies -> 413 before they are read
    drain_timeout_s: float = 60.0
    api_key: str | None = None  # /v1 routes need "Authorization: Bearer <key>" (access.py)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API
    stats_interval_s: float = 10.0  # a throughput/queue line at INFO this often while there is traffic
    metrics_prefix: str = "scratchllm:"  # "vllm:" exports exactly vLLM's metric names (metrics.py)
    trusted_proxies: int = 0  # X-Forwarded-For hops to trust for the client address (capture only)

    def __post_init__(self) -> None:
        assert self.max_in_flight >= 1 and self.max_body_bytes >= 1


@dataclass
class ServerState:
    model: ServedModel
    embedder: ServedEmbedder | None
    config: ServerConfig
    metrics: ServerMetrics
    recent_e2e_s: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    embed_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    trace: TraceWriter | None = None  # the ring the server adds each streamed chunk's spans to
    otlp: Any = None  # an OpenTelemetry tracer: one span per finished request (trace/otlp.py)
    capture: Capture | None = None  # a sample of requests and responses to JSONL (evaluate/capture.py)
    classes: RequestClassMap | None = None  # request id -> class, for the priority feedback hook
    # structured output's GrammarCompiler for the served tokenizer, built on first use; None when
    # the tokenizer cannot feed llguidance (then constrained requests are a 400)
    _compiler: Any = None
    _compiler_built: bool = False
    _compiler_lock: threading.Lock = field(default_factory=threading.Lock)

    def grammar_compiler(self) -> Any:
        """The app's one GrammarCompiler (blocking: its vocabulary trie takes about a second)."""
        with self._compiler_lock:
            if not self._compiler_built:
                from scratchllm.structured import GrammarCompiler
                from scratchllm.tokenizer.guidance import llg_tokenizer

                try:
                    llg_tokenizer(self.model.tokenizer)
                    self._compiler = GrammarCompiler(self.model.tokenizer)
                except ConfigError as err:
                    logger.info("structured output is off for this model: %s", err)
                self._compiler_built = True
            return self._compiler

    def admit(self, n: int = 1) -> None:
        """Reserve n engine slots or refuse with 429. The loop is single-threaded: no lock needed."""
        if self.metrics.in_flight + n > self.config.max_in_flight:
            self.metrics.rejected("queue_full")
            raise APIError(429, f"server is at capacity ({self.config.max_in_flight} requests in flight); "
                           "retry later", type="rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": str(self.retry_after_s())})
        self.metrics.in_flight += n

    def release(self, n: int = 1) -> None:
        self.metrics.in_flight -= n
        assert self.metrics.in_flight >= 0, "released more slots than were admitted"

    def retry_after_s(self) -> int:
        """About one typical request's lifetime: by then a slot has most likely opened."""
        typical = statistics.median(self.recent_e2e_s) if self.recent_e2e_s else 1.0
        return max(MIN_RETRY_AFTER_S, math.ceil(typical))

    def check_model(self, name: str, embedding: bool = False) -> None:
        served = self.embedder if embedding else self.model
        if served is None or name not in (served.name, *served.aliases):
            kind = "embedding model" if embedding else "model"
            have = f"'{served.name}'" if served else "none"
            raise APIError(404, f"The {kind} '{name}' does not exist (this server has {have})",
                           param="model", code="model_not_found")


async def _report_stats(state: ServerState) -> None:
    """Every stats_interval_s, while tokens flow: one INFO line of throughput, queue and KV use."""
    last_tokens, last = state.metrics.tokens_out, time.monotonic()
    while True:
        await asyncio.sleep(state.config.stats_interval_s)
        now, tokens = time.monotonic(), state.metrics.tokens_out
        if tokens != last_tokens and logger.isEnabledFor(logging.INFO):
            stats = state.model.engine.stats()
            used, total = stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total") or 0
            logger.info("generation %.1f tok/s, running %s, waiting %s, in flight %d, KV %.1f%%",
                        (tokens - last_tokens) / (now - last), stats.get("running", "-"), stats.get("waiting", "-"),
                        state.metrics.in_flight, 100.0 * used / total if total else 0.0)
        last_tokens, last = tokens, now


class BodyLimit:
    """Pure ASGI: refuse a body over the limit from its Content-Length, or while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
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


def create_app(model: ServedModel, embedder: ServedEmbedder | None = None,
               config: ServerConfig = ServerConfig(), trace: TraceWriter | None = None, otlp: Any = None,
               capture: Capture | None = None, classes: RequestClassMap | None = None) -> FastAPI:
    """The app. `trace`: the ring the engine writes (the server adds serialize and network-send
    spans per streamed chunk); `otlp`: a tracer for one OpenTelemetry span per request;
    `capture`: where a sample of requests goes for the evaluation loop; `classes`: the map of
    request ids to classes that the engine's priority feedback hook reads."""
    from scratchllm.server import access, chat, completions, embeddings, openapi, utility

    assert isinstance(model.engine, EngineClient), f"{type(model.engine).__name__} is not an EngineClient"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reporter = asyncio.ensure_future(_report_stats(app.state.server))
        yield
        reporter.cancel()
        # uvicorn has already waited for in-flight requests (SIGTERM drain); finish the engine's too.
        await asyncio.to_thread(model.engine.shutdown, True)

    metrics = ServerMetrics(model.engine.stats, model.name, config.metrics_prefix)
    app = FastAPI(title="scratchllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = ServerState(model, embedder, config, metrics, trace=trace, otlp=otlp, capture=capture,
                                   classes=classes)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if err.status_code == 404 else "invalid_request_error"
        body = APIError(err.status_code, str(err.detail), type=kind).body()
        return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        body = APIError(500, f"internal error: {type(err).__name__}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    # response_model=None on every route: FastAPI would otherwise turn a handler's return annotation
    # into a response model (validating and re-serializing each reply, and changing /openapi.json).
    # The annotations are for the type checker; replies go out exactly as the handlers build them.
    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any]:
        return {"status": "ok", "in_flight": metrics.in_flight}

    @app.get("/metrics", response_model=None)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=None)
    async def models() -> dict[str, Any]:
        served = [model] + ([embedder] if embedder else [])
        return {"object": "list", "data": [utility.model_card(m) for m in served]}

    app.get("/v1/models/{model_id}", response_model=None)(utility.model)
    app.post("/tokenize", response_model=None)(utility.tokenize)
    app.post("/detokenize", response_model=None)(utility.detokenize)
    app.get("/version", response_model=None)(utility.version)

    for path, handler in (("/v1/completions", completions.completions), ("/v1/chat/completions", chat.chat_completions),
                          ("/v1/embeddings", embeddings.create_embeddings)):
        app.post(path, response_model=None, openapi_extra=openapi.request_body(openapi.BODIES[path]))(handler)
    openapi.install(app)
    return access.wrap(app, config.api_key, config.allowed_origins)
