"""Feedback: per-request-class diff scores from a run, and the priority hook they drive.

A request's class is, in this order:
  * ``class:<v>`` for a client-supplied ``metadata.request_class`` string;
  * ``user:<v>`` for the OpenAI ``user`` field;
  * ``prefix:<16 hex>``: SHA-256 of the normalized prompt prefix (the prompt, or each chat
    message as "role: content" on its own line; NFKC, case-folded, runs of whitespace made one
    space, then the first PREFIX_CHARS characters). Requests built from one template share it.

A class's score is the share of +1 among its annotators' scores. priorities.json holds, per
class, that score, how many scores it rests on, and `adjust_s`: 0 for a score >= the threshold
(0.5), else -max_adjust_s * (threshold - score) / threshold, so a class nobody preferred is
lowered by the full bound. The scheduler clamps any hook to its own +-max_priority_adjust_s and
ages every request, so a lowered class is delayed, never starved.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import unicodedata
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scratchllm.errors import ConfigError
from scratchllm.evaluate.sources import prompt_text
from scratchllm.evaluate.store import RunStore

if TYPE_CHECKING:
    from scratchllm.engine.request import Request

PREFIX_CHARS = 64
FORMAT_VERSION = 1


def normalized_prompt(body: dict[str, Any]) -> str:
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", prompt_text(body)).casefold()).strip()


def request_class(body: dict[str, Any]) -> str:
    """The request's class key (see the module doc)."""
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("request_class"), str) and metadata["request_class"]:
        return "class:" + str(metadata["request_class"])
    if isinstance(body.get("user"), str) and body["user"]:
        return "user:" + str(body["user"])
    prefix = normalized_prompt(body)[:PREFIX_CHARS]
    return "prefix:" + hashlib.sha256(prefix.encode()).hexdigest()[:16]


def adjustment_s(score: float, threshold: float, max_adjust_s: float) -> float:
    if score >= threshold:
        return 0.0
    return -max_adjust_s * (threshold - score) / threshold


def compute_feedback(store: RunStore, threshold: float = 0.5, max_adjust_s: float = 2.0) -> dict[str, Any]:
    """The priorities.json document for a run's scores."""
    if not 0.0 < threshold <= 1.0 or max_adjust_s < 0:
        raise ConfigError("threshold must be in (0, 1] and max_adjust_s >= 0")
    rows = store.execute("SELECT r.class_key, s.score FROM score s JOIN request r ON r.id = s.request_id")
    by_class: dict[str, list[int]] = defaultdict(list)
    for row in rows:
        by_class[row["class_key"]].append(row["score"])
    classes: dict[str, dict[str, Any]] = {}
    for key, scores in sorted(by_class.items()):
        share = sum(s == 1 for s in scores) / len(scores)
        classes[key] = {"score": share, "num_scores": len(scores),
                        "adjust_s": adjustment_s(share, threshold, max_adjust_s)}
    return {"version": FORMAT_VERSION, "run": str(store.path), "threshold": threshold,
            "max_adjust_s": max_adjust_s, "classes": classes}


def load_priorities(path: str | Path) -> dict[str, float]:
    """priorities.json -> {class key: seconds}, checked."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: cannot read priorities: {err}") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION or not isinstance(doc.get("classes"), dict):
        raise ConfigError(f"{path}: not a priorities file (version {FORMAT_VERSION} with 'classes')")
    bound = float(doc.get("max_adjust_s", 0.0))
    table: dict[str, float] = {}
    for key, entry in doc["classes"].items():
        s = entry.get("adjust_s") if isinstance(entry, dict) else None
        if not isinstance(s, (int, float)) or abs(s) > bound + 1e-9:
            raise ConfigError(f"{path}: class {key!r}: adjust_s must be a number within +-{bound}")
        table[key] = float(s)
    return table


def load_priority_hook(path: str | Path) -> Callable[[str], float]:
    """A function class key -> seconds of priority adjustment (0 for a class not in the file)."""
    table = load_priorities(path)
    return lambda class_key: table.get(class_key, 0.0)


def engine_priority_hook(class_hook: Callable[[str], float],
                         class_of: Callable[[Request], str | None]) -> Callable[[Request], float]:
    """The engine's hook, fn(request) -> seconds, from a class hook and a way to find a queued
    request's class (e.g. a dict request_id -> class key kept by the server)."""
    def hook(request: Request) -> float:
        key = class_of(request)
        return 0.0 if key is None else class_hook(key)

    return hook


class RequestClasses:
    """The server's map request id -> class key, for `engine_priority_hook(..., class_of=this)`.
    `remember` when a request is submitted, `forget` when it ends. A request of several prompts
    is submitted as "<id>-<i>": those find the class of "<id>"."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}
        self._lock = threading.Lock()

    def remember(self, request_id: str, body: dict[str, Any]) -> str:
        key = request_class(body)
        with self._lock:
            self._keys[request_id] = key
        return key

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._keys.pop(request_id, None)

    def __call__(self, request: Request) -> str | None:
        rid = str(request.request_id)
        with self._lock:
            key = self._keys.get(rid)
            if key is None and "-" in rid:
                key = self._keys.get(rid.rsplit("-", 1)[0])
        return key
