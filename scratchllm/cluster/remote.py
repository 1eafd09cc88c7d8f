"""RemoteEngine: the EngineClient contract over a Ray Serve handle to the engine replicas, so the
server's routes (server/app.py) run unchanged in the ingress.

`submit` returns the request's stream at once and starts one task on the event loop that asks
the router (request_router.py, in this process) for a replica and relays that replica's
TokenEvents into the stream. Faults:
  - the replica dies before the request's first token reached the stream: nothing was shown
    to the client, so the request is sent again, to another replica (`avoid`), up to
    `max_attempts` times;
  - it dies after: the client has seen part of the answer, which no other replica can continue
    token for token, so the stream fails: its reader gets `ReplicaFailed` (the server turns that
    into an SSE error event, or a 500 when unstreamed), never a hang.
Each finished request's cached tokens (from its engine's metrics) are compared with what the
router predicted (`accuracy`), and kept for the usage post-processor (usage.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from scratchllm.cluster.ledger import PREDICTIONS
from scratchllm.cluster.view import Accuracy
from scratchllm.engine.protocol import RequestMetrics, RequestStream, TokenEvent, submit_each
from scratchllm.sampling import SamplingParams

logger = logging.getLogger(__name__)


class ReplicaFailed(RuntimeError):
    """The replica serving a stream died after the stream had started."""


class RemoteStream(RequestStream):
    """A RequestStream that can also end in an error, raised to its reader after the last event."""

    error: BaseException | None = None

    def fail(self, error: BaseException, index: int, arrival: float) -> None:
        self.error = error
        now = time.monotonic()
        self.put(TokenEvent(self.request_id, None, "", index, "abort",
                            metrics=RequestMetrics(arrival, None, None, now, 0, index)))

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


def _replica_gone(err: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(err, ActorDiedError | ActorUnavailableError | RayActorError)


class RemoteEngine:
    """EngineClient over `handle` (a DeploymentHandle to EngineReplica). Call submit on the event loop."""

    def __init__(self, handle: Any, max_attempts: int = 3, retry_backoff_s: float = 0.2, keep_usage: int = 10_000):
        assert max_attempts >= 1
        self.handle = handle.options(stream=True)
        self.max_attempts, self.retry_backoff_s, self.keep_usage = max_attempts, retry_backoff_s, keep_usage
        self.accuracy = Accuracy()
        self.counts = {"submitted": 0, "finished": 0, "retried": 0, "failed_mid_stream": 0, "failed": 0, "aborted": 0}
        self.cached_tokens: OrderedDict[str, int] = OrderedDict()  # request id -> cached tokens, for usage.py
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ids = itertools.count(1)
        self._prefix = f"cluster-{uuid.uuid4().hex[:8]}"  # predictions are keyed by id, process-wide
        self._accepting = True

    # --- the contract ---
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RemoteStream:
        if not prompt_token_ids:
            from scratchllm.errors import ConfigError

            raise ConfigError("the prompt is empty: it has no tokens to continue from")
        if not self._accepting:
            raise RuntimeError("the cluster engine is shutting down")
        loop = asyncio.get_running_loop()  # the contract's "any thread" is the ingress's loop here
        rid = str(request_id) if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        while rid in self._tasks:
            rid = f"{self._prefix}-{next(self._ids)}"
        stream = RemoteStream(rid, self.abort)
        self.counts["submitted"] += 1
        self._tasks[rid] = loop.create_task(self._relay(stream, list(prompt_token_ids), params))
        return stream

    def submit_group(self, prompt_token_ids: list[int], params: list[SamplingParams],
                     request_ids: list[str] | None = None) -> list[RequestStream]:
        """n > 1 across the cluster: each choice is a request of its own (the router sends
        requests with the same prompt to the replica that holds its blocks)."""
        return submit_each(self.submit, prompt_token_ids, params, request_ids)

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def stats(self) -> dict[str, Any]:
        return {"running": len(self._tasks), "waiting": 0, **{f"cluster_{k}": v for k, v in self.counts.items()}}

    def shutdown(self, drain: bool = True) -> None:
        self._accepting = False
        if not drain:
            for task in list(self._tasks.values()):
                task.cancel()

    # --- one request ---
    async def _relay(self, stream: RemoteStream, ids: list[int], params: SamplingParams) -> None:
        rid, arrival, index, avoid = stream.request_id, time.monotonic(), 0, []
        last_error: BaseException | None = None
        try:
            for attempt in range(self.max_attempts):
                replica, gen = None, self.handle.generate.remote(ids, params, rid, tuple(avoid))
                try:
                    async for item in gen:
                        if isinstance(item, str):
                            replica = item
                            continue
                        if item.finish_reason is not None:
                            self._finished(rid, len(ids), item)
                        stream.put(item)
                        index += 1
                    return
                except asyncio.CancelledError:
                    gen.cancel()  # the replica aborts the request and frees its blocks
                    raise
                except Exception as err:  # noqa: BLE001 - a replica's failure is reported, never raised here
                    self._settle(rid)
                    last_error = err
                    if not _replica_gone(err) or index > 0:
                        self.counts["failed_mid_stream" if index > 0 else "failed"] += 1
                        logger.warning("request %s failed on replica %s: %s", rid, replica, err)
                        stream.fail(err, index, arrival)
                        return
                    if replica is not None:
                        avoid.append(replica)
                    self.counts["retried"] += 1
                    logger.warning("request %s: replica %s is gone before the first token; retry %d",
                                   rid, replica, attempt + 1)
                    await asyncio.sleep(self.retry_backoff_s * (attempt + 1))
            self.counts["failed"] += 1
            stream.fail(last_error or RuntimeError("no replica answered"), index, arrival)
        except asyncio.CancelledError:
            self.counts["aborted"] += 1
            if not stream.finished:
                stream.put(TokenEvent(rid, None, "", index, "abort",
                                      metrics=RequestMetrics(arrival, None, None, time.monotonic(), len(ids), index)))
        finally:
            self._settle(rid)
            self._tasks.pop(rid, None)

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
