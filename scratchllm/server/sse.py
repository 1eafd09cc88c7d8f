"""Server-Sent Events: one JSON object per event, and the end-of-stream marker.

Streams need no thread of their own: a RequestStream wakes the event loop with
call_soon_threadsafe when the engine thread puts an event (engine/protocol.py), so a handler
just does `async for event in stream`.
"""

import json
from typing import Any

from starlette.types import Receive

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
