"""Our Tokenizer as llguidance sees it: the bytes of every token id, the EOS, and encode.

llguidance computes a grammar's token masks from each token's bytes, so it needs nothing from
transformers or tokenizers: we hand it our own vocabulary. Special tokens (EOS, <|im_start|>,
...) are written with a leading 0xFF byte, llguidance's marker for "not text": the grammar can
never spell them out of ordinary bytes, and only EOS is let through, when the grammar is done.

Building the trie takes about a second for a 49k vocabulary, so there is one per Tokenizer.
"""

import threading
import weakref
from collections.abc import Set
from typing import TYPE_CHECKING, Protocol, cast

from scratchllm.errors import ConfigError

if TYPE_CHECKING:
    import llguidance

    from scratchllm.tokenizer.protocol import TokenizerLike

# llguidance's marker byte for a special token (no UTF-8 text starts with 0xFF).
SPECIAL_MARKER = b"\xff"

_cache: "weakref.WeakKeyDictionary[TokenizerLike, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class ByteVocabulary(Protocol):
    """A tokenizer whose every token is a string of bytes: what the grammar masks are computed
    from (our byte-level BPE Tokenizer, and the fake engine's byte tokenizer, have it)."""

    @property
    def byte_level(self) -> bool: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def special_ids(self) -> Set[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class _Vocabulary:
    """The duck-typed tokenizer llguidance.LLTokenizer reads (its TokenizerWrapper's fields)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: "TokenizerLike") -> None:
        if not getattr(tokenizer, "byte_level", False):
            raise ConfigError(f"structured output needs a byte-level BPE tokenizer; {tokenizer!r} is not one")
        tok = cast(ByteVocabulary, tokenizer)  # a byte-level tokenizer has the rest of ByteVocabulary
        if tok.eos_token_id is None:
            raise ConfigError(f"structured output needs an end-of-sequence token; {tok!r} has none")
        self._tok = tok
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        specials = set(tok.special_ids) | {tok.eos_token_id}
        self.special_token_ids = sorted(specials)
        self.tokens = [SPECIAL_MARKER + tok.token_bytes(i) if i in specials else tok.token_bytes(i)
                       for i in range(tok.vocab_size)]

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance calls this to re-tokenize forced text; invalid UTF-8 cannot come from it
        # (it cuts at character boundaries), but replace rather than fail if it ever does.
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False)


def llg_tokenizer(tok: "TokenizerLike") -> "llguidance.LLTokenizer":
    """The llguidance.LLTokenizer for one of our Tokenizers (built once, then cached)."""
    import llguidance

    with _lock:
        cached = _cache.get(tok)
        if cached is None:
            vocabulary = cast(llguidance.TokenizerWrapper, _Vocabulary(tok))  # duck-typed: the fields it reads
            cached = llguidance.LLTokenizer(vocabulary, n_vocab=tok.vocab_size)
            # Invariant the masks rely on: llguidance's token ids are ours, one for one.
            assert cached.vocab_size == tok.vocab_size, (cached.vocab_size, tok.vocab_size)
            _cache[tok] = cached
        return cached
