"""The latency heatmap's data (requests x token positions) and what its patterns say.

Three patterns, each found from measured values, never assumed:
  * vertical bands: a step far slower than the typical step delays the token of every request in
    it at once. Cause from the step record: a preemption, a prefill chunk much larger than usual.
    Only a step that held back some request's next token counts: a request prefilling alone (the
    usual start on a quiet server) is its own time to first token, not a stall of anyone.
  * late tokens of long requests slow: within long requests, the last quarter of the tokens is
    slower than the first quarter. Attention reads the whole KV cache per token, so its cost grows
    with context: this is KV / attention cost.
  * whole rows slow: some requests are slow at every position (or wait long for their first
    token) while the typical one is not: queueing, or contention with other work.
Decode latencies (since the request's previous token) are used for the last two, outside the
stalled steps so that one stall is not read three ways.

A ring of several models (one server, one engine per model) is diagnosed one model at a time:
a larger model's requests are slower at every position than a smaller one's, which says nothing
about queueing. `compare_models` states the models' typical speeds side by side instead.
"""

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from scratchllm.trace.format import StepFlag, TokenFlag
from scratchllm.trace.views.analysis import Trace

STALL_FACTOR = 3.0  # a step this many times the median step is a stall
LATE_FACTOR = 1.25  # late tokens this many times slower than early ones: a trend worth naming
SLOW_ROW_FACTOR = 2.0  # a request this many times slower than the typical request
LONG_REQUEST_MIN = 16  # tokens a request needs before early vs late means anything


@dataclass
class LatencyGrid:
    """latency_ms[r, p]: request r's (arrival order) token at output position p; NaN = none."""

    requests: npt.NDArray[np.uint64]  # [R] request keys, in arrival order
    latency_ms: npt.NDArray[np.float64]  # [R, P]
    step: npt.NDArray[np.int64]  # [R, P]: the step that made the token, -1 = none
    first_ms: npt.NDArray[np.float64]  # [R] time to first token (NaN if its first token is not in the ring)
    finished: npt.NDArray[np.bool_]  # [R]: the request's last token is in the ring (False: cut or still running)
    drafted: npt.NDArray[np.bool_] | None = None  # [R, P]: an accepted draft (TokenFlag.DRAFTED); None: no such token

    @classmethod
    def from_trace(cls, trace: Trace, max_requests: int | None = None) -> "LatencyGrid":
        t = trace.tokens
        arrival = trace.arrivals()
        seen: dict[int, int] = {}  # ties in arrival: first registered (or first seen) first
        for k in [*trace.names, *t["request"].tolist()]:
            seen.setdefault(k, len(seen))
        keys = np.array(sorted(arrival, key=lambda k: (arrival[k], seen.get(k, len(seen)))), dtype=np.uint64)
        if max_requests is not None and len(keys) > max_requests:
            keys = keys[-max_requests:]  # the most recent: what a flight recorder is read for
        row_of = {int(k): i for i, k in enumerate(keys.tolist())}
        rows = np.array([row_of.get(k, -1) for k in t["request"].tolist()], dtype=np.int64)
        keep = rows >= 0
        rows, t = rows[keep], t[keep]
        cols = t["position"].astype(np.int64)
        width = int(cols.max()) + 1 if len(cols) else 0
        lat = np.full((len(keys), width), np.nan)
        step = np.full((len(keys), width), -1, dtype=np.int64)
        lat[rows, cols] = t["latency_ns"] / 1e6
        step[rows, cols] = t["step"]
        first = np.full(len(keys), np.nan)
        is_first = (t["flags"] & TokenFlag.FIRST) != 0
        first[rows[is_first]] = t["latency_ns"][is_first] / 1e6
        finished = np.zeros(len(keys), dtype=bool)
        finished[rows[(t["flags"] & TokenFlag.FINISHED) != 0]] = True
        is_drafted = (t["flags"] & TokenFlag.DRAFTED) != 0
        drafted = None
        if is_drafted.any():
            drafted = np.zeros((len(keys), width), dtype=bool)
            drafted[rows[is_drafted], cols[is_drafted]] = True
        return cls(keys, lat, step, first, finished, drafted)

    @property
    def cut(self) -> npt.NDArray[np.bool_]:
        """Rows with tokens but no last token: still running when the ring was read, or cut off
        (a client that hung up is finished with an abort; a killed server finishes nothing)."""
        return ~self.finished & ~np.isnan(self.latency_ms).all(axis=1)


