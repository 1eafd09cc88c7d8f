"""POST /infill (and /v1/infill): llama.cpp's fill-in-the-middle endpoint, the one editor plugins
(llama.vscode, llama.vim) call, in its request and reply shapes.

The prompt is the served model's layout (tokenizer/fim.py) of `input_prefix` + `prompt` before
the insertion point and `input_suffix` after it, with `input_extra` (files as
`{"filename", "text"}`) before them as the layout's repository context. A request runs as the
/v1/completions request of those prompt ids (the capture records it so, for replay), so its
sampling and validation are the completions endpoint's; the defaults are llama.cpp's
(temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, n_predict -1: to the end token or the
context's end). `n_predict` 0 only runs the prompt, which fills the prefix cache for the next
request (llama.vscode sends it so while the user types). Two of llama.cpp's stops are kept:
`n_indent` (a line after the first that is indented less ends the text, at that line's first
character) and `t_max_predict_ms` (past that time, the text ends once it holds a newline).

The reply is llama.cpp's: `content`, `stop`, `stop_type` ("eos", "word", "limit"),
`stopping_word`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached` (prompt tokens found in
the prefix cache), `truncated`, and `timings` in llama.cpp's names (prompt_n counts the tokens
computed, the cached ones not). Streamed: SSE lines `{"content", "stop": false, "index"}`, the
last with `"stop": true` and the rest of the reply.
"""

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from scratchllm.engine.protocol import RequestMetrics
from scratchllm.server.errors import APIError
from scratchllm.server.fill import ending_middle, fim_layout, fim_prompt_ids
from scratchllm.server.generation import (
    EventStream,
    Generation,
    StreamFormat,
    matched_stop,
    origin_of,
    sampling_params,
)
from scratchllm.server.messages import Strict
from scratchllm.server.protocol import CompletionRequest, Refusals, _Request, bad_request, new_id, parse_body
from scratchllm.server.registry import models_of
from scratchllm.server.sse import SSE_PING, sse, wait_for_disconnect
from scratchllm.server.state import ServerState
from scratchllm.tokenizer.fim import RepoFile

ENDPOINT = "/infill"


class InfillChunk(Strict):
    """A file of repository context, as llama.vscode sends it (`time`: when it was picked)."""

    filename: str = "tmp"  # llama.cpp's name for a chunk without one
    text: str = ""
    time: float | None = None  # accepted, no effect: the plugin's own bookkeeping


class InfillRequest(_Request):
    REFUSED: ClassVar[Refusals] = {"lora": ((None, []), "this server loads no LoRA adapters")}

    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = []
    prompt: str = ""  # text right before the insertion point, after input_prefix
    n_predict: int = Field(-1, ge=-1)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=100.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-1, le=2**64 - 1)  # -1: a random seed, as llama.cpp reads it
    stop: list[str] = []
    stream: bool = False
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = Field(0, ge=0)
    # accepted, no effect: llama.cpp's server reads t_max_prompt_ms without acting on it; the prefix
    # cache here is always on (cache_prompt); one engine, no slots (id_slot); the sampling order is
    # this server's own (samplers: docs/openai-api.md, "Sampling order")
    t_max_prompt_ms: int | None = None
    cache_prompt: bool = True
    id_slot: int | None = None
    samplers: list[str] | str | None = None
    lora: Any = None

    def completion_fields(self) -> dict[str, Any]:
        """The sampling fields as /v1/completions' (the request this one runs as)."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                               "min_p": self.min_p, "repetition_penalty": self.repeat_penalty,
                               "presence_penalty": self.presence_penalty,
                               "frequency_penalty": self.frequency_penalty}
        if self.seed is not None and self.seed != -1:
            out["seed"] = self.seed
        if self.stop:
            out["stop"] = self.stop
        return out


class LineLimits:
    """llama.cpp's n_indent and t_max_predict_ms stops over the text as it streams: push() each
    piece, get back the text that may be sent and whether the text ends there."""

    def __init__(self, n_indent: int, t_max_predict_ms: int) -> None:
        self.n_indent, self.deadline_ms = n_indent, t_max_predict_ms
        self.text, self.sent = "", 0
        self.start: float | None = None

    def push(self, piece: str) -> tuple[str, bool]:
        self.start = self.start if self.start is not None else time.monotonic()
        self.text += piece
        cut = self._short_line()
        if cut is not None:
            self.text = self.text[:cut]
        late = self.deadline_ms > 0 and "\n" in self.text and \
            (time.monotonic() - self.start) * 1e3 > self.deadline_ms
        end = len(self.text) if cut is not None or late else self._decided()
        out, self.sent = self.text[self.sent:end], max(end, self.sent)
        return out, cut is not None or late

    def rest(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _short_line(self) -> int | None:
        """Where a line after the first, indented less than n_indent, has its first character."""
        if self.n_indent <= 0:
            return None
        at = self.text.find("\n")
        while at >= 0:
            line = self.text[at + 1:]
            body = line.lstrip(" \t").split("\n", 1)[0]
            indent = len(line) - len(line.lstrip(" \t"))
            if body and indent < self.n_indent:
                return at + 1 + indent
            at = self.text.find("\n", at + 1)
        return None

    def _decided(self) -> int:
        """Text that can no longer be cut: up to the last line's indentation while n_indent waits."""
        if self.n_indent <= 0:
            return len(self.text)
        at = self.text.rfind("\n")
        return at + 1 if at >= 0 and not self.text[at + 1:].strip(" \t") else len(self.text)


