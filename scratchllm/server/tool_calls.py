"""A chat reply's tool calls: from the finished text, or as stream deltas while it is written.

Two sources, by the request's tool plan (structured_fields.ToolPlan):
  forced  the grammar wrote `{"name": ..., "arguments": {...}}` (scratchllm.structured.tools);
  auto    the model wrote calls in its template's format; templates that read `tools` use the
          Hermes convention, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and
          text outside the blocks stays content.
A call that did not complete (cut by max_tokens) is no call: the client gets the text and the
engine's finish_reason; a completed call's choice ends with finish_reason "tool_calls".
"""

import json
import re
import uuid
from typing import Any, cast

from scratchllm.engine.protocol import RequestOutput
from scratchllm.errors import ConfigError
from scratchllm.structured import ToolCallStream, tool_calls_from_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _hermes_call(body: str) -> dict[str, Any] | None:
    """One block's JSON -> an OpenAI tool call, or None if it is not a call."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("name"), str)):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return {"id": _call_id(), "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(arguments)}}


def hermes_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the calls, the calls) of a finished text; a block that is not a
    call's JSON stays in the text."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        call = _hermes_call(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    rest = _HERMES_CALL.sub(take, text)
    return rest.strip(), calls


def reply(r: RequestOutput, mode: str) -> dict[str, Any]:
    """message and finish_reason of one finished choice under the tool plan's mode."""
    message: dict[str, Any] = {"role": "assistant", "content": r.text}
    calls: list[dict[str, Any]] = []
    if mode == "forced" and r.finish_reason == "stop":
        try:
            calls = tool_calls_from_text(r.text)
        except ConfigError:
            calls = []
        message["content"] = None
    elif mode == "auto":
        content, calls = hermes_calls(r.text)
        if calls:
            message["content"] = content or None
    if calls and r.finish_reason == "stop":
        return {"message": {**message, "tool_calls": calls}, "finish_reason": "tool_calls"}
    return {"message": {**message, "content": r.text}, "finish_reason": r.finish_reason}


class HermesStream:
    """Auto-mode text as it streams -> (content delta, tool_call deltas). Text that could be the
    start of `<tool_call>` is held back until it cannot; a call is sent whole once its block
    closes (its arguments are known complete only then)."""

    def __init__(self) -> None:
        self.buffer = ""  # text not yet sent: a possible opening tag, or an open call block
        self.calls = 0

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content, deltas = "", cast(list[dict[str, Any]], [])
        while True:
            at = self.buffer.find(OPEN)
            if at < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, deltas
            content += self.buffer[:at]
            self.buffer = self.buffer[at:]
            end = self.buffer.find(CLOSE)
            if end < 0:
                return content, deltas  # inside a call: wait for it to close
            block, self.buffer = self.buffer[:end + len(CLOSE)], self.buffer[end + len(CLOSE):]
            call = _hermes_call(block[len(OPEN):-len(CLOSE)].strip())
            if call is None:
                content += block
            else:
                deltas.append({"index": self.calls, **call})
                self.calls += 1

    def finish(self) -> str:
        """What is left at the end (an unclosed block or a partial tag) is content."""
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


__all__ = ["HermesStream", "ToolCallStream", "hermes_calls", "reply"]
