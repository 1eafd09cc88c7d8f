"""An in-process fake of the engine contract (protocol.EngineClient), so the server runs and is
tested without a model. Like httpx's MockTransport it is part of the package: `scratchllm serve
--fake-engine` uses it, and the conformance suite holds it to the same promises as the real one.

A thread of its own steps every running request by one token per step (`step_ms` apart, prefill
costed per token); KV blocks are really accounted (block size 16, reserved for prompt +
max_tokens at admission, freed at finish or abort). Its "model" writes a row of logits per
request that favours the next byte of a fixed phrase (with multi-byte characters), entered at an
offset that depends on the prompt (greedy) or on the seed; the engines' one sampling path
(sampler.py) draws from it, so penalties, logit_bias, min_tokens and grammars act on the fake as
on a model, and its logprobs are those of the row. Tokens become events in the engine's one
output path (output.py), with a byte-level tokenizer, so stop strings, hold-back and UTF-8 deltas
behave as the real engine's.
`batching="static"` mimics the padded baseline's admission: a new batch only when the last ended.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.engine.output import OutputProcessor
from scratchllm.engine.protocol import EngineStats, RequestMetrics, RequestStream, TokenEvent
from scratchllm.engine.sampler import SampledToken, TokenLists, sample, start_guide
from scratchllm.engine.static import padded_shape, take_batch
from scratchllm.engine.threaded import ThreadedEngine
from scratchllm.engine.validate import RequestLimits
from scratchllm.sampling import SamplingParams

# Byte-level vocabulary: id = byte + 3, after three specials. Ids from 259 up are opaque tokens
# that prompts may hold (load tests send random ids) but the fake never generates or decodes.
logger = logging.getLogger(__name__)

PAD, BOS, EOS = 0, 1, 2
END_TOKENS = frozenset({EOS})  # the fake's tokens that end generation
BYTE_TOKENS = 256 + 3
VOCAB_SIZE = 32000
PHRASE = "The quick brown fox jumps over the lazy dog, café ☕ naïve 東京. ".encode()
# The fake model's logits: each byte token a fixed background in [0, 1), the phrase's next byte
# PHRASE_LOGIT (at temperature 1 another byte is drawn about once in two million tokens), EOS
# one above that once `eos_after` tokens are out; the specials and the opaque ids LOW_LOGIT,
# never drawn unless a logit_bias or a grammar asks for them.
PHRASE_LOGIT, LOW_LOGIT = 20.0, -30.0


class Utf8Deltas:
    """Incremental detokenizer: push a byte token, get back only complete UTF-8 text."""

    def __init__(self) -> None:
        self.pending = b""

    def push(self, token_id: int) -> str:
        if not 3 <= token_id < BYTE_TOKENS:
            return ""
        self.pending += bytes([token_id - 3])
        try:
            text, self.pending = self.pending.decode("utf-8"), b""
            return text
        except UnicodeDecodeError:
            return ""  # a multi-byte character is not complete yet

    def flush(self) -> str:
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


class FakeTokenizer:
    """Byte-level: one token per UTF-8 byte. A ChatML template like the default model's. Every
    token is a string of bytes (the specials and the opaque ids are named like <t300>), so a
    grammar can be compiled for it (tokenizer/guidance.py)."""

    bos_token_id, eos_token_id, end_token_ids, byte_level, vocab_size = BOS, EOS, END_TOKENS, True, VOCAB_SIZE

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        self.vocab_size = vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(3)) | frozenset(range(BYTE_TOKENS, self.vocab_size))

    def token_bytes(self, token_id: int) -> bytes:
        if 3 <= token_id < BYTE_TOKENS:
            return bytes([token_id - 3])
        return {PAD: b"<pad>", BOS: b"<s>", EOS: b"</s>"}.get(token_id, f"<t{token_id}>".encode())

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < BYTE_TOKENS).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = True) -> Utf8Deltas:
        return Utf8Deltas()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@dataclass(eq=False)
class _FakeRequest(TokenLists):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: OutputProcessor
    arrival: float
    offset: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    blocks: int = 0
    aborted: bool = False

    def metrics(self, now: float) -> RequestMetrics:
        return RequestMetrics(self.arrival, self.first_scheduled or now, self.first_token or now, now,
                              len(self.prompt), self.num_output_tokens)


class FakeEngine(ThreadedEngine):
    """The engine contract over a clock instead of a model (see the module docstring)."""

    def __init__(self, step_ms: float = 2.0, prefill_ms_per_token: float = 0.01, max_running: int = 8,
                 num_blocks: int = 1024, block_size: int = 16, max_model_len: int = 2048,
                 block_bytes: int = 16 * 2 * 30 * 3 * 64 * 4, eos_after: int | None = None,
                 batching: str = "continuous", vocab_size: int = VOCAB_SIZE):
        assert max_running >= 1 and num_blocks >= 1 and step_ms >= 0
        assert batching in ("continuous", "static")
        super().__init__("fake", "fake-engine")
        self.static = batching == "static"
        self._static_blocks = 0  # static mode: blocks the current padded batch holds until it all ends
        self.step_s, self.prefill_s_per_token = step_ms / 1e3, prefill_ms_per_token / 1e3
        self.max_running, self.num_blocks, self.block_size = max_running, num_blocks, block_size
        self.max_model_len, self.block_bytes, self.eos_after = max_model_len, block_bytes, eos_after
        self.limits = RequestLimits(max_model_len, vocab_size)
        self.tokenizer = FakeTokenizer(vocab_size)
        # the model's rows: every byte's background; as wide as the vocabulary (the fake writes
        # no id past its bytes, whatever vocab_size says)
        self._background = np.full(max(vocab_size, BYTE_TOKENS), LOW_LOGIT, dtype=np.float32)
        self._background[3:BYTE_TOKENS] = np.random.default_rng(0).random(BYTE_TOKENS - 3)
        self._waiting: list[_FakeRequest] = []
        self._running: list[_FakeRequest] = []
        self._used_blocks = self._peak_blocks = 0
        self._start()

    # --- the contract -------------------------------------------------------------------
    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        self.limits.validate(prompt_token_ids, params)
        with self._cv:
            stream: RequestStream = self._streams.open(request_id)
            rid = stream.request_id
            arrival = time.monotonic()
            output = OutputProcessor(rid, params, self.tokenizer.detokenizer(), END_TOKENS, arrival)
            request = _FakeRequest(rid, list(prompt_token_ids), params, output, arrival)
            seed = params.seed if params.temperature > 0 and params.seed is not None else sum(request.prompt)
            greedy = params.temperature == 0
            offset = seed % len(PHRASE) if greedy else random.Random(seed).randrange(len(PHRASE))
            while PHRASE[offset] & 0xC0 == 0x80:  # start on a character, so the text is valid UTF-8
                offset = (offset + 1) % len(PHRASE)
            request.offset = offset
            start_guide(request)
            self._waiting.append(request)
            self._cv.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cv:
            for request in self._waiting + self._running:
                if request.request_id == request_id:
                    request.aborted = True
            self._cv.notify()

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(running=len(self._running), waiting=len(self._waiting), finished=self._streams.counts(),
                               preemptions=0, kv_blocks_used=self._used_blocks, kv_blocks_peak=self._peak_blocks,
                               kv_blocks_total=self.num_blocks, kv_block_bytes=self.block_bytes)

    # --- internals ----------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _tokens_for(self, request: _FakeRequest) -> int:
        """Prompt + the most it generates (max_tokens, or to the end of the context)."""
        return len(request.prompt) + self.limits.new_tokens(len(request.prompt), request.params)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._waiting or self._running or self._stopping):
                    self._cv.wait()
                if self._stopping and not (self._waiting or self._running):
                    return
                self._drop_aborted()
                newly = self._admit()
                batch = list(self._running)
            # Compute happens outside the lock, as a real step would: submit() never waits on it.
            # Only this thread changes a request's output, which is all the sampler reads.
            time.sleep(self.step_s + self.prefill_s_per_token * sum(len(r.prompt) for r in newly))
            batch = [r for r in batch if not r.aborted]
            try:
                drawn = sample(self._logits(batch), batch, END_TOKENS) if batch else []
            except Exception:  # logged; a failed step aborts its requests, not the server
                logger.exception("a fake engine step failed; its requests are aborted")
                with self._cv:
                    for request in batch:
                        request.aborted = True
                continue
            with self._cv:
                for request, sampled in zip(batch, drawn, strict=True):
                    if not request.aborted:
                        self._emit_next(request, sampled)

    def _admit(self) -> list[_FakeRequest]:
        if self.static:
            return self._admit_static()
        newly = []
        while self._waiting and len(self._running) < self.max_running:
            need = self._blocks_for(self._tokens_for(self._waiting[0]))
            if self._used_blocks + need > self.num_blocks:
                break  # FIFO: the head waits for blocks; nothing behind it jumps the queue
            request = self._waiting.pop(0)
            request.blocks = need
            self._used_blocks += need
            self._peak_blocks = max(self._peak_blocks, self._used_blocks)
            request.first_scheduled = time.monotonic()
            self._running.append(request)
            newly.append(request)
        return newly

    def _admit_static(self) -> list[_FakeRequest]:
        """The padded baseline (static.take_batch): a new batch only when the last one has
        entirely finished; every member holds blocks for the batch's longest prompt + longest
        output until then."""
        if self._running or self._static_blocks or not self._waiting:
            return []
        free = self.num_blocks - self._used_blocks

        def fits(rows: int, prompt: int, output: int) -> bool:
            return rows * self._blocks_for(prompt + output) <= free

        batch = take_batch(self._waiting, self.max_running, self.limits, fits)
        if not batch:
            return []
        self._static_blocks = len(batch) * self._blocks_for(sum(padded_shape(batch, self.limits)))
        self._used_blocks += self._static_blocks
        self._peak_blocks = max(self._peak_blocks, self._used_blocks)
        now = time.monotonic()
        for request in batch:
            request.first_scheduled = now
            self._running.append(request)
        return batch

    def _drop_aborted(self) -> None:
        for request in [r for r in self._waiting + self._running if r.aborted]:
            self._finish(request, request.output.abort())

    def _logits(self, batch: list[_FakeRequest]) -> npt.NDArray[np.float32]:
        """The fake model's next-token logits [R, V] (see LOW_LOGIT). Rows are the bytes only
        unless a request's processors may read ids past them (a logit_bias, a prompt's ids) or a
        script writes such an id (a subclass's `next_token`: an end token of its own)."""
        tokens = [self.next_token(r.prompt, r.offset, r.num_output_tokens) for r in batch]
        wide = any(r.params.uses_processors for r in batch) or any(t >= BYTE_TOKENS for t in tokens)
        rows = np.repeat(self._background[None, : None if wide else BYTE_TOKENS], len(batch), axis=0)
        for row, request, token in zip(rows, batch, tokens, strict=True):
            n = request.num_output_tokens
            row[token] = PHRASE_LOGIT
            if self.eos_after is not None and n >= self.eos_after and not request.params.ignore_eos:
                row[EOS] = PHRASE_LOGIT + 1.0
        return rows

    def _emit_next(self, request: _FakeRequest, sampled: SampledToken) -> None:
        params, n = request.params, request.num_output_tokens
        request.output_token_ids.append(sampled.token)
        now = time.monotonic()
        if n == 0:
            request.first_token = now
        context_full = len(request.prompt) + request.num_output_tokens >= self.max_model_len
        event = request.output.process(sampled.token, sampled.logprob, sampled.top_logprobs, context_full=context_full,
                                       now=now)
        if n == 0 and params.prompt_logprobs is not None:  # a fixed stand-in: the fake computes no prompt
            event.prompt_logprobs = [(-1.0, 1, [(t, -1.0)][:params.prompt_logprobs]) for t in request.prompt[1:]]
        if event.finish_reason is None:
            self._streams.deliver(event)
        else:
            self._finish(request, event)

    def next_token(self, prompt: list[int], offset: int, n: int) -> int:
        """Output token n of a request whose phrase starts at `offset` (a subclass may write
        other text: the server's tests script model replies this way)."""
        return PHRASE[(offset + n) % len(PHRASE)] + 3

    def _finish(self, request: _FakeRequest, event: TokenEvent) -> None:
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
        event.metrics = request.metrics(time.monotonic())
        assert event.finish_reason is not None
        self._streams.deliver(event)
