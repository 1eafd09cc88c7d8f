"""The Batch API's state, kept so that a batch outlives its server: one SQLite file and a folder
of file contents (`serve --batch-dir`, by default `$SCRATCHLLM_CACHE_DIR/batches`).

  file(id, purpose, filename, bytes, created_at)            the file's bytes: files/ID
  batch(id, endpoint, input_file_id, status, ..., metadata)  one row per batch, its times and counts
  line(batch_id, idx, custom_id, body)                      the input's requests, read once at create
  result(batch_id, idx, status_code, body, error)           one per line that has run

Invariants: a line's result is written once (PRIMARY KEY (batch_id, idx); a second write is
refused) and in the transaction that counts it, so after a crash at any instant each line has
either its one result or none, and a resumed batch runs exactly the lines that have none. A
batch's status moves only forward:

    validating -> in_progress -> finalizing -> completed
        |              |  `-> cancelling -> cancelled
        `-> failed     `-> (expires_at passed) -> expired

Every statement commits on its own (autocommit, WAL); the store is used from the event loop's
thread only (its writes take microseconds).
"""

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS file (id TEXT PRIMARY KEY, purpose TEXT, filename TEXT, bytes INTEGER, created_at INTEGER);
CREATE TABLE IF NOT EXISTS batch (id TEXT PRIMARY KEY, endpoint TEXT, input_file_id TEXT, completion_window TEXT,
    status TEXT, created_at INTEGER, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER, expires_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, total INTEGER, errors TEXT, metadata TEXT);
CREATE TABLE IF NOT EXISTS line (batch_id TEXT, idx INTEGER, custom_id TEXT, body TEXT, PRIMARY KEY (batch_id, idx));
CREATE TABLE IF NOT EXISTS result (batch_id TEXT, idx INTEGER, status_code INTEGER, body TEXT, error TEXT,
    request_id TEXT, PRIMARY KEY (batch_id, idx));
