"""A reasoning model's thinking, kept apart from its answer: a thinking block at the start of a
reply becomes the message's `reasoning_content` (`delta.reasoning_content` when streamed), the
text after it the `content` (where tool calls are then looked for).

The block's markers are the chat template's: `<think>...</think>` where the template writes
`<think>` (Qwen3's), `[THINK]...[/THINK]` where it writes `[THINK]` (Magistral's, Mistral's
tokenizer v13 templates with thinking). Mistral's markers are special tokens, so a reply read
with them keeps special tokens in its text (as a tool format whose markers are ones does).
A template may also open the block in the prompt itself (the generation prompt ends in its
opening marker), and then the reply starts inside it. Qwen3's `chat_template_kwargs:
{"enable_thinking": false}` makes its template close an empty block in the prompt: the reply has
no thinking, and nothing is split. The newlines the templates put around the thinking
(`<think>\\n...\\n</think>\\n\\n`) are not part of either text. A reply cut inside its thinking
(max_tokens) has reasoning and no content.
"""

from dataclasses import dataclass

from scratchllm.server.tool_parsers import partial_suffix


@dataclass(frozen=True)
class ThinkMarkers:
    """The pair a template writes around a thinking block; `special`: they are special tokens,
    which a reply's text shows only when special tokens are kept."""

    opening: str
    closing: str
    special: bool = False


TAGS = ThinkMarkers("<think>", "</think>")  # Qwen3's: added tokens, shown like any text
BRACKETS = ThinkMarkers("[THINK]", "[/THINK]", special=True)  # Magistral's: control tokens


def template_thinks(template: str | None) -> ThinkMarkers | None:
    """The markers a chat template writes thinking blocks in; None: it writes none."""
    return next((m for m in (TAGS, BRACKETS) if template and m.opening in template), None)


def prompt_opens_thinking(prompt: str, markers: ThinkMarkers) -> bool:
    """Whether the rendered prompt ends inside an open thinking block."""
    return prompt.rfind(markers.opening) > prompt.rfind(markers.closing)


class ThinkSplitter:
    """A reply's text, as it streams -> (reasoning, content). `inside`: the prompt opened the block."""

    def __init__(self, markers: ThinkMarkers, inside: bool = False) -> None:
        self.opening, self.closing = markers.opening, markers.closing
        self.state = "think" if inside else "start"  # start -> think -> answer, or start -> answer
        self.buffer = ""
        self.held = ""  # the thinking's trailing whitespace, sent if more thinking follows
        self.thought = False  # any reasoning text sent yet
        self.closed = False  # a thinking block ended
        self.answered = False  # any content sent yet

    def push(self, text: str) -> tuple[str, str]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(self.opening):
                self.state, self.buffer = "think", head[len(self.opening):]
            elif not head or self.opening.startswith(head):
                return "", ""  # could still open a block
            else:
                self.state = "answer"
        if self.state == "think":
            at = self.buffer.find(self.closing)
            if at < 0:
                keep = partial_suffix(self.buffer, self.closing)
                thought, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return self._reasoning(thought), ""
            thought, self.buffer = self.buffer[:at], self.buffer[at + len(self.closing):]
            self.state, self.held, self.closed = "answer", "", True
            return self._reasoning(thought), self._answer()
        return "", self._answer()

    def finish(self) -> tuple[str, str]:
        """The reply ended: a held start or a cut closing marker is what it was."""
        if self.state == "start":
            self.state = "answer"
        if self.state == "think":
            rest, self.buffer = self.buffer, ""
            return self._reasoning(rest), ""
        return "", self._answer()

    def _reasoning(self, text: str) -> str:
        if not self.thought:
            text = text.lstrip()
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        self.thought = self.thought or bool(body)
        return body

    def _answer(self) -> str:
        text, self.buffer = self.buffer, ""
        if not self.answered and self.closed:
            text = text.lstrip()  # the newlines after the closing marker
        self.answered = self.answered or bool(text)
        return text
