"""Incremental detokenization for streaming: text only when its characters are complete.

A byte-level token can end in the middle of a UTF-8 character (one emoji is often 2-4 tokens).
Printing each token's bytes at once would show replacement characters; holding the whole output
until the end would defeat streaming. An incremental UTF-8 decoder keeps the unfinished tail and
emits everything before it, so the pieces pushed out join to exactly decode(ids).
"""

import codecs
from typing import Protocol

from scratchllm.tokenizer.spec import PieceModel, TextStream, TokenizerSpec


class DecodingTokenizer(Protocol):
    """What a Detokenizer calls on its tokenizer (tokenizer.Tokenizer)."""

    @property
    def spec(self) -> TokenizerSpec: ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    def id_to_token(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def wordpiece_text(self, token_id: int, first: bool) -> str: ...


class Detokenizer:
    """push(token_id) -> the new complete text (often '', sometimes several characters);
    flush() -> whatever is left at the end (a cut character becomes U+FFFD, as decode does)."""

    def __init__(self, tokenizer: DecodingTokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip: frozenset[int] = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._byte_level = tokenizer.spec.kind == "bpe"
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # SentencePiece pieces decode through their model's stream (byte pieces held per run).
        self._pieces: TextStream | None = None
        if tokenizer.spec.kind == "spm":
            model = tokenizer.spec.model
            assert isinstance(model, PieceModel), model  # what kind "spm" means
            self._pieces = model.stream()
        self._count = 0  # tokens emitted so far (WordPiece writes no space before the first)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._skip:
            return ""
        first = self._count == 0
        self._count += 1
        if self._pieces is not None:
            return self._pieces.push(self._tok.id_to_token(token_id))
        if self._byte_level:
            return self._utf8.decode(self._tok.token_bytes(token_id))
        return self._tok.wordpiece_text(token_id, first)

    def flush(self) -> str:
        if self._pieces is not None:
            return self._pieces.flush()
        return self._utf8.decode(b"", final=True)
