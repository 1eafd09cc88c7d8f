"""Reading traffic to replay: a capture directory or file, or OpenAI Batch API input JSONL.

Capture lines are those `CaptureWriter` writes (a "v" field). Batch API input lines are
``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}``; both
kinds may be mixed. A last line without its newline is what a writer killed mid-write leaves:
it is skipped and counted in `Traffic.partial_lines`. Any other line that is not a request is
an error naming the file and line: a capture is never silently thinned.
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scratchllm.errors import ConfigError
from scratchllm.evaluate.capture import FILE_PATTERN
from scratchllm.server.routes import REPLAYABLE

logger = logging.getLogger(__name__)

ENDPOINTS = REPLAYABLE  # the routes whose rows in the server's route table say they replay


@dataclass
class CapturedRequest:
    endpoint: str  # one of ENDPOINTS
    body: dict[str, Any]
    source: str  # "file:line", for error messages and the run's records
    model: str | None = None
    time: float | None = None
    client: dict[str, Any] | None = None  # the anonymized client (ip_hmac, network), captures only
    response: dict[str, Any] | None = None  # what the serving server answered, captures only
    custom_id: str | None = None  # Batch API input only
    translated_from: str | None = None  # the route an Ollama request came in on (body: its OpenAI equivalent)


@dataclass
class Traffic:
    requests: list[CapturedRequest] = field(default_factory=list)
    partial_lines: int = 0  # unterminated last lines skipped (a writer killed mid-write)
    files: list[str] = field(default_factory=list)


def prompt_text(body: dict[str, Any]) -> str:
    """A request's prompt as a person reads it: the prompt string (several joined by lines, token
    ids as JSON), or the chat messages as one "role: content" line each."""
    if isinstance(body.get("messages"), list):
        return "\n".join(f"{m.get('role', '')}: {_content(m.get('content'))}" for m in body["messages"]
                         if isinstance(m, dict))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    return json.dumps(prompt)


def _content(content: Any) -> str:
    if isinstance(content, list):  # content parts: the text ones
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def capture_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if FILE_PATTERN.match(p.name))
        if not files:
            raise ConfigError(f"{path}: no capture-NNNNNN.jsonl files in this directory")
        return files
    if not path.exists():
        raise ConfigError(f"{path}: no such capture file or directory")
    return [path]


def read_traffic(path: str | Path) -> Traffic:
    traffic = Traffic()
    for file in capture_files(path):
        traffic.files.append(str(file))
        data = file.read_bytes()
        lines = data.split(b"\n")
        # split() leaves "" after a final newline; anything else there is an unterminated line
        tail = lines.pop()
        if tail.strip():
            traffic.partial_lines += 1
            logger.warning("%s: skipped a partial last line (%d bytes): a writer stopped mid-write", file, len(tail))
        for number, raw in enumerate(lines, 1):
            if raw.strip():
                traffic.requests.append(_parse_line(raw, f"{file}:{number}"))
    return traffic


def _parse_line(raw: bytes, where: str) -> CapturedRequest:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where}: not a JSON line ({err})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("body"), dict):
        raise ConfigError(f"{where}: expected an object with a 'body' object")
    if "v" in obj:
        endpoint = _endpoint(obj.get("endpoint", "/v1/completions"), where)
        return CapturedRequest(endpoint, obj["body"], where, model=obj.get("model"), time=obj.get("time"),
                               client=obj.get("client"), response=obj.get("response"),
                               translated_from=obj.get("translated_from"))
    if "custom_id" in obj:
        if obj.get("method", "POST") != "POST":
            raise ConfigError(f"{where}: Batch API method must be POST, got {obj.get('method')!r}")
        endpoint = _endpoint(obj.get("url"), where)
        return CapturedRequest(endpoint, obj["body"], where, model=obj["body"].get("model"),
                               custom_id=str(obj["custom_id"]))
    raise ConfigError(f"{where}: neither a capture line ('v') nor a Batch API input line ('custom_id')")


def _endpoint(endpoint: Any, where: str) -> str:
    if endpoint not in ENDPOINTS:
        raise ConfigError(f"{where}: endpoint {endpoint!r} cannot be replayed (only {', '.join(ENDPOINTS)})")
    return str(endpoint)
