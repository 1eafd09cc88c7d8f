"""A trace as Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open.

Tracks:
  * thread "engine steps" (one per model, "engine steps: MODEL", when the ring holds several:
    each model's engine numbers its own steps): one complete ("X") slice per step, args = its
    split, batch, KV use; a step that verified drafted tokens (speculative decoding) adds
    drafted_tokens, accepted_tokens and draft_ms (its VERIFY record);
    inside it, three slices laid end to end: matmul, attention, other. They are the step's sums
    per kind, drawn in that order for their sizes, not the order the work ran in. Inside "other",
    a "detokenize" slice: the step's time in the detokenizers (a sum over its tokens, from the
    first one's start; it runs after the forward, so it falls in "other").
  * counters: batch (requests, tokens per step), KV blocks in use, requests waiting.
  * one async track per request (cat "request", id = the request's key): the request from
    arrival to its last record, nested inside it its phases (queued, prefill, decode) and an
    instant event per token. The server's per-chunk work (serialize, network send) runs
    alongside decode, so it goes on a second async track of the same request (cat "server"): on
    one track it would overlap the decode slice without nesting in it.
Timestamps are microseconds since the ring's clock origin.
"""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

from scratchllm.trace.format import STEP_KEY, Phase
from scratchllm.trace.views.analysis import Trace

ENGINE_PHASES = (Phase.QUEUED, Phase.PREFILL, Phase.DECODE)
SERVER_PHASES = (Phase.DETOKENIZE, Phase.SERIALIZE, Phase.NETWORK_SEND)
STEPS_TID = 1
Event = dict[str, Any]  # one trace event, as JSON


class ExportCounts(TypedDict):
    """What export() wrote: events in all and per phase ("ph"), steps, requests, tokens."""

    events: int
    by_phase: dict[str, int]
    steps: int
    requests: int
    tokens: int


def trace_events(trace: Trace) -> list[Event]:
    pid = trace.pid or 1

    def us(ns: int | np.integer[Any]) -> float:
        return (int(ns) - trace.origin_ns) / 1e3

    events: list[Event]
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"scratchllm (pid {trace.pid})"}}]
    models = sorted(set(trace.steps["model"].tolist())) or [0]
    for model in models:
        name = trace.model_name(model)
        label = f": {name}" if len(models) > 1 and name else ""
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": STEPS_TID + model,
                       "args": {"name": "engine steps" + label}})
        events += _step_events(trace.steps[trace.steps["model"] == model], pid, STEPS_TID + model,
                               f" ({name})" if len(models) > 1 and name else "", us,
                               trace.verifies[trace.verifies["model"] == model])
    detok = trace.spans[(trace.spans["request"] == STEP_KEY) & (trace.spans["phase"] == Phase.DETOKENIZE)]
    for d in detok:
        events.append({"ph": "X", "name": "detokenize", "cat": "step.detokenize", "pid": pid,
                       "tid": STEPS_TID + int(d["model"]), "ts": us(d["start_ns"]),
                       "dur": (int(d["end_ns"]) - int(d["start_ns"])) / 1e3,
                       "args": {"step": int(d["index"]), "tokens": int(d["count"])}})
    events += _request_tracks(trace, pid, us)
    return events


def _step_events(steps: npt.NDArray[np.void], pid: int, tid: int, counter_suffix: str,
                 us: Callable[[int], float], verifies: npt.NDArray[np.void]) -> list[Event]:
    """One engine's steps: a slice each (its split inside), and the batch, KV and queue
    counters. `verifies`: the engine's VERIFY records, whose counts go on their steps' args."""
    events: list[Event] = []
    verified = {int(v["step"]): v for v in verifies}
    for s in steps:
        start, dur = us(s["start_ns"]), (int(s["end_ns"]) - int(s["start_ns"])) / 1e3
        matmul, attention = int(s["matmul_ns"]) / 1e3, int(s["attention_ns"]) / 1e3
        other = max(dur - matmul - attention, 0.0)
        args = {"matmul_ms": matmul / 1e3, "attention_ms": attention / 1e3, "other_ms": other / 1e3,
                "batch_size": int(s["batch_size"]), "tokens": int(s["step_tokens"]), "kv_blocks": int(s["kv_blocks"]),
                "kv_total": int(s["kv_total"]), "waiting": int(s["waiting"]), "preempted": int(s["preempted"])}
        if (v := verified.get(int(s["step"]))) is not None:
            args |= {"drafted_tokens": int(v["drafted"]), "accepted_tokens": int(v["accepted"]),
                     "draft_ms": int(v["draft_ns"]) / 1e6}
        events.append({"ph": "X", "name": f"step {int(s['step'])}", "cat": "step", "pid": pid, "tid": tid,
                       "ts": start, "dur": dur, "args": args})
        if matmul or attention:
            at = start
            for name, d in (("matmul", matmul), ("attention", attention), ("other", other)):
                d = min(d, start + dur - at)  # never past the parent's end (a split that overran)
                events.append({"ph": "X", "name": name, "cat": "step.split", "pid": pid, "tid": tid,
                               "ts": at, "dur": d})
                at += d
        end = us(s["end_ns"])
        events += [{"ph": "C", "name": "batch" + counter_suffix, "pid": pid, "ts": end,
                    "args": {"requests": int(s["batch_size"]), "tokens": int(s["step_tokens"])}},
                   {"ph": "C", "name": "KV blocks" + counter_suffix, "pid": pid, "ts": end,
                    "args": {"used": int(s["kv_blocks"])}},
                   {"ph": "C", "name": "queue" + counter_suffix, "pid": pid, "ts": end,
                    "args": {"waiting": int(s["waiting"])}}]
    return events


