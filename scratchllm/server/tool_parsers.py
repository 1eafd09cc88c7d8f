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
               message of this format's own wording, see gemma_prompt.py).
The format is the one `--tool-call-parser` names, or the one the chat template itself writes
(detect()).

Small models often answer a tool request with the call's JSON alone, without their format's
markers: `{"name": ..., "arguments": {...}}` (or `"parameters"`), bare or in a ```json fence, or
a list of such objects. Read leniently (the default; `--tool-call-parser strict` turns it off),
hermes, mistral and gemma take such a reply as calls when it begins with that JSON and every
object names a tool the request declares; anything else (prose that mentions a tool, JSON of
another shape, a name the request did not declare) stays content. Llama 3's format is that JSON
already. Each parser turns the reply, as it streams, into content and `delta.tool_calls`
entries (json_calls.py reads the JSON ones); a reply's whole text through the same parser gives
the unstreamed reply, so the two always agree.

Whitespace around a call block is content only between two pieces of text: a reply
"Let me look.\n\n<tool_call>...</tool_call>" has content "Let me look.", and "A\n<call>\nB" has "A\nB".
"""

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scratchllm.server.json_calls import CallsReader, Delta, openai_call_id
from scratchllm.server.mistral_calls import MistralCallsReader
from scratchllm.server.python_calls import PythonCallsReader

Reader = CallsReader | MistralCallsReader | PythonCallsReader  # a call block's reader: feed, finish, calls, unread

FORMATS = ("hermes", "llama3_json", "mistral", "gemma")
PYTHON_TAG = "<|python_tag|>"
# A call's JSON written without the format's markers, at the reply's start (lenient reading):
# marker -> the marker that closes its block (None: the JSON's own end). Longest first.
LEADING = {"```json": "```", "```": "```", "{": None, "[": None}


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

    def __init__(self, names: Sequence[str] = (), new_id: Callable[[], str] = openai_call_id,
                 lenient: bool = False) -> None:
        self.names, self.new_id = names, new_id
        # lenient: a reply that begins with a call's bare JSON is calls (LEADING); tried once, at the start
        self.leading_open = lenient and not self.at_start
        self.block_close = self.close  # the marker that ends the call block being read
        self.leading_block = False  # the block being read is bare JSON at the reply's start
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

    def json_reader(self) -> CallsReader:
        """The reader of a call written as bare JSON: only a declared tool's name makes it a call."""
        return CallsReader(self.names, self.calls, self.new_id, declared_only=True)

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
            if self.leading_block:  # bare JSON is a call only once an object names a declared tool
                content += self._content(self._given_back(self.block) if not self.reader.calls
                                         else self.reader.unread)
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
        if self.leading_open:
            opened = self._leading()
            if opened is not False:
                return bool(opened)
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

    def _leading(self) -> bool | None:
        """At the reply's start: True when a call's bare JSON opens, None while the text could
        still be a marker, False when it is not one (and is then never looked for again)."""
        start = self.buffer.lstrip()
        markers = (*LEADING, *self.opens)
        if any(m.startswith(start) and m != start for m in markers):
            return None
        self.leading_open = False
        marker = next((m for m in LEADING if start.startswith(m)), None)
        if marker is None or any(start.startswith(m) for m in self.opens):  # the format's own markers win
            return False
        self._open(marker, self.buffer.index(marker), leading=True)
        return True

    def _open(self, marker: str, at: int, leading: bool = False) -> None:
        skip = at if marker in self.kept or (leading and LEADING[marker] is None) else at + len(marker)
        self.marker, self.buffer, self.block = marker, self.buffer[skip:], ""
        self.block_close, self.leading_block = LEADING[marker] if leading else self.close, leading
        # held whitespace waits: text may follow
        self.state, self.reader = "calls", self.json_reader() if leading else self.new_reader()

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
            content.append(self._content(self._given_back(read)))
            self.state, self.buffer = ("text" if self.at_start else "content"), rest
            return True
        self.after_call = True
        if self.reader.unread:
            content.append(self._content(self.reader.unread))
        self.state, self.buffer = "close", rest
        return True

    def _given_back(self, read: str) -> str:
        """A block that held no call, as the model wrote it: its opening marker, then what was read."""
        kept = self.marker in self.kept or LEADING.get(self.marker, "") is None
        return read if kept else self.marker + read

    def _at_close(self) -> bool:
        close = self.block_close
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

    def __init__(self, names: Sequence[str] = (), new_id: Callable[[], str] = mistral_call_id,
                 lenient: bool = False) -> None:
        super().__init__(names, new_id, lenient)

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

    def new_parser(self, names: Sequence[str], lenient: bool = False) -> CallParser:
        return self.parser(names, lenient=lenient)


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
