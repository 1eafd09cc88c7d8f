"""From the engine's thread to the event loop, and from there to Server-Sent Events.

The engine steps in a thread of its own and a RequestStream is a blocking iterator. Iterating it
on the event loop would freeze every other connection for a whole request, so each stream gets
a small pump thread that blocks on it and hands each event to the loop with
`loop.call_soon_threadsafe` into a per-request asyncio.Queue. The pump thread spends its life
blocked on a queue (GIL released), so it costs the engine nothing; the loop only ever awaits.

Cancellation is the other direction: when the consumer goes away (client disconnect, server
error) `EventBridge.aclose()` calls `stream.abort()`, which returns the request's KV blocks; the
pump thread keeps draining until the engine's final "abort" event, then ends.
"""

import asyncio
import json
import threading
from collections.abc import AsyncIterator


class EventBridge:
    """Async iteration over one engine RequestStream (see the module docstring)."""

    def __init__(self, stream, loop: asyncio.AbstractEventLoop | None = None):
        self.stream = stream
        self.finished = False
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._thread = threading.Thread(target=self._pump, name="stream-pump", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for event in self.stream:
                self._post(event)
        except BaseException as err:  # noqa: BLE001 - the engine's failure is re-raised on the loop
            self._post(err)

    def _post(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    def __aiter__(self) -> AsyncIterator:
        return self._events()

    async def _events(self):
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finish_reason is not None:
                self.finished = True
            yield item

    def aclose(self) -> None:
        """Abort the request unless it already finished: its blocks go back to the pool."""
        if not self.finished:
            self.finished = True
            self.stream.abort()


def sse(payload: dict) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def wait_for_disconnect(receive) -> None:
    """Return when the client hangs up. The body is already read, so the next message is the end."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
