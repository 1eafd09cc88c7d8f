"""POST /v1/completions and /v1/chat/completions, plain and streamed (SSE).

Both endpoints are one pipeline: parse -> check model -> token ids -> SamplingParams (with the
context-length checks) -> admit (or 429) -> submit -> collect or stream -> release. A request
holds its engine slot from admission to `Generation.close()`, which runs on every path out
(finished, client gone, error) and aborts whatever is still running, freeing its KV blocks.
"""

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from scratchllm.engine.output import OutputCollector
from scratchllm.engine.protocol import RequestOutput, RequestStream, TokenEvent, TopLogprobs
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams
from scratchllm.server.access import client_ip
from scratchllm.server.app import ServerState
from scratchllm.server.metrics import TokenClock
from scratchllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    new_id,
    now_s,
    parse_body,
    timings,
    usage,
)
from scratchllm.server.sse import SSE_DONE, ChunkTrace, sse, wait_for_disconnect
from scratchllm.trace.otlp import record_request

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# (token id, logprob, top alternatives) of one generated token; the id is None on an abort event
LogprobItem = tuple[int | None, float | None, TopLogprobs | None]


@dataclass
class Origin:
    """Where an HTTP request came from: its body as sent, the client's address, the endpoint."""

    body: bytes
    client_ip: str | None
    endpoint: str


class Generation:
    """One HTTP request's engine requests (one per prompt), admitted and submitted together."""

    def __init__(self, state: ServerState, prompts: list[list[int]], params: list[SamplingParams],
                 request_id: str, origin: Origin | None = None) -> None:
        state.admit(len(prompts))
        self.state, self.prompts, self.params, self.closed = state, prompts, params, False
        self.streams: list[RequestStream] = []
        self.chunks = ChunkTrace(state.trace, request_id)  # streamed chunks' spans in the trace ring
        self.rids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self.origin = origin
        # the evaluation loop's sample: the first prompt's tokens, text and end, for the capture file
        self.captured: OutputCollector | None = None
        if origin is not None and state.capture is not None and state.capture.should_capture(origin.body):
            self.captured = OutputCollector(self.rids[0], prompts[0])
        if origin is not None and state.classes is not None:
            body = json.loads(origin.body)
            for rid in self.rids:
                state.classes.remember(rid, body)
        try:
            for ids, p, rid in zip(prompts, params, self.rids, strict=True):
                self.streams.append(state.model.engine.submit(ids, p, request_id=rid))
        except ConfigError as err:  # the engine's own validation: still the client's input
            self.close()
            raise bad_request(str(err)) from None
        except Exception as err:
            self.close()
            raise APIError(503, f"engine refused the request: {err}", type="server_error",
                           code="engine_unavailable") from None

    async def events(self, i: int) -> AsyncIterator[TokenEvent]:
        """The i-th prompt's events; finished requests are recorded in the metrics here."""
        clock = TokenClock(self.state.metrics)
        event: TokenEvent
        async for event in self.streams[i]:
            clock.tick()
            if i == 0 and self.captured is not None:
                self.captured.add(event)
            if event.finish_reason is not None:
                self.state.metrics.observe_finished(event.metrics, event.finish_reason)
                if self.state.otlp is not None and event.metrics is not None:
                    record_request(self.state.otlp, event.request_id, self.state.model.name, event.metrics,
                                   self.params[i])
                m = event.metrics
                if m is not None and m.finished is not None:
                    self.state.recent_e2e_s.append(m.finished - m.arrival)
            yield event

    async def collect(self, receive: Receive) -> list[RequestOutput] | None:
        """Every prompt's full result, or None if the client hung up first (then all is aborted)."""
        results = asyncio.ensure_future(asyncio.gather(*(self._collect_one(i) for i in range(len(self.prompts)))))
        hangup = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            waiting: set[asyncio.Future[Any]] = {results, hangup}  # the result, or the hang-up
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            return results.result() if results in done else None
        finally:
            hangup.cancel()
            results.cancel()
            self.close()

    async def _collect_one(self, i: int) -> RequestOutput:
        collector = OutputCollector(self.streams[i].request_id, self.prompts[i],
                                    logprobs=self.params[i].logprobs is not None)
        async for event in self.events(i):
            collector.add(event)
        return collector.output

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._record_capture()
        if self.state.classes is not None:
            for rid in self.rids:
                self.state.classes.forget(rid)
        for stream in self.streams:
            if not stream.finished:
                self.state.metrics.finished("abort")
                stream.abort()
        self.state.release(len(self.prompts))


    def _record_capture(self) -> None:
        """The sampled request, with what the client got, into the capture file (once, at the end)."""
        c, origin, capture = self.captured, self.origin, self.state.capture
        if c is None or origin is None or capture is None or not c.finished:
            return
        out = c.output
        capture.record(origin.body, self.state.model.name, origin.client_ip, out.token_ids, timings(out.metrics),
                       endpoint=origin.endpoint, response_text=out.text, finish_reason=out.finish_reason)


