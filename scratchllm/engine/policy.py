"""Admission policies: which waiting request the scheduler tries to start next, and when to stop.
The mechanism (token budget, blocks, preemption, the running set) is the scheduler's; a policy
only orders the waiting queue and gates admission. Selected by `EngineConfig.policy`.

  priority (default): two queues and a tick.
    * HIGH = max_tokens < high_priority_max_tokens (256), FIFO; LOW = the rest (and any request
      whose params say low_priority: the Batch API's), by virtual
      arrival (arrival - priority adjustment, so the evaluation loop's hook can move a request).
    * when HIGH is non-empty and utilization < utilization_gate (80%), its head is admitted at
      once (this step, not at the next tick), and again while both still hold.
    * otherwise at most max_low_per_tick (2) LOW requests per tick (tick_s, 10 ms; a tick = the
      first admission round at least tick_s after the previous tick began).
    * LOW waits while HIGH is non-empty: admitting lower-priority work into a machine too busy
      for the high head would invert the priorities. LOW also needs utilization < the gate.
    * aging: a LOW request whose wait (adjustment included) reaches aging_s moves to the tail of
      HIGH, so its worst-case wait is bounded by aging_s + max_priority_adjust_s + the drain time
      of the HIGH queue ahead of it (tests pin this bound).
  fcfs: one queue by virtual arrival; admit while a request fits. No classes, no tick, no gate:
    the plain policy most servers use, and the baseline the priority policy is measured against.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from typing import Protocol

from scratchllm.engine.config import POLICY_NAMES, EngineConfig
from scratchllm.engine.request import Priority, Request

# start(req) -> True if the request was given its blocks and first chunk (the policy then drops
# it from its queue); False: it does not fit now, and admission stops for this step.
Start = Callable[[Request], bool]
Utilization = Callable[[], float]


def virtual_arrival(req: Request) -> tuple[float, int]:
    return (req.arrival - req.priority_adjust_s, req.seq_no)


class AdmissionPolicy(Protocol):
    name: str

    def add(self, req: Request) -> None: ...

    def remove(self, req: Request) -> bool: ...

    def requeue(self, req: Request) -> None: ...

    def __len__(self) -> int: ...

    def admit(self, now: float, start: Start, utilization: Utilization) -> None: ...


class PriorityPolicy:
    """The two-queue priority policy (see the module doc)."""

    name = "priority"

    def __init__(self, config: EngineConfig):
        self.config = config
        self.high: deque[Request] = deque()
        self.low: list[Request] = []  # sorted by virtual_arrival
        self.tick_start: float | None = None
        self.low_this_tick = 0

    def add(self, req: Request) -> None:
        if req.priority is None:  # short requests are high priority, unless marked low (batch work)
            short = req.params.max_tokens < self.config.high_priority_max_tokens
            req.priority = Priority.HIGH if short and not req.params.low_priority else Priority.LOW
        if req.priority == Priority.HIGH:
            self.high.append(req)
        else:
            bisect.insort(self.low, req, key=virtual_arrival)

    def remove(self, req: Request) -> bool:
        for queue in (self.high, self.low):
            if req in queue:
                queue.remove(req)
                return True
        return False

    def requeue(self, req: Request) -> None:
        """Its virtual arrival changed: move it to its new place in LOW (HIGH is FIFO)."""
        if req in self.low:
            self.low.remove(req)
            bisect.insort(self.low, req, key=virtual_arrival)

    def __len__(self) -> int:
        return len(self.high) + len(self.low)

    def _age(self, now: float) -> None:
        while self.low and now - virtual_arrival(self.low[0])[0] >= self.config.aging_s:
            self.high.append(self.low.pop(0))

    def admit(self, now: float, start: Start, utilization: Utilization) -> None:
        cfg = self.config
        self._age(now)
        # the HIGH head, at once, while utilization is below the gate
        while self.high and utilization() < cfg.utilization_gate:
            if not start(self.high[0]):
                return
            self.high.popleft()
        if self.high:
            return
        # at most max_low_per_tick LOW admissions per tick
        if self.tick_start is None or now - self.tick_start >= cfg.tick_s:
            self.tick_start, self.low_this_tick = now, 0
        while self.low and self.low_this_tick < cfg.max_low_per_tick and utilization() < cfg.utilization_gate:
            if not start(self.low[0]):
                return
            self.low.pop(0)
            self.low_this_tick += 1


class FCFSPolicy:
    """First come, first served (see the module doc)."""

    name = "fcfs"

    def __init__(self, config: EngineConfig):
        self.config = config
        self.queue: list[Request] = []  # sorted by virtual_arrival

    def add(self, req: Request) -> None:
        if req.priority is None:
            req.priority = Priority.LOW  # one class: preemption order is arrival order
        bisect.insort(self.queue, req, key=virtual_arrival)

    def remove(self, req: Request) -> bool:
        if req in self.queue:
            self.queue.remove(req)
            return True
        return False

    def requeue(self, req: Request) -> None:
        if self.remove(req):
            self.add(req)

    def __len__(self) -> int:
        return len(self.queue)

    def admit(self, now: float, start: Start, utilization: Utilization) -> None:
        while self.queue and start(self.queue[0]):
            self.queue.pop(0)


POLICIES: dict[str, Callable[[EngineConfig], AdmissionPolicy]] = {cls.name: cls for cls in (PriorityPolicy, FCFSPolicy)}
assert tuple(POLICIES) == POLICY_NAMES, "config.POLICY_NAMES names each policy here, in this order"
