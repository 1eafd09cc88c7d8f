"""An in-process fake of the engine contract, so the server runs and is tested without a model.

Like httpx's MockTransport it is part of the package: `scratchllm serve --fake-engine` uses it.
It keeps the real engine's promises (docs/architecture.md, "engine -> server"):
- `submit(prompt_token_ids, params, request_id) -> stream` is thread-safe; a thread of its own
  steps every running request by one token per step (`step_ms` apart, prefill costed per token);
- events carry complete-UTF-8 text deltas; the last one has finish_reason in {stop, length,
  abort} and `.metrics`; `stream.abort()` returns the request's KV blocks; `shutdown(drain)`;
- `stats()` reports running/waiting requests and KV blocks, which are really accounted
  (block size 16, reserved for prompt + max_tokens at admission, freed at finish or abort).
Output is deterministic: a fixed phrase (with multi-byte characters), entered at an offset that
depends on the prompt (greedy) or on the seed (temperature > 0).
"""

import itertools
import queue
import random
import threading
import time
from dataclasses import dataclass, field

# Byte-level vocabulary: id = byte + 3, after three specials. Ids from 259 up are opaque tokens
# that prompts may hold (load tests send random ids) but the fake never generates or decodes.
PAD, BOS, EOS = 0, 1, 2
BYTE_TOKENS = 256 + 3
VOCAB_SIZE = 32000
PHRASE = "The quick brown fox jumps over the lazy dog, café ☕ naïve 東京. ".encode()


@dataclass
class RequestMetrics:
    arrival: float
    first_scheduled: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def queue_ms(self) -> float:
        return (self.first_scheduled - self.arrival) * 1e3

    @property
    def prefill_ms(self) -> float:
        return (self.first_token - self.first_scheduled) * 1e3

    @property
    def decode_ms(self) -> float:
        return (self.finished - self.first_token) * 1e3


@dataclass
class TokenEvent:
    token_id: int
    text: str
    index: int
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: dict | None = None
    metrics: RequestMetrics | None = None


class FakeTokenizer:
    """Byte-level: one token per UTF-8 byte. A ChatML template like the default model's."""

    bos_token_id, eos_token_id, vocab_size = BOS, EOS, VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < BYTE_TOKENS).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class _Utf8Deltas:
    """Incremental detokenizer: push a byte token, get back only complete UTF-8 text."""

    def __init__(self):
        self.pending = b""

    def push(self, token_id: int) -> str:
        if token_id < 3:
            return ""
        self.pending += bytes([token_id - 3])
        try:
            text, self.pending = self.pending.decode("utf-8"), b""
            return text
        except UnicodeDecodeError:
            return ""  # a multi-byte character is not complete yet


class FakeRequestStream:
    def __init__(self, engine: "FakeEngine", request: "_Request"):
        self._engine, self._request = engine, request

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __iter__(self):
        while True:
            event = self._request.events.get()
            yield event
            if event.finish_reason is not None:
                return

    def abort(self) -> None:
        self._engine._abort(self._request)


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: object
    metrics: RequestMetrics
    events: queue.Queue = field(default_factory=queue.Queue)
    output: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already sent as deltas
    blocks: int = 0
    aborted: bool = False
    offset: int = 0
    detok: _Utf8Deltas = field(default_factory=_Utf8Deltas)