async def infill(request: Request) -> Response | dict[str, Any]:
    registry = models_of(request)
    raw = await request.body()
    req = parse_body(raw, InfillRequest, lenient=registry.config.lenient_fields)
    state = await registry.generator(request, req.model or registry.default.name)
    layout = fim_layout(state, "input_suffix")
    files = [RepoFile(c.filename, c.text) for c in req.input_extra]
    ids = fim_prompt_ids(state, layout, req.input_prefix + req.prompt, req.input_suffix, files, "input_prefix")
    limit = state.model.max_model_len
    if len(ids) >= limit:
        raise bad_request(f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens",
                          param="input_prefix", code="context_length_exceeded")
    nothing = req.n_predict == 0  # the prompt only: one token is made (the prefill makes it) and dropped
    max_tokens = 1 if nothing else (limit - len(ids) if req.n_predict == -1 else min(req.n_predict, limit - len(ids)))
    translated = {"model": state.model.name, "prompt": ids, "max_tokens": max_tokens, **req.completion_fields()}
    openai_req = parse_body(json.dumps(translated).encode(), CompletionRequest)
    params = ending_middle(await sampling_params(state, openai_req, max_tokens), layout)
    recorded = {**translated, "stop_token_ids": list(params.stop_token_ids), "stream": req.stream}
    origin = origin_of(state, request, lambda: json.dumps(recorded).encode(), "/v1/completions", ENDPOINT)
    gen = Generation(state, [ids], [[params]], new_id("infill"), origin)
    run = _Run(gen, state, req, len(ids), nothing)
    if req.stream:
        return EventStream(run.stream(), gen, INFILL_SSE)
    whole = asyncio.ensure_future(run.whole())
    hangup = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({whole, hangup}, return_when=asyncio.FIRST_COMPLETED)
        return whole.result() if whole in done else Response(status_code=499)
    finally:
        for task in (whole, hangup):
            task.cancel()
        gen.close()


def _sse_error(err: Exception) -> bytes:
    return sse(APIError(500, f"the engine failed mid-stream: {type(err).__name__}: {err}",
                        type="server_error").body())


INFILL_SSE = StreamFormat("text/event-stream", SSE_PING, _sse_error)  # llama.cpp's stream ends with no [DONE]


class _Run:
    """One /infill request's generation read into llama.cpp's reply: the text through the line
    limits, how it stopped, and the counts."""

    def __init__(self, gen: Generation, state: ServerState, req: InfillRequest, n_prompt: int, nothing: bool) -> None:
        self.gen, self.state, self.req, self.n_prompt, self.nothing = gen, state, req, n_prompt, nothing
        self.limits = LineLimits(req.n_indent, req.t_max_predict_ms)

    async def pieces(self) -> AsyncGenerator[tuple[str, dict[str, Any] | None], None]:
        """(text to send, the closing fields once the text ended)."""
        params, tokens = self.gen.params[0], []
        async for event in self.gen.events(0):
            if event.token_id is not None:
                tokens.append(event.token_id)
            if self.nothing:
                if event.finish_reason is not None:
                    yield "", self._end("limit", "", event.metrics, 0)
                continue
            text, cut = self.limits.push(event.text)
            if cut or event.finish_reason is not None:
                text += self.limits.rest()
                ended_by_token = event.token_id in (*params.stop_token_ids, *params.eos_token_ids)
                word = "" if cut or ended_by_token else self._stop_word(tokens)
                kind = "limit" if cut or event.finish_reason != "stop" else "word" if word else "eos"
                yield text, self._end(kind, word, event.metrics, len(tokens))
                return
            if text:
                yield text, None

    async def whole(self) -> dict[str, Any]:
        content, last = "", None
        async for text, end in self.pieces():
            content, last = content + text, end
        assert last is not None
        return {"index": 0, "content": content, **last}

    async def stream(self) -> AsyncGenerator[bytes, None]:
        async for text, end in self.pieces():
            yield self.gen.chunks.encode({"index": 0, "content": text, "stop": False} if end is None
                                         else {"index": 0, "content": text, **end})

    def _stop_word(self, tokens: list[int]) -> str:
        """The stop string that ended the text ("" when none did)."""
        return matched_stop(self.state.model.tokenizer, tokens, self.limits.text, self.req.stop) or ""

    def _end(self, stop_type: str, word: str, metrics: RequestMetrics | None, predicted: int) -> dict[str, Any]:
        cached = metrics.cached_tokens if metrics is not None else 0
        return {"stop": True, "stop_type": stop_type, "stopping_word": word,
                "model": self.state.model.name, "tokens_predicted": predicted, "tokens_evaluated": self.n_prompt,
                "tokens_cached": cached, "truncated": False, "timings": _timings(metrics, self.n_prompt - cached)}


def _timings(m: RequestMetrics | None, computed: int) -> dict[str, Any]:
    """llama.cpp's timings: the prompt's (tokens computed, their time) and the generated tokens'."""
    if m is None:
        return {}
    prompt_ms, predicted_ms, predicted = m.queue_ms + m.prefill_ms, m.decode_ms, max(m.completion_tokens - 1, 0)

    def per(n: int, ms: float) -> tuple[float | None, float | None]:
        return (round(ms / n, 3), round(n * 1e3 / ms, 2)) if n > 0 and ms > 0 else (None, None)

    p_token, p_second = per(computed, prompt_ms)
    d_token, d_second = per(predicted, predicted_ms)
    return {"prompt_n": computed, "prompt_ms": round(prompt_ms, 3), "prompt_per_token_ms": p_token,
            "prompt_per_second": p_second, "predicted_n": m.completion_tokens, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": d_token, "predicted_per_second": d_second}
