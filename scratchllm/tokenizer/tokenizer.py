"""The Tokenizer: text <-> ids for every model kind we read, behind one class.

encode: split out special tokens (never cut into pieces) -> normalize (and SentencePiece's
        prefix "▁") -> pre-tokenize -> model (BPE, SentencePiece or WordPiece) per piece -> add the
        model's BOS/CLS/SEP when asked.
decode: ids -> bytes per token -> UTF-8 text (byte-level), SentencePiece's pieces, or
        WordPiece's '##' joining.

Which normalizer, pre-tokenizer and model a checkpoint uses is read from its files by
scratchllm.tokenizer.loaders; this module only runs the pipeline.
"""
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsIndex

import regex

from scratchllm.errors import ConfigError
from scratchllm.tokenizer.added import AddedTokens
from scratchllm.tokenizer.bytelevel import bytelevel_to_bytes, text_to_bytelevel
from scratchllm.tokenizer.chat import render_chat
from scratchllm.tokenizer.detokenizer import Detokenizer
from scratchllm.tokenizer.fim import FimLayout, find_layout
from scratchllm.tokenizer.loaders import load_spec
from scratchllm.tokenizer.pieces import SPACE
from scratchllm.tokenizer.spec import PieceModel, TokenizerSpec
from scratchllm.tokenizer.wordpiece import WordPiece

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# Pre-tokens whose ids a tokenizer remembers; past this many, new ones are encoded but not stored.
CACHE_LIMIT = 200_000


