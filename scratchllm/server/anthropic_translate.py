"""A Messages request as the chat request this server runs (protocol.py's ChatCompletionRequest),
so validation, the chat template, tool calls, thinking and structured output are the chat
endpoint's own:
  system, system turns    system messages
  user turns              text blocks -> the user's text; tool_result blocks -> tool messages
  assistant turns         text -> content, thinking -> reasoning_content, tool_use -> tool_calls
  tools                   function tools (input_schema -> parameters)
  tool_choice             auto / any / tool / none -> auto / required / the named function / none;
                          disable_parallel_tool_use -> parallel_tool_calls false
  stop_sequences          stop; temperature, top_p, top_k as they are
  output_config.format    a JSON schema the reply must match (response_format json_schema)
  thinking                a template that writes thinking (Qwen3's) thinks unless "disabled"
                          (then chat_template_kwargs enable_thinking false); "enabled" on a model
                          that does not think is a 400
Consecutive turns of one role are joined into one, as Anthropic's API does. A conversation that
ends with an assistant turn (a prefill) is refused, as Anthropic refuses it for models that do
not support it. An error the chat request raises names the field as the Messages request spells
it (`renamed`).
"""

import json
from typing import Any

from scratchllm.server.anthropic_protocol import (
    AnthropicRequest,
    MessagesBody,
    TextBlockIn,
    ThinkingBlockIn,
    ToolResultBlockIn,
    ToolUseBlockIn,
    read_block,
)
from scratchllm.server.errors import APIError, bad_request


def chat_messages(req: MessagesBody) -> list[dict[str, Any]]:
    """The conversation as the chat request's messages (see the module doc)."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system)})
    turns: list[tuple[str, list[Any]]] = []
    for i, turn in enumerate(req.messages):
        blocks = [turn.content] if isinstance(turn.content, str) else \
            [read_block(b, f"messages.{i}.content.{j}", turn.role) for j, b in enumerate(turn.content)]
        if turns and turns[-1][0] == turn.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((turn.role, blocks))
    if turns[-1][0] == "assistant":
        raise bad_request("the last message is the assistant's: prefilling a reply is not supported here; end the "
                          "conversation with a user turn", param=f"messages.{len(req.messages) - 1}.role")
    for role, blocks in turns:
        out += _user(blocks) if role == "user" else _assistant(blocks) if role == "assistant" else \
            [{"role": "system", "content": _text(blocks)}]
    return out


def _text(blocks: str | list[Any]) -> str:
    if isinstance(blocks, str):
        return blocks
    return "".join(b if isinstance(b, str) else b.text if isinstance(b, TextBlockIn) else b["text"] for b in blocks)


def _user(blocks: list[Any]) -> list[dict[str, Any]]:
    """A user turn: its text as user messages, its tool results as tool messages, in order."""
    out: list[dict[str, Any]] = []
    for b in blocks:
        if isinstance(b, ToolResultBlockIn):
            content = b.content if isinstance(b.content, str) else _text(b.content or [])
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += _text([b])
        else:
            out.append({"role": "user", "content": _text([b])})
    return out


def _assistant(blocks: list[Any]) -> list[dict[str, Any]]:
    text = "".join(_text([b]) for b in blocks if isinstance(b, str | TextBlockIn))
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlockIn))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlockIn)]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        msg["reasoning_content"] = thinking
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def chat_fields(req: MessagesBody, thinks: bool) -> dict[str, Any]:
    """Everything but the messages, as the chat request's fields; `thinks`: the model's template
    writes thinking."""
    out: dict[str, Any] = {"model": req.model}
    if req.tools:
        out["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.input_schema, "strict": t.strict}}
                        for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise bad_request("tool_choice of type 'tool' needs a 'name'", param="tool_choice.name")
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    thinking = req.thinking
    if thinking is not None and thinking.type == "enabled":
        if not thinks:
            raise bad_request("'thinking' is not available: this model's chat template writes no thinking; send "
                              "{\"type\": \"disabled\"} or \"adaptive\"", param="thinking.type",
                              code="unsupported_parameter")
        if thinking.budget_tokens is None or thinking.budget_tokens < 1024:
            raise bad_request("thinking.budget_tokens must be at least 1024", param="thinking.budget_tokens")
    if thinking is not None and thinking.type == "disabled" and thinks:
        out["chat_template_kwargs"] = {"enable_thinking": False}
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_,
                                                                         "strict": True}}
    if isinstance(req, AnthropicRequest):
        out["max_tokens"] = max(req.max_tokens, 1)
        out["temperature"] = req.temperature
        for name, value in (("stop", req.stop_sequences), ("top_p", req.top_p), ("top_k", req.top_k)):
            if value is not None:
                out[name] = value
    return out


# chat fields as the Messages request spells them, for errors the translated request raises
RENAMED = {"stop": "stop_sequences", "response_format": "output_config.format", "chat_template_kwargs": "thinking",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


def renamed(err: APIError) -> APIError:
    head = (err.param or "").split(".")[0]
    if head not in RENAMED:
        return err
    param = RENAMED[head] + (err.param or "")[len(head):]
    return APIError(err.status, err.message.replace(f"'{head}'", f"'{RENAMED[head]}'"), err.type, param, err.code,
                    err.headers)
