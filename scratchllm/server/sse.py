"""Server-Sent Events: one JSON object per event, and the end-of-stream marker.

Streams need no thread of their own: a RequestStream wakes the event loop with
call_soon_threadsafe when the engine thread puts an event (engine/protocol.py), so a handler
just does `async for event in stream`.
"""

import json
import time
from typing import Any

from starlette.types import Receive

from scratchllm.trace.format import Phase, request_key
from scratchllm.trace.writer import TraceWriter

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client hangs up. The body is already read, so the next message is the end."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ChunkTrace:
    """The server's side of the token trace: per streamed chunk, the time spent serializing it
    (json.dumps) and sending it (from handing it to the ASGI server until it asks for the next:
    the socket write, or the wait for a slow client's window), as spans in the engine's ring.
    Without a ring it only encodes."""

    def __init__(self, writer: TraceWriter | None, request_id: str) -> None:
        self.writer = writer
        self.key = request_key(request_id) if writer is not None else 0
        self.chunks = 0

    def encode(self, payload: dict[str, Any]) -> bytes:
        if self.writer is None:
            return sse(payload)
        start = time.monotonic_ns()
        data = sse(payload)
        self.writer.span(self.key, Phase.SERIALIZE, start, time.monotonic_ns(), count=len(data), index=self.chunks)
        return data

    def sent(self, start_ns: int, nbytes: int) -> None:
        if self.writer is not None:
            self.writer.span(self.key, Phase.NETWORK_SEND, start_ns, time.monotonic_ns(), count=nbytes,
                             index=self.chunks)
        self.chunks += 1
