"""The one output path: sampled tokens -> events -> results. Every engine (continuous, static
baseline, fake) turns its tokens into TokenEvents here, and everyone who wants a whole result
(`LLMEngine.generate`, `LLM`, the server's non-streamed replies) folds events with OutputCollector.

Why a request ends (decided here and nowhere else):
  "stop"   - an end token (any token that ends generation, the EOS among them, unless
             ignore_eos: end_token_ids; or one of stop_token_ids): the token is kept in
             token_ids, its text is not shown; or a stop string appeared in the
             text: the text is cut before it. With include_stop_str_in_output the stop string (the
             end token's text) is kept as the text's end.
  "length" - max_tokens generated, or the engine's context is full.
min_tokens: before that many tokens the sampler cannot draw an end token (sampling.py), and stop
strings are looked for only in the text from the min_tokens-th token on.
Text: the detokenizer returns only complete UTF-8. Text that could still grow into a stop string
is held back (the longest stop string minus one characters) until it cannot, so streamed deltas
never show what the final text will not contain; at the end whatever is left is flushed (a
character cut by the end shows as U+FFFD, as decode does).
Time: each token's event carries `elapsed`, the engine's `now` (the step's one clock reading,
passed in: no clock call per token here) minus the request's arrival.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from scratchllm.engine.protocol import RequestOutput, TokenEvent, TopLogprobs
from scratchllm.sampling import SamplingParams
from scratchllm.tokenizer.protocol import IncrementalDetokenizer as IncrementalDetokenizer  # re-exported for tracing
from scratchllm.tokenizer.protocol import TokenizerLike


class OutputProcessor:
    """One request's token -> event state machine (see the module doc)."""

    def __init__(self, request_id: str, params: SamplingParams, detokenizer: IncrementalDetokenizer | None,
                 end_token_ids: Collection[int], arrival: float):
        self.request_id, self.params, self.detok = request_id, params, detokenizer
        self.end_token_ids, self.arrival = end_token_ids, arrival
        self.num_tokens = 0  # tokens processed so far
        self.text = ""  # the text so far (cut at a stop string once found)
        self.emitted = 0  # characters of `text` already sent as deltas
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.search_from = 0  # stop strings are looked for from here on (past min_tokens' text)
        self.finish_reason: str | None = None

    def process(self, token_id: int, logprob: float | None = None, top: TopLogprobs | None = None,
                context_full: bool = False, *, now: float) -> TokenEvent:
        """The event for the request's next token, produced at `now` (the engine's clock, the one
        its arrival was read on). `context_full`: the engine has no room for another token. The
        event's finish_reason says whether the request ends here."""
        assert self.finish_reason is None, f"request {self.request_id}: a token after its end"
        p = self.params
        self.num_tokens += 1
        reason = None
        stop_token = token_id in p.stop_token_ids or (token_id in self.end_token_ids and not p.ignore_eos)
        if stop_token:
            reason = "stop"
        elif self.num_tokens >= p.max_tokens or context_full:
            reason = "length"
        text = ""
        if self.detok is not None:
            if not stop_token or p.include_stop_str_in_output:
                self.text += self.detok.push(token_id)
            if reason is not None:
                self.text += _flush(self.detok)
            if self.num_tokens < p.min_tokens:  # a stop string may start only at min_tokens' text
                self.search_from = len(self.text)
            else:
                cut = _stop_cut(self.text, p.stop, self.search_from, p.include_stop_str_in_output)
                if cut is not None:
                    self.text, reason = self.text[:cut], "stop"
            end = len(self.text) if reason else max(len(self.text) - self.holdback, self.emitted)
            text, self.emitted = self.text[self.emitted : end], end
        self.finish_reason = reason
        return TokenEvent(self.request_id, int(token_id), text, self.num_tokens - 1, reason, logprob, top,
                          elapsed=now - self.arrival)

    def abort(self) -> TokenEvent:
        """The last event of a request stopped from outside: no token, no more text."""
        assert self.finish_reason is None, f"request {self.request_id} ended twice"
        self.finish_reason = "abort"
        return TokenEvent(self.request_id, None, "", self.num_tokens, "abort")


def end_token_ids(tokenizer: TokenizerLike | None, eos_token_id: int | None = None) -> frozenset[int]:
    """Every id that ends a request's generation (unless ignore_eos): the tokenizer's end tokens
    (end_token_ids, its EOS among them) and `eos_token_id` (the caller's, or the model config's
    where no tokenizer names one)."""
    ends = frozenset(tokenizer.end_token_ids) if tokenizer is not None else frozenset()
    return ends | {eos_token_id} if eos_token_id is not None else ends


def _stop_cut(text: str, stops: tuple[str, ...], start: int, keep: bool) -> int | None:
    """Where the text ends at its earliest stop string found from `start` (after it when
    `keep`), or None when there is none."""
    found = [(at, len(s)) for s in stops if (at := text.find(s, start)) >= 0]
    if not found:
        return None
    at, n = min(found)
    return at + n if keep else at


def _flush(detok: Any) -> str:
    flush = getattr(detok, "flush", None)
    return flush() if flush is not None else ""


class OutputCollector:
    """Folds one request's events into its RequestOutput."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], prompt: str | None = None,
                 logprobs: bool = False):
        self.output = RequestOutput(request_id, prompt, list(prompt_token_ids),
                                    logprobs=[] if logprobs else None)

    def add(self, event: TokenEvent) -> None:
        out = self.output
        assert out.finish_reason is None, f"request {out.request_id}: an event after its end"
        if event.token_id is not None:
            assert event.elapsed is not None, f"request {out.request_id}: a token event without its time"
            out.token_ids.append(event.token_id)
            out.token_elapsed.append(event.elapsed)
            if out.logprobs is not None:
                out.logprobs.append((event.logprob, event.top_logprobs))
        out.text += event.text
        if event.prompt_logprobs is not None:
            out.prompt_logprobs = event.prompt_logprobs
        if event.finish_reason is not None:
            out.finish_reason = event.finish_reason
            out.metrics = event.metrics

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None
