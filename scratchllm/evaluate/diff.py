"""Token-level diff of two outputs: where they first part, the aligned spans, the edit distance,
and the text on either side of the divergence (what an annotator reads first)."""

import difflib
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

CONTEXT_TOKENS = 8


@dataclass(frozen=True)
class TokenDiff:
    first_divergence: int | None  # index of the first differing token; None when equal
    edit_distance: int  # Levenshtein distance in tokens (insert, delete, substitute: 1 each)
    spans: tuple[tuple[str, int, int, int, int], ...]  # (op, a_start, a_end, b_start, b_end)
    context_a: str  # up to CONTEXT_TOKENS tokens before the divergence + "⟦" + after it
    context_b: str
    common_prefix_chars: int  # characters the two texts share from the start (for highlighting)


def edit_distance(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Levenshtein distance, O(len(a) * len(b)) time, one row of memory."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            # prev holds row[j-1] of the previous line: the diagonal
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def first_divergence(a: Sequence[Hashable], b: Sequence[Hashable]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _context(tokens: Sequence[Hashable], strings: Sequence[str], i: int) -> str:
    before = "".join(strings[max(0, i - CONTEXT_TOKENS):i])
    after = "".join(strings[i:i + CONTEXT_TOKENS])
    return f"{before}⟦{after}"


def token_diff(a: Sequence[Hashable], b: Sequence[Hashable], a_strings: Sequence[str] | None = None,
               b_strings: Sequence[str] | None = None, a_text: str = "", b_text: str = "") -> TokenDiff:
    """Diff of token sequences `a` and `b` (ids or strings); `*_strings` render them as text."""
    a_strings = a_strings if a_strings is not None else [str(t) for t in a]
    b_strings = b_strings if b_strings is not None else [str(t) for t in b]
    i = first_divergence(a, b)
    matcher = difflib.SequenceMatcher(None, list(a), list(b), autojunk=False)
    spans = tuple(matcher.get_opcodes())
    ctx_a = _context(a, a_strings, i) if i is not None else ""
    ctx_b = _context(b, b_strings, i) if i is not None else ""
    return TokenDiff(i, edit_distance(a, b), spans, ctx_a, ctx_b, len(os.path.commonprefix([a_text, b_text])))
