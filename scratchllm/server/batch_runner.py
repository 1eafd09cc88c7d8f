"""The Batch API's worker: runs each batch's lines through this server's own routes, in the
engine's low-priority lane, records each result once, and writes the output and error files.

A line runs as an HTTP request to the app itself, made in-process (an ASGI call: no socket), so
it takes exactly the path a client's request takes: validation, the chat template, the API key,
admission, the model's registry lease, the reply's shape. Its body is the line's, unstreamed.
The call runs with BATCH_LANE set, and generation.py marks every engine request made under it
`low_priority`: the priority policy (engine/policy.py) puts those in its low queue whatever
their max_tokens, admitted in the gaps interactive traffic leaves (below the utilization gate,
a few per tick, behind any waiting interactive request). At most `concurrency` lines of a batch
are in the server at once; a 429 (the server's slots full of interactive requests) or a 503
(a model loading, a drain) puts the line back, to run again after a pause.

The worker also keeps out of interactive traffic's way, which the policy alone cannot: a batch
request admitted in a gap keeps decoding beside the interactive requests that arrive after it,
and on a CPU every row in a step costs the step time every interactive token waits for. So a
line starts only while no interactive request is in the server, and a line still running when
one arrives is withdrawn (its engine request aborted, its blocks freed) and put back, to run
again from the start in the next gap: it records no result, so it is still recorded once.
Batch work then takes the server's idle time; under interactive traffic that never pauses it
waits, as a low-priority job should (`yielded` counts the withdrawals).

After a crash the worker resumes every batch that was not finished: the lines with no recorded
result run (batch_store.py's invariant: each line has one result or none), so none is lost and
none is recorded twice. The output file lists the successful lines and the error file the
others, each in the input's order, as OpenAI writes them:

    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}
"""

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from scratchllm.server.batch_store import ACTIVE, BatchStore, Line, new_id

logger = logging.getLogger(__name__)

BATCH_LANE: contextvars.ContextVar[bool] = contextvars.ContextVar("scratchllm_batch_lane", default=False)
RETRY_PAUSE_S = 0.5  # after a 429 or 503, before the line is tried again
GAP_POLL_S = 0.01  # how often a waiting or running line looks for interactive requests
IDLE_POLL_S = 0.5  # how often an idle worker looks for work (a new batch also wakes it)

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def call(app: ASGIApp, path: str, body: dict[str, Any], api_key: str | None) -> tuple[int, Any]:
    """POST `body` to `path` of `app` in-process; (status, the reply's JSON, or its text)."""
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if api_key:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("batch", 0), "server": ("batch", 0)}
    done = asyncio.Event()
    sent = False
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()  # the "client" stays until the reply is whole (a disconnect would abort it)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    token = BATCH_LANE.set(True)
    try:
        await app(scope, receive, send)
    finally:
        BATCH_LANE.reset(token)
        done.set()
    text = b"".join(chunks)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text.decode("utf-8", "replace")


def _engine_requests(endpoint: str, body: dict[str, Any]) -> int:
    """How many engine requests a line makes (what it adds to the server's in-flight count):
    n per prompt; none for embeddings, which the generation engine does not run."""
    if endpoint.endswith("/embeddings"):
        return 0
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    n = body.get("n")
    return prompts * (n if isinstance(n, int) and n > 0 else 1)


