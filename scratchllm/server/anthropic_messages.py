"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the same engine.

A request runs as the chat request it translates into (anthropic_translate.py; the capture
records that request, marked `translated_from` /v1/messages, so the evaluation loop replays it),
and its reply is read by the chat endpoint's parser (tool_calls.ReplyParser) into Anthropic's
content blocks: `thinking` (the reasoning split; empty with thinking.display "omitted"), `text`
and `tool_use` (a call's arguments parsed into `input`). stop_reason: "end_turn", "max_tokens",
"stop_sequence" (with the `stop_sequence` that ended the text) or "tool_use". usage:
`input_tokens` counts the prompt tokens computed, `cache_read_input_tokens` those found in the
prefix cache.

Streamed, the events are Anthropic's, each with its `event:` line: message_start,
content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta;
signature_delta before a thinking block ends) / content_block_stop per block, message_delta
(stop_reason, stop_sequence, usage), message_stop; `ping` events while the stream waits, and an
`error` event if the engine fails mid-stream. Keys: `x-api-key` as well as `Authorization:
Bearer` (access.py); the `anthropic-version` header, when sent, must be a date.
"""

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from scratchllm.engine.protocol import RequestMetrics
from scratchllm.server import chat
from scratchllm.server.anthropic_protocol import (
    AnthropicCountRequest,
    AnthropicRequest,
    anthropic_error_body,
    check_version,
)
from scratchllm.server.anthropic_translate import chat_fields, chat_messages, renamed
from scratchllm.server.errors import APIError
from scratchllm.server.generation import EventStream, Generation, StreamFormat, matched_stop, origin_of
from scratchllm.server.protocol import ChatCompletionRequest, parse_body
from scratchllm.server.reasoning import template_thinks
from scratchllm.server.registry import models_of
from scratchllm.server.state import ServerState
from scratchllm.server.tool_calls import ReplyFormat, message

ENDPOINT = "/v1/messages"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def event(kind: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event with its name, as Anthropic's stream writes them."""
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def _stream_error(err: Exception) -> bytes:
    body = anthropic_error_body(APIError(500, f"the engine failed mid-stream: {type(err).__name__}: {err}",
                                         type="server_error"))
    return event("error", {"error": body["error"]})


ANTHROPIC_SSE = StreamFormat("text/event-stream", event("ping", {}), _stream_error)


async def _translate(request: Request, cls: type[AnthropicRequest] | type[AnthropicCountRequest]
                     ) -> tuple[Any, ServerState, ChatCompletionRequest, dict[str, Any]]:
    """(the Messages request, the model's state, the chat request it runs as, that request's body)."""
    check_version(request.headers.get("anthropic-version"))
    registry = models_of(request)
    req = parse_body(await request.body(), cls, lenient=registry.config.lenient_fields)
    state = await registry.generator(request, req.model)
    thinks = template_thinks(chat.chat_template(state.model.tokenizer)) is not None
    body = {"messages": chat_messages(req), **chat_fields(req, thinks)}
    try:
        translated = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    except APIError as err:
        raise renamed(err) from None
    return req, state, translated, body


async def count_tokens(request: Request) -> dict[str, Any]:
    _, state, translated, _ = await _translate(request, AnthropicCountRequest)
    try:
        prompt, _ = chat.prompt_and_reading(state, translated)
    except APIError as err:
        raise renamed(err) from None
    return {"input_tokens": len(state.model.tokenizer.encode(prompt, add_special_tokens=False))}


async def messages(request: Request) -> Response | dict[str, Any]:
    req, state, translated, body = await _translate(request, AnthropicRequest)
    try:
        ids, reading, params = await chat.prepare(state, translated)
    except APIError as err:
        raise renamed(err) from None
    recorded = {**body, "max_tokens": params.max_tokens, "stream": req.stream}
    origin = origin_of(state, request, lambda: json.dumps(recorded).encode(), "/v1/chat/completions", ENDPOINT)
    gen = Generation(state, [ids], [[params]], f"msg_{uuid.uuid4().hex[:24]}", origin)
    reply = _Reply(req, state, gen, reading, len(ids))
    if req.stream:
        return EventStream(reply.stream(), gen, ANTHROPIC_SSE)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    r = results[0]
    msg, finish = message(reading, r.text, r.finish_reason or "stop")
    content = reply.blocks(msg)
    return {**reply.head(content), **reply.ending(finish, r.token_ids, r.text, r.metrics)}


