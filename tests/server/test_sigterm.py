"""SIGTERM under load, on a real `scratchllm serve --fake-engine` process and httpx clients: the
drain answers new requests with 503 + Retry-After (on new and kept-alive connections) while the
streams in flight finish; a second SIGTERM, or the drain's deadline, cuts them with an SSE error
event and the process exits 1."""

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

BODY = {"model": "fake", "prompt": "drain me", "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}


@contextlib.contextmanager
def serve(*options: str):
    """(process, base URL) of `scratchllm serve --fake-engine` on a free port; killed if still alive."""
    proc = subprocess.Popen([sys.executable, "-m", "scratchllm.cli.main", "serve", "--fake-engine", "--port", "0",
                             "--fake-step-ms", "20", "--embedding-model", "none", *options],
                            stderr=subprocess.PIPE, text=True)
    reader = None
    try:
        line = proc.stderr.readline()
        found = re.search(r"http://\S+", line)
        assert found, f"server did not start: {line}{proc.stderr.read() if proc.poll() is not None else ''}"
        url = found.group(0)
        # the rest of stderr is read all along (the drain logs there; a full pipe would block it)
        log: list[str] = []
        reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.05)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if reader is not None:
            reader.join(timeout=5)
        proc.stderr.close()


def read_events(response: httpx.Response, first: int, then) -> list[str]:
    """The stream's data lines; `then()` is called after the first `first` of them."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        events.append(line)
        if len(events) == first:
            then()
    return events


def test_sigterm_drains_streams_and_answers_new_requests_503_until_done():
    with serve("--drain-timeout", "20") as (proc, url, log):
        with httpx.Client(timeout=20) as kept, httpx.Client(timeout=20) as streaming:
            assert kept.get(url + "/health").status_code == 200  # a connection kept alive from before the signal
            during: dict[str, httpx.Response] = {}

            def sigterm_then_probe():
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.4)  # the drain starts at the server loop's next tick (0.1 s)
                during["kept"] = kept.post(url + "/v1/completions", json={**BODY, "stream": False, "max_tokens": 2})
                with httpx.Client(timeout=5) as fresh:  # a new connection: the listening socket is still open
                    during["fresh"] = fresh.post(url + "/v1/completions", json={**BODY, "max_tokens": 2})
                    during["health"] = fresh.get(url + "/health")
                    during["metrics"] = fresh.get(url + "/metrics")

            with streaming.stream("POST", url + "/v1/completions", json={**BODY, "max_tokens": 60}) as r:
                events = read_events(r, 4, sigterm_then_probe)
        assert proc.wait(timeout=15) == 0, "".join(log)
    for name in ("kept", "fresh", "health"):
        reply = during[name]
        assert reply.status_code == 503, (name, reply.text)
        assert int(reply.headers["Retry-After"]) >= 1
        assert reply.headers["Connection"] == "close"
        assert reply.json()["error"]["code"] == "shutting_down"
    assert during["metrics"].status_code == 200
    data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert events[-1] == "data: [DONE]"
    assert data[-1]["usage"]["completion_tokens"] == 60  # the stream in flight ran to its end
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


@pytest.mark.parametrize("how", ["second sigterm", pytest.param("deadline", marks=pytest.mark.slow)])
def test_drain_cut_ends_streams_with_an_error_event_and_exits_1(how):
    drain_timeout = "30" if how == "second sigterm" else "1"
    with serve("--drain-timeout", drain_timeout) as (proc, url, log):
        plain: dict[str, httpx.Response] = {}

        def unstreamed():  # a reply not yet begun when the cut comes: a 503
            with httpx.Client(timeout=30) as c:
                plain["reply"] = c.post(url + "/v1/completions", json={**BODY, "stream": False, "max_tokens": 2000})

        waiter = threading.Thread(target=unstreamed)
        waiter.start()

        def signal_it():
            proc.send_signal(signal.SIGTERM)
            if how == "second sigterm":
                time.sleep(0.5)
                proc.send_signal(signal.SIGTERM)

        start = time.monotonic()
        with httpx.Client(timeout=30) as c, \
                c.stream("POST", url + "/v1/completions", json={**BODY, "max_tokens": 2000}) as r:
            events = read_events(r, 3, signal_it)
        cut_after = time.monotonic() - start
        waiter.join(timeout=10)
        assert proc.wait(timeout=15) == 1, "".join(log)
    assert cut_after < 10, f"the stream of 2000 x 20 ms was not cut: {cut_after:.1f} s"
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "shutting_down", events[-3:]
    assert "data: [DONE]" not in events
    assert plain["reply"].status_code == 503 and plain["reply"].json()["error"]["code"] == "shutting_down"
