"""The engine's contract with everything above it, in code: the one definition of each type that
crosses the line, and the `EngineClient` protocol the HTTP server is typed against.

    submit(prompt_token_ids, params, request_id) -> RequestStream      (any thread, never blocks)
    submit_group(prompt_token_ids, [params, ...], request_ids) -> [RequestStream, ...]: one prompt,
        several requests (n > 1 sampling); each stream's tokens equal a submit of its own params,
        and an engine may compute and store the prompt once for all of them
    RequestStream: `for event in stream` (a thread) or `async for event in stream` (the event loop)
    abort(request_id) / stream.abort(): the request ends with finish_reason "abort", blocks freed
    stats() -> EngineStats, the counters as of the last finished step; shutdown(drain)

Implemented by the continuous engine (async_engine.AsyncEngine), the static baseline
(static.StaticEngine), the fake engine (fake.FakeEngine) and the cluster's RemoteEngine
(cluster/remote.py), over one StreamHost (streams.py) and one rule set for bad input
(validate.py); tests/engine/test_conformance.py runs the same cases over all four.

Event order (an invariant every implementation keeps and the conformance suite checks): a
request's events have index 0, 1, 2, ... in order, exactly one event has a finish_reason and it
is the last; it carries `metrics`. An aborted request's last event may have no token
(token_id None). `text` deltas join to the final text (stop strings cut, held back until they
can no longer be one). The first event carries the prompt's logprobs when the params ask for
them (`prompt_logprobs`; an engine that cannot compute them refuses the request at submit).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from scratchllm.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class RequestMetrics:
    """Monotonic times (time.monotonic seconds) of one request's life, and durations in ms."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    prompt_tokens: int
    completion_tokens: int
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # speculative decoding: tokens drafted for the request and verified, and those accepted
    spec_drafted: int = 0
    spec_accepted: int = 0

    @property
    def queue_ms(self) -> float:
        return _ms(self.arrival, self.first_scheduled)

    @property
    def prefill_ms(self) -> float:
        return _ms(self.first_scheduled, self.first_token)

    @property
    def decode_ms(self) -> float:
        return _ms(self.first_token, self.finished)

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else _ms(self.arrival, self.first_token)

    @property
    def e2e_ms(self) -> float | None:
        return None if self.finished is None else _ms(self.arrival, self.finished)

    def summary(self) -> dict[str, float | None]:
        """Plain numbers for printing and JSON: the times, the durations and the rates."""
        decoded = self.completion_tokens - 1  # the first token comes from the prefill's logits
        prefill_s, decode_s = self.prefill_ms / 1e3, self.decode_ms / 1e3
        return {
            "arrival": self.arrival, "first_scheduled": self.first_scheduled, "first_token": self.first_token,
            "finished": self.finished, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "num_preemptions": self.num_preemptions,
            "cached_tokens": self.cached_tokens, "spec_drafted": self.spec_drafted,
            "spec_accepted": self.spec_accepted, "queue_ms": self.queue_ms, "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms, "prefill_s": prefill_s, "decode_s": decode_s,
            "ttft_s": (self.queue_ms + self.prefill_ms) / 1e3,
            "prefill_tok_s": self.prompt_tokens / prefill_s if prefill_s > 0 else None,
            "decode_tok_s": decoded / decode_s if decoded > 0 and decode_s > 0 else None,
        }


def _ms(a: float | None, b: float | None) -> float:
    return 0.0 if a is None or b is None else (b - a) * 1000.0


TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first
# One prompt token's: its logprob given the tokens before it, its rank (1 = the most likely),
# and the top alternatives there (SamplingParams.prompt_logprobs of them)
PromptLogprob = tuple[float, int, TopLogprobs]


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters as of its last finished step: what `EngineClient.stats()` returns.

    Numbers, strings and tuples only: a cluster's replicas send it across Ray, pickled. A KV
    figure is None where the engine holds no such thing: RemoteEngine holds no blocks (its
    replicas do), the static baseline has no pool (a padded reservation per batch), and only the
    continuous engine has a prefix cache and a priority hook. Each field says who reads it."""

    # Requests in the running batch and waiting to run (RemoteEngine: its open streams). Read by
    # /metrics (num_requests_running, num_requests_waiting), the server's periodic stats line
    # (server/app.py), a replica's load report to the router (cluster/replica.py) and the
    # ingress's drain (cluster/app.py, running).
    running: int
    waiting: int
    # Requests ended per finish reason (FINISH_REASONS): the tests, and LLM.stats()'s callers.
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    # Requests preempted (recomputed) for lack of blocks (None: an engine that holds no blocks):
    # /metrics num_preemptions, bench engine.
    preemptions: int | None = None
    # Engine steps run: bench engine (steps per run), the fork tests.
    steps: int | None = None
    # KV blocks held by requests now, at most since start, and in the pool (None: no pool).
    # Read by /metrics (kv_blocks_used, kv_blocks_peak, kv_blocks_total, kv_cache_usage_perc),
    # the server's stats line, a replica's report to the router (the soak's leak check reads it
    # there), bench engine and bench cluster (the pool's bytes), and the tests that wait for an
    # aborted request's blocks to come back.
    kv_blocks_used: int | None = None
    kv_blocks_peak: int | None = None
    kv_blocks_total: int | None = None
    # Bytes of one block (the full-attention layers'): /metrics (kv_cache_used_bytes,
    # kv_cache_peak_bytes), bench engine, bench cluster.
    kv_block_bytes: int | None = None
    # Bytes of K and V per token of context, every layer, at the KV dtype: /metrics
    # (kv_cache_bytes_per_token). A mean where the int8 scales are shared by a block's tokens.
    kv_bytes_per_token: float | None = None
    # Bytes held now and at most, each pool's blocks at its own size (windowed layers' blocks
    # differ): bench engine and bench kv_dtype (the peak), the sliding-window tests.
    kv_bytes_used: int | None = None
    kv_bytes_peak: int | None = None
    # Bytes of the pool the work has made resident (blocks ever handed out): /metrics
    # (kv_cache_resident_bytes).
    kv_bytes_resident: int | None = None
    # Free blocks that still hold a cached prefix, prompt blocks looked up in the prefix cache
    # and found there: /metrics (prefix_cache_free_blocks, prefix_cache_queries, prefix_cache_hits).
    prefix_cache_free_blocks: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    # Requests whose priority the evaluation feedback moved: /metrics (priority_adjusted).
    priority_adjusted: int | None = None
    # Speculative decoding, since start (None: the engine does not speculate): verifications,
    # tokens drafted, drafts accepted, tokens the verifications emitted (accepted + one each).
    # /metrics (spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
    # _num_emitted_tokens), bench spec, `LLM.stats()`.
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None
    spec_decode_num_emitted_tokens: int | None = None
    # The chained hashes of the blocks the prefix cache holds, filled only by a cluster replica's
    # engine (cluster/residency.py), which translates them for the router (cluster/replica.py).
    resident_block_hashes: tuple[int, ...] = ()


@dataclass
class TokenEvent:
    """One new token (or the end) of one request."""

    request_id: str
    token_id: int | None  # None: the request ended without a new token (abort)
    text: str  # complete-UTF-8 text delta ("" without a tokenizer)
    index: int  # 0-based index of the token among the request's outputs
    finish_reason: str | None = None  # one of FINISH_REASONS on the last event
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None
    metrics: RequestMetrics | None = None  # on the last event
    # Seconds from the request's arrival until the engine produced this token, on the engine's
    # clock (RequestMetrics' clock): set by the output path for every event with a token (None
    # on an abort event without one). A first token's elapsed is its TTFT; the gap to the
    # request's previous event is the token's latency.
    elapsed: float | None = None
    # On a request's first event, when its params ask for prompt_logprobs: one entry per prompt
    # token from the second on (the first has nothing before it)
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass
class RequestOutput:
    """A request's result: what `LLM.generate` returns and the server's non-streamed reply uses."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # one of FINISH_REASONS
    metrics: RequestMetrics | None = None  # once finished
    logprobs: list[tuple[float | None, TopLogprobs | None]] | None = None  # per token, when asked for
    token_elapsed: list[float] = field(default_factory=list)  # per token: TokenEvent.elapsed
    prompt_logprobs: list[PromptLogprob] | None = None  # TokenEvent.prompt_logprobs, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """One request's events, from the engine's thread to whoever reads them.

    The producer (an engine thread) calls `put`. A reader in another thread iterates it
    (blocking); a reader on an event loop uses `async for`, and then each `put` wakes that loop
    with one call_soon_threadsafe: no thread per stream. Events are buffered until read, so the
    reader may start late and never misses one.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]):
        self.request_id = request_id
        self._abort = abort
        self._events: deque[TokenEvent] = deque()
        self._cv = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self.finished = False  # the last event was put (the reader may not have read it yet)

    # --- the producer side (any thread) ---
    def put(self, event: TokenEvent) -> None:
        with self._cv:
            assert not self.finished, f"request {self.request_id}: an event after the last one"
            self._events.append(event)
            self.finished = event.finish_reason is not None
            self._cv.notify()
            loop, ready = self._loop, self._ready
        if loop is not None and ready is not None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more

    # --- the reader side ---
    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            with self._cv:
                while not self._events:
                    self._cv.wait()
                event = self._events.popleft()
            yield event
            if event.finish_reason is not None:
                return

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._async_events()

    async def _async_events(self) -> AsyncIterator[TokenEvent]:
        with self._cv:
            assert self._loop is None, "a stream has one async reader"
            self._loop, self._ready = asyncio.get_running_loop(), asyncio.Event()
        ready = self._ready
        while True:
            with self._cv:
                batch = list(self._events)
                self._events.clear()
                ready.clear()  # under the lock: a put after this sets it again
            for event in batch:
                yield event
                if event.finish_reason is not None:
                    return
            await ready.wait()

    def abort(self) -> None:
        """Stop the request; its KV blocks go back to the pool. A no-op once it has finished."""
        if not self.finished:
            self._abort(self.request_id)


def submit_each(submit: Callable[..., Any], prompt_token_ids: Sequence[int], params: Sequence[SamplingParams],
                request_ids: Sequence[str] | None = None) -> list[Any]:
    """submit_group for an engine that cannot share a prompt's blocks: one submit per params."""
    ids: list[str | None] = list(request_ids) if request_ids is not None else [None] * len(params)
    return [submit(prompt_token_ids, p, rid) for p, rid in zip(params, ids, strict=True)]


@runtime_checkable
class EngineClient(Protocol):
    """What the server (and anything else that streams) needs of an engine. See the module doc."""

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream: ...

    def submit_group(self, prompt_token_ids: list[int], params: list[SamplingParams],
                     request_ids: list[str] | None = None) -> list[RequestStream]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self, drain: bool = True) -> None: ...
