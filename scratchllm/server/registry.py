"""The models one server serves, by name: where every route gets "the engine of model X".

Each served model is an entry: a ModelSpec (its name and aliases, its task, how to load it, its
share of the memory plan) and its state. A route asks `await registry.generator(request, name)`
(a ServerState: the loaded model, its admission slots and metrics) or `embedder(request, name)`;
a name the server does not serve is a 404 that lists the ones it does.

    unloaded --first request--> loading --loaded--> loaded --idle past its keep-alive--> unloaded
                                   `--the load failed: a 503 to every request waiting on it--> unloaded

Invariants (asserted where they could break):
- A model is loaded at most once at a time: the first request that finds it unloaded starts the
  load (one task per entry) and every request arriving meanwhile awaits that same task.
- A model in use is never unloaded: `users` counts the HTTP requests holding a lease on it, from
  the route's acquire to the response's last byte (queued, prefilling or streaming), and only an
  entry with no user, idle past its keep-alive, is unloaded. The lease is released by the
  ModelLeases middleware however the response ends (done, client gone, drain cut, error).
- Only the event loop's thread changes an entry; the load and the engine's shutdown run in
  worker threads and their results are applied on the loop.
- A model unloaded and loaded again waits for its old engine's shutdown first, so two copies
  never hold memory at once (the memory plan counts each model once).

Keep-alive: `--keep-alive` for every model (None: loaded until the server stops); an Ollama
request's `keep_alive` sets it for the model from the end of that request on (0: unload then).
A model given already loaded, without a loader (`ModelRegistry.serving`, the one-model path of
create_app and the cluster's ingress), is pinned: never unloaded.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from scratchllm.engine.memory_plan import MiB, resident_bytes
from scratchllm.formats.names import Named
from scratchllm.models.heap import release_free_heap
from scratchllm.server.metrics import MetricFamilies, ServerMetrics, no_engine
from scratchllm.server.protocol import APIError
from scratchllm.server.state import ServedEmbedder, ServedModel, ServerConfig, ServerState

logger = logging.getLogger(__name__)

Task = Literal["generate", "embed"]
Status = Literal["unloaded", "loading", "loaded"]
Served = ServedModel | ServedEmbedder
LEASES = "scratchllm.model_leases"  # the ASGI scope key of a request's leases
UNLOAD_TICK_S = 0.25  # how often idle models are looked at, at most (shorter keep-alives: a quarter of it)


@dataclass
class ModelSpec:
    """A model the server serves: what it is called, what it does and how to load it."""

    name: str
    task: Task
    load: Callable[[], Served] | None  # blocking, run in a worker thread; None: given loaded, pinned
    aliases: tuple[str, ...] = ()
    planned_bytes: int = 0  # its share of the server's memory plan (0: not planned, e.g. the fake engine)
    max_len: int | None = None  # context (or input) tokens, known before loading; the loaded model's wins
    details: dict[str, Any] = field(default_factory=dict)  # what the header says (engine/shared_memory_plan.py)


@dataclass
class Lease:
    """One request's hold on a model, released when its response ends."""

    entry: ModelEntry
    load_s: float = 0.0  # how long this request waited for the model to load
    keep_alive_s: float | None | Literal["default"] = "default"  # an Ollama request's own keep_alive


