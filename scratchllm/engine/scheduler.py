"""The scheduler: the mechanism of continuous batching. Who may start next is the admission
policy's call (policy.py: the priority policy or FCFS); what each step computes is decided here:
running requests first, a per-step token budget, chunked prefill, preemption by recompute.
Policy only: no numerics here (those are the model runner's). The scheduler owns its state: the
engine calls schedule() before a step, runs the forward inside `stepping()`, then update(); and
abort(); it never edits the queues or the block tables itself.

Each step (schedule()): running decodes first, then running prefill chunks, both in
(priority, virtual arrival) order, each taking from the token budget; if blocks run out the
running request that sorts last (lowest priority, latest arrival) not yet scheduled is
preempted by recompute (its blocks are freed; its tokens are kept). Then, if no preemption
happened (admitting while preempting would thrash), preempted requests resume first, in their
(priority, arrival) order, and then the policy admits new ones.

Utilization on a CPU: there is no busy counter like a GPU's. It is max(KV occupancy = used
blocks / pool, batch fill = tokens already in this step / token budget): the first says
memory is nearly spent, the second that this step's GEMMs are already full.

The priority hook (request -> seconds, set by the evaluation loop) is clamped to
+-max_priority_adjust_s and moves a request's virtual arrival: positive = earlier.

A TPOT target (EngineConfig.target_tpot_s): the engine reports each step's tokens and duration
(observe_step) to a step-time model (step_time.py); the step's token budget becomes the most
tokens predicted to fit the target, but never fewer than the running decodes (they are not
starved) nor than 1, so admission stops adding sequences once the decodes fill it.
"""

import bisect
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.config import EngineConfig
from scratchllm.engine.policy import POLICIES, AdmissionPolicy
from scratchllm.engine.request import Request, RequestStatus
from scratchllm.engine.speculative.draft import Draft
from scratchllm.engine.step_time import StepTimeModel


