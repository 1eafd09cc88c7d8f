"""The scheduler: who is admitted (the seed's priority policy, plus aging) and what each step
computes (continuous batching over a token budget, chunked prefill, preemption by recompute).
Policy only: no numerics here (those are the model runner's).

Admission, the seed's rules (thresholds in EngineConfig):
  * two queues: HIGH = max_tokens < 256, FIFO; LOW = the rest, by arrival (a request's
    "virtual arrival" = arrival - priority adjustment, so the priority hook can move it).
  * when HIGH is non-empty and utilization < 80%, its head is admitted at once (this step,
    not at the next tick), and again while both still hold.
  * otherwise at most 2 LOW requests per 10 ms tick (a tick = the first schedule() call at
    least tick_s after the previous tick began); the engine loop polls every tick when idle.
  * LOW waits while HIGH is non-empty: admitting lower priority work into a machine too busy
    for the high head would invert the priorities. LOW also needs utilization < the gate.
Additions:
  * aging: a LOW request whose wait (plus its adjustment) reaches aging_s moves to the tail of
    HIGH, so its worst-case wait is bounded by aging_s + max_priority_adjust_s + the drain
    time of the HIGH queue ahead of it (tests pin this bound).
  * preempted requests resume before any new admission, in their (priority, arrival) order.
  * a priority hook (request -> seconds) set by the evaluation loop; clamped to
    +-max_priority_adjust_s. Positive: ages faster, sorts earlier in LOW.

Utilization on a CPU: there is no busy counter like a GPU's. It is max(KV occupancy = used
blocks / pool, batch fill = tokens already in this step / token budget): the first says
memory is nearly spent, the second that this step's GEMMs are already full.

Each step (schedule()): running decodes first, then running prefill chunks, both in
(priority, arrival) order, each taking from the token budget; if blocks run out the running
request that sorts last (lowest priority, latest arrival) not yet scheduled is preempted by
recompute (its blocks are freed; its tokens are kept). Then admissions, if no preemption
happened (admitting while preempting would thrash).
"""

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.config import EngineConfig
from scratchllm.engine.request import Priority, Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work: for each request, how many of its uncomputed tokens to compute."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # CoW block copies to do first
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, clock=time.monotonic):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.high: deque[Request] = deque()
        self.low: list[Request] = []  # sorted by _low_key
        self.resumed: list[Request] = []  # preempted, sorted by _order_key
        self.running: list[Request] = []
        self.priority_hook: Callable[[Request], float] | None = None
        self.tick_start: float | None = None
        self.low_this_tick = 0
        self._seq = 0  # tie-break: equal times keep insertion order
        self.num_preemptions = 0
        self.last_utilization = 0.0

    # --- keys ---
    @staticmethod
    def _order_key(req: Request):
        return (int(req.priority), req.arrival - req.priority_adjust_s, req.seq_no)

    @staticmethod
    def _low_key(req: Request):
        return (req.arrival - req.priority_adjust_s, req.seq_no)

    # --- queue operations ---
    def add(self, req: Request) -> None:
        self._seq += 1
        req.seq_no = self._seq
        if self.priority_hook is not None:
            req.priority_adjust_s = self._clamp(self.priority_hook(req))
        req.status = RequestStatus.WAITING
        if req.priority == Priority.HIGH:
            self.high.append(req)
        else:
            bisect.insort(self.low, req, key=self._low_key)

    def _clamp(self, s: float) -> float:
        m = self.config.max_priority_adjust_s
        return max(-m, min(m, float(s)))

    def adjust_priority(self, req: Request, seconds: float) -> None:
        """The hook's call for a request already queued: move it in LOW by `seconds`."""
        req.priority_adjust_s = self._clamp(seconds)
        if req in self.low:
            self.low.remove(req)
            bisect.insort(self.low, req, key=self._low_key)

    def remove(self, req: Request) -> bool:
        """Take `req` out of whichever queue holds it (abort). Its blocks are the caller's."""
        for queue in (self.high, self.low, self.resumed, self.running):
            if req in queue:
                queue.remove(req)
                return True
        return False

    def has_waiting(self) -> bool:
        return bool(self.high or self.low or self.resumed)

    def has_work(self) -> bool:
        return bool(self.running) or self.has_waiting()

    def num_waiting(self) -> int:
        return len(self.high) + len(self.low) + len(self.resumed)

    # --- utilization (see module doc) ---
    def utilization(self, tokens_in_step: int) -> float:
        fill = tokens_in_step / self.config.max_num_batched_tokens
        return max(self.bm.occupancy, fill)

    def _age(self, now: float) -> None:
        """Aging: a LOW request that waited aging_s (adjustment included) joins HIGH's tail."""
        while self.low and now - self._low_key(self.low[0])[0] >= self.config.aging_s:
            self.high.append(self.low.pop(0))

    # --- one step ---
    def schedule(self, now: float | None = None) -> ScheduledBatch:
        now = self.clock() if now is None else now
        cfg, bm = self.config, self.bm
        batch = ScheduledBatch()
        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()

        self.running.sort(key=self._order_key)
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted as a victim in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._make_room(req, req.num_computed_tokens + n, scheduled, batch):
                continue  # req itself was the victim
            batch.copies += bm.ensure_slots(req, req.num_computed_tokens + n)
            batch.items.append((req, n))
            scheduled.add(id(req))
            budget -= n

        if not batch.preempted:
            budget = self._admit(now, budget, batch)
        self.last_utilization = self.utilization(batch.num_tokens)
        return batch

    def _make_room(self, req: Request, num_tokens: int, scheduled: set, batch: ScheduledBatch) -> bool:
        """Preempt (by recompute) until `req` can grow to `num_tokens` slots. False if `req`
        itself had to go. Victims: the running request sorting last, not yet scheduled."""
        while not self.bm.can_allocate(self.bm.blocks_needed(req, num_tokens)):
            candidates = [r for r in self.running if id(r) not in scheduled]
            victim = max(candidates, key=self._order_key)
            self._preempt(victim, batch)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.bm.free(req)  # keeps token_ids: the resume recomputes prompt + output so far
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.resumed, req, key=self._order_key)
        batch.preempted.append(req)

    def _try_start(self, req: Request, budget: int, batch: ScheduledBatch, now: float) -> int | None:
        """Give `req` its blocks and its first chunk; None (and no blocks held) if it can't fit."""
        if len(self.running) >= self.config.max_num_seqs or budget == 0:
            return None
        self.bm.allocate_prefix(req)  # prefix-cache hits: their K/V is not recomputed
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        # a watermark of one block per running sequence keeps the next decodes from preempting
        need = self.bm.blocks_needed(req, req.num_computed_tokens + n) + len(self.running)
        if not self.bm.can_allocate(need):
            self.bm.free(req)
            return None
        batch.copies += self.bm.ensure_slots(req, req.num_computed_tokens + n)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled is None:
            req.first_scheduled = now
        self.running.append(req)
        batch.items.append((req, n))
        batch.admitted.append(req)
        return budget - n

    def _admit(self, now: float, budget: int, batch: ScheduledBatch) -> int:
        cfg = self.config
        # preempted requests first: they were admitted once already and hold no blocks now
        while self.resumed:
            left = self._try_start(self.resumed[0], budget, batch, now)
            if left is None:
                return budget
            self.resumed.pop(0)
            budget = left
        self._age(now)
        # the seed's rule 1: the HIGH head, at once, while utilization < the gate
        while self.high and self.utilization(batch.num_tokens) < cfg.utilization_gate:
            left = self._try_start(self.high[0], budget, batch, now)
            if left is None:
                return budget
            self.high.popleft()
            budget = left
        if self.high:
            return budget
        # the seed's rule 2: at most max_low_per_tick LOW admissions per tick
        if self.tick_start is None or now - self.tick_start >= cfg.tick_s:
            self.tick_start, self.low_this_tick = now, 0
        while (
            self.low
            and self.low_this_tick < cfg.max_low_per_tick
            and self.utilization(batch.num_tokens) < cfg.utilization_gate
        ):
            left = self._try_start(self.low[0], budget, batch, now)
            if left is None:
                return budget
            self.low.pop(0)
            self.low_this_tick += 1
            budget = left
        return budget

    def finish(self, req: Request) -> None:
        """A finished request leaves the running set and drops its blocks."""
        self.running.remove(req)
        self.bm.free(req)
