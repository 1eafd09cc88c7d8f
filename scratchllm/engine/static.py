"""The static baseline: padded batching, as Hugging Face `generate` does it, and the one
implementation of it that both `bench engine` (run_static, offline) and `serve --batching
static` (StaticEngine, the EngineClient contract) run.

Take up to `batch_size` waiting requests, pad every prompt on the left to the longest, reserve a
contiguous KV cache of [batch, longest prompt + longest output] per layer, run the whole batch
to completion (finished rows keep computing padding), and only then take the next batch.
Nothing is admitted mid-batch. A row's result is out as soon as its own last token is (generous
to the baseline: a real padded server returns the whole batch at its end).

Attention is plain NumPy over the padded cache with the 3-D masks of masks.py. Its numbers are
exact (greedy output equals the engine's, tested); what it wastes is compute on padding and
memory reserved for the longest member. Tokens become events in the engine's one output path.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from scratchllm.engine.kv_sizing import block_bytes
from scratchllm.engine.masks import left_padded_causal_mask
from scratchllm.engine.output import OutputProcessor, end_token_ids
from scratchllm.engine.protocol import EngineStats, RequestMetrics, RequestStream, TokenEvent
from scratchllm.engine.sampler import SampledToken, TokenLists, sample, start_guide
from scratchllm.engine.threaded import ThreadedEngine
from scratchllm.engine.validate import RequestLimits
from scratchllm.errors import ConfigError
from scratchllm.models.attention import softmax_
from scratchllm.sampling import SamplingParams

if TYPE_CHECKING:
    from scratchllm.models.config import ModelConfig
    from scratchllm.models.protocol import Model
    from scratchllm.tokenizer.protocol import TokenizerLike

logger = logging.getLogger(__name__)
Waiting = TypeVar("Waiting", bound="Padded")


class PaddedKVCache:
    """Per layer K as [B, KVH, D, S] and V as [B, KVH, S, D]: row b's real tokens start at column
    pad[b]. K is stored transposed so that q @ K is a plain BLAS product: NumPy's matmul runs the
    [S, D] layout's transposed view through its slow non-BLAS loop (1.1 ms vs 0.19 ms per layer
    for a 16-row decode step at 540 positions)."""

    def __init__(self, config: ModelConfig, batch: int, length: int, pad: Sequence[int]) -> None:
        L, KVH, D = config.num_layers, config.num_kv_heads, config.head_dim
        self.k = np.zeros((L, batch, KVH, D, length), np.float32)
        self.v = np.zeros((L, batch, KVH, length, D), np.float32)
        self.pad = np.asarray(pad)
        self.B, self.start, self.q_len = batch, 0, 0
        # the model's attention: each layer's sliding window (0: full), the softmax scale, the soft-cap
        self.windows = [config.window(i) or 0 for i in range(L)]
        self.scale, self.softcap = config.softmax_scale, config.attn_softcap or 0.0
        # window -> (start, T, ~mask): a step's mask is the same for every layer with that window
        self._hidden: dict[int, tuple[int, int, npt.NDArray[np.bool_]]] = {}

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def __call__(self, layer: int, q: npt.NDArray[np.floating[Any]], k: npt.NDArray[np.floating[Any]],
                 v: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.floating[Any]]:
        # [B*T, H, D], [B*T, KVH, D] x2 -> [B*T, H, D]
        B, T = self.B, q.shape[0] // self.B
        H, D = q.shape[1], q.shape[2]
        KVH = k.shape[1]
        G = H // KVH
        end = self.start + T
        self.k[layer, :, :, :, self.start : end] = k.reshape(B, T, KVH, D).transpose(0, 2, 3, 1)
        self.v[layer, :, :, self.start : end] = v.reshape(B, T, KVH, D).transpose(0, 2, 1, 3)
        keys, values = self.k[layer, :, :, :, :end], self.v[layer, :, :, :end]  # [B, KVH, D, S], [B, KVH, S, D]
        qg = (q * self.scale).reshape(B, T, KVH, G, D).transpose(0, 2, 3, 1, 4).reshape(B, KVH, G * T, D)
        scores = qg @ keys  # [B, KVH, G*T, S]
        if self.softcap:  # Gemma 2: cap * tanh(s / cap), before the mask
            np.tanh(scores / np.float32(self.softcap), out=scores)
            scores *= np.float32(self.softcap)
        window = self.windows[layer]
        hidden = self._hidden.get(window)
        if hidden is None or hidden[:2] != (self.start, T):
            seen = left_padded_causal_mask(self.pad, T, end, window)  # [B, T, S]
            hidden = self._hidden[window] = (self.start, T, ~seen[:, None, None])  # [B, 1, 1, T, S]
        np.copyto(scores.reshape(B, KVH, G, T, end), -np.inf, where=hidden[2])
        softmax_(scores)
        out = scores @ values  # [B, KVH, G*T, D]
        return out.reshape(B, KVH, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B * T, H, D)


@dataclass(eq=False)
class StaticRow(TokenLists):
    """One request in a padded batch: its prompt, its output path, and its times. It is what
    the sampler reads of a request (engine/sampler.py's SamplingState)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: OutputProcessor
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    aborted: bool = False  # set from another thread; the batch loop ends the row at its next step

    @property
    def done(self) -> bool:
        return self.finished is not None

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.arrival, self.first_scheduled, self.first_token, self.finished,
                              len(self.prompt), self.num_output_tokens)