class BatchRunner:
    """One per app: runs the store's active batches, one after another, oldest first."""

    def __init__(self, store: BatchStore, app: ASGIApp, api_key: str | None, concurrency: int,
                 in_flight: Callable[[], int] = lambda: 0) -> None:
        assert concurrency >= 1
        self.store, self.app, self.api_key, self.concurrency = store, app, api_key, concurrency
        self.in_flight = in_flight  # engine requests the server holds now, interactive and batch
        self.wake = asyncio.Event()
        self.ran = 0  # lines this worker ran to a result (a resumed batch's are those left)
        self.yielded = 0  # lines withdrawn because interactive requests arrived
        self.mine = 0  # engine requests of the lines running now

    def interactive(self) -> int:
        return self.in_flight() - self.mine

    async def run_forever(self) -> None:
        while True:
            active = list(reversed(self.store.batches(ACTIVE)))
            if not active:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), IDLE_POLL_S)
                except TimeoutError:
                    pass
                continue
            for batch_id in active:
                try:
                    await self.run(batch_id)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("batch %s failed", batch_id)
                    self.store.move(batch_id, "cancelling")
                    self.finish(batch_id)

    async def run(self, batch_id: str) -> None:
        store = self.store
        batch = store.batch(batch_id)
        assert batch is not None
        store.move(batch_id, "in_progress")
        if batch["status"] not in ("finalizing", "cancelling"):
            queue: asyncio.Queue[Line] = asyncio.Queue()
            for line in store.pending(batch_id):
                queue.put_nowait(line)
            workers = [asyncio.ensure_future(self._lines(batch_id, batch["endpoint"], queue))
                       for _ in range(self.concurrency)]
            try:
                await asyncio.gather(*workers)
            finally:
                for w in workers:
                    w.cancel()
            if store.status(batch_id) == "in_progress":
                if time.time() > batch["expires_at"]:
                    store.move(batch_id, "expired")
                else:
                    store.move(batch_id, "finalizing")
        self.finish(batch_id)

    async def _lines(self, batch_id: str, endpoint: str, queue: asyncio.Queue[Line]) -> None:
        while not queue.empty() and self.store.status(batch_id) == "in_progress":
            line = queue.get_nowait()
            body = {k: v for k, v in line.body.items() if k not in ("stream", "stream_options")}  # whole replies
            while self.interactive() > 0:  # a gap in interactive traffic first
                await asyncio.sleep(GAP_POLL_S)
            result = await self._call(endpoint, body, _engine_requests(endpoint, body))
            if result is None:  # withdrawn for interactive requests
                queue.put_nowait(line)
                continue
            status, reply = result
            if status in (429, 503):
                queue.put_nowait(line)  # the server is full or a model is loading: again, later
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            request_id = reply.get("id", new_id("req_")) if isinstance(reply, dict) else new_id("req_")
            if self.store.record(batch_id, line, status, reply, None, request_id):
                self.ran += 1

    async def _call(self, endpoint: str, body: dict[str, Any], requests: int) -> tuple[int, Any] | None:
        """The line's call, or None when interactive requests arrived while it ran (it is then
        cancelled: the route's generation closes and the engine aborts the request)."""
        self.mine += requests
        task = asyncio.ensure_future(call(self.app, endpoint, body, self.api_key))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=GAP_POLL_S)
                if done:
                    return task.result()
                if self.interactive() > 0:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    self.yielded += 1
                    return None
        finally:
            if not task.done():
                task.cancel()
            self.mine -= requests

    def finish(self, batch_id: str) -> None:
        """Write the output and error files and end the batch (completed, cancelled or expired)."""
        store = self.store
        status = store.status(batch_id)
        if status not in ("finalizing", "cancelling", "expired"):
            return
        ok: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        for r in store.results(batch_id):
            line = {"id": new_id("batch_req_"), "custom_id": r["custom_id"],
                    "response": {"status_code": r["status_code"], "request_id": r["request_id"], "body": r["body"]},
                    "error": r["error"]}
            (ok if 200 <= r["status_code"] < 300 else failed).append(line)
        if status == "expired":
            failed += [{"id": new_id("batch_req_"), "custom_id": ln.custom_id, "response": None,
                        "error": {"code": "batch_expired", "message": "the batch expired before this request ran"}}
                       for ln in store.pending(batch_id)]
        files = {}
        for key, lines in (("output_file_id", ok), ("error_file_id", failed)):
            if lines:
                data = "".join(json.dumps(ln, ensure_ascii=False) + "\n" for ln in lines).encode()
                files[key] = store.add_file(data, f"{batch_id}_{key.split('_')[0]}.jsonl", "batch_output")["id"]
        if status == "expired":
            store.db.execute("UPDATE batch SET output_file_id = ?, error_file_id = ? WHERE id = ?",
                             (files.get("output_file_id"), files.get("error_file_id"), batch_id))
            return
        store.move(batch_id, "completed" if status == "finalizing" else "cancelled", **files)
        logger.info("batch %s %s: %d ok, %d failed", batch_id, store.status(batch_id), len(ok), len(failed))
