"""The server's state: what it serves (ServedModel, ServedEmbedder), its options (ServerConfig)
and one ServerState per generation model (its admission slots, metrics and grammar compiler, and
the trace, the capture and the feedback map the app shares). The model registry (registry.py)
makes one per model and hands it to the handlers (generation.py, chat.py, completions.py,
utility.py, ollama.py) when they ask for a model by name; `request.app.state.server` is the
first model's, for code that serves one.
"""

import logging
import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from scratchllm.engine.protocol import EngineClient
from scratchllm.errors import ConfigError
from scratchllm.models.protocol import Embed
from scratchllm.server.metrics import ServerMetrics
from scratchllm.server.protocol import MIN_RETRY_AFTER_S, APIError
from scratchllm.structured import GrammarCompiler
from scratchllm.tokenizer.guidance import llg_tokenizer
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
               finish_reason: str | None = ..., translated_from: str | None = ...) -> None: ...


class RequestClassMap(Protocol):
    """Request id -> request class, kept while a request is in the engine, so the priority
    feedback hook (scratchllm.evaluate.feedback) can read a queued request's class."""

    def remember(self, request_id: str, body: dict[str, Any]) -> str: ...

    def forget(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ServerConfig:
    max_in_flight: int = 64  # requests one model's engine holds at once (running + waiting); beyond -> 429
    max_body_bytes: int = 1 << 20  # larger bodies -> 413 before they are read
    drain_timeout_s: float = 60.0
    api_key: str | None = None  # /v1 routes need "Authorization: Bearer <key>" (access.py)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API
    stats_interval_s: float = 10.0  # a throughput/queue line at INFO this often while there is traffic
    metrics_prefix: str = "scratchllm:"  # "vllm:" exports exactly vLLM's metric names (metrics.py)
    trusted_proxies: int = 0  # X-Forwarded-For hops to trust for the client address (capture only)
    lenient_fields: bool = False  # unknown request fields logged and ignored instead of a 400 (protocol.py)
    sse_ping_interval_s: float = 15.0  # a `: ping` comment on a stream this long without a chunk; 0 = off
    tool_call_parser: str = "auto"  # the format of auto-mode tool calls (server/tool_parsers.py); auto: the template's
    batch_dir: str | None = None  # where Batch API jobs persist (batch_store.py); None: a folder for this app only
    batch_concurrency: int = 4  # a batch's lines in the server at once (each in the engine's low-priority queue)

    def __post_init__(self) -> None:
        assert self.max_in_flight >= 1 and self.max_body_bytes >= 1 and self.sse_ping_interval_s >= 0
        assert self.batch_concurrency >= 1


@dataclass
class ServerState:
    """One generation model's state in the server. `served` is the loaded model, None while the
    registry has it unloaded; the state itself (metrics, admission) lives as long as the app."""

    served: ServedModel | None
    config: ServerConfig
    metrics: ServerMetrics
    recent_e2e_s: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    trace: TraceWriter | None = None  # the ring the server adds each streamed chunk's spans to
    otlp: Any = None  # an OpenTelemetry tracer: one span per finished request (trace/otlp.py)
    capture: Capture | None = None  # a sample of requests and responses to JSONL (evaluate/capture.py)
    classes: RequestClassMap | None = None  # request id -> class, for the priority feedback hook
    # structured output's GrammarCompiler for the served tokenizer, built on first use; None when
    # the tokenizer cannot feed llguidance (then constrained requests are a 400)
    _compiler: Any = None
    _compiler_built: bool = False
    _compiler_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def model(self) -> ServedModel:
        """The loaded model. Handlers get this state from the registry, which loads the model
        first and keeps it loaded until their response ends."""
        if self.served is None:
            raise APIError(503, f"the model '{self.metrics.model_name}' is not loaded", type="server_error",
                           code="model_not_loaded")
        return self.served

    def detach(self) -> ServedModel | None:
        """Forget the loaded model (the registry unloads it): its compiler goes with it."""
        served, self.served = self.served, None
        with self._compiler_lock:
            self._compiler, self._compiler_built = None, False
        return served

    def grammar_compiler(self) -> Any:
        """The app's one GrammarCompiler (blocking: its vocabulary trie takes about a second)."""
        with self._compiler_lock:
            if not self._compiler_built:
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
