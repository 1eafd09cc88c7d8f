"""The Serve application: N engine replicas behind an ingress that serves our FastAPI routes.

    build_app(ClusterSpec(...)) -> a Serve Application; serve.run(app) deploys it

Two deployments:
  - "engine": EngineReplica (replica.py) x `replicas`, routed by KVBlockRequestRouter
    (request_router.py), each reporting its resident blocks every `report_interval_s`;
  - "ingress": create_app(ServedModel(engine=RemoteEngine(handle to "engine")), embedder) from
    server/app.py, unchanged, wrapped by the usage post-processor (usage.py). The embedding
    model (`embedding_model`, MiniLM by default) runs in the ingress itself, as in the
    one-process server: /v1/embeddings and /v1/models are the same. Serve's HTTP proxy streams
    its SSE replies. GET /cluster/stats adds the router's figures (JSON), GET /cluster/metrics
    its prediction accuracy and fault counters (Prometheus).
`start(spec, ray_address, host, port)` is what `scratchllm serve --replicas N` runs: a deploy that
fails is one line (the first replica's error, `DeployFailed`), SIGTERM a drained exit 0;
`app_builder(args)` is the entry point of a Serve config file (deploy/rayservice.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException

from scratchllm.cluster.ledger import VIEWS
from scratchllm.cluster.remote import RemoteEngine
from scratchllm.cluster.replica import EngineReplica, ReplicaSpec
from scratchllm.cluster.request_router import KVBlockRequestRouter
from scratchllm.cluster.router import STRATEGIES
from scratchllm.cluster.usage import CachedTokensUsage
from scratchllm.engine.validate import RequestLimits
from scratchllm.errors import ConfigError
from scratchllm.server.app import Drain, ServedEmbedder, ServedModel, ServerConfig, create_app

logger = logging.getLogger(__name__)
APP_NAME = "scratchllm"
# After the ingress has handed a response's last bytes to Serve's HTTP proxy, the proxy still has
# to write them to the client's socket; Serve's shutdown kills the proxy without waiting for that.
# Serve exposes no count of the proxy's open responses short of its node-drain protocol (which
# waits at least 30 s), so the drain gives it this long.
PROXY_FLUSH_S = 1.0


@dataclass(frozen=True)
class ClusterSpec:
    replicas: int = 2
    replica: ReplicaSpec = field(default_factory=ReplicaSpec)
    strategy: str = "prefix"  # or the baselines: round_robin, power_of_two
    served_model_name: str | None = None  # default: the model reference ("fake" for the fake engine)
    max_model_len: int | None = None  # default: the fake's 2048, or the model's context
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves (0 in tests sharing 2 cores)
    max_ongoing_requests: int = 64  # per replica; beyond it Serve queues in the router
    report_interval_s: float = 0.5  # how often each replica reports its blocks and load
    server: ServerConfig = field(default_factory=ServerConfig)
    # /v1/embeddings, served by the ingress: a model reference ("minilm"), or None for no embeddings;
    # with the fake engine any name serves the fake embedder, as `serve --fake-engine` does
    embedding_model: str | None = "minilm"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"routing strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        assert self.report_interval_s > 0 and self.replica_cpus >= 0


def _engine_options(spec: ClusterSpec) -> dict[str, Any]:
    options = dict(spec.replica.engine_options)
    if spec.max_model_len:
        options["max_model_len"] = spec.max_model_len
    return options


def replica_limits(spec: ClusterSpec) -> RequestLimits:
    """What the replicas' engines accept (engine/validate.py), read from the model's config only:
    the ingress holds no weights."""
    replica = spec.replica
    if replica.fake:
        from scratchllm.engine.fake import VOCAB_SIZE

        return RequestLimits(spec.max_model_len or replica.engine_options.get("max_model_len") or 2048, VOCAB_SIZE)
    from scratchllm.engine.load import engine_limits

    return engine_limits(replica.model, _engine_options(spec))


def _served_model(spec: ClusterSpec, engine_handle: Any) -> ServedModel:
    """The served model over a RemoteEngine that refuses what the replicas' engines would."""
    replica = spec.replica
    if replica.fake:
        from scratchllm.engine.fake import FakeTokenizer

        limits = replica_limits(spec)
        return ServedModel(spec.served_model_name or "fake", RemoteEngine(engine_handle, limits), FakeTokenizer(),
                           limits.max_model_len)
    from scratchllm.engine.load import load_frontend

    tokenizer, limits = load_frontend(replica.model, _engine_options(spec))  # the ingress holds no weights
    return ServedModel(spec.served_model_name or replica.model, RemoteEngine(engine_handle, limits), tokenizer,
                       limits.max_model_len)


def served_embedder(spec: ClusterSpec) -> ServedEmbedder | None:
    """The embedding model the ingress serves (None: no /v1/embeddings)."""
    if spec.embedding_model is None:
        return None
    if spec.replica.fake:
        from scratchllm.engine.fake import FakeTokenizer
        from scratchllm.server.backend import fake_embed

        return ServedEmbedder("fake-embed", fake_embed, FakeTokenizer(), max_len=512)  # as fake_backend's
    from scratchllm.server.backend import load_embedder

    return load_embedder(spec.embedding_model)


