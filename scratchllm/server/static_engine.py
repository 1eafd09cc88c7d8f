"""`serve --batching static`: the padded baseline (engine/static.py) behind the AsyncEngine contract.

The engine ships static batching as an offline function (`run_static`); serving it needs the
same thread-and-streams contract as AsyncEngine. This is that wrapper, and nothing more: one
thread takes up to `batch_size` waiting requests (FIFO), pads their prompts on the left to the
longest, reserves the engine's PaddedKVCache of [batch, longest prompt + longest output], and runs
the batch to completion (finished rows keep computing padding) before it takes the next batch.
Nothing is admitted mid-batch. A row's stream ends as soon as its own last token is out
(generous to the baseline). Numerics are the engine's: its cache, masks, sampler, detokenizer.
"""

import math
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from scratchllm.engine.async_engine import TokenEvent
from scratchllm.engine.paged_attention import PagedAttention
from scratchllm.engine.request import RequestMetrics
from scratchllm.engine.static import PaddedKVCache
from scratchllm.sampling import make_rng, sample_token, top_logprobs


@dataclass(eq=False)
class _Row:
    request_id: str
    prompt: list[int]
    params: object
    arrival: float
    events: queue.Queue = field(default_factory=queue.Queue)
    output: list[int] = field(default_factory=list)
    first_scheduled: float | None = None
    first_token: float | None = None
    done: bool = False
    aborted: bool = False
    text: str = ""
    emitted: int = 0


class _Stream:
    def __init__(self, owner: "StaticEngine", row: _Row):
        self._owner, self._row, self.request_id = owner, row, row.request_id

    def __iter__(self):
        while True:
            event = self._row.events.get()
            yield event
            if event.finish_reason is not None:
                return

    def abort(self) -> None:
        self._owner._abort(self._row)


