"""A chat reply's parts: thinking, content and tool calls, from the text as it streams.

`ReplyParser` runs one choice's text through the reasoning splitter (reasoning.py, when the
template thinks) and then the tool-call parser (tool_parsers.py) of the request's plan:
  auto    the model decides, in its format (the chat template's, or --tool-call-parser), and
          unless --tool-call-parser is strict also as a call's bare JSON (tool_parsers.py);
  forced  the grammar wrote `{"name": ..., "arguments": {...}}` (tool_choice "required" or a
          named function): the whole reply is the call;
  none    text only.
The stream's deltas and the unstreamed message come from the same parser, so they agree. A call
cut by max_tokens is still a call (its arguments as far as they were written) and the choice
keeps finish_reason "length"; a reply that completed a call ends with "tool_calls".
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

from scratchllm.sampling import SamplingParams
from scratchllm.server.json_calls import Delta, assemble
from scratchllm.server.reasoning import ThinkMarkers, ThinkSplitter
from scratchllm.server.tool_parsers import TOOL_FORMATS, CallParser, ForcedCall, ToolFormat


@dataclass(frozen=True)
class ReplyFormat:
    """How a request's replies are read: `tools` (None: no calls) and `mode`, the markers the
    template thinks in (None: it does not think) and whether the prompt opened the thinking."""

    mode: str = "none"  # "none" | "auto" | "forced"
    tools: ToolFormat | None = None
    names: tuple[str, ...] = ()
    thinking: ThinkMarkers | None = None
    inside_thinking: bool = False
    lenient: bool = False  # auto-mode calls may also be bare JSON (tool_parsers.py); off: --tool-call-parser strict

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """The request's params for replies read this way: a format whose call or thinking
        markers are special tokens needs special tokens shown in the text."""
        if (self.tools is not None and self.tools.special_tokens) or (self.thinking and self.thinking.special):
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def parser(self) -> "ReplyParser":
        calls: CallParser | None = None
        if self.mode == "forced":
            calls = ForcedCall(self.names)
        elif self.mode == "auto" and self.tools is not None:
            calls = self.tools.new_parser(self.names, self.lenient)
        think = ThinkSplitter(self.thinking, self.inside_thinking) if self.thinking is not None else None
        return ReplyParser(calls, think)


class ReplyParser:
    """One choice's text -> delta parts: `reasoning_content`, `content`, `tool_calls`."""

    def __init__(self, calls: CallParser | None, think: ThinkSplitter | None) -> None:
        self.calls, self.think = calls, think
        self.made_calls = False

    def push(self, text: str) -> dict[str, Any]:
        reasoning, content = self.think.push(text) if self.think is not None else ("", text)
        return self._parts(reasoning, content, final=False)

    def finish(self, finish_reason: str) -> tuple[dict[str, Any], str]:
        """The parts the end releases, and the choice's finish_reason."""
        reasoning, content = self.think.finish() if self.think is not None else ("", "")
        parts = self._parts(reasoning, content, final=True)
        called = self.made_calls and finish_reason == "stop"
        return parts, "tool_calls" if called else finish_reason

    def _parts(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        deltas: list[Delta] = []
        if self.calls is not None:
            content, deltas = self.calls.push(content)
            if final:
                more, end = self.calls.finish()
                content, deltas = content + more, deltas + end
        self.made_calls = self.made_calls or bool(deltas)
        parts: dict[str, Any] = {}
        if reasoning:
            parts["reasoning_content"] = reasoning
        if content:
            parts["content"] = content
        if deltas:
            parts["tool_calls"] = deltas
        return parts


def message(fmt: ReplyFormat, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """The unstreamed reply's message and finish_reason: the stream's parts, joined."""
    parser = fmt.parser()
    first = parser.push(text)
    last, finish = parser.finish(finish_reason)
    joined = {key: first.get(key, "") + last.get(key, "") for key in ("reasoning_content", "content")}
    calls = assemble([*first.get("tool_calls", []), *last.get("tool_calls", [])])
    msg: dict[str, Any] = {"role": "assistant", "content": joined["content"] or (None if calls else "")}
    if fmt.thinking is not None:
        msg["reasoning_content"] = joined["reasoning_content"] or None
    if calls:
        msg["tool_calls"] = calls
    return msg, finish


def tool_format(name: str | None) -> ToolFormat | None:
    return TOOL_FORMATS[name] if name else None


__all__ = ["ReplyFormat", "ReplyParser", "message", "tool_format"]
