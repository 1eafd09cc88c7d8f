"""Gemma's tools: its chat template has no place for them, so the server shows them in a system
message of its own wording and rewrites earlier calls and results into Gemma's turns. The calls
the wording asks for are GemmaFormat's (tool_parsers.py): a ```tool_code block of Python calls."""

import json
from collections.abc import Sequence
from typing import Any


def gemma_tool_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system text that shows Gemma the tools and how to call them (its template has no
    place for tools). Written for this server; the calls it asks for are GemmaFormat's."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call the functions below. To call them, reply with nothing but a block like\n"
            "```tool_code\nfunction_name(argument=value, other=value)\n```\n"
            "with one call per line and every argument given by name as a Python literal. "
            "A function's result comes back in a ```tool_output block.\n\nFunctions (JSON):\n" + listed)


def gemma_messages(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation for Gemma's template, which knows only user and model turns: the tools in
    a system message (the template puts it before the first user turn), earlier calls as
    ```tool_code blocks of the assistant's, results as ```tool_output blocks in user turns, and
    turns of one role in a row joined (the template refuses two in a row)."""
    out: list[dict[str, Any]] = []
    system = gemma_tool_prompt(tools)
    for m in messages:
        role, text = m["role"], m.get("content") or ""
        if role == "system":
            system = f"{text}\n\n{system}"
            continue
        if role == "assistant" and m.get("tool_calls"):
            lines = [f"{c['function']['name']}({_python_kwargs(c['function']['arguments'])})" for c in m["tool_calls"]]
            text = (text + "\n" if text else "") + "```tool_code\n" + "\n".join(lines) + "\n```"
        elif role == "tool":
            role, text = "user", "```tool_output\n" + (text if isinstance(text, str) else json.dumps(text)) + "\n```"
        if out and out[-1]["role"] == role:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + text}
        else:
            out.append({"role": role, "content": text})
    return [{"role": "system", "content": system}, *out]


def _python_kwargs(arguments: Any) -> str:
    """A call's arguments (a mapping; text that is not one is passed as `arguments=`) as keywords."""
    if not isinstance(arguments, dict):
        return f"arguments={arguments!r}"
    return ", ".join(f"{k}={v!r}" for k, v in arguments.items())