class StaticEngine:
    def __init__(self, model, tokenizer, batch_size: int = 8, max_model_len: int | None = None,
                 block_size: int = 16, clock=time.monotonic, batch_window_s: float = 0.010):
        assert batch_size >= 1 and batch_window_s >= 0
        self.model, self.tokenizer, self.batch_size, self.clock = model, tokenizer, batch_size, clock
        # A batch starts when it is full or when its first request has waited one window (the
        # seed's 10 ms tick): requests that arrive together are batched together.
        self.batch_window_s = batch_window_s
        cfg = model.config
        self.max_model_len = min(cfg.max_position_embeddings, max_model_len or cfg.max_position_embeddings)
        self.eos_token_id = tokenizer.eos_token_id
        # KV is reported in the paged engine's block units, so the two modes compare in one unit.
        self.block_bytes = PagedAttention.bytes_per_block(cfg, block_size)
        self._cv = threading.Condition()
        self._waiting: list[_Row] = []
        self._running: list[_Row] = []
        self._kv_bytes = self._peak_kv_bytes = 0
        self._ids = 0
        self._accepting, self._stopping = True, False
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self._thread = threading.Thread(target=self._loop, name="scratchllm-static", daemon=True)
        self._thread.start()

    # --- the AsyncEngine contract ---
    def submit(self, prompt_token_ids, params, request_id=None) -> _Stream:
        assert 0 < len(prompt_token_ids) and len(prompt_token_ids) + params.max_tokens <= self.max_model_len
        with self._cv:
            if not self._accepting:
                raise RuntimeError("the engine is shutting down")
            self._ids += 1
            row = _Row(str(request_id or f"static-{self._ids}"), list(prompt_token_ids), params, self.clock())
            self._waiting.append(row)
            self._cv.notify()
        return _Stream(self, row)

    def stats(self) -> dict:
        with self._cv:
            return {"running": sum(not r.done for r in self._running), "waiting": len(self._waiting),
                    "kv_blocks_used": math.ceil(self._kv_bytes / self.block_bytes),
                    "kv_blocks_peak": math.ceil(self._peak_kv_bytes / self.block_bytes),
                    "kv_block_bytes": self.block_bytes, "preemptions": 0, "finished": dict(self.finished)}

    def shutdown(self, drain: bool = True) -> None:
        with self._cv:
            self._accepting = False
            if not drain:
                for row in self._waiting + self._running:
                    row.aborted = True
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    def _abort(self, row: _Row) -> None:
        with self._cv:
            row.aborted = True
            if row in self._waiting:  # never started: it ends now
                self._waiting.remove(row)
                self._finish(row, "abort", None)

    # --- the batch thread ---
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stopping:
                    self._cv.wait()
                if not self._waiting:
                    return
                deadline = self._waiting[0].arrival + self.batch_window_s
                while len(self._waiting) < self.batch_size and not self._stopping and self.clock() < deadline:
                    self._cv.wait(timeout=max(0.0, deadline - self.clock()))
                self._running = self._waiting[: self.batch_size]
                del self._waiting[: self.batch_size]
            self._run_batch(self._running)
            with self._cv:
                self._running, self._kv_bytes = [], 0

    def _run_batch(self, rows: list[_Row]) -> None:
        B = len(rows)
        P = max(len(r.prompt) for r in rows)
        M = max(r.params.max_tokens for r in rows)
        pad = [P - len(r.prompt) for r in rows]
        cache = PaddedKVCache(self.model.config, B, P + M, pad)
        with self._cv:
            self._kv_bytes = cache.nbytes
            self._peak_kv_bytes = max(self._peak_kv_bytes, cache.nbytes)
        ids = np.zeros((B, P), dtype=np.int64)  # [B, P], left-padded
        pos = np.zeros((B, P), dtype=np.int64)
        for b, r in enumerate(rows):
            ids[b, pad[b]:] = r.prompt
            pos[b, pad[b]:] = np.arange(len(r.prompt))
        now = self.clock()
        rngs = [make_rng(r.params) for r in rows]
        detoks = [self.tokenizer.detokenizer() for _ in rows]
        for r in rows:
            r.first_scheduled = now
        logits = self.model.forward(ids.reshape(-1), pos.reshape(-1), cache, logits_rows=np.arange(B) * P + P - 1)
        cache.start = P
        lengths = np.array([len(r.prompt) for r in rows])
        for step in range(M):
            tokens = np.argmax(logits, axis=1)  # [B]
            now = self.clock()
            with self._cv:
                for b, r in enumerate(rows):
                    if r.done:
                        continue  # a finished row keeps computing padding until the batch ends
                    if r.aborted:
                        self._finish(r, "abort", None)
                        continue
                    if not r.params.greedy:
                        tokens[b] = sample_token(logits[b], r.params, rngs[b])
                    self._emit(r, int(tokens[b]), logits[b], detoks[b], now)
            if all(r.done for r in rows):
                return  # the batch is over when its longest member is
            logits = self.model.forward(tokens.astype(np.int64), lengths + step, cache)
            cache.start += 1

    def _emit(self, r: _Row, token: int, logits, detok, now: float) -> None:
        r.output.append(token)
        if r.first_token is None:
            r.first_token = now
        p = r.params
        reason = None
        if (token == self.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        else:
            r.text += detok.push(token)
            if len(r.output) >= p.max_tokens:
                reason = "length"
        hits = [r.text.find(s) for s in p.stop if s in r.text]
        if hits:
            r.text, reason = r.text[: min(hits)], "stop"
        holdback = max((len(s) for s in p.stop), default=1) - 1
        end = len(r.text) if reason else max(len(r.text) - holdback, r.emitted)
        text, r.emitted = r.text[r.emitted:end], end
        lp, top = top_logprobs(logits, token, p.logprobs) if p.logprobs is not None else (None, None)
        event = TokenEvent(token, text, len(r.output) - 1, None, lp, dict(top) if top else None)
        if reason is None:
            r.events.put(event)
        else:
            self._finish(r, reason, event)

    def _finish(self, r: _Row, reason: str, event: TokenEvent | None) -> None:
        r.done = True
        now = self.clock()
        first_scheduled = r.first_scheduled or now
        first_token = r.first_token or now

        def ms(a, b):
            return (b - a) * 1e3

        metrics = RequestMetrics(r.arrival, first_scheduled, first_token, now, ms(r.arrival, first_scheduled),
                                 ms(first_scheduled, first_token), ms(first_token, now), len(r.prompt),
                                 len(r.output))
        event = event or TokenEvent(None, "", len(r.output), None)
        event.finish_reason, event.metrics = reason, metrics
        self.finished[reason] += 1
        r.events.put(event)