"""
NEXT = {"validating": {"in_progress", "failed", "cancelling"},
        "in_progress": {"finalizing", "cancelling", "expired"},
        "finalizing": {"completed"}, "cancelling": {"cancelled"}}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a worker resumes these


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Line:
    idx: int
    custom_id: str
    body: dict[str, Any]
    url: str = ""  # as the input line gave it (a stored batch's lines are all its endpoint's)


class BatchStore:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "files").mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(folder / "batches.sqlite3", isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # ---- files ----
    def file_path(self, file_id: str) -> Path:
        return self.folder / "files" / file_id

    def add_file(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = new_id("file-")
        tmp = self.file_path(file_id).with_suffix(".part")
        tmp.write_bytes(data)
        tmp.rename(self.file_path(file_id))  # the bytes first: a row never names a file that is not there
        self.db.execute("INSERT INTO file VALUES (?, ?, ?, ?, ?)", (file_id, purpose, filename, len(data),
                                                                   int(time.time())))
        file = self.file(file_id)
        assert file is not None
        return file

    def file(self, file_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM file WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            return None
        return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
                "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
                "status_details": None}

    def files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT id FROM file WHERE ? IS NULL OR purpose = ? "
                               "ORDER BY created_at DESC, rowid DESC", (purpose, purpose)).fetchall()
        return [f for f in (self.file(r["id"]) for r in rows) if f is not None]

    def delete_file(self, file_id: str) -> bool:
        gone = self.db.execute("DELETE FROM file WHERE id = ?", (file_id,)).rowcount > 0
        self.file_path(file_id).unlink(missing_ok=True)
        return gone

    # ---- batches ----
    def add_batch(self, endpoint: str, input_file_id: str, window: str, lines: list[Line],
                  metadata: dict[str, Any] | None, errors: list[dict[str, Any]] | None = None) -> str:
        batch_id, now = new_id("batch_"), int(time.time())
        status = "failed" if errors else "validating"
        self.db.execute("BEGIN")
        self.db.execute("INSERT INTO batch (id, endpoint, input_file_id, completion_window, status, created_at, "
                        "failed_at, expires_at, total, errors, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (batch_id, endpoint, input_file_id, window, status, now, now if errors else None,
                         now + 24 * 3600, 0 if errors else len(lines),
                         json.dumps({"object": "list", "data": errors}) if errors else None,
                         json.dumps(metadata) if metadata is not None else None))
        self.db.executemany("INSERT INTO line VALUES (?, ?, ?, ?)",
                            [(batch_id, ln.idx, ln.custom_id, json.dumps(ln.body)) for ln in lines])
        self.db.execute("COMMIT")
        return batch_id

    def move(self, batch_id: str, status: str, **columns: Any) -> bool:
        """Move a batch to `status` if its status allows it (NEXT); whether it moved."""
        now = int(time.time())
        current = self.db.execute("SELECT status FROM batch WHERE id = ?", (batch_id,)).fetchone()
        if current is None or status not in NEXT.get(current["status"], ()):
            return False
        sets = {"status": status, f"{status}_at": now, **columns}
        self.db.execute(f"UPDATE batch SET {', '.join(f'{k} = ?' for k in sets)} WHERE id = ? AND status = ?",
                        (*sets.values(), batch_id, current["status"]))
        return True

    def status(self, batch_id: str) -> str | None:
        row = self.db.execute("SELECT status FROM batch WHERE id = ?", (batch_id,)).fetchone()
        return row["status"] if row is not None else None

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM batch WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            return None
        counts = self.db.execute("SELECT COUNT(*) AS done, SUM(status_code BETWEEN 200 AND 299) AS ok FROM result "
                                 "WHERE batch_id = ?", (batch_id,)).fetchone()
        out = {k: row[k] for k in ("id", "endpoint", "input_file_id", "completion_window", "status", "created_at",
                                   "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                                   "cancelling_at", "cancelled_at", "expires_at", "output_file_id", "error_file_id")}
        return {**out, "object": "batch", "errors": json.loads(row["errors"]) if row["errors"] else None,
                "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
                "request_counts": {"total": row["total"], "completed": counts["ok"] or 0,
                                   "failed": counts["done"] - (counts["ok"] or 0)}}

    def batches(self, status: tuple[str, ...] | None = None) -> list[str]:
        rows = self.db.execute("SELECT id, status FROM batch ORDER BY created_at DESC, rowid DESC").fetchall()
        return [r["id"] for r in rows if status is None or r["status"] in status]

    # ---- lines and results ----
    def pending(self, batch_id: str) -> list[Line]:
        """The lines of a batch that have no result yet, in the input's order."""
        rows = self.db.execute("SELECT idx, custom_id, body FROM line WHERE batch_id = ? AND idx NOT IN "
                               "(SELECT idx FROM result WHERE batch_id = ?) ORDER BY idx", (batch_id, batch_id))
        return [Line(r["idx"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def record(self, batch_id: str, line: Line, status_code: int | None, body: Any, error: dict[str, Any] | None,
               request_id: str) -> bool:
        """A line's result, written once: False when it had one already (never run twice)."""
        try:
            self.db.execute("INSERT INTO result VALUES (?, ?, ?, ?, ?, ?)",
                            (batch_id, line.idx, status_code, json.dumps(body), json.dumps(error), request_id))
        except sqlite3.IntegrityError:
            return False
        return True

    def results(self, batch_id: str) -> list[dict[str, Any]]:
        """Every result of a batch with its custom_id, in the input's order."""
        rows = self.db.execute("SELECT r.idx, l.custom_id, r.status_code, r.body, r.error, r.request_id FROM result r "
                               "JOIN line l ON l.batch_id = r.batch_id AND l.idx = r.idx WHERE r.batch_id = ? "
                               "ORDER BY r.idx", (batch_id,))
        return [{"idx": r["idx"], "custom_id": r["custom_id"], "status_code": r["status_code"],
                 "body": json.loads(r["body"]), "error": json.loads(r["error"]), "request_id": r["request_id"]}
                for r in rows]
