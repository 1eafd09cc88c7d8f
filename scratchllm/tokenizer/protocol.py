"""The contract between a tokenizer and the engine and server above it, as code.

What engine/ and server/ call on a tokenizer, nothing more: ids <-> text, the streaming
detokenizer the engine's output path pushes each token through, the chat template, the
vocabulary size, the end-of-sequence id and every id that ends generation. Our Tokenizer
(tokenizer.py) and the fake engine's byte tokenizer (engine/fake.py) both satisfy it.
"""

from collections.abc import Sequence
from typing import Any, Protocol


class IncrementalDetokenizer(Protocol):
    """Push a token id, get back the text it completes (only whole UTF-8 characters)."""

    def push(self, token_id: int) -> str: ...


class TokenizerLike(Protocol):
    """What engine/ and server/ call on a tokenizer (see the module doc)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def end_token_ids(self) -> frozenset[int]: ...  # every token that ends generation, the EOS among them

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def detokenizer(self, skip_special_tokens: bool = ...) -> IncrementalDetokenizer: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = ...) -> str: ...
