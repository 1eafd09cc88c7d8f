"""The annotation server: a page where annotators score diffs, and the HTTP API it runs on.

Scores: -1 the primary's output is better, 0 no better or worse, +1 the candidate's is better.
The page shows the two outputs as A and B, the candidate left or right by a fixed coin per
annotator and diff, and turns "A better" / "B better" into that score before storing it.
Each diff goes to `per_diff` (3) different annotators. Only diffs of the chosen classes are
handed out (semantic by default) and never noisy ones (primary and secondary already disagree).
An annotator is never shown another's score: the API has no route that returns them.

  GET  /                          the page (annotate.html)
  POST /api/signin   {name}       -> {annotator}
  GET  /api/next?annotator=NAME   -> {diff | null, progress}: this annotator's open diff, else a
                                     new one, preferring diffs closest to their 3 scores
  GET  /api/diff/ID?annotator=    -> one diff (the report links here)
  POST /api/score    {annotator, request_id, score} -> {stored: true}; 409 if this annotator
                                     already scored it or it has its 3 scores

A diff handed out is reserved for its annotator for RESERVE_S so two annotators working at once
do not both become its third; a reservation not scored in time lapses.
"""

import hashlib
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field

from scratchllm.errors import ConfigError
from scratchllm.evaluate.sources import prompt_text
from scratchllm.evaluate.store import RunStore

logger = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("annotate.html")
RESERVE_S = 15 * 60
PER_DIFF = 3


class SignIn(BaseModel):
    name: str = Field(min_length=1, max_length=64)


class ScoreIn(BaseModel):
    annotator: str = Field(min_length=1, max_length=64)
    request_id: int
    score: int = Field(ge=-1, le=1)


def candidate_side(annotator: str | None, request_id: int) -> str:
    """Which column the page shows the candidate in: a fixed coin per (annotator, diff), so no
    one learns that one side is always the change (position bias), and a reload shows the same."""
    digest = hashlib.sha256(f"{annotator or ''}\0{request_id}".encode()).digest()
    return "right" if digest[0] & 1 else "left"


class Annotation:
    """Hand-out and scoring rules over a run file (see the module doc)."""

    def __init__(self, store: RunStore, classes: Sequence[str] = ("semantic",), per_diff: int = PER_DIFF,
                 clock: Callable[[], float] = time.time):
        self.store, self.classes, self.per_diff, self.clock = store, tuple(classes), per_diff, clock

    def _eligible_sql(self) -> tuple[str, list[str]]:
        marks = ",".join("?" * len(self.classes))
        return f"d.klass IN ({marks}) AND d.noisy = 0", list(self.classes)

    def eligible_ids(self) -> list[int]:
        where, args = self._eligible_sql()
        return [int(r[0]) for r in self.store.execute(f"SELECT d.request_id FROM diff d WHERE {where}", args)]

    def next_for(self, annotator: str) -> int | None:
        now, s = self.clock(), self.store
        with s.lock:
            open_ = s.execute("SELECT a.request_id FROM assignment a WHERE a.annotator = ? AND NOT EXISTS "
                              "(SELECT 1 FROM score x WHERE x.request_id = a.request_id AND x.annotator = ?) "
                              "AND a.created > ? ORDER BY a.created", (annotator, annotator, now - RESERVE_S))
            if open_:
                return int(open_[0][0])
            where, args = self._eligible_sql()
            rows = s.execute(
                f"SELECT d.request_id, (SELECT COUNT(*) FROM score x WHERE x.request_id = d.request_id) "
                f"+ (SELECT COUNT(*) FROM assignment a WHERE a.request_id = d.request_id AND a.annotator != ? "
                f"AND a.created > ? AND NOT EXISTS (SELECT 1 FROM score y WHERE y.request_id = a.request_id "
                f"AND y.annotator = a.annotator)) AS taken FROM diff d JOIN request r ON r.id = d.request_id "
                f"WHERE {where} AND NOT EXISTS (SELECT 1 FROM score z WHERE z.request_id = d.request_id "
                f"AND z.annotator = ?) ORDER BY taken DESC, r.idx", [annotator, now - RESERVE_S, *args, annotator])
            for request_id, taken in rows:
                if taken < self.per_diff:
                    s.execute("INSERT OR REPLACE INTO assignment VALUES (?, ?, ?)", (request_id, annotator, now))
                    return int(request_id)
            return None

    def score(self, annotator: str, request_id: int, score: int) -> None:
        s = self.store
        with s.lock:
            if request_id not in self.eligible_ids():
                raise HTTPException(404, f"diff {request_id} is not one to annotate in this run")
            if s.execute("SELECT 1 FROM score WHERE request_id = ? AND annotator = ?", (request_id, annotator)):
                raise HTTPException(409, f"{annotator} already scored diff {request_id}")
            count = s.execute("SELECT COUNT(*) FROM score WHERE request_id = ?", (request_id,))[0][0]
            if count >= self.per_diff:
                raise HTTPException(409, f"diff {request_id} already has its {self.per_diff} scores")
            s.execute("INSERT INTO score VALUES (?, ?, ?, ?)", (request_id, annotator, score, self.clock()))
            s.execute("DELETE FROM assignment WHERE request_id = ? AND annotator = ?", (request_id, annotator))

    def progress(self, annotator: str) -> dict[str, int]:
        mine = self.store.execute("SELECT COUNT(*) FROM score WHERE annotator = ?", (annotator,))[0][0]
        return {"scored": int(mine), "eligible": len(self.eligible_ids())}

    def view(self, request_id: int, annotator: str | None) -> dict[str, Any]:
        rows = self.store.execute("SELECT d.*, r.idx, r.body, r.endpoint FROM diff d JOIN request r "
                                  "ON r.id = d.request_id WHERE d.request_id = ?", (request_id,))
        if not rows:
            raise HTTPException(404, f"no diff {request_id} in this run")
        row = dict(rows[0])
        detail = json.loads(row["detail"])
        outs = self.store.outputs(request_id)
        mine = self.store.execute("SELECT score FROM score WHERE request_id = ? AND annotator = ?",
                                  (request_id, annotator)) if annotator else []
        return {"request_id": request_id, "index": row["idx"], "klass": row["klass"], "endpoint": row["endpoint"],
                "prompt": prompt_text(json.loads(row["body"])), "primary": outs["primary"].text or "",
                "candidate": outs["candidate"].text or "", "first_divergence": row["first_divergence"],
                "edit_distance": row["edit_distance"], "common_prefix_chars": detail.get("common_prefix_chars", 0),
                "your_score": mine[0][0] if mine else None, "candidate_side": candidate_side(annotator, request_id)}


