"""LLMEngine: requests in, tokens out, one step at a time.

    step() = schedule -> execute (one packed forward) -> sample -> output path -> update

Single-threaded by design: AsyncEngine (async_engine.py) owns the thread that calls step() and
funnels submissions and aborts into it between steps. The scheduler owns the queues and the
block tables (this module only asks it); tokens become events in the one output path
(output.py), which decides why a request ends and what text it shows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.block_pool import FOLLOW_PEAK
from scratchllm.engine.config import EngineConfig
from scratchllm.engine.load import load_weights
from scratchllm.engine.memory_plan import MemoryPlan, plan_memory
from scratchllm.engine.model_runner import ModelRunner
from scratchllm.engine.output import OutputCollector, OutputProcessor, end_token_ids
from scratchllm.engine.protocol import FINISH_REASONS, EngineStats, RequestOutput, TokenEvent
from scratchllm.engine.request import Priority, Request
from scratchllm.engine.sampler import SampledToken, sample, verify
from scratchllm.engine.scheduler import Scheduler
from scratchllm.engine.speculative.draft_model import DraftModel
from scratchllm.engine.speculative.speculator import Speculator, by_request, draft_rows
from scratchllm.engine.speculative.vocabulary import Vocabulary, check_same_vocabulary
from scratchllm.engine.streams import RequestIds
from scratchllm.engine.tracing import StepTracer
from scratchllm.engine.validate import RequestLimits
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams
from scratchllm.trace.writer import TraceWriter

if TYPE_CHECKING:
    from scratchllm.models.protocol import Model
    from scratchllm.tokenizer.protocol import TokenizerLike

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: Model, config: EngineConfig | None = None, tokenizer: TokenizerLike | None = None,
                 eos_token_id: int | None = None, clock: Callable[[], float] = time.monotonic,
                 trace: TraceWriter | None = None, draft_model: Model | None = None,
                 draft_tokenizer: TokenizerLike | None = None):
        """`draft_model` (and its tokenizer): the draft of a speculative config with a "model",
        already loaded; None: loaded here from the config's reference."""
        self.model = model
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.clock = clock
        mc = model.config
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer else None
            eos_token_id = mc.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_id = eos_token_id
        self.end_token_ids = end_token_ids(tokenizer, eos_token_id)  # every token that ends a request
        ctx = min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings)
        spec = config.speculative
        if spec is not None and spec.uses_draft_model:
            assert spec.model is not None
            if draft_model is None:
                draft_model, draft_tokenizer = load_weights(spec.model, "auto", tokenizer is not None)
            _check_draft(model, tokenizer, draft_model, draft_tokenizer, spec.model)
        else:
            draft_model = None
        self.plan: MemoryPlan = plan_memory(model, config, ctx, draft=draft_model)
        num_blocks = self.plan.num_kv_blocks
        # a sequence can never outgrow the pool: cap the context there (a windowed pool holds windows)
        self.max_model_len = ctx if self.plan.all_windowed else min(ctx, num_blocks * config.block_size)
        self.limits = RequestLimits(self.max_model_len, mc.vocab_size)
        window_pool = self.plan.num_window_blocks or None  # the windowed layers' own pool, if any
        group_bytes = (self.plan.kv_block_bytes, self.plan.window_block_bytes) if window_pool else \
            (self.plan.kv_block_bytes,)
        # the prefix cache's residue cap, in blocks of every group together (a prefix is cached in
        # each); by default as many blocks as the work's peak
        residue = FOLLOW_PEAK if config.prefix_cache_memory_bytes is None else \
            config.prefix_cache_memory_bytes // sum(group_bytes)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.plan.window, window_pool, block_bytes=group_bytes,
                                          residue_blocks=residue)
        self.scheduler = Scheduler(config, self.block_manager, clock)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.num_threads, window_pool,
                                  self.plan.kv_dtype)
        # speculative decoding: the drafts of each step's decodes (speculative/speculator.py)
        self.speculator: Speculator | None = None
        if spec is not None:
            draft = None if draft_model is None else DraftModel(
                draft_model, self.plan.num_draft_blocks, config.block_size, config.num_threads, self.plan.kv_dtype,
                spec.draft_p_min)
            self.speculator = Speculator(spec, self.max_model_len, draft, self.end_token_ids)
        self.requests: dict[str, Request] = {}
        self._outputs: dict[str, OutputProcessor] = {}
        self._ids = RequestIds("req")  # for requests added without one
        self.num_steps = 0
        self.num_generated = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)  # requests ended per finish reason
        self.step_tokens_total = 0
        self.last_step_tokens = 0
        # every token into the trace ring (scratchllm/trace), when a writer is given
        self.tracer = StepTracer(trace) if trace is not None else None
        logger.info("engine: %s, %d KV blocks of %d tokens, policy %s", type(model).__name__, num_blocks,
                    config.block_size, config.policy)

    @classmethod
    def from_pretrained(cls, ref: str = "default", tokenizer: bool = True, dtype: str = "float32",
                        trace: TraceWriter | None = None, **engine_options: Any) -> LLMEngine:
        """Load a model (and its tokenizer) and build the engine: EngineConfig(**engine_options);
        `trace`: a TraceWriter the engine writes every token into."""
        model, tok = load_weights(ref, dtype, tokenizer)
        return cls(model, EngineConfig(**engine_options), tokenizer=tok, trace=trace)

    # --- requests ---
    def add_request(self, request_id: str | None, prompt_token_ids: Sequence[int],
                    params: SamplingParams | None = None, priority: Priority | str | int | None = None,
                    arrival: float | None = None) -> Request:
        """Queue a request. `arrival`: when it was submitted (this engine's clock; default now)."""
        params = params or SamplingParams()
        request_id = self._ids.next() if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, _priority(priority),
                      arrival=self.clock() if arrival is None else arrival)
        self.requests[request_id] = req
        self._outputs[request_id] = self._output_processor(request_id, params, req.arrival)
        self.scheduler.add(req)
        if self.tracer is not None:
            self.tracer.arrived(req)
        return req

    def add_group(self, request_ids: Sequence[str | None], prompt_token_ids: Sequence[int],
                  params: Sequence[SamplingParams], priority: Priority | str | int | None = None,
                  arrival: float | None = None) -> list[Request]:
        """Several requests on one prompt (n > 1 sampling, each with its own params and seed).
        The first computes the prompt; when its prefill is done the others fork its KV blocks
        (shared, copied on write) and sample their first token from the same logits, so the
        prompt is computed and stored once. Each one's tokens equal a request of its own with
        the same params (tests/engine/test_fork.py)."""
        assert len(request_ids) == len(params) >= 1
        for p in params:
            self.validate(prompt_token_ids, p)
        rids = [None if r is None else str(r) for r in request_ids]
        taken = [r for r in rids if r is not None and (r in self.requests or rids.count(r) > 1)]
        if taken:
            raise ConfigError(f"request id {taken[0]!r} is already in use")
        leader = self.add_request(rids[0], prompt_token_ids, params[0], priority, arrival)
        for rid, p in zip(rids[1:], params[1:], strict=True):
            if rid is None:
                rid = self._ids.next()
            child = Request(rid, list(prompt_token_ids), p, leader.priority, arrival=leader.arrival,
                            fork_parent=leader)
            self.requests[rid] = child
            self._outputs[rid] = self._output_processor(rid, p, child.arrival)
            leader.fork_children.append(child)
            if self.tracer is not None:
                self.tracer.arrived(child)
        return [leader, *leader.fork_children]

    def _output_processor(self, request_id: str, params: SamplingParams, arrival: float) -> OutputProcessor:
        skip = params.skip_special_tokens
        detok = self.tokenizer.detokenizer(skip_special_tokens=skip) if self.tokenizer is not None else None
        if detok is not None and self.tracer is not None:
            detok = self.tracer.detokenize.timed(detok)  # the step's detokenize span
        return OutputProcessor(request_id, params, detok, self.end_token_ids, arrival)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ConfigError for a request this engine can never run (validate.py; read-only: any thread)."""
        self.limits.validate(prompt_token_ids, params)

    def abort(self, request_id: str) -> TokenEvent | None:
        """Stop a request now and return every block it holds. Returns its final event."""
        req = self.requests.pop(str(request_id), None)
        if req is None or req.status.done:
            return None
        self.scheduler.abort(req)  # blocks: deferred by the block manager if a step is in flight
        req.finish("abort", self.clock())
        self.finished["abort"] += 1
        if self.speculator is not None:
            self.speculator.release(req.request_id)
        event = self._outputs.pop(req.request_id).abort()
        event.metrics = req.metrics()
        if self.tracer is not None:
            self.tracer.ended(event)
        return event

    def set_priority_hook(self, fn: Callable[[Request], float] | None) -> None:
        """fn(request) -> seconds of priority adjustment (the evaluation loop's lever)."""
        self.scheduler.priority_hook = fn

    def adjust_priority(self, request_id: str, seconds: float) -> bool:
        """Move a waiting request by `seconds` of virtual arrival (clamped); False if it is not waiting."""
        req = self.requests.get(str(request_id))
        return req is not None and self.scheduler.adjust_priority(req, seconds)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- the step ---
    def step(self) -> list[TokenEvent]:
        start_ns = time.monotonic_ns()
        propose_start = self.clock()
        # speculative decoding: drafts for the decoding requests, verified in this step's forward
        proposals = self.speculator.propose(self.scheduler.decoding()) if self.speculator is not None else None
        draft_ns = time.monotonic_ns() - start_ns
        schedule_time = self.clock()
        batch = self.scheduler.schedule(schedule_time, proposals)
        self.last_step_tokens = batch.num_tokens
        if not batch.items:
            return []
        with self.scheduler.stepping():
            forward_start = time.perf_counter_ns()
            reqs, logits = self.runner.execute(batch)
            forward_ns = time.perf_counter_ns() - forward_start
        self.num_steps += 1
        self.step_tokens_total += batch.num_tokens
        now = self.clock()
        events: list[TokenEvent] = []
        finished: list[Request] = []
        forks: list[tuple[Request, Request]] = []
        emitted: dict[Request, int] = {}
        accepted_by: dict[str, int] = {}  # request id -> its drafts accepted and emitted in this step
        sampled = (verify(logits, reqs, *draft_rows(reqs, batch.drafts), end_token_ids=self.end_token_ids)
                   if batch.drafts else sample(logits, reqs, self.end_token_ids))
        for row, req, tokens in by_request(reqs, sampled):
            if req.fork_children and req.num_output_tokens == 0:  # its prefill is done: the others fork
                kids, req.fork_children = req.fork_children, []
                rows = np.repeat(logits[row : row + 1], len(kids), axis=0)
                for kid, kid_sampled in zip(kids, sample(rows, kids, self.end_token_ids), strict=True):
                    kid.first_scheduled = req.first_scheduled
                    kid.prompt_logprobs = req.prompt_logprobs  # the prompt was computed once, for all
                    if not self._emit(kid, kid_sampled, now, events, finished):
                        forks.append((req, kid))
            n = 0
            for token in tokens:  # one, or a verification's accepted drafts and the target's own
                n += 1
                if self._emit(req, token, now, events, finished):
                    break
            draft = batch.drafts.get(req)
            if draft is not None:
                assert self.speculator is not None
                emitted[req] = n
                accepted = next((i for i, (t, d) in enumerate(zip(tokens, draft.tokens, strict=False))
                                 if t.token != d), min(len(tokens), len(draft.tokens)))
                # drafts accepted and emitted (a request that ended on one drops the rest)
                accepted_by[req.request_id] = min(accepted, n)
                self.speculator.verified(req, len(draft.tokens), accepted_by[req.request_id], n)
        self.scheduler.update(batch, [r for r in finished if r.fork_parent is None or r.block_table], forks, emitted)
        step_s = self.clock() - schedule_time
        self.scheduler.observe_step(batch.num_tokens, self.clock() - propose_start)
        if self.speculator is not None and all(n == 1 or r in batch.drafts for r, n in batch.items):
            self.speculator.observe_step(batch.num_tokens, step_s)  # decodes only: a row's cost
        if self.tracer is not None:
            bm, s = self.block_manager, self.scheduler
            self.tracer.step(self.num_steps, start_ns, time.monotonic_ns(), events, self.requests,
                             forward_ns=forward_ns, attention_ns=self.runner.attention.elapsed_ns,
                             step_tokens=batch.num_tokens, running=s.num_running() + len(finished),
                             waiting=s.num_waiting(), kv_used=bm.num_used, kv_total=bm.num_blocks,
                             preempted=len(batch.preempted), accepted=accepted_by,
                             drafted=sum(len(d.tokens) for d in batch.drafts.values()), draft_ns=draft_ns)
        return events

    def _emit(self, req: Request, sampled: SampledToken, now: float, events: list[TokenEvent],
              finished: list[Request]) -> bool:
        """The request's new token through the output path; True if it finished with it."""
        token, lp, top = sampled
        req.append_token(token, now)
        self.num_generated += 1
        event = self._outputs[req.request_id].process(token, lp, top, context_full=req.num_tokens >= self.max_model_len,
                                                      now=now)
        if req.num_output_tokens == 1 and req.params.prompt_logprobs is not None:
            event.prompt_logprobs = req.prompt_logprobs
        events.append(event)
        if event.finish_reason is None:
            return False
        req.finish(event.finish_reason, now)
        self.finished[event.finish_reason] += 1
        if self.speculator is not None:
            self.speculator.release(req.request_id)
        event.metrics = req.metrics()
        finished.append(req)
        del self.requests[req.request_id], self._outputs[req.request_id]
        return True

    def generate(self, prompts_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run many prompts to completion, batched. `params`: one SamplingParams or one per
        prompt. Returns their RequestOutputs in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts_token_ids)
        collectors = {}
        for ids, p in zip(prompts_token_ids, params, strict=True):
            req = self.add_request(None, ids, p)
            collectors[req.request_id] = OutputCollector(req.request_id, req.prompt_token_ids,
                                                         logprobs=p.logprobs is not None)
        while self.has_work():
            for event in self.step():
                if (c := collectors.get(event.request_id)) is not None:
                    c.add(event)
        return [c.output for c in collectors.values()]

    def stats(self) -> EngineStats:
        bm, s = self.block_manager, self.scheduler
        spec = self.speculator.counters if self.speculator is not None else None
        return EngineStats(
            running=s.num_running(), waiting=s.num_waiting(), finished=dict(self.finished),
            preemptions=s.num_preemptions, steps=self.num_steps,
            kv_blocks_used=bm.num_used, kv_blocks_peak=bm.stats.peak_used, kv_blocks_total=bm.num_blocks,
            kv_block_bytes=self.plan.kv_block_bytes, kv_bytes_per_token=self.plan.kv_bytes_per_token,
            kv_bytes_used=bm.bytes_used, kv_bytes_peak=bm.stats.peak_bytes,
            kv_bytes_resident=sum(g.num_resident * b for g, b in zip(bm.groups, bm.block_bytes, strict=False)),
            prefix_cache_free_blocks=bm.num_cached_free, prefix_cache_queries=bm.stats.prefix_queries,
            prefix_cache_hits=bm.stats.prefix_hits, priority_adjusted=s.num_priority_adjusted,
            spec_decode_num_drafts=spec.drafts if spec else None,
            spec_decode_num_draft_tokens=spec.draft_tokens if spec else None,
            spec_decode_num_accepted_tokens=spec.accepted_tokens if spec else None,
            spec_decode_num_emitted_tokens=spec.emitted_tokens if spec else None)


def _check_draft(model: Model, tokenizer: TokenizerLike | None, draft: Model, draft_tokenizer: TokenizerLike | None,
                 name: str) -> None:
    """A draft model must have the target's vocabulary (speculative/vocabulary.py); without
    tokenizers only the widths of their logits can be compared."""
    target_v, draft_v = model.config.vocab_size, draft.config.vocab_size
    if isinstance(tokenizer, Vocabulary) and isinstance(draft_tokenizer, Vocabulary):
        check_same_vocabulary(tokenizer, draft_tokenizer, target_v, draft_v, f"draft model {name!r}")
    elif target_v != draft_v:
        raise ConfigError(f"draft model {name!r} cannot draft for this model: its vocabulary differs (logits over "
                          f"{draft_v} token ids, the target's over {target_v})")


def _priority(priority: Priority | str | int | None) -> Priority | None:
    """An explicit priority ('high', 'low', 0, 1), or None: the admission policy decides."""
    if priority is None or isinstance(priority, Priority):
        return priority
    if isinstance(priority, str):
        try:
            return Priority[priority.upper()]
        except KeyError:
            raise ConfigError(f"priority must be 'high' or 'low', got {priority!r}") from None
    return Priority(int(priority))

