"""SentencePiece pieces: the "▁" space, byte pieces, and how piece texts decode. Shared by the
two ways such a vocabulary arrives: GGUF metadata (sentencepiece.py) and a tokenizer.json that
SentencePiece was converted to (spm_json.py).

decode: "▁" back to spaces; a run of byte pieces ("<0xE2>", "<0x82>", ...) joined into UTF-8 (a run
    that is no valid UTF-8 becomes one U+FFFD per byte, as `tokenizers`' ByteFallback decoder
    writes it); with `strip_first_space`, the one space a prefix "▁" put at the start of the text
    is taken off again (the Strip decoder of Llama's tokenizer.json, Metaspace's decoder).

The pre-tokenizer (WordSplit) cuts a text where no token can span the cut, so that merging the
parts gives the ids of merging the whole (SentencePiece merges the whole) while the Tokenizer's
cache sees words.
"""

import codecs
import re
from collections.abc import Iterable

import regex

from scratchllm.tokenizer.spec import TokenLookup

SPACE = "\u2581"  # ▁, SentencePiece's visible space
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_pieces() -> list[str]:
    """The texts of the 256 byte pieces, "<0x00>".."<0xFF>", by byte."""
    return [f"<0x{b:02X}>" for b in range(256)]


class PieceDecoding:
    """The decoding half of a SentencePiece model (spec.PieceModel): token_bytes, stream, decode."""

    strip_first_space = False  # the text's first character, a space, came from a prefix "▁": dropped

    def token_bytes(self, text: str) -> bytes:
        """One piece's bytes in decoded text: a byte piece its byte, any other its text with
        spaces for "▁"."""
        m = BYTE_PIECE.fullmatch(text)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return text.replace(SPACE, " ").encode("utf-8")

    def stream(self) -> "PieceStream":
        return PieceStream(self.strip_first_space)

    def decode(self, texts: Iterable[str]) -> str:
        stream = self.stream()
        return "".join(map(stream.push, texts)) + stream.flush()


class PieceStream:
    """Decoding piece by piece, for streaming: push(text) returns the new text. Byte pieces are
    held until the run ends (the next other piece, or flush()), because the reference decides a
    run's text from all its bytes at once."""

    def __init__(self, strip_first_space: bool = False) -> None:
        self._bytes = bytearray()
        self._at_start = strip_first_space  # nothing written yet, and a leading space is to go

    def push(self, text: str) -> str:
        m = BYTE_PIECE.fullmatch(text)
        if m is not None:
            self._bytes.append(int(m.group(1), 16))
            return ""
        return self.flush() + self._start(text.replace(SPACE, " "))

    def flush(self) -> str:
        run, self._bytes = bytes(self._bytes), bytearray()
        if not run:
            return ""
        try:
            return self._start(codecs.decode(run, "utf-8"))
        except UnicodeDecodeError:
            return self._start("\ufffd" * len(run))

    def _start(self, text: str) -> str:
        # at most one space, and only the text's very first character (Strip after Fuse)
        if self._at_start and text:
            self._at_start = False
            if text[0] == " ":
                return text[1:]
        return text


def normalize(text: str) -> str:
    return text.replace(" ", SPACE)


class WordSplit:
    """The pre-tokenizer: the normalized text cut before each "▁" that follows another character,
    where no token can span the cut.

    A merge spans a cut between the characters x and "▁" only if some token holds "x▁", for a
    character x that is a token of its own; one that is not becomes <0xNN> pieces, which might
    join anything after them, so no cut follows it either. Gemma's vocabulary has one token
    with "x▁" in it, ">▁</": no cut after ">"."""

    def __init__(self, vocab: TokenLookup, pieces: list[str]):
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
            if vocab.get(out[-1][-1]) is not None:
                out.append(part)
            else:  # after byte pieces: no cut
                out[-1] += part
        return out
