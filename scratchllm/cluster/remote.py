"""RemoteEngine: the EngineClient contract over a Ray Serve handle to the engine replicas, so the
server's routes (server/app.py) run unchanged in the ingress.

`submit` returns the request's stream at once and starts one task on the event loop that asks
the router (request_router.py, in this process) for a replica and relays that replica's
TokenEvents into the stream. Faults:
  - the replica dies before the request's first token with text reached the stream (tokens
    without text are held back until one has some): nothing was shown to the client, so the
    request is sent again, to another replica (`avoid`), up to `max_attempts` times;
  - it dies after: the client has seen part of the answer, which no other replica can continue
    token for token, so the stream fails: its reader gets `ReplicaFailed` (the server turns that
    into an SSE error event, or a 500 when unstreamed), never a hang.
Each finished request's cached tokens (from its engine's metrics) are compared with what the
router predicted (`accuracy`), and kept for the usage post-processor (usage.py).

Requests are refused at submit by the rules every engine applies (engine/validate.py), with the
replicas' limits (`limits`). The streams are kept by the engines' one StreamHost
(engine/streams.py); each request is a task on one event loop (`loop`, or the one the first
submit runs on), and submit, abort and shutdown may be called from any thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from scratchllm.cluster.ledger import PREDICTIONS
from scratchllm.cluster.view import Accuracy
from scratchllm.engine.protocol import EngineStats, RequestMetrics, RequestStream, TokenEvent, submit_each
from scratchllm.engine.streams import StreamHost
from scratchllm.engine.validate import RequestLimits
from scratchllm.sampling import SamplingParams

logger = logging.getLogger(__name__)


class ReplicaFailed(RuntimeError):
    """The replica serving a stream died after the stream had started."""


class RemoteStream(RequestStream):
    """A RequestStream that can also end in an error, raised to its reader after the last event."""

    error: BaseException | None = None

    def failed(self, error: BaseException, index: int, arrival: float) -> TokenEvent:
        """The stream's last event, after `index` events, once it has failed with `error`."""
        self.error = error
        return _abort_event(self.request_id, index, arrival, 0)

    def _raise(self) -> None:
        assert self.error is not None
        raise ReplicaFailed(f"request {self.request_id}: {self.error}") from self.error

    def __iter__(self) -> Iterator[TokenEvent]:
        for event in super().__iter__():
            if event.finish_reason is not None and self.error is not None:
                self._raise()
            yield event

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._checked()

    async def _checked(self) -> AsyncIterator[TokenEvent]:
        async for event in super().__aiter__():
            if event.finish_reason is not None and self.error is not None:
                self._raise()
            yield event


def _abort_event(rid: str, index: int, arrival: float, prompt_tokens: int) -> TokenEvent:
    return TokenEvent(rid, None, "", index, "abort",
                      metrics=RequestMetrics(arrival, None, None, time.monotonic(), prompt_tokens, index))


