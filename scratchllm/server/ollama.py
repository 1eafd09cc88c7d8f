"""Ollama's API on the same port as OpenAI's, for the tools that speak only Ollama's:

    POST /api/generate   a prompt (the model's chat template around it, or `raw`), `context` ids;
                         with `suffix`, the model's fill-in-the-middle layout of prompt and suffix
    POST /api/chat       messages (and tools), the reply as a message
    POST /api/embed      `input` (a string or several) -> embeddings; /api/embeddings: the older form
    GET  /api/tags       every served model, with its details
    POST /api/show       one model: its details, template and capabilities
    GET  /api/ps         the models loaded now, and when each unloads
    GET  /api/version

Replies stream as NDJSON (one JSON object a line) unless `"stream": false`; the last line has
`"done": true`, the finish reason and Ollama's counts and nanosecond durations (from the
engine's own request metrics). A request's `keep_alive` sets how long its model stays loaded
after it (server/registry.py); a generate or chat request with no prompt or messages only loads
the model, or with `keep_alive` 0 unloads it. Each request is translated into the OpenAI request
this server runs (ollama_protocol.py), so validation, templates and structured output are one
pipeline. Errors are `{"error": "..."}` (app.py shapes every error under /api/ so); one that
happens mid-stream is a last line of that shape (generation.py's EventStream writes both
streamed formats, closing the request however its stream ends). With `serve --capture`, a generate
or chat request is captured as the OpenAI request it was translated into (its replay speaks
OpenAI's API), max_tokens settled, marked `translated_from` the route it came in on.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

import scratchllm
from scratchllm.engine.protocol import RequestMetrics, RequestOutput
from scratchllm.server import chat, tool_calls
from scratchllm.server.embeddings import embed
from scratchllm.server.errors import APIError, bad_request
from scratchllm.server.fill import ending_middle, fim_layout, fim_prompt_ids
from scratchllm.server.generation import (
    EventStream,
    Generation,
    LogprobItem,
    StreamFormat,
    event_logprob,
    origin_of,
    prompt_ids,
    sampling_params,
    token_logprobs,
)
from scratchllm.server.ollama_protocol import (
    FOREVER,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    digest,
    durations,
    embed_options,
    error_body,
    logprob_fields,
    model_details,
    ollama_tool_calls,
    openai_fields,
    openai_messages,
    refuse_unsupported,
    renamed,
    timestamp,
)
from scratchllm.server.profiles import profile_of, with_profile
from scratchllm.server.protocol import ChatCompletionRequest, CompletionRequest, new_id, parse_body
from scratchllm.server.registry import Lease, ModelEntry, ModelRegistry, models_of, parse_keep_alive
from scratchllm.server.state import ServerState

PREFIX = "/api/"


def is_ollama(path: str) -> bool:
    """Whether a request path is Ollama's API (its errors are then Ollama's shape)."""
    return path.startswith(PREFIX)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _ndjson_error(err: Exception) -> bytes:
    message = error_body(err)["error"] if isinstance(err, APIError) else \
        f"the engine failed mid-stream: {type(err).__name__}: {err}"
    return _line({"error": message})


# NDJSON has no comment line to keep a quiet stream alive: no ping; an error is a last {"error"} line
NDJSON = StreamFormat("application/x-ndjson", None, _ndjson_error)


def _keep_alive(value: float | str | None) -> Any:
    if value is None:
        return "default"
    try:
        return parse_keep_alive(value)
    except ValueError as err:
        raise bad_request(str(err), param="keep_alive") from None


async def _openai(raw: dict[str, Any], cls: type[Any], registry: ModelRegistry) -> Any:
    """The translated request, validated as the OpenAI endpoints validate theirs."""
    try:
        return parse_body(json.dumps(with_profile(registry, raw)).encode(), cls, lenient=registry.config.lenient_fields)
    except APIError as err:
        raise renamed(err) from None


async def _hold(request: Request, registry: ModelRegistry, name: str, keep: Any) -> tuple[Lease, ServerState]:
    lease = await registry.acquire(request, name, "generate")
    lease.keep_alive_s = keep
    assert lease.entry.state is not None
    return lease, lease.entry.state


def _max_tokens(state: ServerState, n_prompt: int, num_predict: int | None, num_ctx: int | None) -> int:
    """Ollama's rule: generate up to num_predict tokens, or to the end of the context (num_ctx,
    at most the model's), never past it."""
    limit = min(num_ctx or state.model.max_model_len, state.model.max_model_len)
    if n_prompt >= limit:
        raise bad_request(f"the prompt has {n_prompt} tokens; the context is {limit} tokens "
                          f"({'options.num_ctx' if num_ctx and num_ctx < state.model.max_model_len else 'the model'})",
                          param="prompt", code="context_length_exceeded")
    return min(num_predict or limit - n_prompt, limit - n_prompt)


