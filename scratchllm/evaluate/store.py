"""The run file: one SQLite database per replay, read and extended by triage, annotation, report
and feedback. Tables:

  run(id, created, capture, primary_url, secondary_url, candidate_url, options)   one row
  request(id, idx, endpoint, source, body, replay_body, class_key)                 one per request
  output(request_id, role, ...)       role in primary | secondary | candidate: text, tokens,
                                      token ids, logprobs, top logprobs, latency, server timings
  diff(request_id, klass, noise_klass, first_divergence, edit_distance, noisy, detail)
  assignment(request_id, annotator, created)      a diff handed to an annotator, not yet scored
  score(request_id, annotator, score, created)    -1 / 0 / +1, one per (diff, annotator)

JSON columns hold lists and dicts. A connection is shared across threads under a lock (the
annotation server answers from a thread pool).

Every statement commits on its own (autocommit). A write the disk has no room for (SQLite's
"database or disk is full") is rolled back by SQLite, leaving every row committed before it in
place and the file consistent; it raises RunFileError, which names the file (the command stops
with that one line), and is logged once per store. Reads keep working.
"""

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scratchllm.errors import ConfigError, ScratchLLMError

logger = logging.getLogger(__name__)
ROLES = ("primary", "secondary", "candidate")

SCHEMA = """
CREATE TABLE IF NOT EXISTS run (id INTEGER PRIMARY KEY CHECK (id = 1), created REAL, capture TEXT,
    primary_url TEXT, secondary_url TEXT, candidate_url TEXT, options TEXT);
CREATE TABLE IF NOT EXISTS request (id INTEGER PRIMARY KEY, idx INTEGER, endpoint TEXT, source TEXT,
    body TEXT, replay_body TEXT, class_key TEXT);
CREATE TABLE IF NOT EXISTS output (request_id INTEGER REFERENCES request(id),
    role TEXT CHECK (role IN ('primary', 'secondary', 'candidate')), status INTEGER, error TEXT,
    text TEXT, finish_reason TEXT, tokens TEXT, token_ids TEXT, logprobs TEXT, top_logprobs TEXT,
    latency_ms REAL, timings TEXT, attempts INTEGER, PRIMARY KEY (request_id, role));
CREATE TABLE IF NOT EXISTS diff (request_id INTEGER PRIMARY KEY REFERENCES request(id), klass TEXT,
    noise_klass TEXT, first_divergence INTEGER, edit_distance INTEGER, noisy INTEGER, detail TEXT);
CREATE TABLE IF NOT EXISTS assignment (request_id INTEGER REFERENCES request(id), annotator TEXT,
    created REAL, PRIMARY KEY (request_id, annotator));
CREATE TABLE IF NOT EXISTS score (request_id INTEGER REFERENCES request(id), annotator TEXT,
    score INTEGER CHECK (score IN (-1, 0, 1)), created REAL, PRIMARY KEY (request_id, annotator));
"""


@dataclass
class Output:
    """One server's answer to one request, in a form every OpenAI-compatible server can give.
    `tokens` are the token strings of the logprobs; `token_ids` only where the server sends them."""

    text: str | None = None
    tokens: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    latency_ms: float | None = None
    timings: dict[str, Any] | None = None
    status: int | None = None
    error: str | None = None
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.text is not None


_JSON_FIELDS = ("tokens", "token_ids", "logprobs", "top_logprobs", "timings")


class RunFileError(ScratchLLMError):
    """The run file could not be written (a full disk, a read-only file); what it held is kept."""