def _replica_gone(err: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(err, ActorDiedError | ActorUnavailableError | RayActorError)


class RemoteEngine:
    """EngineClient over `handle` (a DeploymentHandle to EngineReplica); `limits`: the replicas'."""

    def __init__(self, handle: Any, limits: RequestLimits, max_attempts: int = 3, retry_backoff_s: float = 0.2,
                 keep_usage: int = 10_000, loop: asyncio.AbstractEventLoop | None = None):
        assert max_attempts >= 1
        self.handle = handle.options(stream=True)
        self.limits = limits
        self.max_attempts, self.retry_backoff_s, self.keep_usage = max_attempts, retry_backoff_s, keep_usage
        self.accuracy = Accuracy()
        self.counts = {"submitted": 0, "finished": 0, "retried": 0, "failed_mid_stream": 0, "failed": 0, "aborted": 0}
        self.cached_tokens: OrderedDict[str, int] = OrderedDict()  # request id -> cached tokens, for usage.py
        # predictions are keyed by request id, process-wide: this ingress's ids are its own
        self._streams = StreamHost(f"cluster-{uuid.uuid4().hex[:8]}", self.abort, RemoteStream)
        self._tasks: dict[str, asyncio.Task[None]] = {}  # touched on the loop only
        self._loop = loop

    # --- the contract ---
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RemoteStream:
        self.limits.validate(prompt_token_ids, params)
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError("RemoteEngine: submit on the event loop its requests run on, or give it a "
                                   "loop") from None
        stream: RemoteStream = self._streams.open(request_id)
        self._on_loop(self._start, stream, list(prompt_token_ids), params)
        return stream

    def submit_group(self, prompt_token_ids: list[int], params: list[SamplingParams],
                     request_ids: list[str] | None = None) -> list[RequestStream]:
        """n > 1 across the cluster: each choice is a request of its own (the router sends
        requests with the same prompt to the replica that holds its blocks)."""
        return submit_each(self.submit, prompt_token_ids, params, request_ids)

    def abort(self, request_id: str) -> None:
        if self._loop is not None:
            self._on_loop(self._cancel, str(request_id))

    def stats(self) -> EngineStats:
        """Open streams as running; the blocks are the replicas' (their own stats); the ingress's
        fault counters are `counts` (/cluster/stats)."""
        return EngineStats(running=len(self._streams), waiting=0, finished=self._streams.counts())

    def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; without drain, abort the open ones (with drain they run on)."""
        for rid in self._streams.close(drain):
            self.abort(rid)

    # --- on the loop ---
    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _start(self, stream: RemoteStream, ids: list[int], params: SamplingParams) -> None:
        assert self._loop is not None
        self.counts["submitted"] += 1
        task = self._loop.create_task(self._relay(stream, ids, params))
        self._tasks[stream.request_id] = task
        task.add_done_callback(lambda t: self._ended(stream, len(ids), t))

    def _cancel(self, rid: str) -> None:
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel()

    def _ended(self, stream: RemoteStream, prompt_tokens: int, task: asyncio.Task[None]) -> None:
        """Every path out of a request's task (a cancel before it ever ran included): its stream ends."""
        rid = stream.request_id
        self._settle(rid)
        self._tasks.pop(rid, None)
        if not stream.finished:
            self.counts["aborted"] += 1  # cancelled before its relay ran (or it broke outside the relay)
            self._streams.deliver(_abort_event(rid, 0, time.monotonic(), prompt_tokens))

    # --- one request ---
    async def _relay(self, stream: RemoteStream, ids: list[int], params: SamplingParams) -> None:
        rid, arrival, index = stream.request_id, time.monotonic(), 0
        avoid: list[str] = []
        last_error: BaseException | None = None
        try:
            for attempt in range(self.max_attempts):
                replica, gen = None, self.handle.generate.remote(ids, params, rid, tuple(avoid))
                held: list[TokenEvent] = []  # tokens with no text yet: the client has seen nothing
                finished = False  # the last event is delivered: a replica lost after it loses nothing
                try:
                    async for item in gen:
                        if isinstance(item, str):
                            replica = item
                            continue
                        if item.request_id != rid:  # the replica's engine kept another id
                            item = dataclasses.replace(item, request_id=rid)
                        if index == 0 and not item.text and item.finish_reason is None:
                            held.append(item)  # a replica lost now is still retried
                            continue
                        if item.finish_reason is not None:
                            self._finished(rid, len(ids), item)
                            finished = True
                        for event in [*held, item]:
                            self._streams.deliver(event)
                            index += 1
                        held = []
                    return
                except asyncio.CancelledError:
                    gen.cancel()  # the replica aborts the request and frees its blocks
                    raise
                except Exception as err:  # noqa: BLE001 - a replica's failure is reported, never raised here
                    if finished:  # the stream's end went out before the replica went: nothing to report
                        return
                    self._settle(rid)
                    last_error = err
                    if not _replica_gone(err) or index > 0:
                        self.counts["failed_mid_stream" if index > 0 else "failed"] += 1
                        logger.warning("request %s failed on replica %s: %s", rid, replica, err)
                        self._streams.deliver(stream.failed(err, index, arrival))
                        return
                    if replica is not None:
                        avoid.append(replica)
                    self.counts["retried"] += 1
                    logger.warning("request %s: replica %s is gone before the first token; retry %d",
                                   rid, replica, attempt + 1)
                    await asyncio.sleep(self.retry_backoff_s * (attempt + 1))
            self.counts["failed"] += 1
            self._streams.deliver(stream.failed(last_error or RuntimeError("no replica answered"), index, arrival))
        except asyncio.CancelledError:
            self.counts["aborted"] += 1
            self._streams.deliver(_abort_event(rid, index, arrival, len(ids)))

    def _settle(self, rid: str, cached: int | None = None, prompt_tokens: int = 0) -> None:
        """The routed request ended: its replica's load drops; a finished one scores the prediction."""
        routed = PREDICTIONS.take(rid)
        if routed is None:
            return
        view, replica, predicted = routed
        view.completed(replica)
        if cached is not None:
            self.accuracy.add(predicted, cached, prompt_tokens)

    def _finished(self, rid: str, prompt_tokens: int, event: TokenEvent) -> None:
        self.counts["finished"] += 1
        actual = event.metrics.cached_tokens if event.metrics is not None else 0
        self._settle(rid, actual, prompt_tokens)
        self.cached_tokens[rid] = actual
        while len(self.cached_tokens) > self.keep_usage:
            self.cached_tokens.popitem(last=False)
