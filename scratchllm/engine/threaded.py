"""ThreadedEngine: the skeleton the in-process engines behind the EngineClient contract share
(the continuous engine's AsyncEngine, the static baseline's StaticEngine, the FakeEngine),
written once: one thread that owns the work, a condition that guards what other threads hand
it and wakes it, the open streams (StreamHost), and shutdown(drain).

    submit / abort      any thread: take the condition, change the shared state, notify
    _loop               the engine's thread: wait on the condition for work, compute outside
                        it, deliver events under it; return once `_stopping` and no work is left
    shutdown(drain)     refuse new requests; without drain abort every open one (under the
                        condition, so the thread sees all of it or none); wake the thread; join

The condition's lock is reentrant: abort() takes it too, and shutdown calls abort() under it.

Invariant: when shutdown returns, the thread has ended and every stream opened had its last
event (a thread that ends, normally or by an error, ends the streams still open with "abort").
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

from scratchllm.engine.protocol import RequestStream, submit_each
from scratchllm.engine.streams import StreamHost
from scratchllm.sampling import SamplingParams


class ThreadedEngine(ABC):
    def __init__(self, stream_prefix: str, thread_name: str) -> None:
        self._cv = threading.Condition()  # an RLock underneath (see the module doc)
        self._streams = StreamHost(stream_prefix, self.abort)
        self._stopping = False  # set once by shutdown, under _cv
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        """Start the thread: the last line of a subclass's __init__, once its state exists."""
        self._thread.start()

    @abstractmethod
    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream: ...

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def _loop(self) -> None:
        """The engine's thread (see the module doc)."""

    def submit_group(self, prompt_token_ids: Sequence[int], params: Sequence[SamplingParams],
                     request_ids: Sequence[str] | None = None) -> list[RequestStream]:
        """One request per params; nothing is shared between them (only the paged engine can)."""
        return submit_each(self.submit, prompt_token_ids, params, request_ids)

    @property
    def finished(self) -> dict[str, int]:
        """Requests ended per finish reason (stats().finished)."""
        return self._streams.counts()

    def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; with drain, finish the running and waiting ones, else abort them."""
        with self._cv:
            for request_id in self._streams.close(drain):
                self.abort(request_id)
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._cv:  # anything still listening gets its end
                self._streams.end_all()