def create_app(store: RunStore, classes: Sequence[str] = ("semantic",), per_diff: int = PER_DIFF) -> FastAPI:
    ann = Annotation(store, classes, per_diff)
    app = FastAPI(title="scratchllm annotation")
    app.state.annotation = ann

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @app.post("/api/signin")
    def signin(body: SignIn) -> dict[str, str]:
        return {"annotator": body.name.strip()}

    @app.get("/api/next")
    def next_diff(annotator: str) -> dict[str, Any]:
        request_id = ann.next_for(annotator)
        return {"diff": ann.view(request_id, annotator) if request_id is not None else None,
                "progress": ann.progress(annotator)}

    @app.get("/api/diff/{request_id}")
    def one_diff(request_id: int, annotator: str | None = None) -> dict[str, Any]:
        return ann.view(request_id, annotator)

    @app.post("/api/score")
    def score(body: ScoreIn) -> dict[str, bool]:
        ann.score(body.annotator.strip(), body.request_id, body.score)
        return {"stored": True}

    return app


def open_run(run_path: str | Path, classes: Sequence[str] = ("semantic",)) -> FastAPI:
    """The annotation app over a run (triaged first if it was not), or ConfigError saying why
    there is nothing to score: which classes the run's diffs fall in, and which were asked."""
    store = RunStore(run_path)
    if not store.diffs():
        from scratchllm.evaluate.triage import triage_run

        triage_run(store)
    app = create_app(store, classes)
    if not app.state.annotation.eligible_ids():
        raise ConfigError(nothing_to_score(store, classes))
    return app


def nothing_to_score(store: RunStore, classes: Sequence[str]) -> str:
    counts: dict[str, list[int]] = {}
    for d in store.diffs():
        counts.setdefault(d["klass"], [0, 0])[1 if d["noisy"] else 0] += 1
    found = ", ".join(f"{k} {clean}" + (f" (+{noisy} noisy)" if noisy else "")
                      for k, (clean, noisy) in sorted(counts.items())) or "none"
    return (f"{store.path}: no diff to annotate in the classes {', '.join(classes)}. The run's diffs by class: "
            f"{found}. Noisy diffs (primary and secondary already differ) are never handed out; "
            "choose other classes with --classes, e.g. --classes semantic,near-tie")


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Serve the page on a bound socket until interrupted."""
    import uvicorn

    logger.info("annotation page: %d diffs to score", len(app.state.annotation.eligible_ids()))
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
