"""AsyncEngine: the continuous engine behind a thread, implementing the EngineClient contract
(protocol.py). Thread-safe submit / abort / shutdown; each request's events arrive on its own
RequestStream, in order, readable from a thread or from an event loop.

One thread owns the LLMEngine and is the only one that touches it (the thread, its condition
and shutdown are ThreadedEngine's, threaded.py): submissions and aborts go into an inbox that
the thread drains between steps, so the scheduler and the block manager never see two threads.
When there is nothing to compute the thread waits one scheduling tick (10 ms) or until a
submission wakes it, whichever comes first: a new high-priority request is admitted at once,
without a busy loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from scratchllm.engine.engine import LLMEngine
from scratchllm.engine.protocol import EngineStats, RequestStream, TokenEvent
from scratchllm.engine.threaded import ThreadedEngine
from scratchllm.errors import ConfigError
from scratchllm.models.heap import release_free_heap
from scratchllm.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequests:
    """Inbox: requests on one prompt to add (one, or a group that forks the prompt's blocks)."""

    request_ids: tuple[str, ...]
    prompt_token_ids: tuple[int, ...]
    params: tuple[SamplingParams, ...]
    arrival: float  # when submit was called, on the engine's clock: the wait for the step in flight is queueing
    group: bool  # LLMEngine.add_group (the prompt computed once), else add_request


@dataclass(frozen=True)
class AbortRequest:
    """Inbox: a request to stop now (its blocks go back to the pool)."""

    request_id: str


InboxMessage = AddRequests | AbortRequest


class AsyncEngine(ThreadedEngine):
    def __init__(self, engine: LLMEngine):
        super().__init__("req", "scratchllm-engine")
        self.engine = engine
        self.tick_s = engine.config.tick_s
        self.max_model_len = engine.max_model_len
        self._inbox: list[InboxMessage] = []
        self._snapshot = engine.stats()  # written by the engine thread only, read under _cv
        self._start()

    # --- the contract ---
    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its stream at once. Bad input raises ConfigError here."""
        self.engine.validate(prompt_token_ids, params)
        with self._cv:
            stream: RequestStream = self._streams.open(request_id)
            # arrival is now, not when the engine thread takes it in: the wait for the step in
            # flight is queueing too (RequestMetrics.queue_ms)
            self._inbox.append(AddRequests((stream.request_id,), tuple(prompt_token_ids), (params,),
                                           self.engine.clock(), group=False))
            self._cv.notify()
        return stream

    def submit_group(self, prompt_token_ids: Sequence[int], params: Sequence[SamplingParams],
                     request_ids: Sequence[str] | None = None) -> list[RequestStream]:
        """One prompt, len(params) requests that fork its KV blocks (LLMEngine.add_group)."""
        if not params:
            raise ConfigError("a group needs at least one request")
        for p in params:
            self.engine.validate(prompt_token_ids, p)
        with self._cv:
            streams: list[RequestStream] = self._streams.open_group(request_ids, len(params))
            self._inbox.append(AddRequests(tuple(s.request_id for s in streams), tuple(prompt_token_ids),
                                           tuple(params), self.engine.clock(), group=True))
            self._cv.notify()
        return streams

    def abort(self, request_id: str) -> None:
        self._post(AbortRequest(str(request_id)))

    def stats(self) -> EngineStats:
        """The engine's counters as of the last finished step. Other threads never read the
        engine itself (it may be mid-step): the engine thread publishes a snapshot per step."""
        with self._cv:
            snapshot = self._snapshot
        return dataclasses.replace(snapshot, finished=self._streams.counts())

    # --- the engine thread ---
    def _post(self, message: InboxMessage) -> None:
        with self._cv:
            self._inbox.append(message)
            self._cv.notify()

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            self._streams.deliver(event)

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for message in inbox:
            if isinstance(message, AbortRequest):
                final = self.engine.abort(message.request_id)
                if final is not None:
                    self._deliver([final])
                continue
            ids, rids = list(message.prompt_token_ids), list(message.request_ids)
            try:
                if message.group:
                    self.engine.add_group(rids, ids, list(message.params), arrival=message.arrival)
                else:
                    self.engine.add_request(rids[0], ids, message.params[0], arrival=message.arrival)
            except Exception as err:  # noqa: BLE001 - validated in submit; never kill the loop
                logger.warning("request %s refused: %s", rids[0], err)
                self._deliver([TokenEvent(r, None, "", 0, "abort") for r in rids])

    def _loop(self) -> None:
        engine = self.engine
        worked = False  # whether a step ran since the engine was last idle
        while True:
            idle = not engine.has_work()
            if idle and worked:  # the work just ended: give back the heap pages it freed (models/heap.py)
                release_free_heap()
            worked = not idle
            with self._cv:
                if not self._inbox and idle and not self._stopping:  # only this thread changes the engine
                    self._cv.wait(timeout=self.tick_s)  # idle: one tick, or a submission
                self._drain_inbox()
                if self._stopping and not engine.has_work():
                    break
            try:
                events = engine.step()
            except Exception:  # logged; a failed step aborts its requests, not the server
                logger.exception("an engine step failed; its requests are aborted")
                with self._cv:
                    events = [e for rid in list(engine.requests) if (e := engine.abort(rid)) is not None]
            snapshot = engine.stats()
            with self._cv:
                self._snapshot = snapshot
                self._deliver(events)
            if engine.last_step_tokens == 0 and engine.has_work():
                # waiting requests that this tick may not admit (the per-tick limit, a full pool):
                # sleep to the next tick instead of spinning
                with self._cv:
                    if not self._inbox:
                        self._cv.wait(timeout=self.tick_s)
