"""A SentencePiece BPE tokenizer from a GGUF file's metadata (`tokenizer.ggml.model = "llama"`).

    tokenizer.ggml.tokens      [str]    the pieces by id: "▁the" (U+2581 stands for a space), "<0x0A>"
    tokenizer.ggml.scores      [float]  the merge priority of each piece (higher first)
    tokenizer.ggml.token_type  [int]    1 normal, 2 unknown, 3 control (<bos>), 4 user-defined, 6 byte
    tokenizer.ggml.add_bos_token / add_eos_token, bos/eos/unknown/padding_token_id

What it does is what Hugging Face transformers builds from such a file for the Gemma family
(GemmaTokenizer from a GGUF), so that ids match that reference exactly:

encode: control tokens and user-defined tokens ("\\n", "\\t\\t", <start_of_turn>) are matched in the
    raw text first; the rest has its spaces written as "▁" (no prefix space: Gemma's files say
    add_space_prefix = false, and the reference reads no prefix for them either) and is merged
    as one piece: from single characters (a character that is no piece becomes its UTF-8 bytes'
    <0xNN> pieces), joining the adjacent pair whose joined text is the best piece, until none
    joins. "Best": the merge order of the joined piece. Gemma's scores do not follow the order its
    merges were learned in, the order of the pieces in the file does, so that order is the
    pieces' ids. Ties: the longer left half, then the leftmost pair (_sentencepiece.pyx). BOS per
    add_bos_token.

Read for the Gemma family only: other SentencePiece files take a prefix space on the text's
first piece (the reference's Metaspace, prepend "first") and strip it again when decoding; not
built here yet, so refused.
decode: "▁" back to spaces; a run of byte pieces joined into UTF-8 (a run that is no valid
    UTF-8 becomes one U+FFFD per byte, as `tokenizers`' ByteFallback decoder writes it).

Tokens of real spaces ("  ", which Gemma files store with spaces, not "▁") are read as "▁▁", as
the reference respells them, so that text with double spaces finds them.
"""

import codecs
import re
from collections.abc import Iterable, Mapping
from itertools import compress, count
from pathlib import Path
from typing import Any

import numpy as np
import regex

from scratchllm.errors import FormatError
from scratchllm.tokenizer._sentencepiece import PieceMerger
from scratchllm.tokenizer._vocabulary import TokenTexts, Vocabulary
from scratchllm.tokenizer.gguf_meta import meta_int, tokens_and_types
from scratchllm.tokenizer.spec import TokenizerSpec

SPACE = "\u2581"  # ▁, SentencePiece's visible space
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_BYTE = 1, 2, 3, 4, 6
# Architectures whose merge order is the order of the pieces in the file (the reference's Gemma builder).
ORDER_BY_POSITION = frozenset({"gemma", "gemma2", "gemma3"})
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class SentencePieceBPE:
    """The model of a TokenizerSpec of kind "spm": encode_uncached(normalized piece) -> ids, and
    the decoding of piece texts (decode, stream)."""

    def __init__(self, vocab: Vocabulary, order: np.ndarray, unk_id: int | None, max_length: int):
        """order: the merge order of each token as a pair's product (lower first); max_length:
        the longest token's length in characters."""
        self.vocab = vocab
        byte_ids = [vocab.get(f"<0x{b:02X}>", -1) for b in range(256)]
        order = np.ascontiguousarray(order, dtype=np.int64)
        assert order.shape == (vocab.size,)
        self._merger = PieceMerger(vocab, order, byte_ids, -1 if unk_id is None else int(unk_id), max_length)

    def encode_uncached(self, piece: str) -> list[int]:
        return self._merger.encode(piece)

    def token_bytes(self, text: str) -> bytes:
        """One piece's bytes in decoded text: a byte piece its byte, any other its text with
        spaces for "▁"."""
        m = _BYTE_PIECE.fullmatch(text)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return text.replace(SPACE, " ").encode("utf-8")

    def stream(self) -> "PieceStream":
        return PieceStream()

    def decode(self, texts: Iterable[str]) -> str:
        stream = PieceStream()
        return "".join(map(stream.push, texts)) + stream.flush()


