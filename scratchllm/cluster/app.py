"""The Serve application: N engine replicas behind an ingress that serves our FastAPI routes.

    build_app(ClusterSpec(...)) -> a Serve Application; serve.run(app) deploys it

Two deployments:
  - "engine": EngineReplica (replica.py) x `replicas`, routed by KVBlockRequestRouter
    (request_router.py), each reporting its resident blocks every `report_interval_s`;
  - "ingress": create_app(ServedModel(engine=RemoteEngine(handle to "engine"))) from
    server/app.py, unchanged, wrapped by the usage post-processor (usage.py). Serve's HTTP proxy
    streams its SSE replies. GET /cluster/stats adds the router's figures (JSON), GET
    /cluster/metrics its prediction accuracy and fault counters (Prometheus).
`start(spec, ray_address, host, port)` is what `scratchllm serve --replicas N` runs;
`app_builder(args)` is the entry point of a Serve config file (deploy/rayservice.yaml).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response
from ray import serve
from ray.serve.config import RequestRouterConfig

from scratchllm.cluster.ledger import VIEWS
from scratchllm.cluster.remote import RemoteEngine
from scratchllm.cluster.replica import EngineReplica, ReplicaSpec
from scratchllm.cluster.request_router import KVBlockRequestRouter
from scratchllm.cluster.router import STRATEGIES
from scratchllm.cluster.usage import CachedTokensUsage
from scratchllm.engine.validate import RequestLimits
from scratchllm.errors import ConfigError
from scratchllm.server.app import ServedModel, ServerConfig, create_app

logger = logging.getLogger(__name__)
APP_NAME = "scratchllm"


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


class Ingress:
    """The ingress deployment's class: the HTTP routes over RemoteEngine."""

    def __init__(self, engine_handle: Any, spec: ClusterSpec):
        self.spec = spec
        self.model = _served_model(spec, engine_handle)
        assert isinstance(self.model.engine, RemoteEngine)
        self.engine = self.model.engine

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.model, None, self.spec.server)

        @app.get("/cluster/stats")
        async def cluster_stats() -> dict[str, Any]:
            return {"requests": dict(self.engine.counts), "accuracy": self.engine.accuracy.summary(),
                    "routers": [view.snapshot() for view in VIEWS]}

        @app.get("/cluster/metrics")
        async def cluster_metrics() -> Response:
            return Response(_prometheus(self.engine), media_type="text/plain; version=0.0.4; charset=utf-8")

        return CachedTokensUsage(app, lambda: self.engine.cached_tokens)


def _prometheus(engine: RemoteEngine) -> bytes:
    """The router's prediction accuracy and the ingress's fault counters, in Prometheus text."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    accuracy = engine.accuracy.summary()
    for key in ("requests", "predicted_hits", "actual_hits", "hit_agreement", "exact", "predicted_tokens",
                "actual_tokens", "prompt_tokens"):
        Gauge(f"scratchllm_router_{key}", f"router prediction accuracy: {key} (finished requests)",
              registry=registry).set(accuracy[key])
    for key, value in engine.counts.items():
        Gauge(f"scratchllm_cluster_{key}", f"ingress requests: {key}", registry=registry).set(value)
    return generate_latest(registry)


def engine_deployment(spec: ClusterSpec) -> Any:
    router = RequestRouterConfig(request_router_class=KVBlockRequestRouter,
                                 request_router_kwargs={"strategy": spec.strategy},
                                 request_routing_stats_period_s=spec.report_interval_s,
                                 request_routing_stats_timeout_s=max(5.0, 4 * spec.report_interval_s))
    return serve.deployment(EngineReplica, name="engine").options(
        num_replicas=spec.replicas, ray_actor_options={"num_cpus": spec.replica_cpus},
        max_ongoing_requests=spec.max_ongoing_requests, request_router_config=router,
        health_check_period_s=1.0, health_check_timeout_s=10.0)


def build_app(spec: ClusterSpec) -> Any:
    """The Serve application (deploy it with serve.run(build_app(spec), name=..., route_prefix="/"))."""
    # Serve's default of 5 requests at once per replica would queue streams (and /health) in
    # the proxy: the ingress takes what the server admits, plus room for /health and /metrics.
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=spec.server.max_in_flight + 16)
    return ingress.bind(engine_deployment(spec).bind(spec.replica), spec)


BUILDER_ARGS = {"replicas", "model", "strategy", "served_model_name", "max_model_len", "replica_cpus",
                "max_ongoing_requests", "report_interval_s", "max_in_flight", "engine_options", "dtype"}


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application-builder entry point (import_path scratchllm.cluster.app:app_builder in
    a Serve config or a KubeRay RayService): `args` is the config's `args` mapping."""
    unknown = set(args) - BUILDER_ARGS
    if unknown:
        raise ConfigError(f"unknown application args {sorted(unknown)}; known: {sorted(BUILDER_ARGS)}")
    replica = ReplicaSpec(str(args.get("model", "fake")), dict(args.get("engine_options") or {}),
                          dtype=str(args.get("dtype", "float32")))
    fields = {k: args[k] for k in ("replicas", "strategy", "served_model_name", "max_model_len", "replica_cpus",
                                   "max_ongoing_requests", "report_interval_s") if k in args}
    server = ServerConfig(max_in_flight=int(args.get("max_in_flight", 64)))
    return build_app(ClusterSpec(replica=replica, server=server, **fields))


def start(spec: ClusterSpec, ray_address: str | None, host: str, port: int) -> None:
    """Join the Ray cluster at `ray_address` (or start a local one) and serve until interrupted."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(spec), name=APP_NAME, route_prefix="/", blocking=True)
