"""TokenizerSpec: what a loader reads from a checkpoint's files and the Tokenizer runs.

The loaders (loaders.py, gguf_vocab.py) make one; tokenizer.py's Tokenizer takes one.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class TokenLookup(Protocol):
    """A vocabulary's text -> id (a dict, or a compact _vocabulary.Vocabulary)."""

    def get(self, text: str, /) -> int | None: ...


class TokenTextTable(Protocol):
    """A vocabulary's id -> text: a list, or a compact vocabulary's TokenTexts (GGUF)."""

    def __len__(self) -> int: ...

    def __getitem__(self, token_id: int, /) -> str: ...


class TokenModel(Protocol):
    """What the Tokenizer runs for every kind: one pre-token -> ids (bpe.BPE, wordpiece.WordPiece,
    sentencepiece.SentencePieceBPE)."""

    @property
    def vocab(self) -> TokenLookup: ...

    def encode_uncached(self, piece: str, /) -> list[int]: ...


class TextStream(Protocol):
    """Decoding piece texts one at a time: push(text) -> the new text; flush() -> the rest."""

    def push(self, text: str, /) -> str: ...

    def flush(self) -> str: ...


@runtime_checkable
class PieceModel(TokenModel, Protocol):
    """The model of kind "spm" (sentencepiece.SentencePieceBPE), which also decodes piece texts."""

    def token_bytes(self, text: str, /) -> bytes: ...

    def decode(self, texts: Iterable[str], /) -> str: ...

    def stream(self) -> TextStream: ...


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a loader reads from a checkpoint's files.

    model: a BPE or WordPiece (has encode_uncached and vocab); id_to_token: the model's token text by
    id. added: text -> id of tokens matched on the raw text before anything else (specials and
    user-defined tokens); special_ids: those that skip_special_tokens removes.
    """

    kind: str  # "bpe" (byte-level), "wordpiece" or "spm" (SentencePiece BPE: sentencepiece.py)
    model: TokenModel
    id_to_token: TokenTextTable  # a list, or a compact vocabulary's TokenTexts (GGUF)
    pre_tokenizer: Callable[[str], list[str]]
    normalizer: Callable[[str], str] | None = None
    added: dict[str, int] = field(default_factory=dict)
    # tokenizer.json's per-token matching options, for tokens that set any: text -> (lstrip,
    # rstrip, single_word). lstrip/rstrip: the token swallows the whitespace on that side;
    # single_word: it only matches where no word character touches it.
    added_options: dict[str, tuple[bool, bool, bool]] = field(default_factory=dict)
    special_ids: frozenset[int] = frozenset()
    # SentencePiece's prefix space (a Metaspace pre-tokenizer's prepend_scheme): "first" puts "▁"
    # before the text's first section, "always" before every section (the text between added
    # tokens), each only where the normalized section does not begin with "▁"; "never": none.
    prefix_space: str = "never"
    prefix_ids: tuple[int, ...] = ()  # added by encode(add_special_tokens=True)
    suffix_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # every token that ends generation besides eos_token_id (end_tokens.py): <|endoftext|>,
    # <|eot_id|>, <end_of_turn>, generation_config.json's list, ...
    end_token_ids: frozenset[int] = frozenset()
    pad_token_id: int | None = None
    chat_template: str | None = None
    model_max_length: int | None = None
    source: str = ""
    # fill-in-the-middle token ids the file names, by role ("pre", "suf", "mid", "pad", "rep",
    # "sep", "eot"; GGUF's tokenizer.ggml.*_token_id keys): see fim.py
    fim_ids: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.kind in ("bpe", "wordpiece", "spm"), self.kind
        assert self.prefix_space in ("first", "always", "never"), self.prefix_space
