"""The engine's side of the token trace (scratchllm/trace): each step's tokens, the step itself
and each finished request's phases, written into the memory-mapped ring by LLMEngine.step().

Per step, one vectorized `tokens` call for all the step's tokens (request, position, token id,
latency since the request's previous token, KV blocks held, phase, flags) and one `step` record
(duration split into matmuls = the forward minus attention, attention = the paged-attention
calls, and the rest = scheduling, sampling, the output path and Python; batch size, tokens in
the step, KV use, queue, preemptions). Per finished request, its queued / prefill / decode
spans from its own RequestMetrics. The writer never blocks and never allocates per token; this
module's Python is the cost `scratchllm bench trace` measures.

A step that verified drafted tokens (speculative decoding) is flagged StepFlag.VERIFY and
followed by a VERIFY record: tokens drafted, accepted, requests with drafts, the drafting's time.
A request's accepted drafts and the target's own token after them come out of that one step:
the drafts are flagged TokenFlag.DRAFTED and every one of them has the latency its siblings have
(the step's end minus the request's previous token), not zero.

Per step with text, one DETOKENIZE span (request key STEP_KEY, index = the step): the time the
step's output path spent in the detokenizers, summed over the step's tokens and drawn from the
first one's start (a sum, as the step's matmul / attention split is). One span per step, not
one per request: a span record costs 1.5-3 us, so per request it would cost that per token
(more than doubling a token's tracing cost); per step a token adds only its timed push, about
0.4 us (`bench trace` prints both).
"""

from __future__ import annotations

import time

import numpy as np

from scratchllm.engine.output import IncrementalDetokenizer
from scratchllm.engine.protocol import TokenEvent
from scratchllm.engine.request import Request
from scratchllm.trace.format import STEP_KEY, Phase, StepFlag, TokenFlag
from scratchllm.trace.writer import TraceWriter

_NS = 1e9


def _ns(seconds: float) -> int:
    """The engine's monotonic seconds on the ring's clock (time.monotonic_ns: the same clock)."""
    return round(seconds * _NS)


class DetokenizeTimer:
    """The current step's detokenization: when it started, how long it took in all, how many
    tokens. Shared by every request's TimedDetokenizer; StepTracer.step writes it and resets it."""

    __slots__ = ("first_ns", "total_ns", "tokens")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.first_ns = 0  # 0: nothing detokenized in this step yet
        self.total_ns = 0
        self.tokens = 0

    def timed(self, detok: IncrementalDetokenizer) -> TimedDetokenizer:
        return TimedDetokenizer(detok, self)


class TimedDetokenizer:
    """A request's detokenizer, its time added to the step's DetokenizeTimer."""

    __slots__ = ("inner", "timer")

    def __init__(self, inner: IncrementalDetokenizer, timer: DetokenizeTimer):
        self.inner, self.timer = inner, timer

    def push(self, token_id: int) -> str:
        start = time.monotonic_ns()
        text = self.inner.push(token_id)
        end = time.monotonic_ns()
        t = self.timer
        if not t.first_ns:
            t.first_ns = start
        t.total_ns += end - start
        t.tokens += 1
        return text

    def flush(self) -> str:
        flush = getattr(self.inner, "flush", None)
        if flush is None:
            return ""
        start = time.monotonic_ns()
        text: str = flush()
        t = self.timer
        if not t.first_ns:
            t.first_ns = start
        t.total_ns += time.monotonic_ns() - start
        return text