class RunStore:
    def __init__(self, path: str | Path, create: bool = False):
        self.path = Path(path)
        if create and self.path.exists():
            raise ConfigError(f"{self.path}: already exists; give a new run file")
        if not create and not self.path.exists():
            raise ConfigError(f"{self.path}: no such run file")
        self.conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.lock = threading.RLock()
        self._warned = False
        with self.lock, self._writing():
            self.conn.executescript(SCHEMA)
        if not create and self.run() is None:
            raise ConfigError(f"{self.path}: not a run file (no run row)")

    def close(self) -> None:
        self.conn.close()

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self.lock, self._writing():
            return self.conn.execute(sql, args).fetchall()

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """SQLite's errors of a write that did not fit (or could not be made) as RunFileError."""
        try:
            yield
        except sqlite3.OperationalError as err:
            text = str(err)
            if not any(s in text for s in ("disk is full", "disk I/O error", "readonly", "unable to open")):
                raise
            if not self._warned:
                self._warned = True
                logger.warning("%s: cannot write (%s); the rows written before are kept", self.path, text)
            raise RunFileError(f"{self.path}: cannot write the run file ({text}); the rows written before "
                               "are kept: free space and run the command again") from None

    # --- the run and its requests -------------------------------------------------------------
    def create_run(self, capture: str, primary: str, secondary: str, candidate: str, options: dict[str, Any]) -> None:
        self.execute("INSERT INTO run VALUES (1, ?, ?, ?, ?, ?, ?)",
                     (time.time(), capture, primary, secondary, candidate, json.dumps(options)))

    def run(self) -> dict[str, Any] | None:
        rows = self.execute("SELECT * FROM run")
        if not rows:
            return None
        row = dict(rows[0])
        row["options"] = json.loads(row["options"] or "{}")
        return row

    def set_option(self, key: str, value: Any) -> None:
        run = self.run()
        assert run is not None, "a run file has its run row"
        options = run["options"]
        options[key] = value
        self.execute("UPDATE run SET options = ?", (json.dumps(options),))

    def add_request(self, idx: int, endpoint: str, source: str, body: dict[str, Any], replay_body: dict[str, Any],
                    class_key: str) -> int:
        with self.lock, self._writing():
            cur = self.conn.execute("INSERT INTO request (idx, endpoint, source, body, replay_body, class_key) "
                                    "VALUES (?, ?, ?, ?, ?, ?)", (idx, endpoint, source, json.dumps(body),
                                                                  json.dumps(replay_body), class_key))
            assert cur.lastrowid is not None  # set by the INSERT
            return cur.lastrowid

    def requests(self) -> list[dict[str, Any]]:
        rows = self.execute("SELECT * FROM request ORDER BY idx")
        return [{**dict(r), "body": json.loads(r["body"]), "replay_body": json.loads(r["replay_body"])} for r in rows]

    # --- outputs ------------------------------------------------------------------------------
    def put_output(self, request_id: int, role: str, out: Output) -> None:
        assert role in ROLES
        d = asdict(out)
        for k in _JSON_FIELDS:
            d[k] = json.dumps(d[k])
        self.execute("INSERT OR REPLACE INTO output (request_id, role, status, error, text, finish_reason, tokens, "
                     "token_ids, logprobs, top_logprobs, latency_ms, timings, attempts) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (request_id, role, d["status"], d["error"], d["text"], d["finish_reason"], d["tokens"],
                      d["token_ids"], d["logprobs"], d["top_logprobs"], d["latency_ms"], d["timings"], d["attempts"]))

    def outputs(self, request_id: int) -> dict[str, Output]:
        rows = self.execute("SELECT * FROM output WHERE request_id = ?", (request_id,))
        result: dict[str, Output] = {}
        for r in rows:
            # SIM118 is wrong here: a sqlite3.Row iterates its values, so its keys come from keys()
            d = {k: r[k] for k in r.keys() if k not in ("request_id", "role")}  # noqa: SIM118
            for k in _JSON_FIELDS:
                d[k] = json.loads(d[k]) if d[k] is not None else None
            d["top_logprobs"] = [[tuple(p) for p in top] for top in d["top_logprobs"] or []]
            d["tokens"], d["logprobs"] = d["tokens"] or [], d["logprobs"] or []
            result[r["role"]] = Output(**d)
        return result

    # --- diffs --------------------------------------------------------------------------------
    def put_diff(self, request_id: int, klass: str, noise_klass: str, first_divergence: int | None,
                 edit_distance: int, noisy: bool, detail: dict[str, Any]) -> None:
        self.execute("INSERT OR REPLACE INTO diff VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (request_id, klass, noise_klass, first_divergence, edit_distance, int(noisy), json.dumps(detail)))

    def diffs(self) -> list[dict[str, Any]]:
        rows = self.execute("SELECT d.*, r.idx, r.class_key, r.endpoint FROM diff d JOIN request r "
                            "ON r.id = d.request_id ORDER BY r.idx")
        return [{**dict(r), "detail": json.loads(r["detail"])} for r in rows]

    def scores(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.execute("SELECT * FROM score ORDER BY request_id, created")]
