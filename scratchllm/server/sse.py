"""Server-Sent Events: one JSON object per event, and the end-of-stream marker; and the
server's timing of the bytes it writes (ChunkTrace).

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
# A comment line (SSE's keep-alive): every SSE client, the openai one included, skips it.
SSE_PING = b": ping\n\n"


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
    """The server's own time on one HTTP request's reply: per streamed chunk, the time spent
    serializing it (json.dumps) and sending it (from handing it to the ASGI server until it asks
    for the next: the socket write, or the wait for a slow client's window). Each is a span in
    the engine's ring when there is one, and adds to the totals the reply's `timings` report
    (`server_timings`), so the ring and the response say the same thing."""

    def __init__(self, writer: TraceWriter | None, request_id: str) -> None:
        self.writer = writer
        self.key = request_key(request_id) if writer is not None else 0
        self.chunks = 0
        self.serialize_ns = 0  # all the chunks serialized so far
        self.send_ns = 0  # all the chunks sent so far

    def encode(self, payload: dict[str, Any]) -> bytes:
        start = time.monotonic_ns()
        data = sse(payload)
        self._serialized(start, data)
        return data

    def encode_body(self, body: dict[str, Any]) -> bytes:
        """A non-streamed reply's JSON (as Starlette's JSONResponse writes it), its `timings`
        with serialize_ms added: the time encoding the rest of the body. The timings object is
        the body's last field, encoded after that measurement, so it cannot count itself."""
        timings = body.get("timings")
        rest = body if timings is None else {k: v for k, v in body.items() if k != "timings"}
        start = time.monotonic_ns()
        data = json.dumps(rest, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        self._serialized(start, data)
        if timings is None:
            return data
        assert rest and data.endswith(b"}"), "the body is a non-empty JSON object"
        # send_ms: null, the body is sent after it is written
        timings = {**timings, **self.server_timings(), "send_ms": None}
        return data[:-1] + b',"timings":' + json.dumps(timings, allow_nan=False, separators=(",", ":")).encode() + b"}"

    def _serialized(self, start_ns: int, data: bytes) -> None:
        end = time.monotonic_ns()
        self.serialize_ns += end - start_ns
        if self.writer is not None:
            self.writer.span(self.key, Phase.SERIALIZE, start_ns, end, count=len(data), index=self.chunks)

    def sent(self, start_ns: int, nbytes: int) -> None:
        end = time.monotonic_ns()
        self.send_ns += end - start_ns
        if self.writer is not None:
            self.writer.span(self.key, Phase.NETWORK_SEND, start_ns, end, count=nbytes, index=self.chunks)
        self.chunks += 1

    def server_timings(self) -> dict[str, float]:
        """The reply's serialize and send time so far, in ms."""
        return {"serialize_ms": round(self.serialize_ns / 1e6, 3), "send_ms": round(self.send_ns / 1e6, 3)}