class ModelEntry:
    """One served model: its spec, whether it is loaded, and who holds it."""

    def __init__(self, spec: ModelSpec, metrics: ServerMetrics, state: ServerState | None,
                 keep_alive_s: float | None) -> None:
        assert (state is None) == (spec.task == "embed"), "a generation model has a ServerState, an embedder not"
        self.spec, self.metrics, self.state = spec, metrics, state
        self.status: Status = "unloaded"
        self.embedder: ServedEmbedder | None = None
        self.users = 0  # requests holding a lease (see the module's invariants)
        self.last_used = time.monotonic()
        self.keep_alive_s = keep_alive_s  # None: never unloaded
        self.expires_at: float | None = None  # wall-clock time it unloads if still idle (Ollama's /api/ps)
        self.loading: asyncio.Future[None] | None = None
        self.closing: asyncio.Future[Any] | None = None  # the previous engine's shutdown, while it runs
        metrics.loaded = False if spec.load is not None else None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def served(self) -> Served | None:
        return self.state.served if self.state is not None else self.embedder

    def attach(self, served: Served, load_s: float = 0.0) -> None:
        served.name = self.spec.name
        if self.state is not None:
            assert isinstance(served, ServedModel), f"'{self.name}' loaded as {type(served).__name__}"
            self.state.served = served
            self.metrics.engine_stats = served.engine.stats
        else:
            assert isinstance(served, ServedEmbedder), f"'{self.name}' loaded as {type(served).__name__}"
            self.embedder = served
        self.status = "loaded"
        if self.spec.load is not None:
            self.metrics.loaded, self.metrics.load_seconds = True, load_s
            self.metrics.loads += 1
        self.last_used = time.monotonic()

    def detach(self) -> Served | None:
        served: Served | None
        if self.state is not None:
            served = self.state.detach()
        else:
            served, self.embedder = self.embedder, None
        self.metrics.engine_stats = no_engine  # the engine is gone: nothing of it is read again
        self.metrics.loaded = False
        self.metrics.unloads += 1
        self.status, self.expires_at = "unloaded", None
        return served

    def max_len(self) -> int | None:
        served = self.served
        if isinstance(served, ServedModel):
            return served.max_model_len
        if isinstance(served, ServedEmbedder):
            return served.max_len
        return self.spec.max_len

    def idle_due(self, now: float) -> bool:
        """Loaded, held by nobody, and idle past its keep-alive."""
        return (self.status == "loaded" and self.users == 0 and self.spec.load is not None
                and self.keep_alive_s is not None and now - self.last_used >= self.keep_alive_s)