@dataclass
class BatchCost:
    kv_bytes: int  # the padded reservation
    padded_tokens: int  # tokens computed that belong to no request (padding, finished rows)


class Padded(Protocol):
    """What admission reads of a waiting request: its prompt and its params."""

    prompt: list[int]
    params: SamplingParams


def padded_shape(batch: Sequence[Padded], limits: RequestLimits) -> tuple[int, int]:
    """(longest prompt, longest output) of a padded batch: each member reserves their sum."""
    return (max(len(r.prompt) for r in batch),
            max(limits.new_tokens(len(r.prompt), r.params) for r in batch))


def take_batch(waiting: list[Waiting], batch_size: int, limits: RequestLimits,
               fits: Callable[[int, int, int], bool] | None = None) -> list[Waiting]:
    """The static baseline's admission, the one every static run uses (StaticEngine, run_static,
    the fake engine's static mode): the first `batch_size` waiting requests (FIFO), taken out of
    `waiting`. `fits(rows, longest prompt, longest output)`: whether that padded reservation fits
    the free memory; the batch shrinks from its tail until it does ([] if not even its head fits:
    nothing behind it jumps the queue)."""
    assert batch_size >= 1
    batch = waiting[:batch_size]
    while batch and fits is not None and not fits(len(batch), *padded_shape(batch, limits)):
        batch.pop()
    del waiting[: len(batch)]
    return batch


def model_limits(model: Model, max_model_len: int | None = None) -> RequestLimits:
    """A model's limits: its context (or less, when max_model_len is given) and its vocabulary."""
    cfg = model.config
    ctx = cfg.max_position_embeddings
    return RequestLimits(min(ctx, max_model_len or ctx), cfg.vocab_size)


def run_batch(model: Model, rows: list[StaticRow], on_event: Callable[[StaticRow, TokenEvent], None],
              clock: Callable[[], float] = time.monotonic, pad_id: int = 0,
              on_reserved: Callable[[int], None] | None = None, limits: RequestLimits | None = None,
              end_token_ids: Collection[int] = ()) -> BatchCost:
    """Run one padded batch to completion. Every row's events go to on_event (the last one with
    its metrics); on_reserved(kv_bytes) is called once the cache is allocated. A row ends at its
    max_tokens or where `limits` (default: the model's) leave no room for another token.
    `end_token_ids`: the tokens that end generation (min_tokens holds them back)."""
    limits = limits or model_limits(model)
    B = len(rows)
    P, M = padded_shape(rows, limits)
    pad = [P - len(r.prompt) for r in rows]
    cache = PaddedKVCache(model.config, B, P + M, pad)
    if on_reserved is not None:
        on_reserved(cache.nbytes)
    cost = BatchCost(cache.nbytes, sum(pad))
    ids = np.full((B, P), pad_id, dtype=np.int64)  # [B, P], left-padded
    pos = np.zeros((B, P), dtype=np.int64)
    for b, r in enumerate(rows):
        ids[b, pad[b] :] = r.prompt
        pos[b, pad[b] :] = np.arange(len(r.prompt))
    now = clock()
    for r in rows:
        r.first_scheduled = now
        start_guide(r)  # a grammar's first mask is computed while the prefill runs
    logits = model.forward(ids.reshape(-1), pos.reshape(-1), cache, logits_rows=np.arange(B) * P + P - 1)
    cache.start = P
    lengths = np.array([len(r.prompt) for r in rows])
    last = limits.max_model_len - 1  # a finished row's padding is fed no position past the context
    for step in range(M):
        now = clock()
        live = [b for b, r in enumerate(rows) if not r.done and not r.aborted]
        drawn = dict(zip(live, sample(logits[live], [rows[b] for b in live], end_token_ids), strict=True))
        tokens = np.full(B, pad_id, dtype=np.int64)  # [B]; a finished row is fed padding
        for b, r in enumerate(rows):
            if r.done:
                cost.padded_tokens += 1  # a finished row keeps computing padding until the batch ends
                continue
            if b in drawn:
                tokens[b] = drawn[b].token
            _step_row(r, drawn.get(b), now, limits, on_event)
        if all(r.done for r in rows):
            break  # the batch is over when its longest member is
        logits = model.forward(tokens, np.minimum(lengths + step, last), cache)
        cache.start += 1
    return cost


