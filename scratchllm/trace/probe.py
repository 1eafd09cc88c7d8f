"""EngineProbe: traces an LLMEngine from outside, around each step() call, into a TraceWriter.

What an engine-side hook records, but with nothing changed inside the engine: `probe.step()`
calls `engine.step()` and then writes the step's token records (one vectorized call), its step
record and, for each request that finished, its queued / prefill / decode spans from the
request's own metrics. The step's split comes from two timing wrappers set on the engine's
model runner: its attention object (the paged-attention call the model makes once per layer)
and its model's forward; "matmul" is the forward minus attention, so it also holds the norms,
RoPE and activations, which are a few percent of a forward next to the matmuls.

Batch size is the requests still running after the step plus those that finished in it (the
probe sees the step's outputs, not its schedule).
"""

import time

import numpy as np

from scratchllm.trace.format import Phase, StepFlag, TokenFlag
from scratchllm.trace.writer import TraceWriter

_NS = 1e9


class _Timed:
    """Forwards everything to `inner`; adds the nanoseconds spent in one of its methods."""

    def __init__(self, inner, method: str):
        self.__dict__.update(inner=inner, method=method, ns=0)

    def __getattr__(self, name):
        if name == self.method:
            fn = getattr(self.inner, name)

            def timed(*args, **kwargs):
                t = time.perf_counter_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.__dict__["ns"] += time.perf_counter_ns() - t

            return timed
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def __call__(self, *args, **kwargs):  # the attention object is called, not a method of it
        t = time.perf_counter_ns()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.__dict__["ns"] += time.perf_counter_ns() - t


class EngineProbe:
    def __init__(self, engine, writer: TraceWriter):
        self.engine, self.writer = engine, writer
        runner = engine.runner
        self._attention = runner.attention = _Timed(runner.attention, "__call__")
        self._model = runner.model = _Timed(runner.model, "forward")
        self._keys: dict[str, int] = {}
        self._arrival: dict[str, int] = {}  # ns
        self._last: dict[str, int] = {}  # ns of the request's previous token
        self._preemptions: dict[str, int] = {}
        self._seen_preemptions = engine.scheduler.num_preemptions
        self.tracing_ns = 0  # time spent writing records: the probe's own cost

    def add_request(self, request_id, prompt_token_ids, params=None, priority=None):
        req = self.engine.add_request(request_id, prompt_token_ids, params, priority)
        t = time.perf_counter_ns()
        rid = req.request_id
        self._keys[rid] = self.writer.register(rid)
        self._arrival[rid] = round(req.arrival * _NS)
        self.tracing_ns += time.perf_counter_ns() - t
        return req

    def step(self):
        engine, w = self.engine, self.writer
        self._attention.__dict__["ns"] = self._model.__dict__["ns"] = 0
        start = w.clock()
        outputs = engine.step()
        end = w.clock()
        t = time.perf_counter_ns()
        self._record(outputs, start, end)
        self.tracing_ns += time.perf_counter_ns() - t
        return outputs

    def _record(self, outputs, start: int, end: int) -> None:
        engine, w = self.engine, self.writer
        sched, bm = engine.scheduler, engine.block_manager
        step = engine.num_steps
        keys, pos, ids, lat, kv, flags, phase, done = [], [], [], [], [], [], [], []
        for o in outputs:
            if o.token_id is None:
                continue
            rid = o.request_id
            req = engine.requests.get(rid)
            preempted = req.num_preemptions if req is not None else self._preemptions.get(rid, 0)
            f = TokenFlag.FIRST if o.index == 0 else 0
            if preempted != self._preemptions.get(rid, 0):
                f |= TokenFlag.PREEMPTED | TokenFlag.RESUMED
                self._preemptions[rid] = preempted
            if o.finish_reason:
                f |= TokenFlag.FINISHED
                done.append(o)
            keys.append(self._keys.get(rid) or self._key(rid))
            pos.append(o.index)
            ids.append(o.token_id)
            lat.append(end - self._last.get(rid, self._arrival.get(rid, end)))
            kv.append(len(req.block_table) if req is not None else 0)
            flags.append(f)
            phase.append(Phase.PREFILL if f & (TokenFlag.FIRST | TokenFlag.RESUMED) else Phase.DECODE)
            self._last[rid] = end
        batch = len(sched.running) + len(done)
        if keys:
            w.tokens(np.array(keys, dtype=np.uint64), pos, ids, lat, step=step, time_ns=end, kv_blocks=kv,
                     phase=phase, flags=flags, batch_size=batch, step_tokens=engine.last_step_tokens)
        attention = self._attention.__dict__["ns"]
        preempted = sched.num_preemptions - self._seen_preemptions
        self._seen_preemptions = sched.num_preemptions
        step_flags = (StepFlag.PREEMPTION if preempted else 0) | (StepFlag.PREFILL if Phase.PREFILL in phase else 0)
        w.step(step, start, end, matmul_ns=max(self._model.__dict__["ns"] - attention, 0), attention_ns=attention,
               batch_size=batch, step_tokens=engine.last_step_tokens, kv_blocks=bm.num_used, kv_total=bm.num_blocks,
               waiting=sched.num_waiting(), preempted=preempted, flags=step_flags)
        for o in done:
            self._finish(o)

    def _key(self, rid: str) -> int:  # a request added to the engine directly, not through the probe
        self._keys[rid] = self.writer.register(rid)
        return self._keys[rid]

    def _finish(self, o) -> None:
        m, key = o.metrics, self._keys.pop(o.request_id)
        ns = lambda s: round(s * _NS)
        if m.first_scheduled is not None:
            self.writer.span(key, Phase.QUEUED, ns(m.arrival), ns(m.first_scheduled), count=m.prompt_tokens)
            if m.first_token is not None:
                self.writer.span(key, Phase.PREFILL, ns(m.first_scheduled), ns(m.first_token), count=m.prompt_tokens)
        if m.first_token is not None and m.finished is not None:
            self.writer.span(key, Phase.DECODE, ns(m.first_token), ns(m.finished), count=m.completion_tokens)
        for table in (self._arrival, self._last, self._preemptions):
            table.pop(o.request_id, None)
