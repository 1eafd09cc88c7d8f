"""A forced tool call's output text -> the `tool_calls` entries of an OpenAI reply.

The grammar (GrammarCompiler.tool_call) makes the model write {"name": ..., "arguments": {...}};
OpenAI's reply carries the arguments as a JSON *string* inside
{"id", "type": "function", "function": {"name", "arguments"}}.
"""

import json
import uuid

from scratchllm.errors import ConfigError


def tool_calls_from_text(text: str) -> list[dict]:
    """The call(s) in `text`; ConfigError if it is not a complete call (e.g. cut by max_tokens)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"the tool call is not complete JSON ({err.msg}); was it cut by max_tokens?") from None
    calls = data if isinstance(data, list) else [data]
    out = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
            raise ConfigError(f"a tool call must be an object with 'name' and 'arguments', got {text[:200]!r}")
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    return out
