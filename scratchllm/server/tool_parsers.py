"""Tool calls in a model's own words: one parser per format the model families write them in.

  hermes       Hermes, Qwen 2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
               blocks anywhere in the reply, one call each; text around them is content.
  llama3_json  Llama 3.1-3.3: a reply that is JSON, `{"name": ..., "parameters": {...}}` (after
               `<|python_tag|>` when the model writes it), several separated by `;`; a reply that
               does not begin that way is content.
  mistral      Mistral: `[TOOL_CALLS]`, then a JSON list `[{"name": ..., "arguments": {...}}, ...]`
               (Mistral 7B v0.3), or one call `name[ARGS]{...}` per marker, one after another (the
               templates of tokenizer v11 and later; v11's writes `name[CALL_ID]id[ARGS]{...}`);
               mistral_calls.py tells the two apart. Text before the first marker is content. The
               markers are special tokens: the request's text keeps special tokens for them.
  gemma        Gemma: a fenced block ```tool_code with Python calls, `name(key=literal, ...)`, one
               per line (Gemma's template does not read `tools`; the server shows them in a system
               message of this format's own wording, see GemmaFormat.tool_prompt).
The format is the one `--tool-call-parser` names, or the one the chat template itself writes
(detect()). Each parser turns the reply, as it streams, into content and `delta.tool_calls`
entries (json_calls.py reads the JSON ones); a reply's whole text through the same parser gives
the unstreamed reply, so the two always agree.

Whitespace around a call block is content only between two pieces of text: a reply
"Let me look.\n\n<tool_call>...</tool_call>" has content "Let me look.", and "A\n<call>\nB" has "A\nB".
"""

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from scratchllm.server.json_calls import CallsReader, Delta, openai_call_id
from scratchllm.server.mistral_calls import MistralCallsReader
from scratchllm.server.python_calls import PythonCallsReader

Reader = CallsReader | MistralCallsReader | PythonCallsReader  # a call block's reader: feed, finish, calls, unread

FORMATS = ("hermes", "llama3_json", "mistral", "gemma")
PYTHON_TAG = "<|python_tag|>"


def detect(template: str | None) -> str | None:
    """The format a chat template writes its assistant tool calls in (None: it names none)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if PYTHON_TAG in template or ('"parameters"' in template and "<|start_header_id|>" in template):
        return "llama3_json"
    if "<start_of_turn>" in template:
        return "gemma"
    return None


def mistral_call_id() -> str:
    """Mistral's templates refuse a tool call id that is not 9 letters and digits."""
    return uuid.uuid4().hex[:9]


