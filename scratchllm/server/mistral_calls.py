"""Mistral's tool calls: what follows one `[TOOL_CALLS]` marker, in either of the two forms its
chat templates write. The first character after the marker (spaces aside) tells them apart:

  list   `[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3's template): all the
         reply's calls after one marker, read by json_calls.CallsReader.
  named  `name[ARGS]{...}`, or `name[CALL_ID]id[ARGS]{...}` (the templates of Mistral's tokenizer
         v11 and later, as in Mistral Small 3.2): one call per marker, the next call after the
         next marker. `[ARGS]` and `[CALL_ID]` are special tokens, shown in the text as the
         marker is.

A named call is sent (its first delta) once the `{` of its arguments is read, then its
arguments as the model writes them; the `}` that closes them ends the call, and what follows is
the caller's. The id the model writes after `[CALL_ID]` is read past: each call gets a fresh id,
as in every format. Text that breaks the form before the `{` (a name with a space, no `[ARGS]`,
arguments that are not an object) is no call: `feed` gives all of it back, and the caller keeps
it as the model's text. `finish()` (max_tokens) sends a call cut short with its arguments as far
as they were written, once its name is known or completes to one tool (json_calls.complete_name).
"""

from collections.abc import Callable, Sequence

from scratchllm.server.json_calls import (
    CallsReader,
    Delta,
    JsonNesting,
    arguments_delta,
    complete_name,
    first_delta,
)

ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"


class MistralCallsReader:
    """The CallsReader interface (json_calls.py) over what follows one `[TOOL_CALLS]`."""

    def __init__(self, names: Sequence[str], first_index: int, new_id: Callable[[], str]) -> None:
        self.names, self.index, self.new_id = names, first_index, new_id
        self.listed: CallsReader | None = None  # the list form's reader, once the form is known
        self.state = "start"  # start -> name -> (id ->) args? -> args -> done; the named form
        self.head = ""  # the named call's text before its arguments, given back if it is no call
        self.name = ""
        self.marker = ""  # the characters of a marker being read ([ARGS] or [CALL_ID])
        self.nesting = JsonNesting()  # inside the arguments
        self.done = False

    @property
    def calls(self) -> int:
        """Calls sent so far (a named call is one once its first delta is out)."""
        if self.listed is not None:
            return self.listed.calls
        return int(self.state in ("args", "done"))

    @property
    def unread(self) -> str:
        return self.listed.unread if self.listed is not None else ""

    def feed(self, text: str) -> tuple[list[Delta], str | None]:
        """(deltas, rest): rest is None while every character was read as calls."""
        if self.listed is not None:
            return self.listed.feed(text)
        if self.done:
            return [], text
        out: list[Delta] = []
        arguments = ""  # the arguments text read in this piece, sent as one delta
        for i, ch in enumerate(text):
            if self.state == "args":
                arguments += ch
                self.nesting.step(ch)
                if self.nesting.closed:  # the object closed: the call is complete
                    self.state, self.done = "done", True
                    return self._sent(out, arguments), text[i + 1:]
                continue
            if self.state == "start":
                if ch.isspace():
                    continue
                if ch in "[{":
                    self.listed = CallsReader(self.names, self.index, self.new_id)
                    return self.listed.feed(text[i:])
                self.state = "name"
            if self.state == "args?":
                if ch == "{":
                    out.append(first_delta(self.index, self.new_id(), self.name))
                    self.state, arguments = "args", ch
                    self.nesting.step(ch)
                    continue
                if not ch.isspace():
                    return out, self._no_call(text[i:])
            elif not self._name_or_id(ch):
                return out, self._no_call(text[i:])
            self.head += ch
        return self._sent(out, arguments), None

    def finish(self) -> list[Delta]:
        """The end of the text: a call cut short is sent as far as it was written."""
        if self.listed is not None:
            return self.listed.finish()
        out: list[Delta] = []
        if self.state in ("name", "id", "args?"):
            name = complete_name(self.name, self.names) if self.state == "name" else self.name
            if name:
                out.append(first_delta(self.index, self.new_id(), name))
                self.state = "done"  # the call was sent
        self.done = True
        return out

    def _name_or_id(self, ch: str) -> bool:
        """Read one character of the name, the id, or a marker after them; False if it breaks
        the form."""
        if self.marker or ch == "[":
            self.marker += ch
            markers = (ARGS, CALL_ID) if self.state == "name" else (ARGS,)
            if self.marker in markers:
                self.state, self.marker = ("args?" if self.marker == ARGS else "id"), ""
                return True
            return any(m.startswith(self.marker) for m in markers)
        if self.state == "name":
            if not (ch.isalnum() or ch in "_-."):
                return False
            self.name += ch
            return True
        return ch.isalnum()  # the id: letters and digits

    def _sent(self, out: list[Delta], arguments: str) -> list[Delta]:
        if arguments:
            out.append(arguments_delta(self.index, arguments))
        return out

    def _no_call(self, rest: str) -> str:
        """The text broke the form before a call was sent: all of it is the caller's again."""
        assert self.calls == 0  # nothing was sent, so nothing needs taking back
        self.done = True
        return self.head + rest