async def _load_or_unload(request: Request, registry: ModelRegistry, name: str, keep: Any,
                          head: dict[str, Any]) -> dict[str, Any]:
    """A request without a prompt: load the model (keep_alive 0: unload it), as Ollama does."""
    if keep == 0:
        registry.entry(name, "generate")
        await registry.unload(name)
        return {**head, "done": True, "done_reason": "unload"}
    await _hold(request, registry, name, keep)
    return {**head, "done": True, "done_reason": "load"}


async def generate(request: Request) -> Response | dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaGenerateRequest, lenient=registry.config.lenient_fields)
    refuse_unsupported(req)
    keep, fields = _keep_alive(req.keep_alive), {**openai_fields(req.options, req.format), **logprob_fields(req)}
    head = {"model": req.model, "created_at": timestamp(), "response": ""}
    if not req.prompt and not req.context:
        return await _load_or_unload(request, registry, req.model, keep, head)
    num_ctx = fields.pop("num_ctx", None)
    # checked before the model loads; the prompt is tokenized below (a placeholder here)
    openai_req = await _openai({"model": req.model, "prompt": "-", **fields}, CompletionRequest, registry)
    lease, state = await _hold(request, registry, req.model, keep)
    named = profile_of(registry, req.model)
    if named is not None and named.system is not None and req.system is None:
        req = req.model_copy(update={"system": named.system})  # the name's SYSTEM (server/profiles.py)
    layout = fim_layout(state, "suffix") if req.suffix else None
    if layout is not None:  # fill-in-the-middle: the layout of prompt and suffix, as /v1/completions' suffix
        text, special = req.prompt or "", False
        ids = fim_prompt_ids(state, layout, text, req.suffix or "")
    else:
        text, special = _generate_text(state, req)
        ids = list(req.context or []) + (prompt_ids(state, text, "prompt", special) if text else [])
    if any(not 0 <= t < state.model.tokenizer.vocab_size for t in ids):
        raise bad_request("'context' has token ids outside the vocabulary", param="context")
    max_tokens = _max_tokens(state, len(ids), openai_req.max_tokens, num_ctx)  # the name's num_predict too
    params = await sampling_params(state, openai_req, max_tokens)
    if layout is not None:
        params = ending_middle(params, layout)
        fields = {**fields, "suffix": req.suffix}

    def same() -> bytes:  # the prompt as text where /v1/completions makes the same ids of it, else the ids
        as_text = layout is not None or (not req.context and (special or prompt_ids(state, text, "prompt") == ids))
        return _recorded({"model": req.model, "prompt": text if as_text else ids, **fields}, max_tokens, req.stream)

    origin = origin_of(state, request, same, "/v1/completions", "/api/generate")
    gen = Generation(state, [ids], [[params]], new_id("ollama"), origin)
    if req.stream:
        return EventStream(_stream(gen, head, lease, lambda text: {"response": text}, ids), gen, NDJSON)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    r = results[0]
    return {**head, "created_at": timestamp(), "response": r.text, **_reply_logprobs(gen, r),
            **_end(r.finish_reason, r.metrics, lease), "context": ids + r.token_ids}


def _recorded(translated: dict[str, Any], max_tokens: int, stream: bool) -> bytes:
    """The OpenAI request that runs as this Ollama request ran, as the evaluation loop records it
    (and replays it): the translation, with max_tokens as settled here (Ollama's default runs to
    the end of the context, num_ctx's or the model's, where OpenAI's would not)."""
    assert "num_ctx" not in translated, "num_ctx is settled into max_tokens"
    return json.dumps({**translated, "max_tokens": max_tokens, "stream": stream}).encode()


def _generate_text(state: ServerState, req: OllamaGenerateRequest) -> tuple[str, bool]:
    """(the prompt text, whether the tokenizer adds its special tokens): the model's chat template
    around the system and the prompt, or the prompt as given when `raw` (or no template)."""
    tok, prompt = state.model.tokenizer, req.prompt or ""
    has_template = getattr(getattr(tok, "spec", None), "chat_template", True)
    if req.raw or not has_template:
        return (f"{req.system}\n\n{prompt}" if req.system and not req.raw else prompt), True
    messages = [{"role": "system", "content": req.system}] if req.system else []
    try:
        text: str = tok.apply_chat_template([*messages, {"role": "user", "content": prompt}])
    except Exception as err:  # noqa: BLE001 - a template that rejects these messages is the client's input
        raise bad_request(f"the prompt does not fit the chat template: {err}", param="prompt") from None
    return text, False