def _step_row(r: StaticRow, sampled: SampledToken | None, now: float, limits: RequestLimits,
              on_event: Callable[[StaticRow, TokenEvent], None]) -> None:
    """Row r's token of this step as its event (no token drawn: the row was aborted)."""
    if r.aborted or sampled is None:
        event = r.output.abort()
    else:
        r.output_token_ids.append(sampled.token)
        context_full = len(r.prompt) + r.num_output_tokens >= limits.max_model_len
        event = r.output.process(sampled.token, sampled.logprob, sampled.top_logprobs, context_full=context_full,
                                 now=now)
        if r.first_token is None:
            r.first_token = now
    if event.finish_reason is not None:
        r.finished = now
        event.metrics = r.metrics()
    on_event(r, event)


@dataclass
class StaticResult:
    token_ids: list[list[int]] = field(default_factory=list)
    finish_times: list[float] = field(default_factory=list)
    first_token_times: list[float] = field(default_factory=list)
    peak_kv_bytes: int = 0
    padded_tokens: int = 0  # tokens computed that belong to no request (padding, finished rows)


def run_static(model: Model, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], batch_size: int,
               eos_token_id: int | None = None, clock: Callable[[], float] = time.monotonic,
               pad_id: int = 0, arrivals: Sequence[float] | None = None) -> StaticResult:
    """Greedy generation of every request, in FIFO batches of up to `batch_size` (take_batch).
    `arrivals`: seconds after the start at which each request arrives (ascending; default: all
    at once, offline); a batch takes those that have arrived when the last one ended, and whoever
    arrives meanwhile waits for the whole batch. Times in the result are on `clock`."""
    n = len(prompts)
    res = StaticResult([[] for _ in range(n)], [0.0] * n, [0.0] * n)
    ends = frozenset() if eos_token_id is None else frozenset({eos_token_id})
    index: dict[str, int] = {}
    limits = model_limits(model)

    def on_event(row: StaticRow, event: TokenEvent) -> None:
        i = index[row.request_id]
        if event.token_id is not None:
            res.token_ids[i].append(event.token_id)
        if event.finish_reason is not None:
            res.first_token_times[i], res.finish_times[i] = row.first_token or 0.0, row.finished or 0.0

    t0, nxt = clock(), 0
    waiting: list[StaticRow] = []
    while nxt < n or waiting:
        if not waiting and arrivals is not None:  # idle: until the next one arrives
            time.sleep(max(0.0, t0 + arrivals[nxt] - clock()))
        while nxt < n and (arrivals is None or arrivals[nxt] <= clock() - t0):
            params = SamplingParams(max_tokens=int(max_tokens[nxt]), temperature=0.0)
            rid = str(nxt)
            index[rid] = nxt
            arrival = t0 + arrivals[nxt] if arrivals is not None else clock()
            waiting.append(StaticRow(rid, list(prompts[nxt]), params,
                                     OutputProcessor(rid, params, None, ends, arrival), arrival))
            nxt += 1
        if not waiting:
            continue
        cost = run_batch(model, take_batch(waiting, batch_size, limits), on_event, clock, pad_id, limits=limits,
                         end_token_ids=ends)
        res.peak_kv_bytes = max(res.peak_kv_bytes, cost.kv_bytes)
        res.padded_tokens += cost.padded_tokens
    return res


