"""OpenAI's Files and Batch API: upload a JSONL file of requests, make a batch of it, and read its
output file when it is done (batch_runner.py runs it, batch_store.py keeps it across restarts).

    POST   /v1/files                      multipart: `file`, `purpose` ("batch"; "user_data" kept too)
    GET    /v1/files[?purpose=]           the files, newest first
    GET    /v1/files/{id}                 one file's object
    GET    /v1/files/{id}/content         its bytes
    DELETE /v1/files/{id}
    POST   /v1/batches                    {"input_file_id", "endpoint", "completion_window": "24h", "metadata"?}
    GET    /v1/batches[?after=&limit=]    the batches, newest first
    GET    /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Each input line is `{"custom_id", "method": "POST", "url": ENDPOINT, "body": {...}}`, the url the
batch's endpoint, one of the routes whose row in the route table says `batch` (chat
completions, completions, embeddings); custom_ids are unique. A file that breaks these rules
makes a batch that is `failed` at once, its `errors` naming each line at fault, as OpenAI's does.
"""

import email.parser
import email.policy
import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from scratchllm.server.batch_store import BatchStore, Line
from scratchllm.server.errors import APIError, bad_request
from scratchllm.server.messages import Strict
from scratchllm.server.protocol import parse_body

PURPOSES = ("batch", "user_data", "batch_output")
MAX_FILE_BYTES = 200 << 20  # OpenAI's limit for a batch input file
MAX_LINES = 50_000  # OpenAI's limit of requests in one batch


class BatchCreateRequest(Strict):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)


def _store(request: Request) -> BatchStore:
    store: BatchStore = request.app.state.batches
    return store




async def _multipart(request: Request) -> tuple[bytes, str, str]:
    """(the file's bytes, its name, the purpose) of a multipart/form-data upload, read with the
    standard library's MIME parser; at most MAX_FILE_BYTES."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise bad_request("upload the file as multipart/form-data with fields 'file' and 'purpose'", param="file")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FILE_BYTES + 65536:
            raise APIError(413, f"the file is larger than {MAX_FILE_BYTES} bytes", code="file_too_large")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + bytes(body))
    fields: dict[str, tuple[bytes, str | None]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str):
            fields[name] = (payload if isinstance(payload, bytes) else b"", part.get_filename())
    if "file" not in fields:
        raise bad_request("the upload has no 'file' field", param="file")
    purpose = fields.get("purpose", (b"", None))[0].decode("utf-8", "replace").strip()
    if purpose not in PURPOSES[:2]:
        raise bad_request(f"purpose must be one of {', '.join(PURPOSES[:2])}, got {purpose!r}", param="purpose")
    data, filename = fields["file"]
    return data, filename or "upload.jsonl", purpose


# ---- files ------------------------------------------------------------------------------------------
async def upload_file(request: Request) -> dict[str, Any]:
    data, filename, purpose = await _multipart(request)
    if len(data) > MAX_FILE_BYTES:
        raise APIError(413, f"the file is larger than {MAX_FILE_BYTES} bytes", code="file_too_large")
    return _store(request).add_file(data, filename, purpose)


async def list_files(request: Request) -> dict[str, Any]:
    purpose = request.query_params.get("purpose")
    files = _store(request).files(purpose)
    return {"object": "list", "data": files, "first_id": files[0]["id"] if files else None,
            "last_id": files[-1]["id"] if files else None, "has_more": False}


def _found(obj: dict[str, Any] | None, what: str, given: str, param: str) -> dict[str, Any]:
    if obj is None:
        raise APIError(404, f"No such {what} object: {given}", type="not_found", param=param)
    return obj


def _file(request: Request, file_id: str) -> dict[str, Any]:
    return _found(_store(request).file(file_id), "File", file_id, "file_id")


async def retrieve_file(request: Request, file_id: str) -> dict[str, Any]:
    return _file(request, file_id)


async def file_content(request: Request, file_id: str) -> Response:
    _file(request, file_id)
    return Response(_store(request).file_path(file_id).read_bytes(), media_type="application/octet-stream")


async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    _file(request, file_id)
    _store(request).delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


# ---- batches ----------------------------------------------------------------------------------------
def read_lines(data: bytes, endpoints: tuple[str, ...]) -> tuple[list[Line], list[dict[str, Any]]]:
    """A batch input file -> its lines, and the errors of the lines at fault (OpenAI's shape);
    each line's url must be one of `endpoints` (a batch's: its one endpoint)."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def fault(number: int, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": number})

    for number, raw in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as err:
            fault(number, f"line {number} is not JSON: {err}", "invalid_json_line")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("body"), dict):
            fault(number, f"line {number} has no 'body' object", param="body")
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            fault(number, f"line {number} has no 'custom_id'", "missing_required_parameter", "custom_id")
        elif custom_id in seen:
            fault(number, f"line {number}: custom_id {custom_id!r} is used twice", "duplicate_custom_id", "custom_id")
        elif obj.get("method", "POST") != "POST":
            fault(number, f"line {number}: method must be POST", param="method")
        elif obj.get("url") not in endpoints:
            wanted = f"the batch's endpoint {endpoints[0]}" if len(endpoints) == 1 else f"one of {', '.join(endpoints)}"
            fault(number, f"line {number}: url {obj.get('url')!r} is not {wanted}", "mismatched_endpoint", "url")
        elif obj["body"].get("stream"):
            fault(number, f"line {number}: a batch request cannot stream", param="body.stream")
        else:
            seen.add(custom_id)
            lines.append(Line(len(lines), custom_id, obj["body"], obj["url"]))
    if not lines and not errors:
        fault(0, "the input file has no requests", "empty_file")
    if len(lines) > MAX_LINES:
        fault(0, f"a batch holds at most {MAX_LINES} requests, the file has {len(lines)}", "too_many_tasks")
    return lines, errors


