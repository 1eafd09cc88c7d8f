"""Tool calls written as JSON, read as the text streams in: `{"name": ..., "arguments": {...}}`
objects, alone, one after another (separated by `,` or `;`, as Llama 3.2 writes several), or
in a `[...]` array (Mistral's). `parameters` is read as `arguments` (Llama 3's key).

`CallsReader.feed(text)` returns OpenAI `delta.tool_calls` entries as soon as they are known:
a call's first entry (index, id, type, function.name) once its name string is complete, then
its arguments' text as the model writes it, character for character, so the deltas of one
call join to exactly the JSON text the model wrote (a client assembles them by `index`).
Arguments written before the name are held until the name is known. Arguments written as a
JSON string (`"arguments": "{\"a\": 1}"`) are sent decoded, once the string is complete.

The reader stops at the first character that cannot continue the calls outside an object (a
closing tag, prose): `feed` then returns that rest, and the caller decides what it is. Inside
an object a character that breaks JSON ends the reading the same way; an object that has sent
nothing yet is then given back as text (`unread`), so a block that only looked like a call
stays the model's text. `finish()` ends a text cut short (max_tokens): a call whose name is
complete is sent with the arguments written so far (incomplete JSON: the client sees a cut
call, with finish_reason "length"); a name cut short is completed when exactly one of the
request's tools starts with it (a forced call's grammar allows only those names).
"""

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Delta = dict[str, Any]
ARGUMENT_KEYS = ("arguments", "parameters")
_PRIMITIVE = frozenset("0123456789+-.eEtrufalsn")  # the characters of numbers, true, false, null


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class JsonNesting:
    """Where JSON text stands, character by character: inside a string or not, and how deep in
    containers. Enough to find where a value ends; what is between is not checked."""

    depth: int = 0
    in_string: bool = False
    escape: bool = False

    @property
    def closed(self) -> bool:
        """Outside every string and container: the value read so far is complete."""
        return not self.in_string and self.depth == 0

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


@dataclass
class _Object:
    """One call object being read: its key/value state machine at depth 1, and what it sent."""

    index: int
    state: str = "key?"  # key? -> key -> colon? -> value? -> value -> next?
    key: str = ""
    raw_key: str = ""
    nesting: JsonNesting = field(default_factory=JsonNesting)  # inside the current key or value
    value_kind: str = ""  # "container" | "string" | "primitive"
    value: str = ""  # the current value's text (name, string arguments, or held arguments)
    name: str | None = None
    name_prefix: str = ""  # a cut name's characters (finish)
    arguments: str | None = None  # argument text read so far (None: no arguments key yet)
    sent_arguments: int = 0  # characters of `arguments` already sent
    raw: str = ""  # every character of the object, for giving it back as text
    opened: bool = False  # the first delta (with the name) was sent