class StaticEngine(ThreadedEngine):
    """The static baseline behind the EngineClient contract, for `serve --batching static`.

    One thread takes up to `batch_size` waiting requests (take_batch) and runs them with
    run_batch. A batch starts when it is full or when its first request has waited one window
    (10 ms, the scheduling tick): requests that arrive together are batched together. KV is
    reported in the paged engine's block units, so the two modes compare in one unit.
    """

    def __init__(self, model: Model, tokenizer: TokenizerLike | None, batch_size: int = 8,
                 max_model_len: int | None = None,
                 block_size: int = 16, clock: Callable[[], float] = time.monotonic, batch_window_s: float = 0.010):
        assert batch_size >= 1 and batch_window_s >= 0
        super().__init__("static", "scratchllm-static")
        self.model, self.tokenizer, self.batch_size, self.clock = model, tokenizer, batch_size, clock
        self.batch_window_s = batch_window_s
        cfg = model.config
        self.limits = model_limits(model, max_model_len)
        self.max_model_len = self.limits.max_model_len
        self.end_token_ids = end_token_ids(tokenizer, tokenizer.eos_token_id if tokenizer is not None
                                           else cfg.eos_token_id)
        self.block_bytes = block_bytes(cfg, block_size)
        self._waiting: list[StaticRow] = []
        self._running: list[StaticRow] = []
        self._kv_bytes = self._peak_kv_bytes = 0
        self._start()

    # --- the contract ---
    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        self.limits.validate(prompt_token_ids, params)
        if params.prompt_logprobs is not None:
            raise ConfigError("the static baseline does not compute the prompt's logprobs (prompt_logprobs)")
        with self._cv:
            stream: RequestStream = self._streams.open(request_id)
            rid = stream.request_id
            skip = params.skip_special_tokens
            detok = self.tokenizer.detokenizer(skip_special_tokens=skip) if self.tokenizer is not None else None
            arrival = self.clock()
            self._waiting.append(StaticRow(rid, list(prompt_token_ids), params,
                                           OutputProcessor(rid, params, detok, self.end_token_ids, arrival), arrival))
            self._cv.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cv:
            for row in self._waiting:
                if row.request_id == request_id:  # never started: it ends now
                    self._waiting.remove(row)
                    event = row.output.abort()
                    row.finished = self.clock()
                    event.metrics = row.metrics()
                    self._streams.deliver(event)
                    return
            for row in self._running:
                if row.request_id == request_id:
                    row.aborted = True  # the batch loop ends it at its next step

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(running=sum(not r.done for r in self._running), waiting=len(self._waiting),
                               finished=self._streams.counts(), preemptions=0,
                               kv_blocks_used=math.ceil(self._kv_bytes / self.block_bytes),
                               kv_blocks_peak=math.ceil(self._peak_kv_bytes / self.block_bytes),
                               kv_block_bytes=self.block_bytes, kv_bytes_used=self._kv_bytes,
                               kv_bytes_peak=self._peak_kv_bytes)

    # --- the batch thread ---
    def _on_event(self, row: StaticRow, event: TokenEvent) -> None:
        with self._cv:
            self._streams.deliver(event)

    def _reserved(self, nbytes: int) -> None:
        with self._cv:
            self._kv_bytes = nbytes
            self._peak_kv_bytes = max(self._peak_kv_bytes, nbytes)

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
                self._running = take_batch(self._waiting, self.batch_size, self.limits)
            try:
                run_batch(self.model, self._running, self._on_event, self.clock, on_reserved=self._reserved,
                          limits=self.limits, end_token_ids=self.end_token_ids)
            except Exception:  # logged; a failed batch aborts its rows, not the server
                logger.exception("a static batch failed; its requests are aborted")
                with self._cv:
                    for row in self._running:
                        if not row.done:
                            row.finished = self.clock()
                            event = row.output.abort()
                            event.metrics = row.metrics()
                            self._streams.deliver(event)
            with self._cv:
                self._running, self._kv_bytes = [], 0
