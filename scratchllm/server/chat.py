"""POST /v1/chat/completions, plain and streamed (SSE): n choices, logprobs, tool calls, thinking.

Tools: the request's `tools` go to the chat template (as `tools`, Hugging Face's convention)
when the template reads them. A forced call (tool_choice "required", a named function, or
allowed_tools in required mode) is made by the grammar, for any model. With "auto" the model
decides, and its calls are read in its family's format (tool_parsers.py): the one
`--tool-call-parser` names, or the one the template writes. A template that does not read tools
is a 400 for "auto", except Gemma's, whose format comes with its own tool prompt. A template
that writes thinking blocks (`<think>`, or Mistral's `[THINK]`) has its reply's thinking split
into `reasoning_content` (reasoning.py).
Every reply goes through tool_calls.ReplyParser, streamed or not.
"""

import re
from collections.abc import AsyncGenerator
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response

from scratchllm.engine.protocol import RequestMetrics, TopLogprobs
from scratchllm.sampling import SamplingParams
from scratchllm.server.gemma_prompt import gemma_messages
from scratchllm.server.generation import (
    EventStream,
    Generation,
    choice_params,
    event_logprob,
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
from scratchllm.server.reasoning import prompt_opens_thinking, template_thinks
from scratchllm.server.sse import SSE_DONE
from scratchllm.server.state import ServerState
from scratchllm.server.structured_fields import ToolPlan
from scratchllm.server.timings import reply_timings
from scratchllm.server.tool_calls import ReplyFormat, message
from scratchllm.server.tool_parsers import TOOL_FORMATS, detect
from scratchllm.tokenizer.protocol import TokenizerLike


def chat_template(tok: TokenizerLike) -> str | None:
    source = getattr(getattr(tok, "spec", None), "chat_template", None)
    return source if isinstance(source, str) else None


def template_reads_tools(tok: TokenizerLike) -> bool:
    """Whether the tokenizer's chat template uses a `tools` variable (the fake's has none)."""
    source = chat_template(tok)
    return source is not None and re.search(r"\btools\b", source) is not None


def tool_format_name(state: ServerState, tok: TokenizerLike) -> str | None:
    """The format auto-mode calls are read in: --tool-call-parser, else (auto, strict) the
    template's own (a template that reads tools but names no format: Hermes, the common convention)."""
    chosen = state.config.tool_call_parser
    if chosen not in ("auto", "strict"):
        return None if chosen == "none" else chosen
    found = detect(chat_template(tok))
    return found or ("hermes" if template_reads_tools(tok) else None)


def render(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan, fmt: str | None = None) -> str:
    """The prompt text: the messages, and the tools the plan may call where the template reads
    them (or, for Gemma's format, in its own system message)."""
    tok = state.model.tokenizer
    extra: dict[str, Any] = req.template_kwargs()  # chat_template_kwargs, e.g. Qwen3's enable_thinking
    messages = req.template_messages()
    names = {t["name"] for t in plan.tools}
    shown = [t.model_dump(exclude_none=True) for t in req.tools or [] if t.function.name in names]
    if req.tools and plan.mode != "none" and template_reads_tools(tok):
        extra["tools"] = shown
    elif plan.mode == "auto" and fmt == "gemma":
        messages = gemma_messages(messages, [t["function"] for t in shown])
    elif plan.mode == "auto":
        raise bad_request("tool_choice 'auto' needs a chat template that reads 'tools', and this model's does "
                          "not; use tool_choice 'required' or name a function (the call is then forced by a "
                          "grammar), or 'none'", param="tool_choice", code="unsupported_parameter")
    if req.chat_template is not None:
        from scratchllm.tokenizer import Tokenizer

        if not isinstance(tok, Tokenizer):
            raise bad_request("this model's tokenizer takes no other chat template", param="chat_template")
        extra["chat_template"] = req.chat_template
    try:
        text: str = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except Exception as err:  # noqa: BLE001 - a template that rejects these messages is the client's input
        raise bad_request(f"messages do not fit the chat template: {err}", param="messages") from None
    return text


def reply_format(state: ServerState, plan: ToolPlan, fmt: str | None, prompt: str) -> ReplyFormat:
    thinking = template_thinks(chat_template(state.model.tokenizer))
    tools = TOOL_FORMATS[fmt] if fmt is not None and plan.mode == "auto" else None
    return ReplyFormat(plan.mode, tools, tuple(t["name"] for t in plan.tools), thinking,
                       thinking is not None and prompt_opens_thinking(prompt, thinking),
                       lenient=state.config.tool_call_parser != "strict")


async def prepare(state: ServerState, req: ChatCompletionRequest) -> tuple[list[int], ReplyFormat, SamplingParams]:
    """A chat request's prompt ids, how its replies are read, and its SamplingParams (also the
    Responses endpoint's way in: responses.py builds a ChatCompletionRequest)."""
    prompt, reading = prompt_and_reading(state, req)
    # The template already spells the special tokens (e.g. <|im_start|>): add none of our own.
    ids = prompt_ids(state, prompt, "messages", special=False)
    max_tokens = max_tokens_for(state, len(ids), req.max_completion_tokens or req.max_tokens, None, "messages")
    return ids, reading, reading.sampling(await sampling_params(state, req, max_tokens))


def prompt_and_reading(state: ServerState, req: ChatCompletionRequest) -> tuple[str, ReplyFormat]:
    """The prompt text, and how the replies to it are read (Ollama's /api/chat uses it too)."""
    plan = req.tool_plan()
    fmt = tool_format_name(state, state.model.tokenizer) if plan.mode == "auto" else None
    prompt = render(state, req, plan, fmt)
    return prompt, reply_format(state, plan, fmt, prompt)


async def chat_completions(request: Request) -> Response | dict[str, Any]:
    state, raw, req = await read_request(request, ChatCompletionRequest)
    tok = state.model.tokenizer
    ids, reading, params = await prepare(state, req)
    rid, created = new_id("chatcmpl"), now_s()
    gen = Generation(state, [ids], [choice_params(params, req.n)], rid,
                     origin_of(state, request, raw, "/v1/chat/completions"))
    head = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
    if req.stream:
        return EventStream(_stream(gen, {**head, "object": "chat.completion.chunk"}, req, reading, tok), gen)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    choices = []
    for k, r in enumerate(results):
        msg, finish = message(reading, r.text, r.finish_reason or "stop")
        lp = {"content": [chat_logprob(tok, *x) for x in token_logprobs(r)]} if req.logprobs else None
        choices.append({"index": k, "message": msg, "finish_reason": finish, "logprobs": lp})
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


async def _stream(gen: Generation, head: dict[str, Any], req: ChatCompletionRequest, reading: ReplyFormat,
                  tok: TokenizerLike) -> AsyncGenerator[bytes, None]:
    count = len(gen.streams)
    for k in range(count):
        yield gen.chunks.encode(_delta(head, k, {"role": "assistant", "content": ""}))
    parsers = [reading.parser() for _ in range(count)]
    n_out, metrics = 0, cast(list[RequestMetrics | None], [None] * count)
    async for k, event in gen.merged():
        n_out += event.finish_reason != "abort"
        chunks = _chunks(head, k, parsers[k].push(event.text)) if event.text else []
        item = event_logprob(gen, k, event)
        if item is not None:  # on the token's first chunk, or on one of its own while it shows nothing
            chunks = chunks or [_delta(head, k, {})]
            chunks[0]["choices"][0]["logprobs"] = {"content": [chat_logprob(tok, *item)]}
        if event.finish_reason:
            metrics[k] = event.metrics
            parts, finish = parsers[k].finish(event.finish_reason)
            chunks += _chunks(head, k, parts) + [_delta(head, k, {}, finish)]
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


def _chunks(head: dict[str, Any], k: int, parts: dict[str, Any]) -> list[dict[str, Any]]:
    """One chunk per part of a ReplyParser's output (thinking, content, each tool-call delta)."""
    out = [_delta(head, k, {key: parts[key]}) for key in ("reasoning_content", "content") if key in parts]
    return out + [_delta(head, k, {"tool_calls": [d]}) for d in parts.get("tool_calls", [])]