class EventStream(StreamingResponse):
    """SSE response that closes its Generation however the stream ends (done, disconnect, error)."""

    def __init__(self, body: AsyncGenerator[bytes, None], generation: Generation) -> None:
        super().__init__(_guarded(body, generation.chunks), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def _guarded(body: AsyncGenerator[bytes, None], chunks: ChunkTrace) -> AsyncGenerator[bytes, None]:
    """The status line is gone once streaming starts: an engine failure becomes an SSE error event
    (the official client raises it as an APIError) instead of a connection cut mid-stream. Each
    chunk's send is timed from the yield to the ASGI server's next request for one."""
    try:
        async for chunk in body:
            start = time.monotonic_ns()
            yield chunk
            chunks.sent(start, len(chunk))
    except Exception as err:  # noqa: BLE001 - reported to the client, then the stream ends
        yield sse(APIError(500, f"the engine failed mid-stream: {type(err).__name__}: {err}",
                           type="server_error").body())
    finally:
        await body.aclose()


# --- request -> token ids and params ----------------------------------------------------------
def _origin(state: ServerState, request: Request, raw: bytes, endpoint: str) -> Origin | None:
    """Only when the evaluation loop listens (a capture or the priority feedback)."""
    if state.capture is None and state.classes is None:
        return None
    peer = request.client.host if request.client is not None else None
    forwarded = request.headers.get("x-forwarded-for")
    return Origin(raw, client_ip(peer, forwarded, state.config.trusted_proxies), endpoint)


def _prompt_ids(state: ServerState, prompt: str | list[int], param: str, special: bool = True) -> list[int]:
    tok = state.model.tokenizer
    ids: list[int] = tok.encode(prompt, add_special_tokens=special) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise bad_request(f"'{param}' is empty after tokenization", param=param)
    vocab = tok.vocab_size
    if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
        raise bad_request(f"'{param}' has token ids outside [0, {vocab})", param=param)
    return ids


def _params(state: ServerState, req: CompletionRequest | ChatCompletionRequest, n_prompt: int, max_tokens: int | None,
            default: int | None, logprobs: int | None) -> SamplingParams:
    limit = state.model.max_model_len
    if n_prompt >= limit:
        raise bad_request(f"prompt has {n_prompt} tokens; this model's context is {limit} tokens",
                          param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                          code="context_length_exceeded")
    room = limit - n_prompt
    if max_tokens is None:
        max_tokens = min(default, room) if default else room
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if max_tokens > room:
        raise bad_request(f"max_tokens={max_tokens} plus the prompt's {n_prompt} tokens exceeds this model's "
                          f"context of {limit} tokens", param="max_tokens", code="context_length_exceeded")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"'{name}' is not supported (only 0)", param=name)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                              seed=req.seed, stop=req.stop_list(), stop_token_ids=tuple(req.stop_token_ids),
                              ignore_eos=req.ignore_eos, logprobs=logprobs)
    except ConfigError as err:
        raise bad_request(str(err)) from None


def _token_str(tok: Any, token_id: int | None) -> str:
    text: str = tok.decode([token_id])
    return text


# --- /v1/completions -----------------------------------------------------------------------------
async def completions(request: Request) -> Response | dict[str, Any]:
    state: ServerState = request.app.state.server
    # parse_body is typed to return the BaseModel base; it returns an instance of the class it is given
    raw = await request.body()
    req = parse_body(raw, CompletionRequest)
    state.check_model(req.model)
    if req.echo:
        raise bad_request("'echo' is not supported", param="echo")
    prompts = [_prompt_ids(state, p, "prompt") for p in req.prompts()]
    if req.stream and len(prompts) > 1:
        raise bad_request("streaming takes one prompt per request", param="prompt")
    params = [_params(state, req, len(ids), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, req.logprobs)
              for ids in prompts]
    rid, created = new_id("cmpl"), now_s()
    gen = Generation(state, prompts, params, rid, _origin(state, request, raw, "/v1/completions"))
    head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
    tok = state.model.tokenizer
    if req.stream:
        return EventStream(_stream_completion(gen, head, req, tok), gen)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason,
                "logprobs": _completion_logprobs(tok, _token_logprobs(r)) if req.logprobs is not None else None}
               for i, r in enumerate(results)]
    n_prompt = sum(len(p) for p in prompts)
    n_out = sum(len(r.token_ids) for r in results)
    return {**head, "choices": choices, "usage": usage(n_prompt, n_out), "timings": timings(results[0].metrics)}


