"""Finding added tokens (specials, user-defined tokens) in raw text: leftmost, then longest.

Why not one regex alternation of all of them: Gemma's vocabulary has 6384 (<unused0>..., runs of
newlines and tabs); that regex took 2 s to compile and 10 s to split 1.4 MB of text. Here the
scan jumps from one possible first character to the next (a small character class) and tries
the token lengths that start with it there, longest first: nothing to compile, and a dict lookup
per length at each candidate.
"""

import re
from collections.abc import Iterable


class AddedTokens:
    """split(text) -> [text, token, text, token, ..., text], as re.split with one group gives:
    odd indices are the tokens found."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._tokens = frozenset(tokens)
        lengths: dict[str, set[int]] = {}
        for token in self._tokens:
            if token:
                lengths.setdefault(token[0], set()).add(len(token))
        self._lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self._first = re.compile("[" + "".join(map(_in_class, sorted(lengths))) + "]") if lengths else None

    def split(self, text: str) -> list[str]:
        parts: list[str] = []
        if self._first is None:
            return [text]
        tokens, lengths, search = self._tokens, self._lengths, self._first.search
        last = at = 0
        while (m := search(text, at)) is not None:
            i = m.start()
            for n in lengths[text[i]]:
                if text[i:i + n] in tokens:
                    parts += (text[last:i], text[i:i + n])
                    last = at = i + n
                    break
            else:
                at = i + 1
        parts.append(text[last:])
        return parts


def _in_class(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c
