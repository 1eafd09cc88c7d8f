"""A simulated engine that writes a ring through the real TraceWriter, with a clock it controls:
so a test knows exactly which step stalled, which request was starved, how latency grows."""

from dataclasses import dataclass, field

import numpy as np

from scratchllm.trace import Phase, StepFlag, TokenFlag, TraceWriter

MS = 1_000_000
ORIGIN = 10**12  # the simulated clock starts here (ns); the writer's header origin is real time


@dataclass
class Sim:
    lengths: list[int]  # output tokens per request
    arrive_step: list[int] | None = None  # the step each request is first scheduled in
    every: list[int] | None = None  # a request gets a token every `every` steps (1: every step)
    base_ms: float = 10.0
    per_context_ms: float = 0.0  # step time grows with the mean context of the batch (attention)
    stalls: dict = field(default_factory=dict)  # step -> (extra ms, StepFlag, preempted)
    prompt: int = 32
    model: str | None = None  # the model its records carry (a server of several: one Sim each, one ring)

    def write(self, path, ring_records: int = 100_000, writer: TraceWriter | None = None) -> dict:
        """Run to completion; return facts the tests check against (per-step times and more).
        `writer`: write into that ring (left open) instead of making one at `path`."""
        n = len(self.lengths)
        arrive = self.arrive_step or [0] * n
        every = self.every or [1] * n
        own = writer is None
        w = TraceWriter(path, ring_bytes=4096 + 64 * ring_records, clock=lambda: ORIGIN) if own else writer
        if self.model is not None:
            w = w.for_model(self.model)
        tag = f"{self.model}-" if self.model else ""
        keys = [w.register(f"{tag}req-{i}") for i in range(n)]
        made, last_t, arrival_t, first_t = [0] * n, [0] * n, [0] * n, [0] * n
        t, step, facts = ORIGIN, 0, {"step_ms": {}, "tokens": 0}
        while any(made[i] < self.lengths[i] for i in range(n)):
            active = [i for i in range(n) if arrive[i] <= step and made[i] < self.lengths[i]]
            for i in active:
                if arrive[i] == step:
                    arrival_t[i] = t
                    w.span(keys[i], Phase.QUEUED, t, t, count=self.prompt)
            ctx = np.mean([self.prompt + made[i] for i in active]) if active else 0
            extra, flags, preempted = self.stalls.get(step, (0.0, 0, 0))
            dur = int((self.base_ms + self.per_context_ms * ctx + extra) * MS)
            end = t + dur
            out = [i for i in active if (step - arrive[i]) % every[i] == 0]
            if any(arrive[i] == step for i in active):
                flags |= StepFlag.PREFILL
            lat = [end - (last_t[i] if made[i] else arrival_t[i]) for i in out]
            fl = [(TokenFlag.FIRST if made[i] == 0 else 0) | (TokenFlag.FINISHED if made[i] + 1 == self.lengths[i]
                                                               else 0) for i in out]
            w.tokens(np.array([keys[i] for i in out], np.uint64), [made[i] for i in out], [7] * len(out), lat,
                     step=step, time_ns=end, kv_blocks=[1 + (self.prompt + made[i]) // 16 for i in out],
                     flags=fl, batch_size=len(active), step_tokens=len(active))
            w.step(step, t, end, matmul_ns=dur // 2, attention_ns=dur // 4, batch_size=len(active),
                   step_tokens=len(active), kv_blocks=len(active) * 3, kv_total=1000, waiting=0,
                   preempted=preempted, flags=flags)
            for i in out:
                if made[i] == 0:
                    w.span(keys[i], Phase.PREFILL, arrival_t[i], end, count=self.prompt)
                    first_t[i] = end
                made[i] += 1
                last_t[i] = end
                if made[i] == self.lengths[i]:
                    w.span(keys[i], Phase.DECODE, first_t[i], end)
                    w.span(keys[i], Phase.SERIALIZE, end, end + MS // 10, count=120, index=made[i])
                    w.span(keys[i], Phase.NETWORK_SEND, end + MS // 10, end + MS // 5, count=120, index=made[i])
            facts["step_ms"][step] = dur / MS
            facts["tokens"] += len(out)
            t, step = end, step + 1
        facts["steps"] = step
        facts["records"] = w.written
        if own:
            w.close()
        return facts
