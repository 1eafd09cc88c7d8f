"""A minimal asyncio HTTP/1.1 client that timestamps each Server-Sent Event as it arrives.

Load testing needs the moment each token reaches the client, not when a library decides to hand
it over; and the run-time dependencies hold no HTTP client. So: one TCP connection per request
(`Connection: close`, cheap on loopback), a request line, a JSON body, then the response read
by Content-Length or by chunked transfer encoding, with SSE events split on blank lines.
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes = b""  # non-streamed body (errors, plain JSON)
    events: list[tuple[float, dict]] = field(default_factory=list)  # (monotonic arrival, SSE JSON)
    done: bool = False  # saw `data: [DONE]`

    def json(self):
        return json.loads(self.body)


def split_url(url: str) -> tuple[str, int, str]:
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"need an http:// URL, got {url!r}")
    return u.hostname, u.port or 80, u.path.rstrip("/")


async def request(url: str, method: str = "GET", body: dict | None = None, timeout: float = 600.0) -> Reply:
    """One HTTP request; an SSE response (text/event-stream) is parsed into timestamped events."""
    host, port, path = split_url(url)
    return await asyncio.wait_for(_request(host, port, method, path or "/", body), timeout)


async def _request(host, port, method, path, body) -> Reply:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        writer.write(head.encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split()
        if len(parts) < 2:
            raise ConnectionError(f"bad status line {status_line!r}")
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        reply = Reply(int(parts[1]), headers)
        sse = headers.get("content-type", "").startswith("text/event-stream")
        buffer = b""
        async for data in _body_chunks(reader, headers):
            if not sse:
                reply.body += data
                continue
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                _take_event(reply, event)
        return reply
    finally:
        writer.close()


def _take_event(reply: Reply, event: bytes) -> None:
    now = time.monotonic()
    for line in event.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            reply.done = True
        else:
            reply.events.append((now, json.loads(data)))


async def _body_chunks(reader: asyncio.StreamReader, headers: dict):
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()  # the blank line after the last chunk (no trailers sent)
                return
            chunk = await reader.readexactly(size)
            await reader.readline()  # CRLF after each chunk
            yield chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()  # until the server closes
