"""LLMEngine: requests in, tokens out, one step at a time.

    step() = schedule -> execute (one packed forward) -> postprocess (sample, stop, free)

Single-threaded by design: AsyncEngine (async_engine.py) owns the thread that calls step() and
funnels submissions and aborts into it between steps. Text: with a tokenizer, each request has
an incremental detokenizer; `StepOutput.text` is the complete-UTF-8 delta, stop strings are
found in the text, and text that could still become a stop string is held back until it cannot.
"""

import time
from dataclasses import dataclass, field

from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.config import EngineConfig
from scratchllm.engine.memory_plan import MemoryPlan, plan_memory
from scratchllm.engine.model_runner import ModelRunner
from scratchllm.engine.request import Priority, Request, RequestMetrics, RequestStatus
from scratchllm.engine.scheduler import Scheduler
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams


@dataclass
class StepOutput:
    """One new token (or the end) of one request."""

    request_id: str
    token_id: int | None  # None: the request ended without a new token (abort)
    text: str  # complete-UTF-8 text delta ("" without a tokenizer)
    index: int  # 0-based index of the token among the request's outputs
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last output
    logprob: float | None = None
    top_logprobs: list | None = None
    metrics: RequestMetrics | None = None  # on the last output


@dataclass
class _TextState:
    detok: object
    text: str = ""
    emitted: int = 0
    holdback: int = 0
    stops: tuple = field(default_factory=tuple)


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None, eos_token_id=None,
                 clock=time.monotonic):
        self.model = model
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.clock = clock
        mc = model.config
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer else None
            eos_token_id = mc.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_id = eos_token_id
        ctx = min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings)
        self.plan: MemoryPlan = plan_memory(model, config, ctx)
        num_blocks = self.plan.num_kv_blocks
        # a sequence can never outgrow the pool: cap the context there
        self.max_model_len = min(ctx, num_blocks * config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, clock)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.num_threads)
        self.requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self._next_id = 0
        self.num_steps = 0
        self.num_generated = 0
        self.step_tokens_total = 0
        self.last_step_tokens = 0

    @classmethod
    def from_pretrained(cls, ref: str = "default", tokenizer=True, dtype: str = "float32",
                        **engine_options) -> "LLMEngine":
        """Load a model (and its tokenizer) and build the engine: EngineConfig(**engine_options)."""
        from scratchllm.models import load_model

        model = load_model(ref, dtype=dtype)
        tok = None
        if tokenizer:
            from scratchllm.tokenizer import Tokenizer

            tok = Tokenizer.from_pretrained(ref)
        return cls(model, EngineConfig(**engine_options), tokenizer=tok)

    # --- requests ---
    def add_request(self, request_id, prompt_token_ids, params: SamplingParams | None = None,
                    priority=None) -> Request:
        params = params or SamplingParams()
        if request_id is None:
            self._next_id += 1
            request_id = f"req-{self._next_id}"
        request_id = str(request_id)
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, self._priority(params, priority),
                      arrival=self.clock())
        self.requests[request_id] = req
        if self.tokenizer is not None:
            stops = params.stop
            self._text[request_id] = _TextState(self.tokenizer.detokenizer(skip_special_tokens=True),
                                                holdback=max((len(s) for s in stops), default=1) - 1, stops=stops)
        self.scheduler.add(req)
        return req

    def validate(self, prompt_token_ids, params: SamplingParams) -> None:
        """Raise ConfigError for a request this engine can never run (read-only: any thread)."""
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be SamplingParams, got {type(params).__name__}")
        if len(prompt_token_ids) == 0:
            raise ConfigError("the prompt is empty: it has no tokens to continue from")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ConfigError(f"the prompt has {len(prompt_token_ids)} tokens; this engine's context is "
                              f"{self.max_model_len} (at least one must be left to generate)")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")

    def _priority(self, params: SamplingParams, priority) -> Priority:
        if priority is None:  # the seed's rule: short requests are high priority
            return Priority.HIGH if params.max_tokens < self.config.high_priority_max_tokens else Priority.LOW
        if isinstance(priority, str):
            try:
                return Priority[priority.upper()]
            except KeyError:
                raise ConfigError(f"priority must be 'high' or 'low', got {priority!r}") from None
        return Priority(int(priority))

    def abort(self, request_id) -> StepOutput | None:
        """Stop a request now and return every block it holds. Returns its final output."""
        req = self.requests.pop(str(request_id), None)
        if req is None or req.status.done:
            return None
        if req.status == RequestStatus.RUNNING:
            self.scheduler.running.remove(req)
        else:
            self.scheduler.remove(req)
        self.block_manager.free(req)  # deferred by the block manager if a step is in flight
        req.finish("abort", self.clock())
        self._text.pop(req.request_id, None)
        return StepOutput(req.request_id, None, "", req.num_output_tokens, "abort", metrics=req.metrics())

    def set_priority_hook(self, fn) -> None:
        """fn(request) -> seconds of priority adjustment (the evaluation loop's lever)."""
        self.scheduler.priority_hook = fn

    def adjust_priority(self, request_id, seconds: float) -> bool:
        """Move a waiting request by `seconds` of aging (clamped); False if it is not waiting."""
        req = self.requests.get(str(request_id))
        if req is None or req.status != RequestStatus.WAITING:
            return False
        self.scheduler.adjust_priority(req, seconds)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- the step ---
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule(self.clock())
        self.last_step_tokens = batch.num_tokens
        if not batch.items:
            return []
        bm = self.block_manager
        bm.begin_step()
        try:
            reqs, logits = self.runner.execute(batch)
        finally:
            bm.end_step()
        self.num_steps += 1
        self.step_tokens_total += batch.num_tokens
        for req, n in batch.items:
            req.num_computed_tokens += n
            bm.cache_full_blocks(req)
        now = self.clock()
        outputs = []
        for req, (token, lp, top) in zip(reqs, ModelRunner.sample(reqs, logits), strict=True):
            outputs.append(self._postprocess(req, token, lp, top, now))
        return outputs

    def _postprocess(self, req: Request, token: int, lp, top, now: float) -> StepOutput:
        req.append_token(token, now)
        self.num_generated += 1
        params = req.params
        reason = None
        stop_token = token in params.stop_token_ids or (token == self.eos_token_id and not params.ignore_eos)
        if stop_token:
            reason = "stop"  # the token is kept in token_ids; its text is not shown
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        text = ""
        ts = self._text.get(req.request_id)
        if ts is not None:
            if not stop_token:
                ts.text += ts.detok.push(token)
            if reason is not None and hasattr(ts.detok, "flush"):
                ts.text += ts.detok.flush()  # a character cut at the end shows as U+FFFD, as decode does
            for s in ts.stops:
                at = ts.text.find(s)
                if at >= 0:
                    ts.text, reason = ts.text[:at], "stop"
            end = len(ts.text) if reason else max(len(ts.text) - ts.holdback, ts.emitted)
            text, ts.emitted = ts.text[ts.emitted : end], end
        out = StepOutput(req.request_id, token, text, req.num_output_tokens - 1, reason, lp, top)
        if reason is not None:
            req.finish(reason, now)
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            self._text.pop(req.request_id, None)
            out.metrics = req.metrics()
        return out

    def generate(self, prompts_token_ids, params) -> list[dict]:
        """Run many prompts to completion, batched (what LLM.generate needs). `params`: one
        SamplingParams or one per prompt. Returns, in prompt order, dicts with request_id,
        token_ids, text, finish_reason, metrics (RequestMetrics) and logprobs (per token
        (logprob, [(id, logprob), ...]) when the params ask for them, else None)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts_token_ids)
        results = {}
        for ids, p in zip(prompts_token_ids, params, strict=True):
            req = self.add_request(None, ids, p)
            results[req.request_id] = {"request_id": req.request_id, "token_ids": [], "text": "",
                                       "finish_reason": None, "metrics": None,
                                       "logprobs": [] if p.logprobs is not None else None}
        order = list(results)
        while self.has_work():
            for o in self.step():
                r = results.get(o.request_id)
                if r is None:
                    continue
                r["token_ids"].append(o.token_id)
                r["text"] += o.text
                if r["logprobs"] is not None:
                    r["logprobs"].append((o.logprob, o.top_logprobs))
                if o.finish_reason:
                    r["finish_reason"], r["metrics"] = o.finish_reason, o.metrics
        return [results[rid] for rid in order]

    def stats(self) -> dict:
        bm, s = self.block_manager, self.scheduler
        return {
            "running": len(s.running),
            "waiting": s.num_waiting(),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used,
            "kv_blocks_peak": bm.stats.peak_used,
            "kv_block_bytes": self.plan.kv_block_bytes,
            "kv_bytes_used": bm.num_used * self.plan.kv_block_bytes,
            "kv_bytes_peak": bm.stats.peak_used * self.plan.kv_block_bytes,
            "kv_occupancy": bm.occupancy,
            "utilization": s.last_utilization,
            "prefix_cache_queries": bm.stats.prefix_queries,
            "prefix_cache_hits": bm.stats.prefix_hits,
            "preemptions": s.num_preemptions,
            "steps": self.num_steps,
            "generated_tokens": self.num_generated,
            "memory_plan": self.plan.describe(),
        }