def _request_tracks(trace: Trace, pid: int, us: Callable[[int], float]) -> list[Event]:
    events: list[Event] = []
    tokens, spans = trace.tokens, trace.spans[trace.spans["request"] != STEP_KEY]
    by_request: dict[int, dict[str, npt.NDArray[np.void]]] = {}
    for key in np.unique(np.concatenate([tokens["request"], spans["request"]])).tolist():
        by_request[key] = {"tokens": tokens[tokens["request"] == key], "spans": spans[spans["request"] == key]}
    arrival = trace.arrivals()
    for key, rec in by_request.items():
        name, rid = trace.name(key), f"0x{key:016x}"
        t, s = rec["tokens"], rec["spans"]
        engine = s[np.isin(s["phase"], ENGINE_PHASES + (Phase.REQUEST,))]
        server = s[np.isin(s["phase"], SERVER_PHASES)]
        starts = [arrival.get(key, 0)] if key in arrival else []
        starts += engine["start_ns"].tolist() + t["time_ns"].tolist()
        ends = engine["end_ns"].tolist() + t["time_ns"].tolist()
        if starts and ends:
            lo, hi = min(starts), max(max(ends), min(starts))
            common = {"cat": "request", "id": rid, "pid": pid}
            events.append({"ph": "b", "name": name, "ts": us(lo), "args": {"request": name}, **common})
            for sp in sorted(engine[engine["phase"] != Phase.REQUEST], key=lambda r: int(r["start_ns"])):
                phase = Phase(int(sp["phase"])).name.lower()
                events.append({"ph": "b", "name": phase, "ts": us(sp["start_ns"]), "args": {"count": int(sp["count"])},
                               **common})
                events.append({"ph": "e", "name": phase, "ts": us(sp["end_ns"]), **common})
            for tok in t:
                events.append({"ph": "n", "name": "token", "ts": us(tok["time_ns"]), **common,
                               "args": {"position": int(tok["position"]), "token_id": int(tok["token_id"]),
                                        "latency_ms": int(tok["latency_ns"]) / 1e6, "step": int(tok["step"])}})
            events.append({"ph": "e", "name": name, "ts": us(hi), **common})
        common = {"cat": "server", "id": rid, "pid": pid}
        for sp in server:
            phase = Phase(int(sp["phase"])).name.lower()
            label = f"{name} {phase}"
            args = {"chunk": int(sp["index"]), "count": int(sp["count"])}
            events.append({"ph": "b", "name": label, "ts": us(sp["start_ns"]), "args": args, **common})
            events.append({"ph": "e", "name": label, "ts": us(sp["end_ns"]), **common})
    return events


def export(trace: Trace, path: str | os.PathLike[str]) -> ExportCounts:
    """Write the JSON file; returns counts of what went in."""
    events = trace_events(trace)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"ring": trace.path, "writer_pid": trace.pid, "wall_clock_origin_ns": trace.wall_origin_ns,
                         "dropped": trace.dropped, "lapped": trace.lapped, "torn": trace.torn}}
    Path(path).write_text(json.dumps(doc, separators=(",", ":")))
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["ph"]] = kinds.get(e["ph"], 0) + 1
    return {"events": len(events), "by_phase": kinds, "steps": len(trace.steps),
            "requests": len({e["id"] for e in events if e.get("cat") == "request"}), "tokens": len(trace.tokens)}