class ModelRegistry:
    """Name -> model, loaded on demand and unloaded when idle (the module doc). `report` gets
    one line per load, unload and reload, with its duration and memory (default: logged)."""

    def __init__(self, specs: list[ModelSpec], keep_alive_s: float | None = None,
                 report: Callable[[str], None] | None = None) -> None:
        names = [n for s in specs for n in (s.name, *s.aliases)]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model names served twice: {', '.join(dup)}")
        assert specs, "a server serves at least one model"
        self.specs, self.keep_alive_s = specs, keep_alive_s
        self.entries: dict[str, ModelEntry] = {}  # every name and alias -> its entry, once bound
        self.embed_lock = asyncio.Lock()  # one embedding batch at a time: two would fight over the cores
        self.given: dict[str, Served] = {}  # models handed over loaded (serving), attached by bind
        self.config = ServerConfig()  # the app's, set by bind
        # names made while serving (Ollama's /api/create, /api/copy, /api/pull: server/model_names.py)
        self.new_spec: Callable[[str, str], ModelSpec] | None = None  # (name, model reference) -> a spec
        self.added: set[str] = set()  # the names added while serving: those /api/delete may remove
        self.profiles: dict[str, Named] = {}  # name -> what it adds to each request (model_names.with_profile)
        self._bind: tuple[MetricFamilies, Callable[[ServerMetrics], ServerState]] | None = None
        self.report: Callable[[str], None] = report or logger.info

    @classmethod
    def serving(cls, model: ServedModel, embedder: ServedEmbedder | None = None) -> ModelRegistry:
        """A registry of models already loaded, pinned (the one-model server; the cluster's ingress)."""
        specs = [ModelSpec(model.name, "generate", None, model.aliases, max_len=model.max_model_len)]
        if embedder is not None:
            specs.append(ModelSpec(embedder.name, "embed", None, embedder.aliases, max_len=embedder.max_len))
        registry = cls(specs)
        registry.given = {model.name: model, **({embedder.name: embedder} if embedder else {})}
        return registry

    def bind(self, config: ServerConfig, families: MetricFamilies,
             make_state: Callable[[ServerMetrics], ServerState]) -> None:
        """Make each model's metrics and state (create_app calls this once, with the app's options)."""
        assert not self.entries, "a registry serves one app"
        self.config = config
        self._bind = (families, make_state)
        for spec in self.specs:
            self._bind_spec(spec)

    def _bind_spec(self, spec: ModelSpec) -> ModelEntry:
        assert self._bind is not None, "bind first"
        families, make_state = self._bind
        metrics = ServerMetrics(model_name=spec.name, families=families, generates=spec.task == "generate")
        state = make_state(metrics) if spec.task == "generate" else None
        entry = ModelEntry(spec, metrics, state, self.keep_alive_s)
        for name in (spec.name, *spec.aliases):
            self.entries[name] = entry
        if spec.name in self.given:
            entry.attach(self.given[spec.name])
        return entry

    # --- names added and removed while serving ---
    def add_spec(self, spec: ModelSpec) -> ModelEntry:
        """Serve a model from now on (unloaded: it loads on its first request)."""
        if spec.name in self.entries:
            raise APIError(409, f"the model '{spec.name}' is already served", code="model_exists")
        self.specs.append(spec)
        self.added.add(spec.name)
        return self._bind_spec(spec)

    def add_alias(self, name: str, target: str) -> ModelEntry:
        """`name` for the model `target` is (one engine, one entry)."""
        entry = self.entry(target)
        self.entries[name] = entry
        self.added.add(name)
        return entry

    def remove_name(self, name: str) -> None:
        """Stop serving `name` (an alias, or a model added while serving: then unloaded first)."""
        entry = self.entry(name)
        if name != entry.name:  # an alias
            del self.entries[name]
        else:
            if entry.users:
                raise APIError(409, f"the model '{name}' is in use; delete it when its requests are done",
                               code="model_in_use")
            if entry.status == "loaded":
                self._unload(entry)
            for alias in [n for n, e in self.entries.items() if e is entry]:
                del self.entries[alias]
                self.added.discard(alias)
            self.specs.remove(entry.spec)
        self.added.discard(name)

    # --- what the routes ask ---
    def models(self) -> list[ModelEntry]:
        """Every served model once, in the order given."""
        return list({id(e): e for e in self.entries.values()}.values())

    def names(self, task: Task | None = None) -> list[str]:
        return [s.name for s in self.specs if task is None or s.task == task]

    def every_name(self) -> list[str]:
        """Every name a request may give: the models' own, their aliases and the names added."""
        return list(self.entries)

    @property
    def default(self) -> ModelEntry:
        """The first generation model (the one a request without a model name gets)."""
        return next(e for e in self.models() if e.spec.task == "generate")

    def entry(self, name: str, task: Task | None = None) -> ModelEntry:
        """The entry called `name`, or the client's 404: unknown, or not a model of `task` (for
        this endpoint there is no such model); the message lists what the server does serve."""
        entry = self.entries.get(name)
        if entry is None and ":" not in name.rsplit("/", 1)[-1]:
            entry = self.entries.get(f"{name}:latest")  # Ollama's names: no tag means :latest
        if entry is None:
            raise APIError(404, f"The model '{name}' does not exist; this server serves {self._listing()}",
                           param="model", code="model_not_found")
        if task is not None and entry.spec.task != task:
            what = "an embedding model (for /v1/embeddings)" if entry.spec.task == "embed" else "a generation model"
            others = ", ".join(f"'{n}'" for n in self.names(task)) or "none"
            kind = "embedding" if task == "embed" else "generation"
            raise APIError(404, f"The model '{name}' is {what}; {kind} models here: {others}", param="model",
                           code="model_not_found")
        return entry

    def _listing(self) -> str:
        parts = []
        kinds: tuple[tuple[Task, str], ...] = (("generate", "generation"), ("embed", "embeddings"))
        for task, label in kinds:
            names = self.names(task)
            if names:
                parts.append(f"{label}: " + ", ".join(f"'{n}'" for n in names))
        return "; ".join(parts)

    async def acquire(self, request: Request, name: str, task: Task | None = None) -> Lease:
        """A lease on model `name` for this request, loaded first if it is not (see the invariants)."""
        leases: list[Lease] | None = request.scope.get(LEASES)
        assert leases is not None, "a route asked for a model outside the ModelLeases middleware"
        entry = self.entry(name, task)
        lease = Lease(entry)
        entry.users += 1  # before any await: from here the unloader leaves it alone
        entry.expires_at = None
        leases.append(lease)
        if entry.status != "loaded":
            start = time.monotonic()
            await self._loaded(entry)
            lease.load_s = time.monotonic() - start
        return lease

    async def generator(self, request: Request, name: str) -> ServerState:
        entry = (await self.acquire(request, name, "generate")).entry
        assert entry.state is not None and entry.state.served is not None
        return entry.state

    async def embedder(self, request: Request, name: str) -> ServedEmbedder:
        entry = (await self.acquire(request, name, "embed")).entry
        assert entry.embedder is not None
        return entry.embedder

    def release(self, lease: Lease) -> None:
        entry = lease.entry
        entry.users -= 1
        assert entry.users >= 0, f"'{entry.name}': more leases released than taken"
        entry.last_used = time.monotonic()
        if lease.keep_alive_s != "default":
            entry.keep_alive_s = lease.keep_alive_s
        if entry.users == 0 and entry.keep_alive_s is not None and entry.spec.load is not None:
            entry.expires_at = time.time() + entry.keep_alive_s
            if entry.idle_due(entry.last_used):  # keep_alive 0: unload now, not at the next tick
                self._unload(entry)

    # --- loading and unloading ---
    async def _loaded(self, entry: ModelEntry) -> None:
        if entry.spec.load is None:
            raise APIError(503, f"the model '{entry.name}' is not loaded and cannot be", type="server_error",
                           code="model_not_loaded")
        if entry.loading is None:
            entry.loading = asyncio.ensure_future(self._load(entry))
            # retrieved here too: every waiter may be gone (clients hung up) when a load fails
            entry.loading.add_done_callback(lambda f: f.cancelled() or f.exception())
        # shielded: a waiter that goes away (its client hung up) does not cancel the others' load
        await asyncio.shield(entry.loading)

    async def _load(self, entry: ModelEntry) -> None:
        assert entry.status == "unloaded" and entry.spec.load is not None
        entry.status = "loading"
        try:
            if entry.closing is not None:
                await entry.closing
            logger.info("loading model '%s'", entry.name)
            load = entry.spec.load
            served, seconds, grew = await asyncio.to_thread(_measured, load)
            entry.attach(served, seconds)
            self.report(loaded_line(entry, seconds, grew))
        except Exception as err:  # noqa: BLE001 - any failure to load is every waiting request's 503
            entry.status = "unloaded"
            logger.error("model '%s' failed to load: %s", entry.name, err)
            raise APIError(503, f"the model '{entry.name}' could not be loaded: {err}", type="server_error",
                           code="model_load_failed") from None
        finally:
            entry.loading = None

    async def unload(self, name: str) -> bool:
        """Unload `name` now if it is loaded and nobody holds it; whether it was."""
        entry = self.entry(name)
        if entry.status != "loaded" or entry.users or entry.spec.load is None:
            return False
        self._unload(entry)
        return True

    def _unload(self, entry: ModelEntry) -> None:
        # on the loop, no await between the checks and the detach: no request can slip in between
        assert entry.users == 0 and entry.status == "loaded", "only an idle, loaded model is unloaded"
        idle_s, keep = time.monotonic() - entry.last_used, entry.keep_alive_s
        held = [entry.detach()]  # _close takes it out: no reference is left here to keep its memory
        closing = entry.closing = asyncio.ensure_future(asyncio.to_thread(_measured, _close, held))

        def closed(done: asyncio.Future[tuple[None, float, int]]) -> None:
            if entry.closing is closing:
                entry.closing = None
            if not done.cancelled() and done.exception() is None:
                _, seconds, grew = done.result()
                why = ("when asked" if keep is None else "at once (keep-alive 0)" if keep == 0 else
                       f"after {idle_s:.1f} s idle (keep-alive {keep:g} s)")
                self.report(f"unloaded '{entry.name}' {why} in {seconds:.1f} s: resident memory "
                            f"{grew / MiB:+.0f} MiB, now {resident_bytes() / MiB:.0f} MiB")

        closing.add_done_callback(closed)

    def unload_idle(self, now: float | None = None) -> int:
        """Unload every model idle past its keep-alive; how many were."""
        now = time.monotonic() if now is None else now
        due = [e for e in self.models() if e.idle_due(now)]
        for entry in due:
            self._unload(entry)
        return len(due)

    async def run_unloader(self) -> None:
        """The app's background task: unload idle models, for as long as the app runs."""
        while True:
            keeps = [e.keep_alive_s for e in self.models() if e.keep_alive_s is not None]
            await asyncio.sleep(max(0.01, min([UNLOAD_TICK_S, *(k / 4 for k in keeps)])))
            self.unload_idle()

    async def shutdown(self) -> None:
        """Shut every loaded engine down, draining (the app's lifespan end)."""
        for entry in self.models():
            if entry.closing is not None:
                await entry.closing
            if entry.state is not None and entry.state.served is not None:
                await asyncio.to_thread(entry.state.served.engine.shutdown, True)

    def load_all(self) -> None:
        """Load every model not yet loaded, one after another, on this thread (`serve --load
        start`: before the app serves, so no request can race it)."""
        for entry in self.models():
            if entry.status == "unloaded" and entry.spec.load is not None:
                served, seconds, grew = _measured(entry.spec.load)
                entry.attach(served, seconds)
                self.report(loaded_line(entry, seconds, grew))


