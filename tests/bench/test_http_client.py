"""The load generator's client times each Server-Sent Event when it arrives, whatever the
framing: a stream that is neither chunked nor sized (ended by the server's close), CRLF line
ends, `data:` without a space; headers reach the server; metrics keep their labels."""

import asyncio
import time

from scratchllm.bench import http_client

GAP_S = 0.2


async def _serve_once(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _slow_sse(events: list[bytes], seen_headers: list[bytes]):
    async def handler(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        seen_headers.append(head)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")) or 0)
        await reader.readexactly(length)
        # HTTP/1.1 with neither Content-Length nor chunked encoding: the body ends at close
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await writer.drain()
        for e in events:
            writer.write(e)
            await writer.drain()
            await asyncio.sleep(GAP_S)
        writer.close()

    return handler


def test_unsized_stream_with_crlf_events_is_timed_per_event():
    events = [b'data:{"n": 0}\r\n\r\n', b'data: {"n": 1}\r\n\r\n', b'data:{"n":\r\ndata: 2}\r\n\r\n',
              b"data: [DONE]\r\n\r\n"]
    headers: list[bytes] = []

    async def main():
        server, url = await _serve_once(_slow_sse(events, headers))
        async with server, http_client.new_client(10, {"Authorization": "Bearer k-123"}) as client:
            start = time.monotonic()
            reply = await http_client.request(client, url + "/v1/completions", "POST", {"prompt": "x"})
        return start, reply

    start, reply = asyncio.run(main())
    assert reply.status == 200 and reply.done
    assert [e["n"] for _, e in reply.events] == [0, 1, 2]  # the third event spans two data lines
    times = [t - start for t, _ in reply.events]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(g >= GAP_S * 0.75 for g in gaps), gaps  # each event stamped when it arrived
    assert b"authorization: bearer k-123" in headers[0].lower()  # the client sends the given headers


def test_metrics_keep_their_labels():
    text = (
        "# HELP x_requests Finished requests\n# TYPE x_requests counter\n"
        'x_requests_total{finish_reason="stop",model_name="m"} 3.0\n'
        'x_requests_total{finish_reason="length",model_name="m"} 4.0\n'
        "# HELP x_running Running\n# TYPE x_running gauge\nx_running 2.0\n"
    )
    m = http_client.parse_metrics(text)
    assert m['x_requests_total{finish_reason="stop",model_name="m"}'] == 3.0
    assert m['x_requests_total{finish_reason="length",model_name="m"}'] == 4.0
    assert m["x_running"] == 2.0