class StepTracer:
    def __init__(self, writer: TraceWriter):
        self.writer = writer
        self.detokenize = DetokenizeTimer()
        self._keys: dict[str, int] = {}
        self._last_ns: dict[str, int] = {}  # the request's previous token (or its arrival)
        self._preemptions: dict[str, int] = {}
        self.tracing_ns = 0  # time spent in this module: tracing's own cost

    def arrived(self, req: Request) -> None:
        t = time.perf_counter_ns()
        self._keys[req.request_id] = self.writer.register(req.request_id)
        self._last_ns[req.request_id] = _ns(req.arrival)
        self._preemptions[req.request_id] = 0
        self.tracing_ns += time.perf_counter_ns() - t

    def step(self, step: int, start_ns: int, end_ns: int, events: list[TokenEvent], requests: dict[str, Request],
             *, forward_ns: int, attention_ns: int, step_tokens: int, running: int, waiting: int,
             kv_used: int, kv_total: int, preempted: int, accepted: dict[str, int] | None = None, drafted: int = 0,
             draft_ns: int = 0) -> None:
        """`accepted`: {request id: drafted tokens it accepted} of each request whose drafts the
        step verified (its first that many tokens of the step are drafts); `drafted`: the step's
        drafted tokens in all; `draft_ns`: the time their drafting took."""
        t = time.perf_counter_ns()
        accepted = accepted or {}
        drafts_left = dict(accepted)  # per request: how many of its next tokens are accepted drafts
        n = sum(e.token_id is not None for e in events)
        keys = np.empty(n, np.uint64)
        pos, ids, lat, kv, flags, phase = (np.empty(n, np.int64) for _ in range(6))
        i, prefill = 0, False
        for e in events:
            if e.token_id is None:
                continue
            rid = e.request_id
            req = requests.get(rid)
            f = TokenFlag.FIRST if e.index == 0 else 0
            seen = req.num_preemptions if req is not None else self._preemptions.get(rid, 0)
            if seen != self._preemptions.get(rid, 0):
                f |= TokenFlag.PREEMPTED | TokenFlag.RESUMED
                self._preemptions[rid] = seen
            if e.finish_reason is not None:
                f |= TokenFlag.FINISHED
            if drafts_left.get(rid, 0) > 0:
                f |= TokenFlag.DRAFTED
                drafts_left[rid] -= 1
            p = Phase.PREFILL if f & (TokenFlag.FIRST | TokenFlag.RESUMED) else Phase.DECODE
            prefill |= p == Phase.PREFILL
            keys[i], pos[i], ids[i] = self._keys[rid], e.index, e.token_id
            lat[i] = end_ns - self._last_ns.get(rid, end_ns)
            kv[i] = len(req.block_table) if req is not None else 0
            flags[i], phase[i] = f, p
            i += 1
        for e in events:  # after all the step's tokens: a request's tokens of one step share their latency
            if e.token_id is not None:
                self._last_ns[e.request_id] = end_ns
        w = self.writer
        if n:
            w.tokens(keys, pos, ids, lat, step=step, time_ns=end_ns, kv_blocks=kv, phase=phase, flags=flags,
                     batch_size=running, step_tokens=step_tokens)
        step_flags = ((StepFlag.PREEMPTION if preempted else 0) | (StepFlag.PREFILL if prefill else 0)
                      | (StepFlag.VERIFY if accepted else 0))
        w.step(step, start_ns, end_ns, matmul_ns=max(forward_ns - attention_ns, 0), attention_ns=attention_ns,
               batch_size=running, step_tokens=step_tokens, kv_blocks=kv_used, kv_total=kv_total, waiting=waiting,
               preempted=preempted, flags=step_flags)
        if accepted:
            w.verify(step, end_ns, drafted=drafted, accepted=sum(accepted.values()), requests=len(accepted),
                     draft_ns=draft_ns)
        d = self.detokenize
        if d.first_ns:
            w.span(STEP_KEY, Phase.DETOKENIZE, d.first_ns, d.first_ns + d.total_ns, count=d.tokens, index=step)
            d.reset()
        for e in events:
            if e.finish_reason is not None:
                self.ended(e)
        self.tracing_ns += time.perf_counter_ns() - t

    def ended(self, e: TokenEvent) -> None:
        """A request's last event (finished in a step, or aborted between steps): its spans."""
        key = self._keys.pop(e.request_id, None)
        self._last_ns.pop(e.request_id, None)
        self._preemptions.pop(e.request_id, None)
        m = e.metrics
        if key is None or m is None:
            return
        w = self.writer
        if m.first_scheduled is not None:
            w.span(key, Phase.QUEUED, _ns(m.arrival), _ns(m.first_scheduled), count=m.prompt_tokens)
            if m.first_token is not None:
                w.span(key, Phase.PREFILL, _ns(m.first_scheduled), _ns(m.first_token), count=m.prompt_tokens)
        if m.first_token is not None and m.finished is not None:
            w.span(key, Phase.DECODE, _ns(m.first_token), _ns(m.finished), count=m.completion_tokens)
