"""A ring's records as tables, and the figures a live view shows.

Times here are seconds since the ring's clock origin (the writer's start), so every command
speaks of the same instants.
"""

import os
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from scratchllm.errors import ConfigError
from scratchllm.trace.format import (
    NO_MODEL,
    SPAN_DTYPE,
    STEP_DTYPE,
    TOKEN_DTYPE,
    VERIFY_DTYPE,
    Kind,
    Phase,
    TokenFlag,
)
from scratchllm.trace.reader import ReadResult, RingReader


@dataclass
class Trace:
    """Everything read from one ring: the valid records of each kind, in write order."""

    tokens: npt.NDArray[np.void]  # TOKEN_DTYPE
    steps: npt.NDArray[np.void]  # STEP_DTYPE
    spans: npt.NDArray[np.void]  # SPAN_DTYPE
    names: dict[int, str]
    origin_ns: int  # the monotonic clock at the writer's start
    wall_origin_ns: int  # the wall clock at the same moment
    capacity: int
    pid: int = 0
    written: int = 0  # records the writer committed in all
    dropped: int = 0  # records the writer dropped rather than wait
    lapped: int = 0  # records overwritten before they were read
    torn: int = 0
    writer_state: str = ""  # RingReader.writer_state()
    path: str = ""
    port: int = 0  # the writing server's port (0: none, or a version 1 ring)
    models: dict[int, str] = field(default_factory=dict)  # model byte -> name (the header's table)
    request_models: dict[int, int] = field(default_factory=dict)  # request key -> model byte (NAME records)
    verifies: npt.NDArray[np.void] = field(default_factory=lambda: np.zeros(0, VERIFY_DTYPE))  # speculation

    @classmethod
    def empty(cls, origin_ns: int = 0, capacity: int = 0) -> "Trace":
        return cls(np.zeros(0, TOKEN_DTYPE), np.zeros(0, STEP_DTYPE), np.zeros(0, SPAN_DTYPE), {}, origin_ns, 0,
                   capacity)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Trace":
        """Read a whole ring (live or not) once."""
        with RingReader(path) as reader:
            trace = cls.opened(reader)
            trace.add(reader.read_new(), reader)
        return trace

    @classmethod
    def opened(cls, reader: RingReader) -> "Trace":
        """An empty trace of the ring `reader` has open: its header's facts, no records yet."""
        trace = cls.empty(reader.clock_origin_ns, reader.capacity)
        trace.wall_origin_ns, trace.pid, trace.path, trace.port = (reader.wall_origin_ns, reader.pid,
                                                                   str(reader.path), reader.port)
        return trace

    def add(self, got: ReadResult, reader: RingReader) -> None:
        """Append one read's records (a live view calls this once per refresh)."""
        self.tokens = np.concatenate([self.tokens, got.of(Kind.TOKEN)])
        self.steps = np.concatenate([self.steps, got.of(Kind.STEP)])
        self.spans = np.concatenate([self.spans, got.of(Kind.SPAN)])
        self.verifies = np.concatenate([self.verifies, got.of(Kind.VERIFY)])
        self.names.update(got.names())
        self.request_models.update(got.request_models())
        self.models = reader.models
        self.written, self.dropped, self.lapped, self.torn = got.end, reader.dropped, reader.lapped, reader.torn
        self.writer_state = reader.writer_state()

    # --- per model ---
    def model_ids(self) -> list[int]:
        """The model bytes of the models with token or step records here, in the header's order."""
        seen = set(self.tokens["model"].tolist()) | set(self.steps["model"].tolist())
        return sorted(seen)

    def model_name(self, model: int) -> str:
        """A model byte's name: the header's, or '' for records no model was named for."""
        return self.models.get(model, "" if model == NO_MODEL else f"model {model}")

    def model_id(self, name: str) -> int:
        """The model byte of the model called `name`; ConfigError naming the ring's models if none is."""
        for index, known in self.models.items():
            if known == name:
                return index
        have = ", ".join(f"'{n}'" for n in self.models.values()) or "none (the ring names no models)"
        raise ConfigError(f"{self.path}: no model '{name}' in this ring; its models: {have}")

    def of_model(self, model: int) -> "Trace":
        """The records of one model: its tokens and steps, and the spans of its requests (the
        server's own spans of a request carry no model: they go with the request's tokens)."""
        out = Trace(**{**self.__dict__})
        out.tokens = self.tokens[self.tokens["model"] == model]
        out.steps = self.steps[self.steps["model"] == model]
        out.verifies = self.verifies[self.verifies["model"] == model]
        keys = set(out.tokens["request"].tolist()) | {k for k, m in self.request_models.items() if m == model}
        spans = self.spans
        mine = (spans["model"] == model) | ((spans["model"] == NO_MODEL) & np.isin(spans["request"], list(keys)))
        out.spans = spans[mine]
        return out

    def now_s(self) -> float | None:
        """Seconds since the writer started, now, for a ring whose writer is still running (its
        clock is this machine's monotonic clock); None when it is not (closed, or died)."""
        if self.writer_state != "running":
            return None
        return (time.monotonic_ns() - self.origin_ns) / 1e9

    def seconds(self, ns: npt.ArrayLike) -> npt.NDArray[np.float64]:
        return (np.asarray(ns, dtype=np.int64) - self.origin_ns) / 1e9

    def name(self, key: int) -> str:
        return self.names.get(int(key), f"{int(key):016x}")

    @property
    def time_range(self) -> tuple[float, float]:
        """(first, last) instant any record mentions, in seconds; (0, 0) when empty."""
        times = [self.tokens["time_ns"], self.steps["start_ns"], self.steps["end_ns"], self.spans["start_ns"],
                 self.spans["end_ns"]]
        stamps = np.concatenate([t.astype(np.int64) for t in times])
        if not len(stamps):
            return 0.0, 0.0
        return float(self.seconds(stamps.min())), float(self.seconds(stamps.max()))

    def window(self, start_s: float, end_s: float) -> "Trace":
        """The records that fall in [start_s, end_s] (a span or step: if it overlaps)."""
        lo, hi = int(self.origin_ns + start_s * 1e9), int(self.origin_ns + end_s * 1e9)
        out = Trace(**{**self.__dict__})
        out.tokens = self.tokens[(self.tokens["time_ns"] >= lo) & (self.tokens["time_ns"] <= hi)]
        out.steps = self.steps[(self.steps["end_ns"] >= lo) & (self.steps["start_ns"] <= hi)]
        out.spans = self.spans[(self.spans["end_ns"] >= lo) & (self.spans["start_ns"] <= hi)]
        out.verifies = self.verifies[(self.verifies["time_ns"] >= lo) & (self.verifies["time_ns"] <= hi)]
        return out

    def speculation(self) -> "Speculation | None":
        """Speculative decoding's figures over these records (one model's, for a rate that
        means something), or None when no step verified drafts."""
        v = self.verifies
        if not len(v):
            return None
        return Speculation(steps=len(v), drafted=int(v["drafted"].sum()), accepted=int(v["accepted"].sum()),
                          drafted_tokens=int(np.count_nonzero(self.tokens["flags"] & TokenFlag.DRAFTED)),
                          draft_ms=float(v["draft_ns"].sum()) / 1e6)

    def arrivals(self) -> dict[int, int]:
        """Each request's arrival (ns): the start of its QUEUED or REQUEST span, else its first
        token's time minus that token's latency (a first token's latency is its TTFT), else its
        first token's time."""
        arrival: dict[int, int] = {}
        t = self.tokens
        for key, when in zip(t["request"].tolist(), (t["time_ns"] - t["latency_ns"]).tolist(), strict=True):
            if key not in arrival or when < arrival[key]:
                arrival[key] = when
        s = self.spans[np.isin(self.spans["phase"], (Phase.QUEUED, Phase.REQUEST))]
        for key, when in zip(s["request"].tolist(), s["start_ns"].tolist(), strict=True):
            arrival[key] = min(when, arrival.get(key, when))
        return arrival