class Ingress:
    """The ingress deployment's class: the HTTP routes over RemoteEngine, and the embedder."""

    def __init__(self, engine_handle: Any, spec: ClusterSpec):
        self.spec = spec
        self.model = _served_model(spec, engine_handle)
        self.embedder = served_embedder(spec)
        assert isinstance(self.model.engine, RemoteEngine)
        self.engine = self.model.engine
        self.http_drain = Drain()  # the app's: counts the HTTP responses still being written

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.model, self.embedder, self.spec.server, drain=self.http_drain)

        @app.get("/cluster/stats")
        async def cluster_stats() -> dict[str, Any]:
            return {"requests": dict(self.engine.counts), "accuracy": self.engine.accuracy.summary(),
                    "routers": [view.snapshot() for view in VIEWS]}

        @app.get("/cluster/metrics")
        async def cluster_metrics() -> Response:
            return Response(_prometheus(self.engine), media_type="text/plain; version=0.0.4; charset=utf-8")

        return CachedTokensUsage(app, lambda: self.engine.cached_tokens)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503) and wait up to `timeout_s` for the open ones to end; returns
        how many are still open (the shutdown's first half: `start` calls it on SIGTERM).

        Open means either side: a request whose replica has sent its last event may still have
        events queued behind a slow HTTP send, so the engine's stream count alone reads 0 while
        the client has not got its answer; the app's drain gate counts responses until their
        last byte has been handed to Serve's proxy."""
        self.http_drain.start()
        self.engine.shutdown(drain=True)
        deadline = time.monotonic() + timeout_s
        while self._open() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._open()

    def _open(self) -> int:
        return max(self.engine.stats().running, self.http_drain.active)


ROUTER_TOTALS = ("requests", "predicted_hits", "actual_hits", "hit_agreement", "exact", "predicted_tokens",
                 "actual_tokens", "prompt_tokens")  # Accuracy's running totals (view.py)


def _prometheus(engine: RemoteEngine) -> bytes:
    """The router's prediction accuracy and the ingress's fault counters, in Prometheus text:
    running totals are counters (`..._total`), what holds now (open requests, replicas in the
    router's view) gauges."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector

    accuracy = engine.accuracy.summary()
    families: list[Metric] = []
    for key in ROUTER_TOTALS:
        families.append(CounterMetricFamily(f"scratchllm_router_{key}", f"router prediction accuracy: {key} "
                                            "(finished requests)", value=accuracy[key]))
    for key, value in engine.counts.items():
        families.append(CounterMetricFamily(f"scratchllm_cluster_{key}", f"ingress requests: {key}", value=value))
    families.append(GaugeMetricFamily("scratchllm_cluster_requests_open", "ingress requests open now (streams "
                                      "not yet ended)", value=engine.stats().running))
    replicas = {rid for view in VIEWS for rid in view.snapshot()["replicas"]}
    families.append(GaugeMetricFamily("scratchllm_router_replicas", "engine replicas in the router's view now",
                                      value=len(replicas)))

    class Families(Collector):
        def collect(self) -> list[Metric]:
            return families

    registry = CollectorRegistry()
    registry.register(Families())
    return generate_latest(registry)


CONSTRUCTOR_TRIES = 3  # replicas that fail to start before the deploy fails (Serve's default: 20)


def engine_deployment(spec: ClusterSpec) -> Any:
    router: dict[str, Any] = {"request_router_class": KVBlockRequestRouter,
                              "request_router_kwargs": {"strategy": spec.strategy},
                              "request_routing_stats_period_s": spec.report_interval_s,
                              "request_routing_stats_timeout_s": max(5.0, 4 * spec.report_interval_s)}
    return serve.deployment(
        name="engine", num_replicas=spec.replicas, ray_actor_options={"num_cpus": spec.replica_cpus},
        max_ongoing_requests=spec.max_ongoing_requests, request_router_config=RequestRouterConfig(**router),
        health_check_period_s=1.0, health_check_timeout_s=10.0,
        max_constructor_retry_count=CONSTRUCTOR_TRIES)(EngineReplica)


def build_app(spec: ClusterSpec) -> Any:
    """The Serve application (deploy it with serve.run(build_app(spec), name=..., route_prefix="/"))."""
    # Serve's default of 5 requests at once per replica would queue streams (and /health) in
    # the proxy: the ingress takes what the server admits, plus room for /health and /metrics.
    ingress = serve.deployment(
        name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=spec.server.max_in_flight + 16,
        max_constructor_retry_count=CONSTRUCTOR_TRIES)(serve.ingress()(Ingress))
    return ingress.bind(engine_deployment(spec).bind(spec.replica), spec)


BUILDER_ARGS = {"replicas", "model", "strategy", "served_model_name", "max_model_len", "replica_cpus",
                "max_ongoing_requests", "report_interval_s", "max_in_flight", "engine_options", "dtype",
                "embedding_model"}


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application-builder entry point (import_path scratchllm.cluster.app:app_builder in
    a Serve config or a KubeRay RayService): `args` is the config's `args` mapping."""
    unknown = set(args) - BUILDER_ARGS
    if unknown:
        raise ConfigError(f"unknown application args {sorted(unknown)}; known: {sorted(BUILDER_ARGS)}")
    replica = ReplicaSpec(str(args.get("model", "fake")), dict(args.get("engine_options") or {}),
                          dtype=str(args.get("dtype", "float32")))
    names = ("replicas", "strategy", "served_model_name", "max_model_len", "replica_cpus", "max_ongoing_requests",
             "report_interval_s")
    fields: dict[str, Any] = {k: args[k] for k in names if k in args}
    if "embedding_model" in args:
        fields["embedding_model"] = None if str(args["embedding_model"]) == "none" else str(args["embedding_model"])
    server = ServerConfig(max_in_flight=int(args.get("max_in_flight", 64)))
    return build_app(ClusterSpec(replica=replica, server=server, **fields))


class DeployFailed(ConfigError):
    """The application did not start: a replica's (or the ingress's) constructor failed."""


def deploy_error(message: str) -> str:
    """The replica's error in Serve's deployment status message, as one line. The message is a
    sentence, then the replica's traceback: its last unindented line is the exception raised in
    the constructor (`scratchllm.errors.FormatError: x.gguf: ...`), given without its module."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip() for line in message.splitlines()]
    lines = [line for line in lines if line.strip()]
    if not any(line.lstrip().startswith("File ") for line in lines):
        return lines[0] if lines else "no message"
    error = next(line for line in reversed(lines) if not line[0].isspace())
    name, sep, text = error.partition(": ")
    return f"{name.rsplit('.', 1)[-1]}: {text}" if sep and " " not in name else error


def _failure(app_name: str) -> str:
    """Why `app_name` failed to deploy: a failed deployment's error (the engine's first), one line."""
    from ray import serve

    status = serve.status().applications.get(app_name)
    if status is None:
        return "the application is gone"
    failed = sorted(status.deployments.items(), key=lambda kv: (kv[1].status != "DEPLOY_FAILED", kv[0] != "engine"))
    for name, deployment in failed:
        if deployment.message:
            return f"deployment '{name}': {deploy_error(deployment.message)}"
    return deploy_error(status.message)


class _Stop(BaseException):
    """SIGTERM or SIGINT arrived: shut down (drained)."""


def _stop(signum: int, frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second signal does not cut the shutdown short
    raise _Stop(signal.Signals(signum).name)


def _deployed_ingress() -> Any:
    """The ingress's handle if the application was deployed, else None. A signal can come while
    `serve.run` is still waiting for the last replica: the ingress may already be serving
    requests then (its /health answers before `serve.run` returns), and they must drain too."""
    try:
        return serve.get_app_handle(APP_NAME)
    except (RayServeException, RayError):  # no Serve controller yet, or no application: nothing was served
        return None


def _drain(ingress: Any, timeout_s: float, say: Any) -> int:
    """Drain the ingress (Ingress.drain), then give Serve's proxy PROXY_FLUSH_S to write what
    it holds; returns how many requests the drain timeout cut. An ingress that cannot be asked
    (it died, or never finished starting) is said in one line, and the shutdown goes on."""
    if ingress is None:
        return 0
    try:
        left = int(ingress.drain.remote(timeout_s).result(timeout_s=timeout_s + 30))
    except (RayError, TimeoutError) as err:
        print(f"scratchllm serve: the ingress could not be drained ({type(err).__name__}: {err}); "
              "shutting down", file=say, flush=True)
        return 0
    time.sleep(PROXY_FLUSH_S)
    return left


def start(spec: ClusterSpec, ray_address: str | None, host: str, port: int) -> None:
    """Join the Ray cluster at `ray_address` (or start a local one) and serve until SIGTERM or
    Ctrl-C: then new requests get 503, the open ones run to their end (up to the drain timeout),
    and Serve and Ray shut down; the replicas' own logs stay in Ray's session folder."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(signum, _stop)
    say, ingress = sys.stderr, None
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            ingress = serve.run(build_app(spec), name=APP_NAME, route_prefix="/")
        except RuntimeError as err:
            if "failed" not in str(err):
                raise
            raise DeployFailed(f"the cluster did not start: {_failure(APP_NAME)}") from None
        print(f"scratchllm serve: ready, {spec.replicas} replicas (SIGTERM or Ctrl-C stops it)", file=say,
              flush=True)
        while True:
            time.sleep(3600)
    except _Stop as stop:
        print(f"scratchllm serve: {stop}: draining (up to {spec.server.drain_timeout_s:g} s), then shutting down",
              file=say, flush=True)
        left = _drain(ingress or _deployed_ingress(), spec.server.drain_timeout_s, say)
        print(f"scratchllm serve: stopped ({left} requests cut by the drain timeout)" if left else
              "scratchllm serve: stopped (drained)", file=say, flush=True)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        serve.shutdown()
        ray.shutdown()