@dataclass
class CallsReader:
    """See the module doc. `names`: the tools the request offers (to complete a cut name);
    `first_index`: the index of the first call read (calls already sent before it);
    `new_id`: the format's call ids (Mistral's templates want 9 characters)."""

    names: Sequence[str] = ()
    first_index: int = 0
    new_id: Callable[[], str] = openai_call_id
    declared_only: bool = False  # an object naming no tool in `names` is not a call (a reply read leniently)
    calls: int = 0  # objects opened so far
    done: bool = False  # stopped: every later character is the caller's
    unread: str = ""  # an object's text given back when it turned out not to be a call
    _top: str = "start"  # start -> between (array or sequence); "array" while inside [...]
    _in_array: bool = False
    _obj: _Object | None = None

    @property
    def started(self) -> bool:
        """Whether any call object was opened (the text was calls, not prose)."""
        return self.calls > 0

    @property
    def in_object(self) -> bool:
        return self._obj is not None

    def feed(self, text: str) -> tuple[list[Delta], str | None]:
        """(deltas, rest): rest is None while every character was read as calls."""
        out: list[Delta] = []
        for i, ch in enumerate(text):
            if self.done:
                return out, text[i:]
            if self._obj is not None:
                if not self._object_char(self._obj, ch, out):
                    return out, self._broken(text[i:])
                continue
            if ch.isspace():
                continue
            if ch == "{":
                self._obj = _Object(self.first_index + self.calls, state="key?", raw="{")
                self.calls += 1
            elif ch == "[" and self._top == "start":
                self._in_array = True
            elif ch in ",;" and self._top == "between":
                pass
            elif ch == "]" and self._in_array:
                self.done = True
            else:
                self.done = True
                return out, text[i:]
            self._top = "between" if ch != "[" else "start"
        return out, None

    def finish(self) -> list[Delta]:
        """The end of the text: a call cut short is sent as far as it was written."""
        out: list[Delta] = []
        obj, self._obj = self._obj, None
        if obj is not None:
            if obj.name is None and obj.state == "value" and obj.key == "name":
                obj.name_prefix = obj.value[1:]  # after the opening quote
            if obj.name is None:
                obj.name = complete_name(obj.name_prefix, self.names)
            if obj.name is not None:
                if obj.state == "value" and obj.key in ARGUMENT_KEYS and obj.value_kind != "container":
                    obj.arguments = (obj.arguments or "") + obj.value  # a string or number cut short
                self._open(obj, out)
                self._send_arguments(obj, out)
            else:
                self.calls -= 1  # nothing was sent: it is not a call
        self.done = True
        return out

    # --- one object ----------------------------------------------------------------------
    def _object_char(self, obj: _Object, ch: str, out: list[Delta]) -> bool:
        """Read one character of an object; False if it breaks the JSON."""
        obj.raw += ch
        s = obj.state
        if s == "value":
            return self._value_char(obj, ch, out)
        if ch.isspace() and s != "key":
            return True
        if s == "key?":
            if ch == "}":  # `{}`, or a trailing comma: the object ends
                return self._close(obj, out)
            if ch != '"':
                return False
            obj.state, obj.raw_key, obj.nesting = "key", '"', JsonNesting(in_string=True)
        elif s == "key":
            obj.raw_key += ch
            obj.nesting.step(ch)
            if not obj.nesting.in_string:
                obj.key, obj.state = _loads(obj.raw_key), "colon?"
                if not isinstance(obj.key, str):
                    return False
        elif s == "colon?":
            if ch != ":":
                return False
            obj.state = "value?"
        elif s == "value?":
            obj.state, obj.value, obj.nesting = "value", "", JsonNesting()
            obj.value_kind = "container" if ch in "{[" else "string" if ch == '"' else "primitive"
            if obj.value_kind == "primitive" and ch not in _PRIMITIVE:
                return False
            obj.nesting.step(ch)
            return self._take(obj, ch, out)
        elif s == "next?":
            if ch == ",":
                obj.state = "key?"
            elif ch == "}":
                return self._close(obj, out)
            else:
                return False
        return True

    def _value_char(self, obj: _Object, ch: str, out: list[Delta]) -> bool:
        if obj.value_kind == "primitive":
            if ch in _PRIMITIVE:
                return self._take(obj, ch, out)
            if not self._end_value(obj, out):
                return False
            obj.state = "next?"
            obj.raw = obj.raw[:-1]  # _object_char reads it again, as what follows the value
            return self._object_char(obj, ch, out)
        obj.nesting.step(ch)
        if not self._take(obj, ch, out):
            return False
        if obj.nesting.closed:  # a container closed, or a string ended
            if not self._end_value(obj, out):
                return False
            obj.state = "next?"
        return True

    def _take(self, obj: _Object, ch: str, out: list[Delta]) -> bool:
        """One character of the current value: kept, or streamed when it is argument text."""
        if obj.key in ARGUMENT_KEYS and obj.value_kind == "container":
            obj.arguments = (obj.arguments or "") + ch
            if obj.opened:
                self._send_arguments(obj, out)
        else:
            obj.value += ch
        return True

    def _end_value(self, obj: _Object, out: list[Delta]) -> bool:
        if obj.key == "name":
            name = _loads(obj.value)
            if not isinstance(name, str) or not name or (self.declared_only and name not in self.names):
                return False
            obj.name = name
            self._open(obj, out)
            self._send_arguments(obj, out)
        elif obj.key in ARGUMENT_KEYS and obj.value_kind != "container":
            value = _loads(obj.value)
            if obj.value_kind == "string" and isinstance(value, str):
                obj.arguments = value
            else:
                obj.arguments = obj.value
            if obj.opened:
                self._send_arguments(obj, out)
        return True

    def _close(self, obj: _Object, out: list[Delta]) -> bool:
        self._obj = None
        if obj.name is None:  # a JSON object without a name is not a call: give it back
            self.calls -= 1
            self.unread += obj.raw
            return True
        if obj.arguments is None:
            obj.arguments = "{}"
        self._send_arguments(obj, out)
        return True

    def _open(self, obj: _Object, out: list[Delta]) -> None:
        if not obj.opened:
            assert obj.name is not None  # a call opens once its name is known
            obj.opened = True
            out.append(first_delta(obj.index, self.new_id(), obj.name))

    def _send_arguments(self, obj: _Object, out: list[Delta]) -> None:
        if obj.opened and obj.arguments is not None and len(obj.arguments) > obj.sent_arguments:
            out.append(arguments_delta(obj.index, obj.arguments[obj.sent_arguments:]))
            obj.sent_arguments = len(obj.arguments)

    def _broken(self, rest: str) -> str:
        """The JSON broke inside an object: what was sent stands; an unsent object is text again."""
        obj, self._obj = self._obj, None
        self.done = True
        assert obj is not None
        if obj.opened:
            return rest[1:]  # the breaking character was read into the call
        self.calls -= 1
        return obj.raw[:-1] + rest


def first_delta(index: int, call_id: str, name: str) -> Delta:
    """A call's first stream entry: its index, id, type and name, with empty arguments."""
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def arguments_delta(index: int, text: str) -> Delta:
    """More of a call's arguments text, in the stream."""
    return {"index": index, "function": {"arguments": text}}


def complete_name(prefix: str, names: Sequence[str]) -> str | None:
    """A name cut short: the one request tool that starts with it (None: none, or several)."""
    matches = [n for n in names if n.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def assemble(deltas: Sequence[Delta]) -> list[dict[str, Any]]:
    """Stream deltas joined into whole OpenAI tool calls, as a client assembles them."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call["id"] = d.get("id", call["id"])
        fn = d.get("function", {})
        call["function"]["name"] += fn.get("name", "")
        call["function"]["arguments"] += fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]
