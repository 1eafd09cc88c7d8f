"""The inference engine: requests, paged KV blocks, the scheduler, continuous batching.

See docs/architecture.md. Modules, one concept each: protocol (the contract with everything
above: events, metrics, results, streams, EngineClient), request (states and timestamps),
block_pool (paged KV ids, ref counts, free lists, prefix hashes), block_manager (each sequence's
block tables: prefix hits, CoW, windows), policy (admission: the priority policy or FCFS),
scheduler (the batching mechanism: budget, chunked prefill, preemption), paged_attention (the
pool and the Cython kernel), kv_sizing (KV bytes per token and block), masks (3-D masks),
model_runner (one packed forward per step), sampler (the one sampling path: logits rows ->
tokens), output (the one output path: tokens -> events -> results), engine (LLMEngine),
async_engine (the engine behind a thread), static (the padded baseline), fake (the fake engine),
threaded (the thread, condition and shutdown those three share),
streams (request ids and open streams, for every engine), validate (the one rule set for bad
input), memory_plan (refuse at start, never OOM later).
"""

from scratchllm.engine.config import EngineConfig
from scratchllm.engine.engine import LLMEngine
from scratchllm.engine.protocol import EngineClient, RequestMetrics, RequestOutput, RequestStream, TokenEvent
from scratchllm.engine.request import Priority, Request, RequestStatus

__all__ = ["EngineConfig", "LLMEngine", "Priority", "Request", "RequestMetrics", "RequestStatus", "RequestOutput",
           "RequestStream", "TokenEvent", "EngineClient", "AsyncEngine"]


def __getattr__(name: str) -> type:
    if name == "AsyncEngine":
        from scratchllm.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'scratchllm.engine' has no attribute {name!r}")
