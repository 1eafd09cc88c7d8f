"""The pipeline both generation endpoints share (completions.py and chat.py are the endpoints).

parse -> check model -> token ids -> SamplingParams (the request model's one call, after the
context-length checks here) -> one params per choice (seed + i) -> admit (or 429) -> submit
(a prompt with several choices is one engine group: the choices fork its KV blocks) -> collect
or stream -> release. A request holds its engine slots from admission to `Generation.close()`,
which runs on every path out (finished, client gone, error) and aborts whatever is still
running, freeing its KV blocks.
"""

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from scratchllm.engine.output import OutputCollector
from scratchllm.engine.protocol import RequestMetrics, RequestOutput, RequestStream, TokenEvent, TopLogprobs
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams
from scratchllm.server.access import client_ip
from scratchllm.server.batch_runner import BATCH_LANE
from scratchllm.server.metrics import TokenClock
from scratchllm.server.profiles import profile_of, with_profile
from scratchllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_body,
    usage,
)
from scratchllm.server.registry import ModelRegistry, models_of
from scratchllm.server.sse import SSE_DONE, SSE_PING, ChunkTrace, sse, wait_for_disconnect
from scratchllm.server.state import ServerState
from scratchllm.server.timings import timings, token_timings
from scratchllm.tokenizer.protocol import TokenizerLike
from scratchllm.trace.otlp import record_request

# (token id, logprob, top alternatives) of one generated token; the id is None on an abort event
LogprobItem = tuple[int | None, float | None, TopLogprobs | None]
SEED_SPACE = 2**64  # seeds are uint64 (the request model wraps negatives); choice i uses seed + i


@dataclass
class Origin:
    """Where an HTTP request came from: its body as sent, the client's address, the endpoint.
    A request that came in on another API (Ollama's) has its equivalent OpenAI request as `body`
    and `endpoint`, and the route it came in on as `translated_from`."""

    body: bytes
    client_ip: str | None
    endpoint: str
    translated_from: str | None = None


