"""Pre-tokenizers: cut text into the pieces that BPE or WordPiece then encode one at a time.

A merge never crosses a piece boundary, so these regexes decide much of a tokenizer's behaviour:
GPT-2 keeps a leading space on the word it precedes (' world'), Llama 3 and Qwen2 peel digits
into groups, SmolLM (and StarCoder) first isolate every digit. A pre-tokenizer here is a list of
split steps applied in turn, each to every piece the previous step produced, as both Hugging Face
`tokenizers` (Sequence) and llama.cpp (its list of regexes per `tokenizer.ggml.pre`) do.
"""

from dataclasses import dataclass
from pathlib import Path

import regex

from scratchllm.errors import FormatError

# GPT-2's rule (also tiktoken's "gpt2" and HF ByteLevel(use_regex=True)). The trailing `\s+(?!\S)`
# leaves the last space of a run for the next word, so 'a   b' -> 'a', '  ', ' b'.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Llama 3 (llama.cpp `llama-bpe`): case-insensitive contractions, one non-letter may lead a word,
# numbers in groups of at most three digits, newlines kept together.
LLAMA3_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2: Llama 3's rule with every digit on its own.
QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DIGIT_PATTERN = r"\p{N}"

# SmolLM / StarCoder: every digit alone, then GPT-2's rule on the text between digits. Fused into
# one regex (one pass instead of two): digits leave the alternatives, and a whitespace run keeps
# its last space only before a non-digit, because before a digit the two-step form ends its piece
# there and `\s+(?!\S)` takes the whole run. tests/tokenizer/test_pretokenize.py checks the
# fused and the two-step forms against each other and against tokenizers.
SMOLLM_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""


@dataclass(frozen=True)
class Split:
    """One step: cut each piece at the matches of `pattern`.

    behavior 'isolated' keeps matches and the text between them as pieces; 'removed' drops the
    matches (whitespace splitting); 'merged_with_previous' / 'merged_with_next' join each match
    to the text before / after it. invert=True means the pattern describes the pieces to keep.
    """

    pattern: str
    behavior: str = "isolated"
    invert: bool = False

    def __post_init__(self) -> None:
        assert self.behavior in BEHAVIORS, self.behavior
        assert not (self.invert and self.behavior.startswith("merged")), "merged behaviours are not inverted"


BEHAVIORS = ("isolated", "removed", "merged_with_previous", "merged_with_next")


def escape(text: str) -> str:
    """A regex that matches `text` literally (tokenizers' Split on a String pattern)."""
    escaped: str = regex.escape(text)
    return escaped


class PreTokenizer:
    """Applies its split steps in order: text -> list of non-empty pieces. With 'isolated' steps
    only, the pieces concatenate back to the text."""

    def __init__(self, steps: list[Split]) -> None:
        self.steps = tuple(steps)
        self._compiled: list[tuple[regex.Pattern[str], Split, bool]] = []
        for step in self.steps:
            pattern = regex.compile(step.pattern)
            # findall can stand in for the general loop only when it returns whole matches
            # (no groups) and never an empty one.
            simple = pattern.groups == 0 and pattern.fullmatch("") is None
            self._compiled.append((pattern, step, simple))

    def __call__(self, text: str) -> list[str]:
        pieces = [text] if text else []
        for pattern, step, simple in self._compiled:
            out: list[str] = []
            for piece in pieces:
                out += _split(pattern, step, simple, piece)
            pieces = out
        return pieces


def _split(pattern: regex.Pattern[str], step: Split, simple: bool, text: str) -> list[str]:
    if step.behavior.startswith("merged"):
        return _split_merged(pattern, step.behavior == "merged_with_previous", text)
    keep_matches = step.behavior == "isolated" or step.invert
    keep_gaps = step.behavior == "isolated" or not step.invert
    if keep_matches and keep_gaps and simple:
        found: list[str] = pattern.findall(text)
        # Fast path: the matches tile the whole text (the GPT-2 family's patterns always do).
        if sum(map(len, found)) == len(text):
            return found
    pieces: list[str] = []
    start = 0
    for m in pattern.finditer(text):
        if keep_gaps and m.start() > start:
            pieces.append(text[start : m.start()])
        if keep_matches and m.end() > m.start():
            pieces.append(m.group())
        start = m.end()
    if keep_gaps and start < len(text):
        pieces.append(text[start:])
    return pieces


def _split_merged(pattern: regex.Pattern[str], with_previous: bool, text: str) -> list[str]:
    """Cut after each match (joined to the text before it) or before it (joined to the text after)."""
    pieces: list[str] = []
    start = 0
    for m in pattern.finditer(text):
        if m.end() == m.start():
            continue
        cut = m.end() if with_previous else m.start()
        if cut > start:
            pieces.append(text[start:cut])
        start = cut
    if start < len(text):
        pieces.append(text[start:])
    return pieces


_GPT2 = [Split(GPT2_PATTERN)]
_LLAMA3 = [Split(LLAMA3_PATTERN)]
_QWEN2 = [Split(QWEN2_PATTERN)]
# StarCoder family: llama.cpp applies [DIGIT_PATTERN, GPT2_PATTERN] in turn; SMOLLM_PATTERN is the
# same split in one pass.
_STARCODER = [Split(SMOLLM_PATTERN)]
# llama.cpp's fallback when the file names no pre-tokenizer: runs of punctuation cut out first,
# then GPT-2's rule, then numbers cut into runs and those into groups of three.
_LLAMA_CPP_DEFAULT = [Split(r"[\p{P}\$\+<=>\^~\|]+"), Split(GPT2_PATTERN), Split(r"\p{N}+"), Split("[0-9][0-9][0-9]")]

# llama.cpp's `tokenizer.ggml.pre` names -> the split steps it applies (llama-vocab.cpp). A name
# not listed is refused rather than guessed (llama.cpp falls back to its default with a warning).
GGUF_PRETOKENIZERS: dict[str, list[Split]] = {
    "default": _LLAMA_CPP_DEFAULT,
    # llama.cpp spells GPT-2's kind 'gpt-2'; 'gpt2' (the tokenizer model's name) means the same here.
    **dict.fromkeys(["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"], _GPT2),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"], _LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], _QWEN2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    _STARCODER),
}

# Kinds whose tokenizer looks the whole piece up in the vocabulary before merging, and kinds that
# add BOS when the file has no tokenizer.ggml.add_bos_token (llama.cpp's defaults).
GGUF_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3"}
GGUF_ADD_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3"}


def from_gguf_name(name: str, path: str | Path) -> PreTokenizer:
    if name not in GGUF_PRETOKENIZERS:
        known = ", ".join(sorted(GGUF_PRETOKENIZERS))
        raise FormatError(path, f"tokenizer.ggml.pre '{name}' is not a pre-tokenizer we know ({known})")
    return PreTokenizer(GGUF_PRETOKENIZERS[name])