def _measured(work: Callable[..., Any], *args: Any) -> tuple[Any, float, int]:
    """work(*args) on this thread: its result, its seconds and the resident memory it added
    (the whole process's: another model loading at the same moment is counted too)."""
    before, start = resident_bytes(), time.monotonic()
    result = work(*args)
    return result, time.monotonic() - start, resident_bytes() - before


def loaded_line(entry: ModelEntry, seconds: float, grew: int) -> str:
    """What a load says: the model, load or reload, seconds, memory, and its context when it
    differs from the one planned at start."""
    served = entry.served
    verb = "loaded" if entry.metrics.loads <= 1 else f"reloaded (load {entry.metrics.loads})"
    planned = f" (planned {entry.spec.planned_bytes / MiB:.0f} MiB)" if entry.spec.planned_bytes else ""
    context = ""
    if isinstance(served, ServedModel) and entry.spec.max_len and served.max_model_len != entry.spec.max_len:
        context = (f"; context {served.max_model_len:,} tokens, not the {entry.spec.max_len:,} planned at start "
                   "(the loaded model's KV pool holds that much)")
    return (f"{verb} '{entry.name}' in {seconds:.1f} s: resident memory {grew / MiB:+.0f} MiB{planned}, now "
            f"{resident_bytes() / MiB:.0f} MiB{context}")


