"""One engine replica: a Ray Serve deployment wrapping an EngineClient.

`generate(prompt_token_ids, params, request_id)` is a streaming method (call it through a handle
with `.options(stream=True)`): it yields this replica's id first, then the request's
TokenEvents as the engine makes them. When the caller goes away Serve cancels the generator and
the request is aborted, so its KV blocks go back to the pool. `record_routing_stats` is Serve's
hook for custom request routers: Serve's controller calls it every
`request_routing_stats_period_s` and hands the result to every router of this deployment
(request_router.py), here the routing hashes of the resident prefix blocks, the load and the
batch capacity, with the replica's process id and requests served (shown in /cluster/stats).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from scratchllm.cluster.residency import REPORT_CAP, HashTranslator, PrefixCacheModel, ReportingEngine
from scratchllm.engine.protocol import EngineClient, EngineStats, TokenEvent
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSpec:
    """What engine a replica runs: the fake one (model "fake") or a model behind the continuous engine."""

    model: str = "fake"  # "fake", "default", a .gguf file or a Hugging Face folder
    engine_options: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields, or the fake's
    tokenizer: bool = True  # False: token ids only (the bench's tiny random models have no tokenizer)
    dtype: str = "float32"

    @property
    def fake(self) -> bool:
        return self.model == "fake"


# The prefix cache may fill the pool (bytes beyond any pool's size). The router gives each replica
# its share of the prefixes and counts on it to keep them; the one-process server's default cap
# (as many cached blocks as the most the work has held at once, for its memory) evicted a share
# that the batch's peak did not cover while up to a quarter of the pool was never written.
PREFIX_CACHE_FILLS_POOL = 1 << 62


@dataclass(frozen=True)
class BuiltEngine:
    engine: EngineClient
    residency: HashTranslator | PrefixCacheModel  # the source of its resident block hashes (residency.py)
    capacity: int  # requests it runs at once (the router keeps a prefix's claim while one more fits)


def build_engine(spec: ReplicaSpec) -> BuiltEngine:
    """The replica's engine, its source of resident block hashes and its batch capacity."""
    if spec.fake:
        from scratchllm.engine.fake import FakeEngine

        fake = FakeEngine(**spec.engine_options)
        return BuiltEngine(fake, PrefixCacheModel(fake.num_blocks, fake.block_size), fake.max_running)
    from scratchllm.engine.async_engine import AsyncEngine

    options = {"prefix_cache_memory_bytes": PREFIX_CACHE_FILLS_POOL, **spec.engine_options}
    try:
        llm = ReportingEngine.from_pretrained(spec.model, tokenizer=spec.tokenizer, dtype=spec.dtype, **options)
    except TypeError as err:  # an option EngineConfig does not have
        raise ConfigError(f"engine option: {err}") from None
    if llm.config.block_size != 16:
        raise ConfigError(f"the router hashes blocks of 16 tokens; this engine's are {llm.config.block_size}")
    return BuiltEngine(AsyncEngine(llm), HashTranslator(4 * llm.block_manager.num_blocks), llm.config.max_num_seqs)


def _rss_bytes() -> int:
    """This process's resident set now (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class EngineReplica:
    """The deployment's class (app.py wraps it with serve.deployment)."""

    def __init__(self, spec: ReplicaSpec):
        from ray import serve

        self.spec = spec
        built = build_engine(spec)
        self.engine, self.residency, self.capacity = built.engine, built.residency, built.capacity
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.reports = 0
        self.served = 0  # requests this replica has started (the fault tests see a restarted one used)
        logger.info("replica %s: %s", self.replica_id, spec.model)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       avoid: tuple[str, ...] = ()) -> AsyncIterator[str | TokenEvent]:
        """The replica's id, then the request's events (`avoid` is read by the router only)."""
        modelled = None
        if isinstance(self.residency, PrefixCacheModel):
            modelled = self.residency.admit(prompt_token_ids)
        else:
            self.residency.learn(prompt_token_ids)
        stream = self.engine.submit(prompt_token_ids, params, request_id=request_id)
        self.served += 1
        yield self.replica_id
        try:
            async for event in stream:
                if event.finish_reason is not None and modelled is not None and event.metrics is not None:
                    event = dataclasses.replace(event, metrics=dataclasses.replace(event.metrics,
                                                                                   cached_tokens=modelled))
                yield event
        finally:
            stream.abort()  # a no-op once finished; else the caller is gone: free the blocks

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's hook (a dict, as Serve wants): what the router reads, and the facts
        /cluster/stats shows per replica (the soak's leak check reads kv_blocks_used there)."""
        stats = self.engine.stats()
        if isinstance(self.residency, PrefixCacheModel):
            hashes = self.residency.resident()
        else:
            hashes = self.residency.translate(stats.resident_block_hashes)
        self.reports += 1
        return {"hashes": hashes[-REPORT_CAP:], "load": stats.running + stats.waiting,
                "capacity": self.capacity, "seq": self.reports, "kv_blocks_used": stats.kv_blocks_used,
                "kv_blocks_total": stats.kv_blocks_total, "rss_bytes": _rss_bytes(), "pid": os.getpid(),
                "served": self.served}

    def stats(self) -> EngineStats:
        """The engine's counters (without the hash list, which only the router's report needs),
        for the bench: picklable, so it crosses Ray as it is."""
        return dataclasses.replace(self.engine.stats(), resident_block_hashes=())

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(drain=False)