class Generation:
    """One HTTP request's engine requests: `choices` per prompt, admitted and submitted together.

    Stream k is choice k % choices of prompt k // choices (OpenAI's choice index is k). The
    choices of one prompt are one engine group (submit_group), so they share its KV blocks."""

    def __init__(self, state: ServerState, prompts: list[list[int]], params: list[list[SamplingParams]],
                 request_id: str, origin: Origin | None = None) -> None:
        assert len(prompts) == len(params) and len({len(p) for p in params}) == 1, "choices per prompt differ"
        self.choices = len(params[0])
        self.params = [p for per_prompt in params for p in per_prompt]
        if BATCH_LANE.get():  # a Batch API line (batch_runner.py): the engine's low-priority queue
            self.params = [dataclasses.replace(p, low_priority=True) for p in self.params]
        if len(self.params) > state.config.max_in_flight:  # never admissible: a 429 would invite retries
            raise bad_request(f"this request needs {len(self.params)} engine requests (prompts x choices); the "
                              f"server holds at most {state.config.max_in_flight} at once", param="n")
        state.admit(len(self.params))
        self.state, self.prompts, self.closed = state, prompts, False
        self.streams: list[RequestStream] = []
        self.chunks = ChunkTrace(state.trace, request_id)  # the reply's serialize / send time (and ring spans)
        self._previous: list[float | None] = [None] * len(self.params)  # each stream's last token's elapsed
        self.rids = [request_id] if len(self.params) == 1 else [f"{request_id}-{i}" for i in range(len(self.params))]
        self.origin = origin
        # the evaluation loop's sample: the first prompt's tokens, text and end, for the capture file
        self.captured: OutputCollector | None = None
        if origin is not None and state.capture is not None and state.capture.should_capture(origin.body):
            self.captured = OutputCollector(self.rids[0], prompts[0])
        if origin is not None and state.classes is not None:
            body = json.loads(origin.body)
            for rid in self.rids:
                state.classes.remember(rid, body)
        engine, c = state.model.engine, self.choices
        try:
            for p, ids in enumerate(prompts):
                rids, ps = self.rids[p * c:(p + 1) * c], self.params[p * c:(p + 1) * c]
                if c == 1:
                    self.streams.append(engine.submit(ids, ps[0], request_id=rids[0]))
                else:
                    self.streams.extend(engine.submit_group(ids, ps, rids))
        except ConfigError as err:  # the engine's own validation: still the client's input
            self.close()
            raise bad_request(str(err)) from None
        except Exception as err:  # noqa: BLE001 - any other refusal (shutting down, backend gone) is a 503
            self.close()
            raise APIError(503, f"engine refused the request: {err}", type="server_error",
                           code="engine_unavailable") from None

    def prompt_of(self, k: int) -> list[int]:
        return self.prompts[k // self.choices]

    async def events(self, k: int) -> AsyncIterator[TokenEvent]:
        """Stream k's events; finished requests are recorded in the metrics here."""
        clock = TokenClock(self.state.metrics)
        event: TokenEvent
        async for event in self.streams[k]:
            clock.tick()
            if k == 0 and self.captured is not None:
                self.captured.add(event)
            if event.finish_reason is not None:
                self.state.metrics.observe_finished(event.metrics, event.finish_reason)
                if self.state.otlp is not None and event.metrics is not None:
                    record_request(self.state.otlp, event.request_id, self.state.model.name, event.metrics,
                                   self.params[k])
                m = event.metrics
                if m is not None and m.finished is not None:
                    self.state.recent_e2e_s.append(m.finished - m.arrival)
            yield event

    async def merged(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(stream index, event) of every stream, as they come (a streamed reply with n > 1)."""
        if len(self.streams) == 1:
            async for event in self.events(0):
                yield 0, event
            return
        queue: asyncio.Queue[tuple[int, TokenEvent | Exception]] = asyncio.Queue()

        async def pump(k: int) -> None:
            try:
                async for event in self.events(k):
                    queue.put_nowait((k, event))
            except Exception as err:  # noqa: BLE001 - re-raised in the reader, which reports it
                queue.put_nowait((k, err))

        tasks = [asyncio.ensure_future(pump(k)) for k in range(len(self.streams))]
        try:
            for _ in range(len(tasks)):  # each stream ends with exactly one finishing event
                while True:
                    k, item = await queue.get()
                    if isinstance(item, Exception):
                        raise item
                    event = item
                    yield k, event
                    if event.finish_reason is not None:
                        break
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, receive: Receive) -> list[RequestOutput] | None:
        """Every stream's full result, or None if the client hung up first (then all is aborted)."""
        results = asyncio.ensure_future(asyncio.gather(*(self._collect_one(k) for k in range(len(self.streams)))))
        hangup = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            waiting: set[asyncio.Future[Any]] = {results, hangup}  # the result, or the hang-up
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            return results.result() if results in done else None
        finally:
            hangup.cancel()
            results.cancel()
            # a cancelled gather ends with CancelledError as its exception: retrieve it, or asyncio
            # logs "exception was never retrieved" at ERROR for every client that hung up
            results.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.close()

    async def _collect_one(self, k: int) -> RequestOutput:
        collector = OutputCollector(self.streams[k].request_id, self.prompt_of(k),
                                    logprobs=self.params[k].logprobs is not None)
        async for event in self.events(k):
            collector.add(event)
        return collector.output

    def token_timings(self, k: int, event: TokenEvent) -> dict[str, Any] | None:
        """Stream k's per-token times for `event` (timings_per_token); None for an event without
        a token. Call it once per event of the stream, in order: it remembers the previous one."""
        if event.elapsed is None:
            return None
        t = token_timings(event.index, event.elapsed, self._previous[k])
        self._previous[k] = event.elapsed
        return t

    def final_timings(self, metrics: RequestMetrics | None, per_token: dict[str, Any] | None = None
                      ) -> dict[str, Any] | None:
        """A streamed choice's last chunk's `timings`: the engine's split, the reply's serialize
        and send time so far (every chunk before this one), and its token's times if asked for."""
        t = timings(metrics)
        if t is None:
            return per_token
        return {**t, **self.chunks.server_timings(), **(per_token or {})}

    def reply(self, body: dict[str, Any]) -> Response:
        """A non-streamed reply, its serialization measured into its own `timings` (sse.ChunkTrace)."""
        return Response(self.chunks.encode_body(body), media_type="application/json")

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
        self.state.release(len(self.params))

    def _record_capture(self) -> None:
        """The sampled request, with what the client got, into the capture file (once, at the end)."""
        c, origin, capture = self.captured, self.origin, self.state.capture
        if c is None or origin is None or capture is None or not c.finished:
            return
        out = c.output
        capture.record(origin.body, self.state.model.name, origin.client_ip, out.token_ids, timings(out.metrics),
                       endpoint=origin.endpoint, response_text=out.text, finish_reason=out.finish_reason,
                       translated_from=origin.translated_from)


@dataclass(frozen=True)
class StreamFormat:
    """How a streamed reply is written: its media type, the line that keeps a quiet stream alive
    (None: none), and the last chunk it ends with when the engine fails mid-stream."""

    media_type: str
    ping: bytes | None
    error: Callable[[Exception], bytes]


def _sse_error(err: Exception) -> bytes:
    """An SSE error event (the official client raises it as an APIError), then [DONE]: the
    status line is gone once streaming starts, so this instead of a connection cut."""
    return sse(APIError(500, f"the engine failed mid-stream: {type(err).__name__}: {err}",
                        type="server_error").body()) + SSE_DONE


SSE_FORMAT = StreamFormat("text/event-stream", SSE_PING, _sse_error)


class EventStream(StreamingResponse):
    """A streamed reply (SSE unless another format is given) that closes its Generation however
    the stream ends (done, disconnect, error). While no chunk comes for the config's
    sse_ping_interval_s (a long queue wait, a slow prefill) it sends the format's ping (SSE's
    comment, `: ping`, which clients skip and proxies count as traffic)."""

    def __init__(self, body: AsyncGenerator[bytes, None], generation: Generation,
                 fmt: StreamFormat = SSE_FORMAT) -> None:
        interval = generation.state.config.sse_ping_interval_s
        if interval > 0 and fmt.ping is not None:
            body = _pinged(body, interval, fmt.ping)
        super().__init__(_guarded(body, generation.chunks, fmt.error), media_type=fmt.media_type,
                         headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def _pinged(body: AsyncGenerator[bytes, None], interval_s: float, ping: bytes) -> AsyncGenerator[bytes, None]:
    """`body`'s chunks, with `ping` between two that are more than interval_s apart."""
    pending: asyncio.Task[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(body))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield ping
                continue
            task, pending = pending, None
            try:
                chunk = task.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None:  # the body must stop running before it can be closed
            pending.cancel()
            await asyncio.wait({pending})
        await body.aclose()


async def _guarded(body: AsyncGenerator[bytes, None], chunks: ChunkTrace,
                   error: Callable[[Exception], bytes]) -> AsyncGenerator[bytes, None]:
    """An engine failure becomes the stream's `error` chunk, its last. Each chunk's send is timed
    from the yield to the ASGI server's next request for one."""
    try:
        async for chunk in body:
            start = time.monotonic_ns()
            yield chunk
            chunks.sent(start, len(chunk))
    except Exception as err:  # noqa: BLE001 - reported to the client, then the stream ends
        yield error(err)
    finally:
        await body.aclose()


# --- request -> token ids and params ----------------------------------------------------------
RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


async def read_request(request: Request, model_cls: type[RequestT]) -> tuple[ServerState, bytes, RequestT]:
    """(the named model's state, the body as sent, the validated request). The model is loaded
    first if it is not, and stays loaded until the response ends (server/registry.py)."""
    registry = models_of(request)
    raw = await request.body()
    req = parse_body(profiled(registry, raw), model_cls, lenient=registry.config.lenient_fields)
    return await registry.generator(request, req.model), raw, req


def profiled(registry: ModelRegistry, raw: bytes) -> bytes:
    """The body with what its model's name adds (model_names.with_profile), when the name adds
    anything; as sent otherwise (a body that is no JSON object is parse_body's to refuse)."""
    if not registry.profiles:
        return raw
    try:
        body = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(body, dict) or profile_of(registry, body.get("model")) is None:
        return raw
    return json.dumps(with_profile(registry, body)).encode()


def origin_of(state: ServerState, request: Request, raw: bytes | Callable[[], bytes], endpoint: str,
              translated_from: str | None = None) -> Origin | None:
    """Only when the evaluation loop listens (a capture or the priority feedback). `raw`: the
    body, or (a translated request) what builds it, called only then."""
    if state.capture is None and state.classes is None:
        return None
    peer = request.client.host if request.client is not None else None
    forwarded = request.headers.get("x-forwarded-for")
    body = raw if isinstance(raw, bytes) else raw()
    return Origin(body, client_ip(peer, forwarded, state.config.trusted_proxies), endpoint, translated_from)


def prompt_ids(state: ServerState, prompt: str | list[int], param: str, special: bool = True) -> list[int]:
    tok = state.model.tokenizer
    ids: list[int] = tok.encode(prompt, add_special_tokens=special) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise bad_request(f"'{param}' is empty after tokenization", param=param)
    vocab = tok.vocab_size
    if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
        raise bad_request(f"'{param}' has token ids outside [0, {vocab})", param=param)
    return ids


def max_tokens_for(state: ServerState, n_prompt: int, max_tokens: int | None, default: int | None,
                   prompt_param: str) -> int:
    """The request's max_tokens, settled against the context: room left after the prompt."""
    limit = state.model.max_model_len
    if n_prompt >= limit:
        raise bad_request(f"prompt has {n_prompt} tokens; this model's context is {limit} tokens",
                          param=prompt_param, code="context_length_exceeded")
    room = limit - n_prompt
    if max_tokens is None:
        max_tokens = min(default, room) if default else room
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if max_tokens > room:
        raise bad_request(f"max_tokens={max_tokens} plus the prompt's {n_prompt} tokens exceeds this model's "
                          f"context of {limit} tokens", param="max_tokens", code="context_length_exceeded")
    return max_tokens


async def sampling_params(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                          max_tokens: int) -> SamplingParams:
    """The request's SamplingParams. A constrained request compiles its grammar off the event
    loop (a large schema takes milliseconds; the first one also builds the vocabulary's trie)."""
    tok = state.model.tokenizer
    vocab, eos = tok.vocab_size, tok.eos_token_id
    if req.constraint() is None:
        plain: SamplingParams = req.sampling_params(max_tokens, None, vocab, eos)
        return plain
    compiler = await asyncio.to_thread(state.grammar_compiler)
    params: SamplingParams = await asyncio.to_thread(req.sampling_params, max_tokens, compiler, vocab, eos)
    return params


def choice_params(params: SamplingParams, count: int) -> list[SamplingParams]:
    """`count` choices of one prompt: choice i of a seeded request is seeded seed + i, so n
    choices equal n single requests seeded seed, seed + 1, ..."""
    if params.seed is None:
        return [params] * count
    return [dataclasses.replace(params, seed=(params.seed + i) % SEED_SPACE) for i in range(count)]


def usage_of(gen: Generation, completion_tokens: int, metrics: list[RequestMetrics | None]) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once however many choices it has; cached_tokens are the
    prompt tokens whose K/V came from the prefix cache (first choice of each prompt)."""
    firsts = metrics[::gen.choices]
    cached = sum(m.cached_tokens for m in firsts if m is not None)
    return {**usage(sum(len(p) for p in gen.prompts), completion_tokens),
            "prompt_tokens_details": {"cached_tokens": cached}}


def token_logprobs(r: RequestOutput) -> list[LogprobItem]:
    """(token id, logprob, top pairs) per generated token of a finished result."""
    return [(t, lp, top) for t, (lp, top) in zip(r.token_ids, r.logprobs or [], strict=True)]


def event_logprob(gen: Generation, k: int, event: TokenEvent) -> LogprobItem | None:
    """The logprob item stream k's `event` brings: its token's, when the stream asked for
    logprobs; None for an event without a token (an abort). A streamed reply sends each once and
    in order: on the chunk with the text its event shows or, when the event shows none (text held
    back for a stop string or an incomplete character; an end token's), on a chunk with empty
    text, so the chunks' entries add up to the whole reply's."""
    if gen.params[k].logprobs is None or event.token_id is None:
        return None
    return event.token_id, event.logprob, event.top_logprobs


def token_str(tok: TokenizerLike, token_id: int | None) -> str:
    text: str = tok.decode([token_id]) if token_id is not None else ""
    return text


def matched_stop(tok: TokenizerLike, token_ids: list[int], text: str, stops: list[str]) -> str | None:
    """The stop string that ended a reply whose shown text is `text`: the one its whole generated
    text has right after it (None: an end token or the length ended it)."""
    if not stops:
        return None
    written = tok.decode(token_ids)
    return next((s for s in stops if (text + s) in written), None)