@dataclass
class Finding:
    pattern: str  # "stalled_steps" | "late_tokens" | "slow_rows" | "cut" | "uniform" | "models" | "speculation"
    text: str
    values: dict[str, object] = field(default_factory=dict)


def step_durations(trace: Trace) -> dict[int, float]:
    """ms per step: from step records where the ring has them, else the median latency of the
    decode tokens the step made (a decode token waits exactly one step when its request ran in
    the previous step too)."""
    if len(trace.steps):
        s = trace.steps
        return dict(zip(s["step"].tolist(), ((s["end_ns"] - s["start_ns"]) / 1e6).tolist(), strict=True))
    t = trace.tokens[(trace.tokens["flags"] & TokenFlag.FIRST) == 0]
    out: dict[int, float] = {}
    order = np.argsort(t["step"], kind="stable")
    steps, lat = t["step"][order], t["latency_ns"][order] / 1e6
    bounds = np.flatnonzero(np.diff(steps)) + 1
    for chunk_steps, chunk_lat in zip(np.split(steps, bounds), np.split(lat, bounds), strict=True):
        if len(chunk_steps):
            out[int(chunk_steps[0])] = float(np.median(chunk_lat))
    return out


def diagnose(trace: Trace, grid: LatencyGrid | None = None) -> list[Finding]:
    grid = grid or LatencyGrid.from_trace(trace)
    findings = []
    durations = step_durations(trace)
    stalled: set[int] = set()
    if len(durations) >= 4:
        median_ms = float(np.median(list(durations.values())))
        held_back = set(np.unique(grid.step[:, 1:]).tolist())  # steps that made some request's next token
        stalled = {s for s, d in durations.items() if d > STALL_FACTOR * median_ms and s in held_back}
        if stalled:
            findings.append(_stalls(trace, grid, sorted(stalled), durations, median_ms))
    decode = ~np.isnan(grid.latency_ms) & np.isin(grid.step, list(stalled), invert=True)
    decode[:, 0] = False  # position 0 is the first token: its latency is the wait for it (TTFT)
    late = _late_tokens(grid, decode)
    if late:
        findings.append(late)
    rows = _slow_rows(grid, decode)
    if rows:
        findings.append(rows)
    cut = int(grid.cut.sum())
    if cut:
        findings.append(Finding("cut", f"{_count(cut, 'request')} without a last token in the ring: still "
                                       "running when it was read, or cut off (a killed server); marked x",
                                {"rows": np.flatnonzero(grid.cut).tolist()}))
    if not any(f.pattern != "cut" for f in findings):
        lat = grid.latency_ms[decode]
        ratio = float(np.percentile(lat, 99) / np.percentile(lat, 50)) if len(lat) else float("nan")
        findings.append(Finding("uniform", f"no stalls, no trend with position, no slow requests: decode latency "
                                           f"p99/p50 = {ratio:.2f}", {"p99_over_p50": ratio}))
    spec = trace.speculation()
    if spec is not None:
        findings.append(Finding("speculation", spec.text() + ("; accepted drafts marked with dots" if spec.accepted
                                                              else ""),
                                {"drafted": spec.drafted, "accepted": spec.accepted, "rate": spec.rate,
                                 "steps": spec.steps}))
    return findings


def _stalls(trace: Trace, grid: LatencyGrid, stalled: list[int], durations: dict[int, float],
            median_ms: float) -> Finding:
    steps = {int(s["step"]): s for s in trace.steps} if len(trace.steps) else {}
    usual_tokens = float(np.median(trace.steps["step_tokens"])) if len(trace.steps) else 0.0
    usual = _count(round(usual_tokens), "token")
    parts = []
    for s in stalled[:5]:
        rec, cause = steps.get(s), "cause not recorded"
        if rec is not None:
            if rec["preempted"] or rec["flags"] & StepFlag.PREEMPTION:
                cause = _count(int(rec["preempted"]), "preemption") if rec["preempted"] else "a preemption"
            elif rec["flags"] & StepFlag.PREFILL and rec["step_tokens"] > 2 * usual_tokens:
                cause = f"a prefill of {int(rec['step_tokens'])} tokens (a usual step has {usual})"
        hit = int(np.count_nonzero((grid.step[:, 1:] == s).any(axis=1)))  # requests (a step of drafts: several tokens)
        delayed = f"{hit} request's token" if hit == 1 else f"{hit} requests' tokens"
        parts.append(f"step {s}: {durations[s]:.0f} ms, {delayed} delayed, {cause}")
    more = f"; {len(stalled) - 5} more" if len(stalled) > 5 else ""
    text = (f"vertical bands: {_count(len(stalled), 'step')} stalled at > {STALL_FACTOR:g}x the median step of "
            f"{median_ms:.1f} ms ({'; '.join(parts)}{more})")
    return Finding("stalled_steps", text, {"steps": stalled, "median_step_ms": median_ms,
                                           "stall_ms": [durations[s] for s in stalled]})