def _close(held: list[Served | None]) -> None:
    """Free an unloaded model, the one reference left to it in `held`: its engine's thread stops
    and its arrays go with that reference."""
    served = held.pop()
    if isinstance(served, ServedModel):
        served.engine.shutdown(True)
    del served
    gc.collect()  # the engine and the model hold reference cycles: free their arrays now, not later
    release_free_heap()  # and what they freed inside the C heap's arenas goes back to the kernel too


class ModelLeases:
    """Pure ASGI: gives each HTTP request a list of the leases its route takes, and releases them
    when the response has ended, however it ends (so a model streaming to a client is in use)."""

    def __init__(self, app: ASGIApp, registry: ModelRegistry) -> None:
        self.app, self.registry = app, registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        leases: list[Lease] = []
        scope[LEASES] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in leases:
                self.registry.release(lease)


def models_of(request: Request) -> ModelRegistry:
    registry: ModelRegistry = request.app.state.models
    return registry


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object) -> float | None:
    """A keep-alive as Ollama and `--keep-alive` take it -> seconds, or None for "forever".

    A number is seconds; a duration string is Go's ("300ms", "5m", "1h30m", "-1s"); a number in a
    string ("30") is seconds; any negative value, or "forever"/"never"/"inf", keeps the model
    loaded. Raises ValueError naming what is wrong."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive is a number of seconds or a duration such as '5m', not {value!r}")
    if isinstance(value, int | float):
        if math.isnan(value):
            raise ValueError("keep_alive is not a number (NaN)")
        return None if value < 0 or math.isinf(value) else float(value)
    if not isinstance(value, str):
        raise ValueError(f"keep_alive is a number of seconds or a duration such as '5m', not {type(value).__name__}")
    text = value.strip().lower()
    if text in ("forever", "never", "inf", "infinite"):
        return None
    try:
        return parse_keep_alive(float(text))
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    parts = _DURATION.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive {value!r} is not a duration: seconds (300), or e.g. '300ms', '5m', '1h30m'")
    return parse_keep_alive(sign * sum(float(n) * _UNIT_S[u] for n, u in parts))
