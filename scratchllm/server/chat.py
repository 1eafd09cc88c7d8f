"""POST /v1/chat/completions, plain and streamed (SSE): n choices, logprobs and tool calls.

Tools: the request's `tools` go to the chat template (as `tools`, Hugging Face's convention)
when the template reads them. A forced call (tool_choice "required", a named function, or
allowed_tools in required mode) is made by the grammar, for any model: the reply carries
`message.tool_calls` (streamed as `delta.tool_calls`) and finish_reason "tool_calls". With
"auto" the model decides, in its template's own format: calls written as Hermes-style
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (the convention of the
templates that read tools) become tool_calls; a template that does not read tools is a 400.
"""

import re
from collections.abc import AsyncGenerator
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response

from scratchllm.engine.protocol import RequestMetrics, TokenEvent, TopLogprobs
from scratchllm.errors import ConfigError
from scratchllm.server import tool_calls
from scratchllm.server.generation import (
    EventStream,
    Generation,
    choice_params,
    max_tokens_for,
    origin_of,
    prompt_ids,
    read_request,
    sampling_params,
    token_logprobs,
    token_str,
    usage_of,
)
from scratchllm.server.protocol import ChatCompletionRequest, bad_request, new_id, now_s
from scratchllm.server.sse import SSE_DONE
from scratchllm.server.state import ServerState
from scratchllm.server.structured_fields import ToolPlan
from scratchllm.server.timings import reply_timings
from scratchllm.tokenizer.protocol import TokenizerLike


def template_reads_tools(tok: TokenizerLike) -> bool:
    """Whether the tokenizer's chat template uses a `tools` variable (the fake's has none)."""
    source = getattr(getattr(tok, "spec", None), "chat_template", None)
    return isinstance(source, str) and re.search(r"\btools\b", source) is not None


def render(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan) -> str:
    """The prompt text: the messages, and the tools the plan may call where the template reads them."""
    tok = state.model.tokenizer
    extra: dict[str, Any] = req.template_kwargs()  # chat_template_kwargs, e.g. Qwen3's enable_thinking
    names = {t["name"] for t in plan.tools}
    if req.tools and plan.mode != "none" and template_reads_tools(tok):
        extra["tools"] = [t.model_dump(exclude_none=True) for t in req.tools if t.function.name in names]
    elif plan.mode == "auto":
        raise bad_request("tool_choice 'auto' needs a chat template that reads 'tools', and this model's does "
                          "not; use tool_choice 'required' or name a function (the call is then forced by a "
                          "grammar), or 'none'", param="tool_choice", code="unsupported_parameter")
    try:
        text: str = tok.apply_chat_template(req.template_messages(), add_generation_prompt=True, **extra)
    except Exception as err:  # noqa: BLE001 - a template that rejects these messages is the client's input
        raise bad_request(f"messages do not fit the chat template: {err}", param="messages") from None
    return text


async def chat_completions(request: Request) -> Response | dict[str, Any]:
    state, raw, req = await read_request(request, ChatCompletionRequest)
    plan = req.tool_plan()
    mode, tok = plan.mode, state.model.tokenizer
    # The template already spells the special tokens (e.g. <|im_start|>): add none of our own.
    ids = prompt_ids(state, render(state, req, plan), "messages", special=False)
    max_tokens = max_tokens_for(state, len(ids), req.max_completion_tokens or req.max_tokens, None, "messages")
    params = choice_params(await sampling_params(state, req, max_tokens), req.n)
    rid, created = new_id("chatcmpl"), now_s()
    gen = Generation(state, [ids], [params], rid, origin_of(state, request, raw, "/v1/chat/completions"))
    head = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
    if req.stream:
        return EventStream(_stream(gen, {**head, "object": "chat.completion.chunk"}, req, mode, tok), gen)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    choices = [{"index": k, **tool_calls.reply(r, mode),
                "logprobs": {"content": [chat_logprob(tok, *x) for x in token_logprobs(r)]} if req.logprobs else None}
               for k, r in enumerate(results)]
    n_out = sum(len(r.token_ids) for r in results)
    return gen.reply({**head, "choices": choices, "usage": usage_of(gen, n_out, [r.metrics for r in results]),
                      "timings": reply_timings(results[0], req.timings_per_token)})