class Tokenizer:
    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._model = spec.model
        pieces = spec.model if spec.kind == "spm" else None
        assert pieces is None or isinstance(pieces, PieceModel), pieces  # what kind "spm" means
        self._pieces = pieces  # the SentencePiece model, which decodes its own pieces
        self._byte_level = spec.kind == "bpe"
        self._id_to_token = spec.id_to_token
        self._added_by_id = {i: t for t, i in spec.added.items()}
        # Longest first so that '<|im_start|>' wins over any shorter special it begins with
        # (leftmost-longest, as tokenizers' Aho-Corasick matcher does).
        specials = sorted(spec.added, key=len, reverse=True)
        self._special_re: regex.Pattern[str] | AddedTokens | None
        if not specials:
            self._special_re = None
        elif spec.added_options:  # per-token matching options: one pattern each
            self._special_re = regex.compile("(" + "|".join(map(self._added_pattern, specials)) + ")")
        else:  # plain tokens (all GGUF ones): a scan, not a regex of thousands of alternatives
            self._special_re = AddedTokens(specials)
        self._token_bytes: dict[int, bytes] = {}  # filled token by token, as decoding meets them
        # Raw pre-token -> ids. (Keyed by the raw text: the byte-level form of ' ' is 'Ġ', which
        # is also a raw character of its own, so the two forms must not share one table.)
        self._piece_cache: dict[str, list[int]] = {}
        self.cache_limit = CACHE_LIMIT

    def _added_pattern(self, token: str) -> str:
        lstrip, rstrip, single_word = self.spec.added_options.get(token, (False, False, False))
        core: str = regex.escape(token)
        if single_word:
            core = rf"(?<!\w){core}(?!\w)"
        return (r"\s*" if lstrip else "") + core + (r"\s*" if rstrip else "")

    def _added_id(self, matched: str) -> int:
        added = self.spec.added
        if matched in added:
            return added[matched]
        # The match includes whitespace an lstrip/rstrip token swallowed.
        for core in (matched.lstrip(), matched.rstrip(), matched.strip()):
            if core in added:
                return added[core]
        raise AssertionError(f"special-token match {matched!r} names no added token")

    @classmethod
    def from_pretrained(cls, ref: str | Path, **options: Any) -> "Tokenizer":
        """ref: 'default', 'minilm', a .gguf, a folder with tokenizer.json or vocab.txt, a
        tokenizer.json, or a tiktoken rank file. `checkpoint=`: that model file already opened
        (formats.load_checkpoint), read instead of parsing its header again; see loaders.load_spec."""
        return cls(load_spec(ref, **options))

    # ---- facts -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return max(len(self._id_to_token), max(self._added_by_id, default=-1) + 1)

    @property
    def bos_token_id(self) -> int | None:
        return self.spec.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.spec.eos_token_id

    @property
    def end_token_ids(self) -> frozenset[int]:
        """Every token that ends generation: the EOS and the others the model file names
        (end_tokens.py: <|endoftext|>, <|eot_id|>, <end_of_turn>, generation_config.json's list)."""
        eos = self.spec.eos_token_id
        return self.spec.end_token_ids | ({eos} if eos is not None else set())

    @property
    def pad_token_id(self) -> int | None:
        return self.spec.pad_token_id

    @property
    def special_ids(self) -> frozenset[int]:
        return self.spec.special_ids

    @property
    def byte_level(self) -> bool:
        """Every token is a string of bytes (token_bytes): byte-level BPE, which grammars need."""
        return self._byte_level

    @property
    def model_max_length(self) -> int | None:
        return self.spec.model_max_length

    def token_to_id(self, token: str) -> int | None:
        if token in self.spec.added:
            return self.spec.added[token]
        return self._model.vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._added_by_id:
            return self._added_by_id[token_id]
        # A negative id would index from the end and decode to a wrong token without a word.
        if not 0 <= token_id < len(self._id_to_token):
            raise ConfigError(f"token id {token_id} is outside the vocabulary (ids 0..{self.vocab_size - 1})")
        return self._id_to_token[token_id]

    def __repr__(self) -> str:
        return f"Tokenizer({self.spec.kind}, vocab_size={self.vocab_size}, source={self.spec.source!r})"

    # ---- encode ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """text -> ids. Special tokens written in the text become their single id."""
        ids = list(self.spec.prefix_ids) if add_special_tokens else []
        if self._special_re is None:
            ids += self._encode_ordinary(text, True)
        else:
            # split with a group alternates text, special, text, ...: odd indices are specials.
            for i, part in enumerate(self._special_re.split(text)):
                if i % 2:
                    ids.append(self._added_id(part))
                elif part:
                    ids += self._encode_ordinary(part, i == 0)
        if add_special_tokens:
            ids += self.spec.suffix_ids
        return ids

    def _encode_ordinary(self, text: str, first: bool) -> list[int]:
        """One section of text between added tokens; `first`: it begins the text."""
        if self.spec.normalizer is not None:
            text = self.spec.normalizer(text)
        prefix = self.spec.prefix_space
        if prefix != "never" and text and (first or prefix == "always") and not text.startswith(SPACE):
            text = SPACE + text
        # Ids per raw pre-token: a word seen before costs one dict lookup, skipping the byte-level
        # translation and the merges (where nearly all the time goes).
        cache = self._piece_cache
        limit = self.cache_limit
        encode = self._model.encode_uncached
        byte_level = self._byte_level
        ids: list[int] = []
        for piece in self.spec.pre_tokenizer(text):
            cached = cache.get(piece)
            if cached is None:
                cached = encode(text_to_bytelevel(piece) if byte_level else piece)
                if len(cache) < limit:
                    cache[piece] = cached
            ids += cached
        return ids

    def clear_cache(self) -> None:
        self._piece_cache.clear()

    def encode_batch(self, texts: list[str], *, max_length: int | None = None, pad_id: int | None = None
                     ) -> "tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]":
        """For encoder models: (input_ids [B, T], attention_mask [B, T]) as int64 arrays, padded on
        the right to the longest text; texts longer than max_length (default model_max_length)
        are cut, keeping the closing special tokens (e.g. [SEP]) as tokenizers' truncation does."""
        max_length = max_length or self.spec.model_max_length
        pad = pad_id if pad_id is not None else (self.spec.pad_token_id or 0)
        rows = []
        for text in texts:
            ids = self.encode(text, add_special_tokens=True)
            if max_length is not None and len(ids) > max_length:
                keep = max_length - len(self.spec.suffix_ids)
                assert keep > len(self.spec.prefix_ids), "max_length leaves no room for text"
                ids = ids[:keep] + list(self.spec.suffix_ids)
            rows.append(ids)
        return pad_batch(rows, pad)

    # ---- decode ----------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """What one token contributes to byte-level decoded text (its own text for specials).
        Memoized one token at a time: converting the whole vocabulary up front made a process's
        first decode (the first request's first token) take 36 ms on the default model."""
        got = self._token_bytes.get(token_id)
        if got is not None:
            return got
        if token_id in self._added_by_id:
            return self._added_by_id[token_id].encode("utf-8")
        if not 0 <= token_id < len(self._id_to_token):
            self.id_to_token(token_id)  # raises the out-of-vocabulary error
        text = self._id_to_token[token_id]
        got = self._token_bytes[token_id] = \
            self._pieces.token_bytes(text) if self._pieces is not None else bytelevel_to_bytes(text)
        return got

    def wordpiece_text(self, token_id: int, first: bool) -> str:
        """One WordPiece token as the decoder writes it: '##ing' joins the word before it, other
        tokens follow a space; then tokenizers' cleanup pulls punctuation back (' .' -> '.')."""
        token = self.id_to_token(token_id)
        model = self._model
        assert isinstance(model, WordPiece), model  # only WordPiece tokens are written so
        prefix = model.prefix
        if not first:
            token = token[len(prefix):] if token.startswith(prefix) else " " + token
        for before, after in _CLEANUP:
            token = token.replace(before, after)
        return token

    def decode(self, ids: Iterable[SupportsIndex], skip_special_tokens: bool = False) -> str:
        ints = [int(i) for i in ids]
        if skip_special_tokens:
            ints = [i for i in ints if i not in self.spec.special_ids]
        if self._pieces is not None:
            return self._pieces.decode(map(self.id_to_token, ints))
        if self._byte_level:
            # Invalid UTF-8 (a cut multi-byte character) shows as U+FFFD, like tokenizers.
            return b"".join(self.token_bytes(i) for i in ints).decode("utf-8", errors="replace")
        return "".join(self.wordpiece_text(i, n == 0) for n, i in enumerate(ints))

    def detokenizer(self, skip_special_tokens: bool = False) -> Detokenizer:
        """Incremental decoding for streaming: push(id) returns only complete characters."""
        return Detokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---- fill-in-the-middle ----------------------------------------------------------------------
    def fim_layout(self) -> FimLayout:
        """This model's fill-in-the-middle layout (fim.py); FimUnsupported names what it lacks."""
        return find_layout(self, self.spec.fim_ids)

    # ---- chat --------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self.spec.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **extra: Any) -> str:
        """The messages as a prompt, by the model's chat template (or `chat_template` instead)."""
        source = chat_template or self.spec.chat_template
        if not source:
            raise ConfigError(f"{self.spec.source}: this tokenizer has no chat template")
        names = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id, "pad_token": self.pad_token_id}
        special_tokens = {k: self.id_to_token(v) for k, v in names.items() if v is not None}
        return render_chat(source, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=special_tokens, **extra)


# tokenizers' WordPiece decoder cleanup (what BERT's original decoder did), applied per token.
_CLEANUP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
    (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)


def pad_batch(rows: list[list[int]], pad_id: int = 0) -> "tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]":
    """Token-id lists -> input_ids [B, T] int64 (right-padded with pad_id), attention_mask [B, T]
    int64 (1 = real token)."""
    import numpy as np  # only batch encoding needs arrays; the tokenizer itself is pure Python

    width = max((len(r) for r in rows), default=0)
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(rows), width), dtype=np.int64)
    for b, ids in enumerate(rows):
        input_ids[b, : len(ids)] = ids
        attention_mask[b, : len(ids)] = 1
    return input_ids, attention_mask