def _count(n: int, noun: str) -> str:
    """'1 token', '3 tokens'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _late_tokens(grid: LatencyGrid, decode: npt.NDArray[np.bool_]) -> Finding | None:
    lengths = (~np.isnan(grid.latency_ms)).sum(axis=1)
    long_rows = np.flatnonzero(lengths >= max(LONG_REQUEST_MIN, np.median(lengths) if len(lengths) else 0))
    early, late = [], []
    for r in long_rows:
        n = lengths[r]
        row = grid.latency_ms[r, :n][decode[r, :n]]
        pos = np.arange(n)[decode[r, :n]]
        early.append(row[pos < n / 4])
        late.append(row[pos >= 3 * n / 4])
    if not early or not sum(map(len, early)) or not sum(map(len, late)):
        return None
    e, lt = float(np.median(np.concatenate(early))), float(np.median(np.concatenate(late)))
    if lt <= LATE_FACTOR * e:
        return None
    return Finding("late_tokens", f"late tokens of long requests slow: the last quarter of {len(long_rows)} long "
                                  f"requests' tokens takes {lt:.1f} ms vs {e:.1f} ms for the first quarter "
                                  f"({lt / e:.2f}x): KV / attention cost growing with context",
                   {"early_ms": e, "late_ms": lt, "ratio": lt / e, "requests": len(long_rows)})


def _slow_rows(grid: LatencyGrid, decode: npt.NDArray[np.bool_]) -> Finding | None:
    masked = np.where(decode, grid.latency_ms, np.nan)
    has = decode.any(axis=1)
    if has.sum() < 4:
        return None
    row_ms = np.full(len(grid.requests), np.nan)
    row_ms[has] = np.nanmedian(masked[has], axis=1)
    typical = float(np.nanmedian(row_ms))
    slow = np.flatnonzero(row_ms > SLOW_ROW_FACTOR * typical)
    first = grid.first_ms[~np.isnan(grid.first_ms)]
    waited: list[int | np.intp] | npt.NDArray[np.intp]
    waited = np.flatnonzero(grid.first_ms > SLOW_ROW_FACTOR * np.median(first)) if len(first) >= 4 else []
    waited = [r for r in waited if grid.first_ms[r] > SLOW_ROW_FACTOR * typical]  # beyond a step's noise
    if not len(slow) and not len(waited):
        return None
    bits = []
    if len(slow):
        bits.append(f"{len(slow)} of {int(has.sum())} requests slow at every position (median "
                    f"{float(np.median(row_ms[slow])):.1f} ms per token vs a typical {typical:.1f} ms)")
    if len(waited):
        bits.append(f"{len(waited)} waited > {SLOW_ROW_FACTOR:g}x the median time to first token "
                    f"({float(np.median(first)):.0f} ms)")
    return Finding("slow_rows", f"whole rows slow: {'; '.join(bits)}: queueing or contention",
                   {"rows": slow.tolist(), "waited_rows": list(map(int, waited)), "typical_ms": typical})


def typical_decode_ms(grid: LatencyGrid) -> float | None:
    """The median latency of the grid's decode tokens (positions after the first), or None."""
    lat = grid.latency_ms[:, 1:]
    lat = lat[~np.isnan(lat)]
    return float(np.median(lat)) if len(lat) else None


def compare_models(grids: dict[str, LatencyGrid]) -> Finding | None:
    """With two models or more: each one's typical time per token, side by side (what a reader
    would otherwise take for slow rows), and that each is diagnosed against itself."""
    typical = {name: typical_decode_ms(grid) for name, grid in grids.items()}
    known = {name: ms for name, ms in typical.items() if ms is not None}
    if len(grids) < 2 or not known:
        return None
    parts = [f"'{name}' {ms:.1f} ms ({len(grids[name].requests)} requests)" for name, ms in known.items()]
    spread = max(known.values()) / min(known.values()) if min(known.values()) > 0 else float("nan")
    return Finding("models", f"{len(grids)} models, typical time per token {', '.join(parts)} ({spread:.1f}x apart): "
                             "each model's requests are compared with its own, not with another model's",
                   {"typical_ms": known})