class FakeEngine:
    """The AsyncEngine contract over a clock instead of a model (see the module docstring)."""

    def __init__(self, step_ms: float = 2.0, prefill_ms_per_token: float = 0.01, max_running: int = 8,
                 num_blocks: int = 1024, block_size: int = 16, max_model_len: int = 2048,
                 block_bytes: int = 16 * 2 * 30 * 3 * 64 * 4, eos_after: int | None = None,
                 batching: str = "continuous"):
        assert max_running >= 1 and num_blocks >= 1 and step_ms >= 0
        assert batching in ("continuous", "static")
        self.static = batching == "static"
        self._static_blocks = 0  # static mode: blocks the current padded batch holds until it all ends
        self.step_s, self.prefill_s_per_token = step_ms / 1e3, prefill_ms_per_token / 1e3
        self.max_running, self.num_blocks, self.block_size = max_running, num_blocks, block_size
        self.max_model_len, self.block_bytes, self.eos_after = max_model_len, block_bytes, eos_after
        self._lock = threading.Condition()
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._used_blocks = self._peak_blocks = 0
        self._ids = itertools.count()
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self._accepting, self._stopping = True, False
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    # --- the contract -------------------------------------------------------------------
    def submit(self, prompt_token_ids, params, request_id=None) -> FakeRequestStream:
        assert prompt_token_ids, "an empty prompt has nothing to condition on"
        with self._lock:
            if not self._accepting:
                raise RuntimeError("engine is shutting down")
            rid = request_id or f"fake-{next(self._ids)}"
            request = _Request(rid, list(prompt_token_ids), params, RequestMetrics(time.monotonic()))
            request.metrics.prompt_tokens = len(request.prompt)
            seed = params.seed if params.temperature > 0 and params.seed is not None else sum(request.prompt)
            greedy = params.temperature == 0
            offset = seed % len(PHRASE) if greedy else random.Random(seed).randrange(len(PHRASE))
            while PHRASE[offset] & 0xC0 == 0x80:  # start on a character, so the text is valid UTF-8
                offset = (offset + 1) % len(PHRASE)
            request.offset = offset
            self._waiting.append(request)
            self._lock.notify()
        return FakeRequestStream(self, request)

    def stats(self) -> dict:
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "kv_blocks_used": self._used_blocks, "kv_blocks_total": self.num_blocks,
                    "kv_blocks_peak": self._peak_blocks, "kv_block_bytes": self.block_bytes,
                    "preemptions": 0, "finished": dict(self.finished)}

    def shutdown(self, drain: bool = True) -> None:
        with self._lock:
            self._accepting = False
            if not drain:
                for r in self._waiting + self._running:
                    r.aborted = True
            self._stopping = True
            self._lock.notify()
        self._thread.join()

    # --- internals ----------------------------------------------------------------------
    def _abort(self, request: _Request) -> None:
        with self._lock:
            request.aborted = True
            self._lock.notify()

    def _blocks_for(self, request: _Request) -> int:
        tokens = len(request.prompt) + request.params.max_tokens
        return -(-tokens // self.block_size)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._running or self._stopping):
                    self._lock.wait()
                if self._stopping and not (self._waiting or self._running):
                    return
                self._drop_aborted()
                newly = self._admit()
                batch = list(self._running)
            # Compute happens outside the lock, as a real step would: submit() never waits on it.
            time.sleep(self.step_s + self.prefill_s_per_token * sum(len(r.prompt) for r in newly))
            with self._lock:
                for request in batch:
                    if not request.aborted:
                        self._emit_next(request)

    def _admit(self) -> list[_Request]:
        if self.static:
            return self._admit_static()
        newly = []
        while self._waiting and len(self._running) < self.max_running:
            need = self._blocks_for(self._waiting[0])
            if self._used_blocks + need > self.num_blocks:
                break  # FIFO: the head waits for blocks; nothing behind it jumps the queue
            request = self._waiting.pop(0)
            request.blocks = need
            self._used_blocks += need
            self._peak_blocks = max(self._peak_blocks, self._used_blocks)
            request.metrics.first_scheduled = time.monotonic()
            self._running.append(request)
            newly.append(request)
        return newly

    def _admit_static(self) -> list[_Request]:
        """The padded baseline: a new batch only when the last one has entirely finished; every
        member holds blocks for the batch's longest prompt + longest output until then."""
        if self._running or self._static_blocks or not self._waiting:
            return []
        batch = self._waiting[: self.max_running]
        longest = max(len(r.prompt) for r in batch) + max(r.params.max_tokens for r in batch)
        per_request = -(-longest // self.block_size)
        while batch and per_request * len(batch) > self.num_blocks - self._used_blocks:
            batch.pop()
        if not batch:
            return []
        del self._waiting[: len(batch)]
        self._static_blocks = per_request * len(batch)
        self._used_blocks += self._static_blocks
        self._peak_blocks = max(self._peak_blocks, self._used_blocks)
        now = time.monotonic()
        for request in batch:
            request.metrics.first_scheduled = now
            self._running.append(request)
        return batch

    def _drop_aborted(self) -> None:
        for request in [r for r in self._waiting + self._running if r.aborted]:
            if request.metrics.first_scheduled == 0.0:
                request.metrics.first_scheduled = time.monotonic()
            if request.metrics.first_token == 0.0:
                request.metrics.first_token = request.metrics.first_scheduled
            self._finish(request, "abort", token_id=EOS, text="")

    def _emit_next(self, request: _Request) -> None:
        params, n = request.params, len(request.output)
        if self.eos_after is not None and n >= self.eos_after and not params.ignore_eos:
            token = EOS
        else:
            token = PHRASE[(request.offset + n) % len(PHRASE)] + 3
        request.output.append(token)
        now = time.monotonic()
        if n == 0:
            request.metrics.first_token = now
        request.text += request.detok.push(token)
        finish, end = None, len(request.text)
        hits = [request.text.find(s) for s in params.stop if s in request.text]
        if token == EOS or token in params.stop_token_ids:
            finish = "stop"
        elif hits:
            finish, end = "stop", min(hits)  # the text ends before the first stop string
        elif len(request.output) >= params.max_tokens:
            finish = "length"
        else:
            # Hold back a tail that could still grow into a stop string: streamed text never
            # shows what the final text will not contain.
            end -= max((k for s in params.stop for k in range(1, len(s)) if request.text.endswith(s[:k])), default=0)
        text, request.emitted = request.text[request.emitted:end], max(request.emitted, end)
        logprob = -0.25 if params.temperature == 0 else -1.0
        top = {token: logprob, (token - 2) % (BYTE_TOKENS - 3) + 3: logprob - 1.0} if params.logprobs else None
        event = TokenEvent(token, text, n, finish, logprob, top)
        if finish is None:
            request.events.put(event)
        else:
            self._finish(request, finish, event=event)

    def _finish(self, request: _Request, reason: str, event: TokenEvent | None = None, token_id: int = EOS,
                text: str = "") -> None:
        # Invariant: a request's blocks go back exactly once, when it leaves the running or waiting set.
        if request in self._running:
            self._running.remove(request)
            self._used_blocks -= request.blocks
            if self.static and not self._running:  # the padded batch is over: its blocks go back
                self._used_blocks -= self._static_blocks
                self._static_blocks = 0
            assert self._used_blocks >= 0
        elif request in self._waiting:
            self._waiting.remove(request)
        request.metrics.finished = time.monotonic()
        request.metrics.completion_tokens = len(request.output)
        if event is None:
            event = TokenEvent(token_id, text, len(request.output), reason)
        event.metrics = request.metrics
        self.finished[reason] += 1
        request.events.put(event)


def fake_embed(input_ids, attention_mask):  # [B, T], [B, T] -> [B, 32], L2-normalized
    """A deterministic stand-in for MiniLM: mean of fixed per-token vectors, normalized."""
    import numpy as np

    table = np.random.default_rng(0).standard_normal((BYTE_TOKENS, 32)).astype(np.float32)
    input_ids = np.asarray(input_ids) % BYTE_TOKENS  # opaque ids share the byte rows
    mask = np.asarray(attention_mask, dtype=np.float32)[..., None]
    pooled = (table[np.asarray(input_ids)] * mask).sum(1) / np.maximum(mask.sum(1), 1.0)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def fake_backend(max_model_len: int = 2048, **engine_options):
    """(ServedModel, ServedEmbedder) over the fake engine, for `serve --fake-engine` and tests."""
    from scratchllm.server.app import ServedEmbedder, ServedModel

    tokenizer = FakeTokenizer()
    engine = FakeEngine(max_model_len=max_model_len, **engine_options)
    model = ServedModel("fake", engine, tokenizer, max_model_len)
    return model, ServedEmbedder("fake-embed", fake_embed, tokenizer, max_len=512)