@dataclass
class ScheduledBatch:
    """One step's work: for each request, how many of its uncomputed tokens to compute. A decoding
    request that verifies drafted tokens computes its last token and the drafts: its item counts
    1 + len(drafts[req].tokens) rows."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # CoW (group, src, dst) copies to do first
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    drafts: dict[Request, Draft] = field(default_factory=dict)  # speculative decoding: what each verifies

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, clock: Callable[[], float] = time.monotonic,
                 policy: AdmissionPolicy | None = None):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.policy: AdmissionPolicy = policy or POLICIES[config.policy](config)
        self.resumed: list[Request] = []  # preempted, sorted by _order_key
        self.running: list[Request] = []
        self.priority_hook: Callable[[Request], float] | None = None
        self._seq = 0  # tie-break: equal times keep insertion order
        self.num_preemptions = 0
        self.num_priority_adjusted = 0  # requests the hook moved (an audit count for /metrics)
        self.last_utilization = 0.0
        self.step_time = StepTimeModel()  # fed by observe_step; read only with a TPOT target
        self.last_token_budget = config.max_num_batched_tokens

    @staticmethod
    def _order_key(req: Request) -> tuple[int, float, int]:
        assert req.priority is not None, "the policy classifies a request when it is added"
        return (int(req.priority), req.arrival - req.priority_adjust_s, req.seq_no)

    # --- requests in and out ---
    def add(self, req: Request) -> None:
        self._seq += 1
        req.seq_no = self._seq
        if self.priority_hook is not None:
            req.priority_adjust_s = self._clamp(self.priority_hook(req))
            self.num_priority_adjusted += req.priority_adjust_s != 0.0
        req.status = RequestStatus.WAITING
        self.policy.add(req)

    def _clamp(self, s: float) -> float:
        m = self.config.max_priority_adjust_s
        return max(-m, min(m, float(s)))

    def adjust_priority(self, req: Request, seconds: float) -> bool:
        """Move a waiting request by `seconds` of virtual arrival (clamped); False if it is not waiting."""
        if req.status != RequestStatus.WAITING:
            return False
        req.priority_adjust_s = self._clamp(seconds)
        self.policy.requeue(req)
        return True

    def abort(self, req: Request) -> bool:
        """Take `req` out of whichever queue holds it and free its blocks (deferred by the block
        manager while a step is in flight). False if the scheduler did not hold it. A choice
        still waiting to fork leaves its parent; a parent aborted before its prefill hands its
        waiting choices back to the queue as requests of their own."""
        if req.fork_parent is not None and req in req.fork_parent.fork_children:
            req.fork_parent.fork_children.remove(req)
            return True
        for child in req.fork_children:
            child.fork_parent = None
            self.add(child)
        req.fork_children = []
        if req in self.running:
            self.running.remove(req)
        elif req in self.resumed:
            self.resumed.remove(req)
        elif not self.policy.remove(req):
            return False
        self.bm.free(req)
        return True

    # --- questions ---
    def has_waiting(self) -> bool:
        return bool(self.resumed) or len(self.policy) > 0

    def has_work(self) -> bool:
        return bool(self.running) or self.has_waiting()

    def num_waiting(self) -> int:
        return len(self.policy) + len(self.resumed)

    def num_running(self) -> int:
        return len(self.running)

    def decoding(self) -> list[Request]:
        """The running requests whose next step is a decode (one token not yet computed), in the
        order the next schedule() takes them: the ones a proposer may draft for."""
        return sorted((r for r in self.running if r.num_tokens - r.num_computed_tokens == 1), key=self._order_key)

    def utilization(self, tokens_in_step: int) -> float:
        fill = tokens_in_step / self.config.max_num_batched_tokens
        return max(self.bm.occupancy, fill)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens took `seconds` (schedule to update): the step-time model's data."""
        self.step_time.observe(tokens, seconds)

    def token_budget(self, decodes: int) -> int:
        """This step's token budget: the configured one, within a TPOT target if one is set."""
        budget = self.config.max_num_batched_tokens
        target = self.config.target_tpot_s
        if target is not None:
            fit = self.step_time.max_tokens(target)
            if fit is not None:
                budget = min(budget, max(fit, decodes, 1))
        return budget

    # --- one step ---
    def schedule(self, now: float | None = None, proposals: Mapping[Request, Draft] | None = None) -> ScheduledBatch:
        """This step's batch. `proposals`: drafted tokens of decoding requests (speculative
        decoding), each verified this step if the budget and the free blocks allow, cut to what
        they allow otherwise: a draft never preempts, nor takes the blocks the decodes after it
        need (one each)."""
        now = self.clock() if now is None else now
        bm = self.bm
        batch = ScheduledBatch()
        scheduled: set[int] = set()

        self.running.sort(key=self._order_key)
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        budget = self.last_token_budget = self.token_budget(len(decodes))
        for i, req in enumerate(decodes + prefills):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted as a victim in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._make_room(req, req.num_computed_tokens + n, scheduled, batch):
                continue  # req itself was the victim
            draft = proposals.get(req) if proposals and i < len(decodes) else None
            k = min(len(draft.tokens), budget - n) if draft is not None else 0
            if k and not bm.can_allocate(bm.blocks_needed(req, req.num_computed_tokens + n + k),
                                         reserve=len(decodes) - i - 1):
                k = 0
            batch.copies += bm.ensure_slots(req, req.num_computed_tokens + n + k)
            batch.items.append((req, n + k))
            if draft is not None and k:
                batch.drafts[req] = draft.head(k)
            scheduled.add(id(req))
            budget -= n + k

        if not batch.preempted:
            self._admit(now, budget, batch)
        self.last_utilization = self.utilization(batch.num_tokens)
        return batch

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around the forward of a scheduled batch: blocks freed meanwhile (an abort from
        another request's end) are not handed out again until the step that reads them is over."""
        self.bm.begin_step()
        try:
            yield
        finally:
            self.bm.end_step()

    def update(self, batch: ScheduledBatch, finished: list[Request],
               forks: Sequence[tuple[Request, Request]] = (), emitted: Mapping[Request, int] | None = None) -> None:
        """After the forward: the batch's K/V is computed (full blocks enter the prefix cache);
        each (parent, child) fork makes the child share the parent's blocks and run from the
        next step; then the requests that finished this step leave the running set with their
        blocks (a finished parent's blocks stay while a child holds them).

        A request that verified drafts (batch.drafts) emitted `emitted[req]` tokens: its accepted
        drafts and one more. Its computed positions are its last token's and the accepted drafts'
        (the rows before the first rejected one): min(rows, emitted). The K/V of rejected drafts
        lies past them, is rewritten when those positions are computed again, and the blocks that
        hold only such slots go back to the pool."""
        for req, n in batch.items:
            verified = req in batch.drafts
            if verified:
                assert emitted is not None and emitted[req] >= 1, "a verification emits at least one token"
                n = min(n, emitted[req])
            req.num_computed_tokens += n
            assert req.num_computed_tokens <= req.num_tokens
            self.bm.cache_full_blocks(req)
            self.bm.release_outside_window(req)  # windowed layers: blocks no later query reads
            if verified and not req.status.done:
                self.bm.trim(req)
        for parent, child in forks:
            assert child.fork_parent is parent and not child.block_table
            self.bm.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        for req in finished:
            assert req.status.done, f"request {req.request_id} is not finished"
            self.running.remove(req)
            self.bm.free(req)

    def _make_room(self, req: Request, num_tokens: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
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
        if len(self.running) + 1 + len(req.fork_children) > self.config.max_num_seqs or budget == 0:
            return None  # a request and the choices that will fork from it run together
        cached = self.bm.allocate_prefix(req)  # prefix-cache hits: their K/V is not recomputed
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        # a watermark of one block per running sequence keeps the next decodes from preempting
        need = self.bm.blocks_needed(req, req.num_computed_tokens + n)
        if not self.bm.can_allocate(need, reserve=len(self.running)):
            self.bm.free(req)
            return None
        batch.copies += self.bm.ensure_slots(req, req.num_computed_tokens + n)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled is None:
            req.first_scheduled = now
            req.num_cached_tokens = min(cached, req.num_prompt_tokens)
        self.running.append(req)
        batch.items.append((req, n))
        batch.admitted.append(req)
        return budget - n

    def _admit(self, now: float, budget: int, batch: ScheduledBatch) -> None:
        left = budget

        def start(req: Request) -> bool:
            nonlocal left
            after = self._try_start(req, left, batch, now)
            if after is None:
                return False
            left = after
            return True

        # preempted requests first: they were admitted once already and hold no blocks now
        while self.resumed:
            if not start(self.resumed[0]):
                return
            self.resumed.pop(0)
        self.policy.admit(now, start, lambda: self.utilization(batch.num_tokens))
