"""StreamHost: the bookkeeping every engine behind the EngineClient contract (protocol.py) shares,
written once: request ids (RequestIds, which LLMEngine uses too), the table of open streams, the
finished counters and what shutdown(drain) refuses and ends.

    open(request_id) -> stream      a caller's id is kept; ours ("<prefix>-1", ...) never collide
    deliver(event)                  to its stream; the last event closes it and is counted
    close(drain) -> [request id]    refuse new requests; without drain, the ids to abort now

Thread-safe (one lock of its own, never held while calling out). Invariant: a stream is in the
table from open until its last event was delivered; each finished request is counted once,
under its finish reason. Events of a request that is not open (ended, or never opened) are
dropped: an abort racing its request's last token ends it once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from scratchllm.engine.protocol import FINISH_REASONS, RequestStream, TokenEvent


class RequestIds:
    """Request ids for requests given none: "<prefix>-1", "<prefix>-2", ... (thread-safe)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._count = itertools.count(1)  # next() on a count is atomic under the GIL

    def next(self) -> str:
        return f"{self.prefix}-{next(self._count)}"


class StreamHost:
    def __init__(self, prefix: str, abort: Callable[[str], None], stream_type: type[RequestStream] = RequestStream):
        self._abort, self._stream_type = abort, stream_type
        self._lock = threading.Lock()
        self._ids = RequestIds(prefix)
        self._streams: dict[str, RequestStream] = {}
        self._accepting = True
        self._finished = dict.fromkeys(FINISH_REASONS, 0)

    def open(self, request_id: str | None = None) -> Any:
        """A new request's stream (of `stream_type`), in the table. RuntimeError once closed."""
        return self.open_group(None if request_id is None else [request_id], 1)[0]

    def open_group(self, request_ids: Sequence[str] | None, n: int) -> list[Any]:
        """n streams at once (one prompt's group): all opened, or none when the host is closed."""
        assert request_ids is None or len(request_ids) == n
        with self._lock:
            if not self._accepting:
                raise RuntimeError("the engine is shutting down")
            streams = []
            for i in range(n):
                rid = str(request_ids[i]) if request_ids is not None else self._ids.next()
                while rid in self._streams:  # a caller's id that is open already: ours instead
                    rid = self._ids.next()
                stream = self._stream_type(rid, self._abort)
                self._streams[rid] = stream
                streams.append(stream)
            return streams

    def get(self, request_id: str) -> Any:
        with self._lock:
            return self._streams.get(request_id)

    def deliver(self, event: TokenEvent) -> bool:
        """Put the event on its request's stream; False (dropped) if that request is not open."""
        with self._lock:
            stream = self._streams.get(event.request_id)
            if stream is None:
                return False
            if event.finish_reason is not None:
                del self._streams[event.request_id]
                self._finished[event.finish_reason] += 1
        stream.put(event)
        return True

    def end_all(self) -> None:
        """Every stream still open gets an abort event (an engine thread that is leaving)."""
        for rid in self.open_ids():
            self.deliver(TokenEvent(rid, None, "", 0, "abort"))

    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def counts(self) -> dict[str, int]:
        """The finished counters: requests ended per finish reason."""
        with self._lock:
            return dict(self._finished)

    def close(self, drain: bool) -> list[str]:
        """shutdown(drain)'s first half: refuse new requests from now on. With drain the open ones
        run to their end (none returned); without, the caller aborts the ids returned."""
        with self._lock:
            self._accepting = False
            return [] if drain else list(self._streams)