class CallParser:
    """A reply's text -> (content, tool-call deltas), as it streams: push() each piece, then
    finish() once. Content is held back while it could still be the start of a call block.

    opens: the markers a call block begins with; a marker in `kept` is also the first
    character of the calls (Llama 3's `{`). close: the marker that ends a block (None: the
    calls' own end does). at_start: calls may only begin the reply (Llama 3)."""

    opens: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    close: str | None = None
    at_start: bool = False

    def __init__(self, names: Sequence[str] = (), new_id: Callable[[], str] = openai_call_id) -> None:
        self.names, self.new_id = names, new_id
        self.state = "content"  # content -> calls -> close -> content ...; "text": no calls any more
        self.buffer = ""  # text not yet decided
        self.block = ""  # a call block's text read so far (given back if it is no call)
        self.marker = ""
        self.reader: Reader | None = None
        self.calls = 0
        self.held = ""  # content's trailing whitespace, sent only if more content follows
        self.after_call = False

    def new_reader(self) -> Reader:
        return CallsReader(self.names, self.calls, self.new_id)

    def push(self, text: str) -> tuple[str, list[Delta]]:
        self.buffer += text
        content: list[str] = []
        deltas: list[Delta] = []
        while self.buffer and self._step(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[Delta]]:
        """The reply ended: a call cut short is sent as far as written; a cut closing marker is
        dropped, a cut opening marker is the model's text."""
        content, deltas = self.push("")
        if self.state == "calls":
            assert self.reader is not None
            deltas += self.reader.finish()
            self.calls += self.reader.calls
        elif self.state in ("content", "text"):  # what only looked like a marker's start is text
            content += self._content(self.buffer)
        self.buffer = ""
        if not self.calls:
            content += self.held
        self.held = ""
        return content, deltas

    # --- the state machine ---------------------------------------------------------------
    def _step(self, content: list[str], deltas: list[Delta]) -> bool:
        """Move on through the buffer; False when it must wait for more text."""
        if self.state == "text":
            content.append(self._content(self.buffer))
            self.buffer = ""
            return False
        if self.state == "content":
            return self._in_content(content)
        if self.state == "calls":
            return self._in_calls(content, deltas)
        return self._at_close()

    def _in_content(self, content: list[str]) -> bool:
        if self.at_start:
            start = self.buffer.lstrip()
            marker = next((m for m in self.opens if start.startswith(m)), None)
            if marker is None:
                if start and any(m.startswith(start) for m in self.opens):
                    return False  # could still be a marker
                if start:
                    self.state = "text"
                return bool(start)
            self._open(marker, self.buffer.index(marker))
            return True
        found = [(at, m) for m in self.opens if (at := self.buffer.find(m)) >= 0]
        if not found:
            keep = max((partial_suffix(self.buffer, m) for m in self.opens), default=0)
            content.append(self._content(self.buffer[:len(self.buffer) - keep]))
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        at, marker = min(found)
        content.append(self._content(self.buffer[:at]))
        self._open(marker, at)
        return True

    def _open(self, marker: str, at: int) -> None:
        skip = at if marker in self.kept else at + len(marker)
        self.marker, self.buffer, self.block = marker, self.buffer[skip:], ""
        self.state, self.reader = "calls", self.new_reader()  # held whitespace waits: text may follow

    def _in_calls(self, content: list[str], deltas: list[Delta]) -> bool:
        assert self.reader is not None
        got, rest = self.reader.feed(self.buffer)
        deltas += got
        self.block += self.buffer
        self.buffer = ""
        if rest is None:
            return False
        read = self.block[:len(self.block) - len(rest)]
        self.calls += self.reader.calls
        if not self.reader.calls:  # it only looked like a call block: the text stays the model's
            opened = "" if self.marker in self.kept else self.marker
            content.append(self._content(opened + read))
            self.state, self.buffer = ("text" if self.at_start else "content"), rest
            return True
        self.after_call = True
        if self.reader.unread:
            content.append(self._content(self.reader.unread))
        self.state, self.buffer = "close", rest
        return True

    def _at_close(self) -> bool:
        close = self.close
        if close is None or self.buffer.startswith(close):
            self.buffer = self.buffer[len(close or ""):]
            self.state = "text" if self.at_start else "content"
            return True
        if close.startswith(self.buffer):
            return False  # the closing marker is still coming
        self.state = "text" if self.at_start else "content"  # no closing marker: the rest is content
        return True

    def _content(self, text: str) -> str:
        """Content, less whitespace right after a call block; trailing whitespace held back."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body


class HermesFormat(CallParser):
    opens, close = ("<tool_call>",), "</tool_call>"


class MistralFormat(CallParser):
    opens = ("[TOOL_CALLS]",)

    def __init__(self, names: Sequence[str] = (), new_id: Callable[[], str] = mistral_call_id) -> None:
        super().__init__(names, new_id)

    def new_reader(self) -> MistralCallsReader:
        return MistralCallsReader(self.names, self.calls, self.new_id)


class Llama3JsonFormat(CallParser):
    opens, kept, at_start = (PYTHON_TAG, "{"), ("{",), True


class GemmaFormat(CallParser):
    opens, close = ("```tool_code",), "```"

    def new_reader(self) -> PythonCallsReader:
        return PythonCallsReader(self.calls, self.new_id, end="```")


class ForcedCall(CallParser):
    """A call the grammar forces (tool_choice "required" or a named function): the whole reply
    is `{"name": ..., "arguments": ...}`, never content."""

    opens, kept, at_start = ("{",), ("{",), True


@dataclass(frozen=True)
class ToolFormat:
    """A format: its parser, and whether it needs special tokens shown in the text."""

    name: str
    parser: type[CallParser]
    special_tokens: bool = False  # the reply's text must keep special tokens (the markers are ones)

    def new_parser(self, names: Sequence[str]) -> CallParser:
        return self.parser(names)


TOOL_FORMATS = {
    "hermes": ToolFormat("hermes", HermesFormat),
    "llama3_json": ToolFormat("llama3_json", Llama3JsonFormat),
    "mistral": ToolFormat("mistral", MistralFormat, special_tokens=True),
    "gemma": ToolFormat("gemma", GemmaFormat),
}
assert tuple(TOOL_FORMATS) == FORMATS


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def gemma_tool_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system text that shows Gemma the tools and how to call them (its template has no
    place for tools). Written for this server; the calls it asks for are GemmaFormat's."""
    import json

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
    import json

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
