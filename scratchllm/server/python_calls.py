"""Tool calls written as Python calls (Gemma's ```tool_code blocks): `name(key=value, ...)`,
one per line or as a list `[f(a=1), g(b=2)]`, arguments given by keyword as Python literals.

The block is parsed with `ast` (never run): each call's keyword values go through
ast.literal_eval, and the arguments are sent as their JSON (json.dumps), since the model wrote
no JSON to pass on. A call is sent whole once the block's end marker arrives. `print(f(...))`
is read as `f(...)`. A block that is not such calls (a positional argument, a variable, any
other statement) is no call, and the caller gives its text back as content. A block cut short
(max_tokens) sends its complete calls, and the cut one with the arguments complete so far,
written as JSON without its closing brace (the client sees a cut call).
"""

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from scratchllm.server.json_calls import Delta, arguments_delta, first_delta

Call = tuple[str, dict[str, Any]]
_CALL_START = re.compile(r"\s*(?:print\()?([A-Za-z_][\w.]*)\((.*)", re.DOTALL)


class PythonCallsReader:
    """The CallsReader interface (json_calls.py) over Python-call text ending at `end`."""

    def __init__(self, first_index: int, new_id: Callable[[], str], end: str) -> None:
        self.first_index, self.new_id, self.end = first_index, new_id, end
        self.body = ""
        self.calls = 0
        self.unread = ""
        self.done = False

    def feed(self, text: str) -> tuple[list[Delta], str | None]:
        if self.done:
            return [], text
        self.body += text
        at = self.body.find(self.end)
        if at < 0:
            return [], None
        self.done = True
        calls = parse_calls(self.body[:at])
        return self._deltas(calls or [], cut=None), self.body[at:]

    def finish(self) -> list[Delta]:
        if self.done:
            return []
        self.done = True
        lines = self.body.strip().splitlines()
        whole: list[Call] = []
        for i in range(len(lines), -1, -1):  # the longest run of complete lines that parses
            calls = parse_calls("\n".join(lines[:i]))
            if calls is not None:
                whole = calls
                break
        else:
            i = 0
        return self._deltas(whole, cut=_cut_call("\n".join(lines[i:])))

    def _deltas(self, calls: list[Call], cut: tuple[str, str] | None) -> list[Delta]:
        out: list[Delta] = []
        texts = [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
        for name, arguments in [*texts, *([cut] if cut else [])]:
            out.append(first_delta(self.first_index + self.calls, self.new_id(), name))
            out.append(arguments_delta(self.first_index + self.calls, arguments))
            self.calls += 1
        return out


def parse_calls(text: str) -> list[Call] | None:
    """[(name, arguments)] of every call in `text`, or None if it is anything but calls."""
    try:
        tree = ast.parse(text.strip())
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls: list[Call] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return None
        nodes = stmt.value.elts if isinstance(stmt.value, ast.List) else [stmt.value]
        for node in nodes:
            call = _call(node)
            if call is None:
                return None
            calls.append(call)
    return calls


def _call(node: ast.expr) -> Call | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" \
            and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            value = _jsonable(ast.literal_eval(kw.value))
            json.dumps(value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        args[kw.arg] = value
    return (name, args) if name else None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _jsonable(value: Any) -> Any:
    """Python literals as JSON values: tuples and sets are lists; dict keys must be strings."""
    if isinstance(value, (tuple, list, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a dict key that is not a string")
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, complex)):
        raise TypeError(type(value).__name__)
    return value


def _cut_call(text: str) -> tuple[str, str] | None:
    """(name, arguments so far as JSON without its closing brace) of a call cut short."""
    m = _CALL_START.match(text)
    if m is None:
        return None
    name, rest = m.group(1), m.group(2)
    commas = [i for i, ch in enumerate(rest) if ch == ","]
    for end in [len(rest), *reversed(commas)]:  # the longest run of arguments that parses
        for closer in ("", "'", '"'):  # a string cut short is closed where it was cut
            call = _call_expr(f"{name}({rest[:end]}{closer})")
            if call is not None:
                return name, json.dumps(call[1], ensure_ascii=False)[:-1]
    return name, "{"


def _call_expr(text: str) -> Call | None:
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return _call(tree.body)
