"""AsyncEngine: the engine behind a thread, for the server. Thread-safe submit / abort / shutdown;
each request's tokens arrive on its own RequestStream as TokenEvents, in order.

One thread owns the LLMEngine and is the only one that touches it: submissions and aborts go
into an inbox that the thread drains between steps, so the scheduler and the block manager
never see two threads. When there is nothing to compute the thread waits one scheduling tick
(10 ms) or until a submission wakes it, whichever comes first: a new high-priority request is
admitted at once, as the seed asks, without a busy loop.
"""

import itertools
import queue
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

from scratchllm.engine.engine import LLMEngine, StepOutput
from scratchllm.engine.request import RequestMetrics


@dataclass
class TokenEvent:
    token_id: int | None
    text: str  # complete-UTF-8 text delta
    index: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    logprob: float | None = None
    top_logprobs: dict | None = None  # token id -> logprob of the most likely tokens
    metrics: RequestMetrics | None = None  # on the last event


class RequestStream:
    """Iterate to receive a request's TokenEvents; the last one has a finish_reason."""

    def __init__(self, owner: "AsyncEngine", request_id: str):
        self._owner = owner
        self.request_id = request_id
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self.finished = False

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self._events.get()
            yield event
            if event.finish_reason is not None:
                return

    def abort(self) -> None:
        """Stop the request; its blocks return to the pool before the next step."""
        self._owner._post(("abort", self.request_id))


def _event(o: StepOutput) -> TokenEvent:
    top = dict(o.top_logprobs) if o.top_logprobs is not None else None
    return TokenEvent(o.token_id, o.text, o.index, o.finish_reason, o.logprob, top, o.metrics)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tick_s = engine.config.tick_s
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count(1)
        self._accepting = True
        self._stopping = False
        self._finished = {"stop": 0, "length": 0, "abort": 0}
        self._snapshot = engine.stats()  # written by the engine thread only, read under _cv
        self._thread = threading.Thread(target=self._loop, name="scratchllm-engine", daemon=True)
        self._thread.start()

    # --- the contract ---
    def submit(self, prompt_token_ids, params, request_id=None) -> RequestStream:
        """Queue a request; returns its stream at once. Bad input raises ConfigError here."""
        self.engine.validate(prompt_token_ids, params)
        with self._cv:
            if not self._accepting:
                raise RuntimeError("the engine is shutting down")
            rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
            while rid in self._streams:  # a caller's id is kept; ours never collide
                rid = f"req-{next(self._ids)}"
            stream = RequestStream(self, rid)
            self._streams[rid] = stream
            self._inbox.append(("add", rid, list(prompt_token_ids), params))
            self._cv.notify()
        return stream

    def abort(self, request_id) -> None:
        self._post(("abort", str(request_id)))

    def stats(self) -> dict:
        """The engine's counters as of the last finished step. Other threads never read the
        engine itself (it may be mid-step): the engine thread publishes a snapshot per step."""
        with self._cv:
            stats = dict(self._snapshot)
            stats["finished"] = dict(self._finished)
        return stats

    def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; with drain, finish the running and waiting ones, else abort them."""
        with self._cv:
            self._accepting = False
            if not drain:
                self._inbox += [("abort", rid) for rid in list(self._streams)]
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    # --- the engine thread ---
    def _post(self, message) -> None:
        with self._cv:
            self._inbox.append(message)
            self._cv.notify()

    def _deliver(self, outputs) -> None:
        for o in outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue
            if o.finish_reason is not None:
                del self._streams[o.request_id]
                self._finished[o.finish_reason] += 1
            stream._events.put(_event(o))

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for message in inbox:
            if message[0] == "add":
                _, rid, ids, params = message
                try:
                    self.engine.add_request(rid, ids, params)
                except Exception as err:  # noqa: BLE001 - validated in submit; never kill the loop
                    print(f"scratchllm engine: request {rid} refused: {err}", file=sys.stderr)
                    self._deliver([StepOutput(rid, None, "", 0, "abort")])
            else:
                final = self.engine.abort(message[1])
                if final is not None:
                    self._deliver([final])

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                if not self._inbox and not engine.has_work() and not self._stopping:
                    self._cv.wait(timeout=self.tick_s)  # idle: one tick, or a submission
                self._drain_inbox()
                if self._stopping and not engine.has_work():
                    break
            try:
                outputs = engine.step()
            except Exception:  # noqa: BLE001 - a failed step aborts its requests, not the server
                traceback.print_exc(file=sys.stderr)
                with self._cv:
                    outputs = [o for rid in list(engine.requests) if (o := engine.abort(rid)) is not None]
            snapshot = engine.stats()
            with self._cv:
                self._snapshot = snapshot
            self._deliver(outputs)
            if engine.last_step_tokens == 0 and engine.has_work():
                # waiting requests that this tick may not admit (the 2-per-tick rule, a full pool):
                # sleep to the next tick instead of spinning
                with self._cv:
                    if not self._inbox:
                        self._cv.wait(timeout=self.tick_s)
        with self._cv:  # anything still listening gets its end
            for rid in list(self._streams):
                self._deliver([StepOutput(rid, None, "", 0, "abort")])
