"""The inference engine: requests, paged KV blocks, the seed's scheduler, continuous batching.

See docs/architecture.md, "engine -> server". Modules, one concept each: request (states and
timestamps), block_manager (paged KV ids, ref counts, prefix cache, CoW), scheduler (admission
policy and per-step batching), paged_attention (the pool and the Cython kernel), masks (3-D masks),
model_runner (one packed forward per step), engine (LLMEngine), async_engine (threads and streams),
static (the padded baseline), memory_plan (refuse at start, never OOM later).
"""

from scratchllm.engine.config import EngineConfig
from scratchllm.engine.engine import LLMEngine, StepOutput
from scratchllm.engine.request import Priority, Request, RequestMetrics, RequestStatus

__all__ = ["EngineConfig", "LLMEngine", "StepOutput", "Priority", "Request", "RequestMetrics", "RequestStatus",
           "AsyncEngine", "RequestStream", "TokenEvent"]


def __getattr__(name):
    if name in ("AsyncEngine", "RequestStream", "TokenEvent"):
        from scratchllm.engine import async_engine

        return getattr(async_engine, name)
    raise AttributeError(f"module 'scratchllm.engine' has no attribute {name!r}")
