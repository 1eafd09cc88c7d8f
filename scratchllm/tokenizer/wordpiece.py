"""BERT's tokenizer: clean and lower-case the text, split on spaces and punctuation, then cut each
word greedily into the longest vocabulary pieces ('playing' -> 'play', '##ing').

Follows Hugging Face `tokenizers` (BertNormalizer, BertPreTokenizer, WordPiece), which is what
sentence-transformers runs for all-MiniLM-L6-v2.
"""

import unicodedata

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


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def _is_punctuation(ch: str) -> bool:
    # ASCII symbols such as '$', '+', '^' count too, though Unicode files them under S*.
    return (ch.isascii() and not ch.isalnum() and ch.isprintable() and ch != " ") or (
        unicodedata.category(ch).startswith("P")
    )


def bert_normalize(text: str, *, lowercase: bool = True, strip_accents: bool | None = None,
                   clean_text: bool = True, handle_chinese_chars: bool = True) -> str:
    """The BertNormalizer steps in tokenizers' order: clean, space out CJK, strip accents, lower."""
    out = []
    for ch in text:
        if clean_text:
            if ch in "\t\n\r":
                out.append(" ")
                continue
            if ch == "\x00" or ch == "\ufffd" or unicodedata.category(ch)[0] == "C":
                continue
            if ch in _WHITESPACE:
                out.append(" ")
                continue
        if handle_chinese_chars and _is_cjk(ord(ch)):
            out.append(f" {ch} ")
        else:
            out.append(ch)
    text = "".join(out)
    # Accents go with lower-casing unless the config says otherwise (strip_accents null).
    if lowercase if strip_accents is None else strip_accents:
        text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
    if lowercase:
        text = text.lower()
    return text


def bert_pre_tokenize(text: str) -> list[str]:
    """Split on whitespace (dropped) and around every punctuation character (kept alone)."""
    words = []
    current = []
    for ch in text:
        if ch in _WHITESPACE:
            if current:
                words.append("".join(current))
                current = []
        elif _is_punctuation(ch):
            if current:
                words.append("".join(current))
                current = []
            words.append(ch)
        else:
            current.append(ch)
    if current:
        words.append("".join(current))
    return words


class WordPiece:
    """Greedy longest-match-first over the vocabulary; a word that cannot be covered entirely
    becomes one unk token (as does any word longer than max_chars)."""

    def __init__(self, vocab: dict[str, int], *, unk_token: str = "[UNK]", prefix: str = "##",
                 max_chars: int = 100):
        if unk_token not in vocab:
            raise ValueError(f"WordPiece vocabulary lacks its unknown token {unk_token!r}")
        self.vocab = vocab
        self.unk_id = vocab[unk_token]
        self.prefix = prefix
        self.max_chars = max_chars
        self._cache: dict[str, list[int]] = {}

    def encode_word(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        ids = self._cut(word)
        if len(self._cache) < 200_000:
            self._cache[word] = ids
        return ids

    def _cut(self, word: str) -> list[int]:
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
