"""A reasoning model's thinking, kept apart from its answer: `<think>...</think>` at the start of
a reply becomes the message's `reasoning_content` (`delta.reasoning_content` when streamed),
the text after it the `content` (where tool calls are then looked for).

It is on when the model's chat template writes `<think>` (Qwen3's does); a template may also
open the block in the prompt itself (the generation prompt ends in `<think>`), and then the
reply starts inside it. Qwen3's `chat_template_kwargs: {"enable_thinking": false}` makes its
template close an empty block in the prompt: the reply has no thinking, and nothing is split.
The newlines the templates put around the thinking (`<think>\\n...\\n</think>\\n\\n`) are not
part of either text. A reply cut inside its thinking (max_tokens) has reasoning and no content.
"""

from scratchllm.server.tool_parsers import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template: str | None) -> bool:
    """Whether a chat template writes thinking blocks."""
    return bool(template) and OPEN in str(template)


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` block."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ThinkSplitter:
    """A reply's text, as it streams -> (reasoning, content). `inside`: the prompt opened the block."""

    def __init__(self, inside: bool = False) -> None:
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
            if head.startswith(OPEN):
                self.state, self.buffer = "think", head[len(OPEN):]
            elif not head or OPEN.startswith(head):
                return "", ""  # could still open a block
            else:
                self.state = "answer"
        if self.state == "think":
            at = self.buffer.find(CLOSE)
            if at < 0:
                keep = partial_suffix(self.buffer, CLOSE)
                thought, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return self._reasoning(thought), ""
            thought, self.buffer = self.buffer[:at], self.buffer[at + len(CLOSE):]
            self.state, self.held, self.closed = "answer", "", True
            return self._reasoning(thought), self._answer()
        return "", self._answer()

    def finish(self) -> tuple[str, str]:
        """The reply ended: a held start or a cut closing tag is what it was."""
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
            text = text.lstrip()  # the newlines after </think>
        self.answered = self.answered or bool(text)
        return text