def _end(finish_reason: str | None, metrics: RequestMetrics | None, lease: Lease) -> dict[str, Any]:
    """The last line's fields: done, why ("stop" or "length"), the counts and durations."""
    reason = finish_reason if finish_reason in ("stop", "length") else "stop"
    return {"done": True, "done_reason": reason, **durations(metrics, lease.load_s)}


def _logprobs(gen: Generation, items: list[LogprobItem]) -> dict[str, Any]:
    """A reply line's `logprobs` field: one entry per token, of OpenAI chat's shape, which is
    Ollama's too; nothing when the request did not ask for logprobs or the line has no token."""
    if gen.params[0].logprobs is None or not items:
        return {}
    tok = gen.state.model.tokenizer
    return {"logprobs": [chat.chat_logprob(tok, *item) for item in items]}


def _reply_logprobs(gen: Generation, r: RequestOutput) -> dict[str, Any]:
    return _logprobs(gen, token_logprobs(r)) if r.logprobs is not None else {}


async def _stream(gen: Generation, head: dict[str, Any], lease: Lease, delta: Callable[[str], dict[str, Any]],
                  context: list[int] | None = None) -> AsyncGenerator[bytes, None]:
    """The NDJSON lines of a reply: `delta(text)`'s fields per piece of text, then the "done"
    line (with `context`: the prompt's ids and the reply's). A token's logprobs ride on the first
    line its event writes; a token that shows no text yet gets a line of its own, so the lines'
    logprobs add up to the whole reply's."""
    out: list[int] = []
    async for event in gen.events(0):
        if event.token_id is not None:
            out.append(event.token_id)
        item = event_logprob(gen, 0, event)
        lp = _logprobs(gen, [item]) if item is not None else {}
        if event.text or (lp and event.finish_reason is None):
            yield _line({**head, "created_at": timestamp(), **delta(event.text), **lp, "done": False})
            lp = {}
        if event.finish_reason is not None:
            end = {"context": context + out} if context is not None else {}
            yield _line({**head, "created_at": timestamp(), **delta(""), **lp,
                         **_end(event.finish_reason, event.metrics, lease), **end})


async def chat_route(request: Request) -> Response | dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaChatRequest, lenient=registry.config.lenient_fields)
    refuse_unsupported(req)
    keep, fields = _keep_alive(req.keep_alive), {**openai_fields(req.options, req.format), **logprob_fields(req)}
    head = {"model": req.model, "created_at": timestamp()}
    if not req.messages:
        return await _load_or_unload(request, registry, req.model, keep,
                                     {**head, "message": {"role": "assistant", "content": ""}})
    num_ctx = fields.pop("num_ctx", None)
    raw = {"model": req.model, "messages": openai_messages(req.messages), **fields}
    if req.tools:
        raw["tools"] = req.tools
    openai_req: ChatCompletionRequest = await _openai(raw, ChatCompletionRequest, registry)
    lease, state = await _hold(request, registry, req.model, keep)
    prompt, reading = chat.prompt_and_reading(state, openai_req)
    ids = prompt_ids(state, prompt, "messages", special=False)
    max_tokens = _max_tokens(state, len(ids), openai_req.max_tokens, num_ctx)  # the name's num_predict too
    params = reading.sampling(await sampling_params(state, openai_req, max_tokens))
    origin = origin_of(state, request, lambda: _recorded(raw, max_tokens, req.stream), "/v1/chat/completions",
                       "/api/chat")
    gen = Generation(state, [ids], [[params]], new_id("ollama"), origin)
    if req.stream and reading.mode == "none":
        return EventStream(_stream(gen, head, lease, _assistant), gen, NDJSON)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    r = results[0]
    reply, _ = tool_calls.message(reading, r.text, r.finish_reason or "stop")
    message = {"role": "assistant", "content": reply.get("content") or ""}
    calls = ollama_tool_calls(reply.get("tool_calls"))
    if calls:
        message["tool_calls"] = calls
    end = _end(r.finish_reason, r.metrics, lease)
    body = {**head, "created_at": timestamp(), "message": message, **_reply_logprobs(gen, r), **end}
    if not req.stream:
        return body
    # a streamed reply with tools: the calls are known only at the end, so it is one message line
    return Response(_line({**body, "done": False, "done_reason": None})
                    + _line({**head, "created_at": timestamp(), **_assistant(""), **end}),
                    media_type="application/x-ndjson")


def _assistant(text: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text}}