async def create_batch(request: Request) -> dict[str, Any]:
    req = parse_body(await request.body(), BatchCreateRequest)
    endpoints: tuple[str, ...] = request.app.state.batch_endpoints  # the route table's rows marked batch
    if req.endpoint not in endpoints:
        raise bad_request(f"endpoint must be one of {', '.join(endpoints)}, got {req.endpoint!r}", param="endpoint")
    if req.completion_window != "24h":
        raise bad_request("completion_window must be '24h'", param="completion_window")
    store = _store(request)
    file = _found(store.file(req.input_file_id), "File", req.input_file_id, "input_file_id")
    if file["purpose"] != "batch":
        raise bad_request(f"file {req.input_file_id} has purpose {file['purpose']!r}, not 'batch'",
                          param="input_file_id")
    lines, errors = read_lines(store.file_path(req.input_file_id).read_bytes(), (req.endpoint,))
    batch_id = store.add_batch(req.endpoint, req.input_file_id, req.completion_window, [] if errors else lines,
                               req.metadata, errors or None)
    request.app.state.batch_runner.wake.set()
    batch = store.batch(batch_id)
    assert batch is not None
    return batch


def _batch(request: Request, batch_id: str) -> dict[str, Any]:
    return _found(_store(request).batch(batch_id), "Batch", batch_id, "batch_id")


async def retrieve_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return _batch(request, batch_id)


async def list_batches(request: Request) -> dict[str, Any]:
    store = _store(request)
    ids = store.batches()
    after = request.query_params.get("after")
    if after in ids:
        ids = ids[ids.index(after) + 1:]
    try:
        limit = max(1, min(100, int(request.query_params.get("limit", "20"))))
    except ValueError:
        raise bad_request("limit must be an integer from 1 to 100", param="limit") from None
    page = [b for b in (store.batch(i) for i in ids[:limit]) if b is not None]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ids) > limit}


async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    batch = _batch(request, batch_id)
    store = _store(request)
    if batch["status"] in ("validating", "in_progress"):
        store.move(batch_id, "cancelling")
        request.app.state.batch_runner.wake.set()
    elif batch["status"] not in ("cancelling", "cancelled"):
        raise APIError(409, f"batch {batch_id} is {batch['status']}: it cannot be cancelled",
                       code="batch_not_cancellable")
    return _batch(request, batch_id)