class PieceStream:
    """Decoding piece by piece, for streaming: push(text) returns the new text. Byte pieces are
    held until the run ends (the next other piece, or flush()), because the reference decides a
    run's text from all its bytes at once."""

    def __init__(self) -> None:
        self._bytes = bytearray()

    def push(self, text: str) -> str:
        m = _BYTE_PIECE.fullmatch(text)
        if m is not None:
            self._bytes.append(int(m.group(1), 16))
            return ""
        return self.flush() + text.replace(SPACE, " ")

    def flush(self) -> str:
        run, self._bytes = bytes(self._bytes), bytearray()
        if not run:
            return ""
        try:
            return codecs.decode(run, "utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)


def normalize(text: str) -> str:
    return text.replace(" ", SPACE)


class WordSplit:
    """The pre-tokenizer: the normalized text cut before each "▁" that follows another character,
    where no token can span the cut, so that merging the parts gives the ids of merging the whole
    (the reference merges the whole) while the Tokenizer's cache sees words.

    A merge spans a cut between the characters x and "▁" only if some token holds "x▁", for a
    character x that is a token of its own; one that is not becomes <0xNN> pieces, which might
    join anything after them, so no cut follows it either. Gemma's vocabulary has one token
    with "x▁" in it, ">▁</": no cut after ">"."""

    def __init__(self, vocab: Vocabulary, pieces: list[str]):
        self._vocab = vocab
        joined = "\x00".join(pieces)
        if joined.count("\x00") == len(pieces) - 1:  # no piece holds NUL: find "x▁" in one pass, in C
            spanned = set(regex.findall(f"([^{SPACE}\x00]){SPACE}", joined))
        else:
            spanned = {p[k - 1] for p in pieces for k in range(1, len(p)) if p[k] == SPACE and p[k - 1] != SPACE}
        self._cut = regex.compile(f"(?<=[^{regex.escape(SPACE + ''.join(sorted(spanned)))}])(?={SPACE})")

    def __call__(self, text: str) -> list[str]:
        parts = self._cut.split(text)
        if len(parts) == 1:
            return parts if text else []
        vocab = self._vocab
        out = [parts[0]]
        for part in parts[1:]:
            if out[-1][-1] in vocab:
                out.append(part)
            else:  # after byte pieces: no cut
                out[-1] += part
        return out


def from_gguf_metadata(path: str | Path, meta: Mapping[str, Any]) -> TokenizerSpec:
    """The TokenizerSpec of a GGUF whose tokenizer.ggml.model is "llama"."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in ORDER_BY_POSITION:
        # Those files take a prefix space on the first piece only (Metaspace, prepend "first"),
        # and their decoder strips it again; not built here yet.
        raise FormatError(path, f"tokenizer.ggml.model 'llama' (SentencePiece) is read for the Gemma family "
                                f"only, not for architecture {arch!r}")
    tokens, types = tokens_and_types(meta, path)
    n = len(tokens)
    # Tokens of nothing but whitespace with a real space in them are stored with spaces ("  ");
    # they join text as "▁" runs (the reference respells them so).
    pieces = list(tokens)
    for i in compress(count(), map(str.isspace, tokens)):
        if " " in tokens[i]:
            pieces[i] = SPACE * len(tokens[i])
    vocab = Vocabulary(pieces)
    # The merge order of each product: its position in the file, the last one where a text is
    # listed twice (the one the vocabulary gives its id).
    order = np.arange(n, dtype=np.int64)
    bos: Any  # the file's values, whatever they are: checked here (int() refuses what is no number)
    eos: Any
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    unk, pad = meta.get("tokenizer.ggml.unknown_token_id"), meta.get("tokenizer.ggml.padding_token_id")
    for name, value in (("bos", bos), ("eos", eos), ("unknown", unk), ("padding", pad)):
        if value is not None and not 0 <= int(value) < n:
            raise FormatError(path, f"tokenizer.ggml.{name}_token_id {value} is outside the {n} tokens")
    if unk is None and (unk_id := vocab.get("<unk>")) is not None:
        unk = unk_id
    model = SentencePieceBPE(vocab, order, meta_int(unk), max(map(len, pieces), default=1))
    # Matched whole in the raw text: control pieces (special: skip_special_tokens drops them) and
    # user-defined ones as the vocabulary spells them (a stored "  " is not: it became "▁▁").
    control = list(compress(count(), map(GGUF_CONTROL.__eq__, types)))
    named = [int(v) for v in (bos, eos, unk, pad) if v is not None]
    special = frozenset(control + named)
    added = {pieces[i]: vocab[pieces[i]] for i in sorted(special)}
    for i in compress(count(), map(GGUF_USER_DEFINED.__eq__, types)):
        if pieces[i] == tokens[i]:
            added.setdefault(pieces[i], vocab[pieces[i]])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    return TokenizerSpec(
        kind="spm", model=model, id_to_token=TokenTexts(vocab), pre_tokenizer=WordSplit(vocab, pieces),
        normalizer=normalize,
        added=added, special_ids=special,
        prefix_ids=(int(bos),) if add_bos else (), suffix_ids=(int(eos),) if add_eos else (),
        bos_token_id=meta_int(bos), eos_token_id=meta_int(eos), pad_token_id=meta_int(pad),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=meta_int(meta.get(f"{arch}.context_length")),
        source=str(path),
    )