def _token_logprobs(r: RequestOutput) -> list[LogprobItem]:
    """(token id, logprob, top pairs) per generated token of a finished result."""
    return [(t, lp, top) for t, (lp, top) in zip(r.token_ids, r.logprobs or [], strict=True)]


def _completion_logprobs(tok: Any, items: Sequence[LogprobItem]) -> dict[str, Any]:
    return {"tokens": [_token_str(tok, t) for t, _, _ in items], "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [{_token_str(tok, i): lp for i, lp in top or ()} for _, _, top in items],
            "text_offset": []}


async def _stream_completion(gen: Generation, head: dict[str, Any], req: CompletionRequest,
                             tok: Any) -> AsyncGenerator[bytes, None]:
    n_out = 0
    async for event in gen.events(0):
        counted = event.finish_reason != "abort"
        n_out += counted
        if event.text or event.finish_reason:
            choice: dict[str, Any] = {"index": 0, "text": event.text, "finish_reason": event.finish_reason,
                                      "logprobs": None}
            if req.logprobs is not None and counted:
                choice["logprobs"] = _completion_logprobs(tok, [(event.token_id, event.logprob, event.top_logprobs)])
            chunk = {**head, "choices": [choice]}
            if event.finish_reason:
                chunk["timings"] = timings(event.metrics)
            yield gen.chunks.encode(chunk)
    if req.stream_options and req.stream_options.include_usage:
        yield gen.chunks.encode({**head, "choices": [], "usage": usage(len(gen.prompts[0]), n_out)})
    yield SSE_DONE


# --- /v1/chat/completions ------------------------------------------------------------------------
async def chat_completions(request: Request) -> Response | dict[str, Any]:
    state: ServerState = request.app.state.server
    # parse_body is typed to return the BaseModel base; it returns an instance of the class it is given
    raw = await request.body()
    req = parse_body(raw, ChatCompletionRequest)
    state.check_model(req.model)
    tok = state.model.tokenizer
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template that rejects these messages is the client's input
        raise bad_request(f"messages do not fit the chat template: {err}", param="messages") from None
    # The template already spells the special tokens (e.g. <|im_start|>): add none of our own.
    ids = _prompt_ids(state, text, "messages", special=False)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _params(state, req, len(ids), req.max_completion_tokens or req.max_tokens, None, logprobs)
    rid, created = new_id("chatcmpl"), now_s()
    gen = Generation(state, [ids], [params], rid, _origin(state, request, raw, "/v1/chat/completions"))
    head = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
    if req.stream:
        return EventStream(_stream_chat(gen, {**head, "object": "chat.completion.chunk"}, req, tok), gen)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    r = results[0]
    choice = {"index": 0, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason,
              "logprobs": {"content": [_chat_logprob(tok, *x) for x in _token_logprobs(r)]} if req.logprobs else None}
    n_out = len(r.token_ids)
    return {**head, "choices": [choice], "usage": usage(len(ids), n_out), "timings": timings(r.metrics)}


def _chat_logprob(tok: Any, token_id: int | None, logprob: float | None, top: TopLogprobs | None) -> dict[str, Any]:
    def entry(t: int | None, lp: float | None) -> dict[str, Any]:
        s = _token_str(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in top or ()]}


async def _stream_chat(gen: Generation, head: dict[str, Any], req: ChatCompletionRequest,
                       tok: Any) -> AsyncGenerator[bytes, None]:
    yield gen.chunks.encode({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None, "logprobs": None}]})
    n_out = 0
    async for event in gen.events(0):
        n_out += event.finish_reason != "abort"
        if event.text:
            lp = {"content": [_chat_logprob(tok, event.token_id, event.logprob, event.top_logprobs)]} \
                if req.logprobs else None
            yield gen.chunks.encode({**head, "choices": [{"index": 0, "delta": {"content": event.text},
                                                          "finish_reason": None,
                                            "logprobs": lp}]})
        if event.finish_reason:
            yield gen.chunks.encode({**head, "choices": [{"index": 0, "delta": {},
                                                          "finish_reason": event.finish_reason,
                                            "logprobs": None}], "timings": timings(event.metrics)})
    if req.stream_options and req.stream_options.include_usage:
        yield gen.chunks.encode({**head, "choices": [], "usage": usage(len(gen.prompts[0]), n_out)})
    yield SSE_DONE