async def embed_route(request: Request) -> dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaEmbedRequest, lenient=registry.config.lenient_fields)
    inputs = [req.input] if isinstance(req.input, str) else list(req.input)
    vectors, n, lease, start = await _embed(request, registry, req.model, inputs, req.options, req.keep_alive,
                                            req.truncate, req.dimensions)
    return {"model": req.model, "embeddings": vectors, "total_duration": int((time.monotonic() - start) * 1e9),
            "load_duration": int(lease.load_s * 1e9), "prompt_eval_count": n}


async def embeddings_route(request: Request) -> dict[str, Any]:
    """The older endpoint: one `prompt`, one `embedding`."""
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaEmbeddingsRequest, lenient=registry.config.lenient_fields)
    vectors, _, _, _ = await _embed(request, registry, req.model, [req.prompt], req.options, req.keep_alive)
    return {"embedding": vectors[0]}


async def _embed(request: Request, registry: ModelRegistry, name: str, inputs: list[str],
                 options: dict[str, Any] | None, keep_alive: float | str | None, truncate: bool = True,
                 dimensions: int | None = None) -> tuple[list[list[float]], int, Lease, float]:
    start = time.monotonic()
    registry.entry(name, "embed")
    embed_options(options)
    keep = _keep_alive(keep_alive)
    if dimensions is not None:
        raise bad_request("'dimensions' is not supported: this model's size is fixed", param="dimensions")
    if not inputs or any(not isinstance(x, str) or not x for x in inputs):
        raise bad_request("'input' needs at least one non-empty string", param="input")
    lease = await registry.acquire(request, name, "embed")
    lease.keep_alive_s = keep
    emb = lease.entry.embedder
    assert emb is not None
    rows: list[str | list[int]] = list(inputs)
    if truncate:  # Ollama's default: an input longer than the model takes is cut, its last token kept
        rows = []
        for text in inputs:
            ids = emb.tokenizer.encode(text, add_special_tokens=True)
            rows.append(ids if len(ids) <= emb.max_len else [*ids[:emb.max_len - 1], ids[-1]])
    vectors, n = await embed(registry, emb, rows)
    return vectors.tolist(), n, lease, start


def _listing(entry: ModelEntry) -> dict[str, Any]:
    d = entry.spec.details
    return {"name": entry.name, "model": entry.name, "modified_at": timestamp(d.get("mtime", 0.0)),
            "size": int(d.get("size", 0)), "digest": digest(entry.name, d), "details": model_details(d)}


async def tags(request: Request) -> dict[str, Any]:
    """Every served model, and every name made while serving (/api/create, /api/copy, /api/pull)."""
    registry = models_of(request)
    listed = [_listing(e) for e in registry.models()]
    shown = {m["name"] for m in listed}
    for name in sorted(registry.added - shown):
        listed.append({**_listing(registry.entries[name]), "name": name, "model": name})
    return {"models": listed}


async def show(request: Request) -> dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaShowRequest, lenient=registry.config.lenient_fields)
    name = req.model or req.name
    if not name:
        raise bad_request("'model' is required", param="model")
    entry = registry.entry(name)
    d, served = entry.spec.details, entry.served
    spec = getattr(getattr(served, "tokenizer", None), "spec", None)
    template = getattr(spec, "chat_template", None) or d.get("template") or ""
    family = str(d.get("family", ""))
    capabilities = ["embedding"] if entry.spec.task == "embed" else ["completion"]
    if entry.spec.task == "generate" and "tools" in template:
        capabilities.append("tools")
    info = {"general.architecture": family, "general.parameter_count": d.get("parameters", 0),
            f"{family}.context_length": entry.max_len()}
    return {"modelfile": f"# served by scratchllm {scratchllm.__version__}\nFROM {d.get('path', name)}\n",
            "parameters": "", "template": template, "details": model_details(d), "model_info": info,
            "capabilities": capabilities, "modified_at": timestamp(d.get("mtime", 0.0))}


async def ps(request: Request) -> dict[str, Any]:
    out = []
    for entry in models_of(request).models():
        if entry.status != "loaded":
            continue
        if entry.keep_alive_s is None or entry.spec.load is None:
            expires = FOREVER
        else:  # in use: its keep-alive counts from when its last request ends
            expires = timestamp(entry.expires_at or time.time() + entry.keep_alive_s)
        out.append({**_listing(entry), "size": entry.spec.planned_bytes or int(entry.spec.details.get("size", 0)),
                    "expires_at": expires, "size_vram": 0, "context_length": entry.max_len()})
    return {"models": out}


async def version() -> dict[str, str]:
    return {"version": scratchllm.__version__}
