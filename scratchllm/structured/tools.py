"""A forced tool call's output text -> the `tool_calls` entries of an OpenAI reply.

The grammar (GrammarCompiler.tool_call) makes the model write {"name": ..., "arguments": {...}};
OpenAI's reply carries the arguments as a JSON *string* inside
{"id", "type": "function", "function": {"name", "arguments"}}.
"""

import json
import uuid
from typing import Any

from scratchllm.errors import ConfigError


def tool_calls_from_text(text: str) -> list[dict[str, Any]]:
    """The call(s) in `text`; ConfigError if it is not a complete call (e.g. cut by max_tokens)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"the tool call is not complete JSON ({err.msg}); was it cut by max_tokens?") from None
    calls = data if isinstance(data, list) else [data]
    out: list[dict[str, Any]] = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
            raise ConfigError(f"a tool call must be an object with 'name' and 'arguments', got {text[:200]!r}")
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    return out


class ToolCallStream:
    """A forced call's text as it streams -> OpenAI `delta.tool_calls` entries.

    The grammar writes `{"name": "<name>", "arguments": <JSON>}` in exactly that order and
    spacing (grammar.JSON_OPTIONS), so once the prefix up to the arguments is complete the name is
    known, and every later character is argument text except the wrapper's closing brace, which
    is held back until the stream ends. push() returns the deltas the new text completes."""

    _HEAD = '{"name": '
    _ARGS = ', "arguments": '

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.buffer = ""
        self.sent = 0  # characters of the arguments text already sent
        self.name: str | None = None
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"

    def push(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        out: list[dict[str, Any]] = []
        if self.name is None:
            at = self.buffer.find(self._ARGS)
            if not self.buffer.startswith(self._HEAD[: len(self.buffer)]) or at < 0:
                return out
            self.name = json.loads(self.buffer[len(self._HEAD):at])
            self._start = at + len(self._ARGS)
            out.append({"index": self.index, "id": self.call_id, "type": "function",
                        "function": {"name": self.name, "arguments": ""}})
        args = self.buffer[self._start:-1]  # the last character may be the wrapper's closing brace
        if len(args) > self.sent:
            out.append({"index": self.index, "function": {"arguments": args[self.sent:]}})
            self.sent = len(args)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """At the end of the output: check the call is complete, send the rest of the arguments."""
        tool_calls_from_text(self.buffer)  # raises ConfigError on a cut-off call
        # a complete call holds the arguments prefix, so push() has named it already
        assert self.name is not None, self.buffer
        out: list[dict[str, Any]] = []
        args = self.buffer[self._start:].removesuffix("}")
        if len(args) > self.sent:
            out.append({"index": self.index, "function": {"arguments": args[self.sent:]}})
            self.sent = len(args)
        return out