@dataclass
class Speculation:
    """Speculative decoding in a trace: steps that verified drafts, drafted tokens, those
    accepted (emitted without a step of their own) and the time spent drafting."""

    steps: int
    drafted: int
    accepted: int
    drafted_tokens: int  # TOKEN records flagged DRAFTED (= accepted unless the ring lost some)
    draft_ms: float

    @property
    def rate(self) -> float:
        """Accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def text(self) -> str:
        return (f"speculative decoding: {self.accepted} of {self.drafted} drafted tokens accepted "
                f"({100 * self.rate:.0f}%) in {self.steps} verification steps")


def percentile(values: npt.ArrayLike, q: float) -> float | None:
    values = np.asarray(values, dtype=np.float64)
    return float(np.percentile(values, q)) if len(values) else None


@dataclass
class LiveFigures:
    """What `trace watch` shows, over the last `window_s` seconds of the trace."""

    window_s: float
    end_s: float
    tokens: int
    tokens_per_s: float
    records_per_s: float
    itl_ms: dict[str, float | None] = field(default_factory=dict)  # p50 / p99 of decode tokens' latency
    ttft_ms: dict[str, float | None] = field(default_factory=dict)  # p50 / p99 of first tokens' latency
    batch_size: float | None = None  # mean requests per step
    kv_blocks: int | None = None  # at the last step
    kv_total: int | None = None
    waiting: int | None = None  # requests queued at the last step
    requests_seen: int = 0
    retention_s: float | None = None  # how long the ring holds at this record rate
    idle_s: float | None = None  # a running writer that made no token in the window: since its last one
    last_token_s: float | None = None  # the newest token's time, seconds since the writer started
    speculation: Speculation | None = None  # speculative decoding in the window (None: no step verified drafts)


def live_figures(trace: Trace, window_s: float = 10.0, now_s: float | None = None) -> LiveFigures:
    """The figures over the last window_s seconds before `now_s` (a running writer's now: an
    idle server shows no tokens, not its last busy window), else before the newest record
    (after a crash the newest record is the moment that matters)."""
    first, last = trace.time_range
    if now_s is not None:
        last = max(now_s, last)
    span = min(window_s, max(last - first, 1e-9))
    w = trace.window(last - span, last)
    t = w.tokens
    lat_ms = t["latency_ns"] / 1e6
    first_tok = (t["flags"] & TokenFlag.FIRST) != 0
    records = len(t) + len(w.steps) + len(w.spans) + len(w.verifies)
    fig = LiveFigures(window_s=span, end_s=last, tokens=len(t), tokens_per_s=len(t) / span,
                      records_per_s=records / span, requests_seen=len(np.unique(t["request"])),
                      speculation=w.speculation())
    fig.itl_ms = {"p50": percentile(lat_ms[~first_tok], 50), "p99": percentile(lat_ms[~first_tok], 99)}
    fig.ttft_ms = {"p50": percentile(lat_ms[first_tok], 50), "p99": percentile(lat_ms[first_tok], 99)}
    if len(w.steps):
        s = w.steps
        fig.batch_size = float(s["batch_size"].mean())
        last = s[-1]
        fig.kv_blocks, fig.kv_total, fig.waiting = int(last["kv_blocks"]), int(last["kv_total"]), int(last["waiting"])
    elif len(t):
        fig.batch_size = float(t["batch_size"].mean())
        fig.kv_blocks = int(t["kv_blocks"][t["step"] == t["step"][-1]].sum())
    if fig.records_per_s > 0:
        fig.retention_s = trace.capacity / fig.records_per_s
    if len(trace.tokens):
        fig.last_token_s = float(trace.seconds(trace.tokens["time_ns"].max()))
    if now_s is not None and not len(t):
        fig.idle_s = last - fig.last_token_s if fig.last_token_s is not None else last - first
        fig.batch_size, fig.waiting = 0.0, fig.waiting if len(w.steps) else 0
    return fig


def retention_s(capacity: int, tokens_per_s: float, records_per_token: float = 1.1) -> float:
    """Seconds of history a ring of `capacity` records holds at tokens_per_s, counting
    records_per_token records per token (one token record, plus the steps and spans around it:
    about 0.1 per token at 16 requests per step and a few spans per request)."""
    return capacity / (tokens_per_s * records_per_token)