class _Reply:
    """One Messages reply: its head, its content blocks, and how it ended; streamed, the events."""

    def __init__(self, req: AnthropicRequest, state: ServerState, gen: Generation, reading: ReplyFormat,
                 n_prompt: int) -> None:
        self.req, self.state, self.gen, self.reading, self.n_prompt = req, state, gen, reading, n_prompt
        self.show_thinking = req.thinking is None or req.thinking.display != "omitted"
        self.nothing = req.max_tokens == 0  # the prompt only (it fills the prefix cache)

    def head(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.gen.rids[0], "type": "message", "role": "assistant", "model": self.req.model,
                "content": content}

    def blocks(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        if self.nothing:
            return []
        out: list[dict[str, Any]] = []
        if msg.get("reasoning_content"):
            out.append({"type": "thinking", "thinking": msg["reasoning_content"] if self.show_thinking else "",
                        "signature": ""})
        if msg.get("content"):
            out.append({"type": "text", "text": msg["content"]})
        for call in msg.get("tool_calls") or []:
            out.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
        return out

    def ending(self, finish: str, token_ids: list[int], text: str, metrics: RequestMetrics | None
               ) -> dict[str, Any]:
        """stop_reason, stop_sequence and usage."""
        word = matched_stop(self.state.model.tokenizer, token_ids, text, self.req.stop_sequences or []) \
            if finish == "stop" else None
        reason = "max_tokens" if self.nothing else "stop_sequence" if word else STOP_REASONS.get(finish, "end_turn")
        return {"stop_reason": reason, "stop_sequence": word, "usage": self.usage(metrics, len(token_ids))}

    def usage(self, metrics: RequestMetrics | None, generated: int) -> dict[str, Any]:
        cached = metrics.cached_tokens if metrics is not None else 0
        return {"input_tokens": self.n_prompt - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": 0 if self.nothing else generated}

    async def stream(self) -> AsyncGenerator[bytes, None]:
        start = {**self.head([]), "stop_reason": None, "stop_sequence": None, "usage": self.usage(None, 0)}
        yield event("message_start", {"message": start})
        blocks, parser = _Blocks(self.show_thinking), self.reading.parser()
        tokens: list[int] = []
        text = ""
        async for ev in self.gen.events(0):
            if ev.token_id is not None:
                tokens.append(ev.token_id)
            text += ev.text
            for chunk in blocks.write(parser.push(ev.text) if ev.text and not self.nothing else {}):
                yield chunk
            if ev.finish_reason is not None:
                parts, finish = parser.finish(ev.finish_reason)
                for chunk in blocks.write(parts if not self.nothing else {}) + blocks.close():
                    yield chunk
                end = self.ending(finish, tokens, text, ev.metrics)
                yield event("message_delta", {"delta": {"stop_reason": end["stop_reason"],
                                                        "stop_sequence": end["stop_sequence"]}, "usage": end["usage"]})
        yield event("message_stop", {})


class _Blocks:
    """A reply's parts (ReplyParser's) as content block events: a block opens when its kind of
    part first comes, and closes when another kind comes or the reply ends."""

    def __init__(self, show_thinking: bool) -> None:
        self.show_thinking = show_thinking
        self.index = -1
        self.open: str | None = None  # "thinking", "text", or "tool_use:<call index>"

    def write(self, parts: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if parts.get("reasoning_content"):
            out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if self.show_thinking:
                out.append(self._delta({"type": "thinking_delta", "thinking": parts["reasoning_content"]}))
        if parts.get("content"):
            out += self._switch("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": parts["content"]}))
        for d in parts.get("tool_calls", []):
            if "id" in d:
                block = {"type": "tool_use", "id": _tool_id(d["id"]), "name": d["function"]["name"], "input": {}}
                out += self._switch(f"tool_use:{d['index']}", block)
            if d["function"].get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": d["function"]["arguments"]}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = [self._delta({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return out + [event("content_block_stop", {"index": self.index})]

    def _switch(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == kind:
            return []
        out = self.close()
        self.index, self.open = self.index + 1, kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})


def _tool_id(call_id: str) -> str:
    """Anthropic's tool_use ids begin "toolu_"; a call's id (ours, or a client's) keeps its rest."""
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its `input` object ({} when the model wrote no object)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
