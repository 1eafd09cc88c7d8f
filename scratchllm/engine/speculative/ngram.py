"""N-gram prompt lookup: draft the tokens that followed the sequence's last n tokens the first
time those n tokens appeared earlier in it (its prompt or its output so far).

The rule is vLLM's (its `ngram` method, `prompt_lookup_min` / `prompt_lookup_max`): the longest
n in [min_n, max_n] whose n-gram ending at the last token also ends somewhere earlier; of that
n-gram's earlier occurrences, the first; the draft is the up to k tokens that followed it, fewer
when the sequence ends sooner. No n-gram found: no draft (the request decodes one token).

Why the first occurrence: an editor's request holds the code once, in the prompt, and the answer
copies it; the first place an n-gram appeared is the prompt's copy, where the original text goes
on, rather than the answer's own few tokens back.

Incremental, not a rescan: `NgramIndex` keeps, for each n, a dict from each n-gram to the
position just after its first occurrence. Appending a token registers the (max_n - min_n + 1)
n-grams that end at it (a dict insert each, kept only if new); a proposal is at most that many
lookups of the current suffix. A suffix whose first occurrence is itself (the dict's position is
the end of the sequence) has no earlier one. The index only grows: drafted tokens are not added
until they are accepted (then they are the request's tokens like any other).
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One sequence's tokens and the first occurrence of each of its n-grams, min_n <= n <= max_n.

    Invariant: for each n and each n-gram g of `tokens`, first[n - min_n][g] is i + n where i is
    the smallest index with tokens[i : i + n] == g (the position of the token that followed it)."""

    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.first: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens, registering every n-gram that ends at each of them."""
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            end = len(seq)
            for n, table in enumerate(self.first, start=self.min_n):
                if end < n:
                    break
                table.setdefault(tuple(seq[end - n : end]), end)

    def sync(self, tokens: list[int]) -> None:
        """Bring the index up to `tokens`, of which its own are a prefix (a request's token ids)."""
        assert len(tokens) >= len(self.tokens), "a sequence only grows"
        self.extend(tokens[len(self.tokens) :])

    def match(self) -> tuple[int, int] | None:
        """(n, start of the continuation) of the longest n-gram ending at the last token that ended
        earlier too, at its first occurrence; None when there is none."""
        seq, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            at = self.first[n - self.min_n].get(tuple(seq[end - n : end]))
            if at is not None and at < end:
                return n, at
        return None

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens: what followed the matched n-gram (fewer near the end; [] if none)."""
        return self.lookup(k)[0]

    def lookup(self, k: int) -> tuple[list[int], int]:
        """propose(k), and the n of the n-gram that matched (0: none). A longer match's drafts are
        accepted more often: the speculator keeps their rates apart."""
        found = self.match() if k > 0 else None
        if found is None:
            return [], 0
        n, at = found
        return self.tokens[at : at + k], n
