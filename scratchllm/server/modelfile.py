"""Ollama's Modelfile, read: the instructions `ollama create -f Modelfile` takes, as the fields of
Ollama's /api/create request they stand for.

    FROM model-or-path           the model it is made from (a name, a reference, a GGUF path)
    SYSTEM text                  the system prompt
    TEMPLATE text                a chat template
    PARAMETER name value         a sampling option by Ollama's name (`stop` may repeat)
    MESSAGE role content         an earlier turn (role: system, user or assistant)
    LICENSE text                 read, not used
    # a comment

Instructions are case-insensitive; a value between three double quotes on each side may span
lines, one in double quotes is one line. ADAPTER (a LoRA) is refused: this server has no adapters. Anything else is
an error naming its line.
"""

import json
import re
from typing import Any

from scratchllm.server.errors import bad_request

INSTRUCTION = re.compile(r"^\s*([A-Za-z]+)\s+(.*)$", re.S)
ROLES = ("system", "user", "assistant")


def _value(text: str) -> Any:
    """A PARAMETER's value: an integer, a number, true/false, else the text."""
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        try:
            value: str = json.loads(text)
            return value
        except ValueError:
            return text[1:-1]
    return text


def _statements(text: str) -> list[tuple[int, str]]:
    """(line number, statement) with triple-quoted values joined across lines."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line, start = lines[i], i + 1
        if line.count('"""') == 1:
            while i + 1 < len(lines):
                i += 1
                line += "\n" + lines[i]
                if '"""' in lines[i]:
                    break
            else:
                raise bad_request(f"Modelfile line {start}: a \"\"\" value is never closed", param="modelfile")
        out.append((start, line))
        i += 1
    return out


def parse(text: str) -> dict[str, Any]:
    """A Modelfile -> {"from", "system", "template", "license", "parameters", "messages"} (those it
    sets), or a 400 naming the line at fault."""
    out: dict[str, Any] = {}
    parameters: dict[str, Any] = {}
    messages: list[dict[str, str]] = []
    for number, line in _statements(text):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = INSTRUCTION.match(line)
        if match is None:
            raise bad_request(f"Modelfile line {number}: expected an instruction and its value, got {line!r}",
                              param="modelfile")
        command, rest = match.group(1).upper(), match.group(2)
        value = rest.strip()[3:-3] if rest.strip().startswith('"""') else _unquote(rest)
        if command in ("FROM", "SYSTEM", "TEMPLATE", "LICENSE"):
            out[command.lower()] = value.strip("\n") if command != "FROM" else value.strip()
        elif command == "PARAMETER":
            name, _, raw = rest.strip().partition(" ")
            if not raw.strip():
                raise bad_request(f"Modelfile line {number}: PARAMETER needs a name and a value", param="modelfile")
            parsed = _value(_unquote(raw))
            if name == "stop":
                parameters.setdefault("stop", []).append(str(_unquote(raw)))
            else:
                parameters[name] = parsed
        elif command == "MESSAGE":
            role, _, content = rest.strip().partition(" ")
            if role.lower() not in ROLES:
                raise bad_request(f"Modelfile line {number}: MESSAGE role must be one of {', '.join(ROLES)}, "
                                  f"got {role!r}", param="modelfile")
            messages.append({"role": role.lower(), "content": _unquote(content)})
        elif command == "ADAPTER":
            raise bad_request(f"Modelfile line {number}: ADAPTER (a LoRA adapter) is not supported by this server",
                              param="modelfile")
        else:
            raise bad_request(f"Modelfile line {number}: unknown instruction {command}; the instructions: FROM, "
                              "SYSTEM, TEMPLATE, PARAMETER, MESSAGE, LICENSE", param="modelfile")
    if parameters:
        out["parameters"] = parameters
    if messages:
        out["messages"] = messages
    return out