def chat_logprob(tok: TokenizerLike, token_id: int | None, logprob: float | None,
                 top: TopLogprobs | None) -> dict[str, Any]:
    def entry(t: int | None, lp: float | None) -> dict[str, Any]:
        s = token_str(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in top or ()]}


def _delta(head: dict[str, Any], k: int, delta: dict[str, Any], finish: str | None = None,
           logprobs: Any = None) -> dict[str, Any]:
    return {**head, "choices": [{"index": k, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


async def _stream(gen: Generation, head: dict[str, Any], req: ChatCompletionRequest, mode: str,
                  tok: TokenizerLike) -> AsyncGenerator[bytes, None]:
    count = len(gen.streams)
    for k in range(count):
        yield gen.chunks.encode(_delta(head, k, {"role": "assistant", "content": ""}))
    forced = [tool_calls.ToolCallStream() for _ in range(count)] if mode == "forced" else None
    hermes = [tool_calls.HermesStream() for _ in range(count)] if mode == "auto" else None
    n_out, metrics = 0, cast(list[RequestMetrics | None], [None] * count)
    async for k, event in gen.merged():
        n_out += event.finish_reason != "abort"
        lp = {"content": [chat_logprob(tok, event.token_id, event.logprob, event.top_logprobs)]} \
            if req.logprobs and event.token_id is not None else None
        if event.finish_reason:
            metrics[k] = event.metrics
        if forced is not None:
            chunks = _forced_deltas(head, k, event, forced[k], lp)
        elif hermes is not None:
            chunks = _hermes_deltas(head, k, event, hermes[k], lp)
        else:
            chunks = [_delta(head, k, {"content": event.text}, logprobs=lp)] if event.text else []
            if event.finish_reason:
                chunks.append(_delta(head, k, {}, event.finish_reason))
        per_token = gen.token_timings(k, event) if req.timings_per_token else None
        if per_token is not None and not chunks:  # a token that shows nothing yet still gets its times
            chunks = [_delta(head, k, {})]
        for chunk in chunks:
            if chunk["choices"][0]["finish_reason"] is not None:  # the choice's last chunk
                chunk["timings"] = gen.final_timings(event.metrics, per_token)
            elif per_token is not None:
                chunk["timings"] = per_token
            yield gen.chunks.encode(chunk)
    if req.stream_options and req.stream_options.include_usage:
        yield gen.chunks.encode({**head, "choices": [], "usage": usage_of(gen, n_out, metrics)})
    yield SSE_DONE


def _hermes_deltas(head: dict[str, Any], k: int, event: TokenEvent, calls: tool_calls.HermesStream,
                   lp: Any) -> list[dict[str, Any]]:
    """Auto mode: content as it comes, each call once its block closes."""
    content, deltas = calls.push(event.text)
    if event.finish_reason is not None:
        content += calls.finish()
    out = [_delta(head, k, {"content": content}, logprobs=lp)] if content else []
    out += [_delta(head, k, {"tool_calls": [d]}) for d in deltas]
    if event.finish_reason is not None:
        called = calls.calls > 0 and event.finish_reason == "stop"
        out.append(_delta(head, k, {}, "tool_calls" if called else event.finish_reason))
    return out


def _forced_deltas(head: dict[str, Any], k: int, event: TokenEvent, call: tool_calls.ToolCallStream,
                 lp: Any) -> list[dict[str, Any]]:
    """A forced call's chunks for one event: the name once known, then argument text; at the end
    finish_reason "tool_calls", or the event's own reason when the call was cut short."""
    out = [_delta(head, k, {"tool_calls": [d]}, logprobs=lp) for d in call.push(event.text)] if event.text else []
    if event.finish_reason is None:
        return out
    finish = event.finish_reason
    if finish == "stop":
        try:
            out += [_delta(head, k, {"tool_calls": [d]}) for d in call.finish()]
            finish = "tool_calls"
        except ConfigError:
            pass  # not a complete call: the client gets what was streamed and the engine's reason
    return out + [_delta(head, k, {}, finish)]
