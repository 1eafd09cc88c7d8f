"""BERT's tokenizer: clean and lower-case the text, split on spaces and punctuation, then cut each
word greedily into the longest vocabulary pieces ('playing' -> 'play', '##ing').

Follows Hugging Face `tokenizers` (BertNormalizer, BertPreTokenizer, WordPiece), which is what
sentence-transformers runs for all-MiniLM-L6-v2.
"""

import unicodedata

import regex

# Code point ranges BERT treats as CJK ideographs: each becomes a word of its own, because
# Chinese has no spaces and the vocabulary holds single characters.
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B920, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)

# Unicode White_Space (what Rust's char::is_whitespace tests); str.isspace() also accepts
# U+001C..U+001F, which BERT removes as control characters instead.
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
    "\u200a\u2028\u2029\u202f\u205f\u3000"
)


_CJK_CLASS = "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in _CJK_RANGES)
_CJK = regex.compile(f"([{_CJK_CLASS}])")
# Removed by clean_text: NUL, U+FFFD and every other control/format/unassigned character (C*).
# Tab, newline and carriage return are C* too but count as whitespace, so they become spaces first.
_CONTROL = regex.compile(r"[\x00\ufffd\p{C}]")
_TO_SPACE = {ord(c): " " for c in _WHITESPACE}
_NONSPACING_MARK = regex.compile(r"\p{Mn}")
# A word is a run of anything but whitespace and punctuation; each punctuation character stands
# alone. Punctuation is Unicode P* plus ASCII's symbols ('$', '+', '^', ...), which Unicode files
# under S* but BERT splits off too.
_PUNCT_CLASS = r"\p{P}!-/:-@\[-`{-~"
_WS_CLASS = "".join(f"\\u{ord(c):04x}" for c in sorted(_WHITESPACE))
_WORD_OR_PUNCT = regex.compile(f"[^{_WS_CLASS}{_PUNCT_CLASS}]+|[{_PUNCT_CLASS}]")


def bert_normalize(text: str, *, lowercase: bool = True, strip_accents: bool | None = None,
                   clean_text: bool = True, handle_chinese_chars: bool = True) -> str:
    """The BertNormalizer steps in tokenizers' order: clean, space out CJK, strip accents, lower.
    Each step is one regex or translate pass over the whole text (C speed, no Python loop per char)."""
    if clean_text:
        text = _CONTROL.sub("", text.replace("\t", " ").replace("\n", " ").replace("\r", " "))
        text = text.translate(_TO_SPACE)
    if handle_chinese_chars and not text.isascii():
        text = _CJK.sub(r" \1 ", text)
    # Accents go with lower-casing unless the config says otherwise (strip_accents null).
    if (lowercase if strip_accents is None else strip_accents) and not text.isascii():
        text = _NONSPACING_MARK.sub("", unicodedata.normalize("NFD", text))
    if lowercase:
        text = text.lower()
    return text


def bert_pre_tokenize(text: str) -> list[str]:
    """Split on whitespace (dropped) and around every punctuation character (kept alone)."""
    words: list[str] = _WORD_OR_PUNCT.findall(text)
    return words


class WordPiece:
    """Greedy longest-match-first over the vocabulary; a word that cannot be covered entirely
    becomes one unk token (as does any word longer than max_chars)."""

    def __init__(self, vocab: dict[str, int], *, unk_token: str = "[UNK]", prefix: str = "##",
                 max_chars: int = 100) -> None:
        if unk_token not in vocab:
            raise ValueError(f"WordPiece vocabulary lacks its unknown token {unk_token!r}")
        self.vocab = vocab
        self.unk_id = vocab[unk_token]
        self.prefix = prefix
        self.max_chars = max_chars

    def encode_uncached(self, word: str) -> list[int]:
        if len(word) > self.max_chars:
            return [self.unk_id]
        ids = []
        start = 0
        while start < len(word):
            # Longest piece first: shrink the end until the piece is in the vocabulary.
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                token_id = self.vocab.get(piece)
                if token_id is not None:
                    break
                end -= 1
            else:
                return [self.unk_id]
            ids.append(token_id)
            start = end
        return ids
