"""Byte-pair encoding of one pre-token: start from single symbols, merge the best pair, repeat.

"Best" is the adjacent pair with the lowest merge rank; ties go to the leftmost pair. This is the
rule of Hugging Face `tokenizers` (rank = line of the merges list) and of tiktoken (rank of the
concatenated bytes); both reduce to a table (left, right) -> rank, built once here.

The table is over token ids, not text (_merge_ranks.PairTable, in C arrays): (left, right) ->
rank, and rank -> the id the pair becomes. Merging ids gives the ids of merging strings,
because a text and its id name each other one to one (distinct ids are checked where a
vocabulary comes from outside) and texts that are no token get numbers of their own past the
last id.

Cost: almost all encode time is spent in the merge loop (PairTable.merge, in C), once per
distinct pre-token, because the Tokenizer caches the ids of every pre-token (prose repeats its
words; the cache turns BPE into a dict lookup).
"""

import heapq
from collections.abc import Iterable

from scratchllm.errors import ConfigError
from scratchllm.tokenizer import _merge_ranks
from scratchllm.tokenizer._vocabulary import Vocabulary

# Pieces longer than this (in symbols) merge through a heap: PairTable.merge rescans every
# pair per merge, O(n^2), which a 100 kB run of letters in a prompt would turn into minutes.
HEAP_ABOVE = 64

# The symbol of a character that is neither a token nor a merge half: it merges with nothing.
NO_SYMBOL = -1
# In the heap merge: a position merged into the symbol on its left (never a symbol).
_MERGED = -2


class BPE:
    """vocab: token text -> id (a dict, or a compact Vocabulary); table: (PairTable, extra) from
    _merge_ranks, extra the symbols (numbers >= first_extra) of merge texts that are no token.
    The constructors from_ranks / from_merges / from_ranked_tokens / gguf_vocab.from_gguf build
    it.

    ignore_merges: look the whole pre-token up in the vocabulary first (tiktoken and Llama 3 do;
    GPT-2 style tokenizers do not, and the two can differ when a token is in the vocabulary but
    the merges reach the word by another path).
    """

    def __init__(
        self,
        vocab: dict[str, int] | Vocabulary,
        table: tuple[_merge_ranks.PairTable, dict[str, int]],
        first_extra: int,
        *,
        ignore_merges: bool = False,
        unk_id: int | None = None,
    ):
        self.vocab = vocab
        self.table, self.extra = table
        # Symbols below first_extra are ids of the vocabulary; at and above, texts that are no token.
        self.first_extra = first_extra
        self.ignore_merges = ignore_merges
        self.unk_id = unk_id

    @classmethod
    def from_ranks(cls, vocab: dict[str, int], ranks: dict[tuple[str, str], int], *,
                   ignore_merges: bool = False, unk_id: int | None = None) -> "BPE":
        """A table written as text, {(left, right): rank}; each pair merges to left + right."""
        ids = vocab.values()
        if len(set(ids)) != len(vocab):
            seen: dict[int, str] = {}
            clash = next((t, seen[i]) for t, i in vocab.items() if seen.setdefault(i, t) != t)
            raise ConfigError(f"the vocabulary gives one id ({vocab[clash[0]]}) to {clash[0]!r} and {clash[1]!r}")
        first_extra = max(ids, default=-1) + 1
        return cls(vocab, _merge_ranks.table_from_ranks(ranks, vocab, first_extra), first_extra,
                   ignore_merges=ignore_merges, unk_id=unk_id)

    @classmethod
    def from_merges(cls, vocab: dict[str, int], merges: Iterable[tuple[str, str]], *,
                    ignore_merges: bool = False, unk_id: int | None = None) -> "BPE":
        ranks: dict[tuple[str, str], int] = {}
        for rank, pair in enumerate(merges):
            # A pair listed twice keeps its first (best) rank, as tokenizers does.
            ranks.setdefault(pair, rank)
        return cls.from_ranks(vocab, ranks, ignore_merges=ignore_merges, unk_id=unk_id)

    @classmethod
    def from_ranked_tokens(cls, ranked: dict[str, int], *, unk_id: int | None = None) -> "BPE":
        """tiktoken's form: each token's rank is its id and the rank of any pair that concatenates
        to it. Every split of a token into two tokens becomes a pair (a few per token)."""
        ranks: dict[tuple[str, str], int] = {}
        for token, rank in ranked.items():
            for cut in range(1, len(token)):
                left, right = token[:cut], token[cut:]
                if left in ranked and right in ranked:
                    ranks[(left, right)] = rank
        return cls.from_ranks(dict(ranked), ranks, ignore_merges=True, unk_id=unk_id)

    def ranks(self) -> dict[tuple[str, str], int]:
        """The table written as text, {(left, right): rank}: for tests and inspection (it costs
        what the id table saves)."""
        text = {i: t for t, i in self.vocab.items()} | {i: t for t, i in self.extra.items()}
        return {(text[a], text[b]): rank for a, b, rank in sorted(self.table.items(), key=lambda item: item[2])}

    def encode_uncached(self, word: str) -> list[int]:
        """One pre-token, already in the vocabulary's alphabet (byte-level text for GPT-2 style),
        -> ids; the Tokenizer caches the result per raw pre-token. Symbols missing from the
        vocabulary become unk_id, or are dropped without one (what tokenizers does)."""
        vocab = self.vocab
        if self.ignore_merges and word in vocab:
            return [vocab[word]]
        symbols = self.merge(self.symbols(word))
        first_extra = self.first_extra
        if min(symbols, default=0) >= 0 and max(symbols, default=0) < first_extra:
            return symbols  # the common case: every symbol is a token
        unk = self.unk_id
        if unk is None:
            return [s for s in symbols if 0 <= s < first_extra]
        return [s if 0 <= s < first_extra else unk for s in symbols]

    def merge(self, symbols: list[int]) -> list[int]:
        """Merge the best pair (lowest rank, then leftmost) until none merges: a new list."""
        return self._merge_heap(symbols) if len(symbols) > HEAP_ABOVE else self.table.merge(symbols)

    def symbols(self, word: str) -> list[int]:
        """The symbol of each character of `word`, before any merge."""
        if not self.extra and isinstance(self.vocab, Vocabulary):
            return self.vocab.symbols(word)  # in C
        get = self.vocab.get
        if self.extra:
            extra = self.extra.get
            return [get(c, extra(c, NO_SYMBOL)) for c in word]
        return [get(c, NO_SYMBOL) for c in word]

    def _merge_heap(self, symbols: list[int]) -> list[int]:
        """The same merges as PairTable.merge in O(n log n): a heap of candidate pairs (rank,
        position) over a linked list of symbols. Entries go stale when a neighbour merges; each
        is checked against the current symbols when popped instead of being removed."""
        get = self.table.rank
        merged_of = self.table.product
        symbols = list(symbols)  # _MERGED: merged into the symbol on its left
        n = len(symbols)
        nxt = list(range(1, n + 1))  # n: no right neighbour
        prv = list(range(-1, n - 1))
        # (rank, left position, left symbol, right symbol); positions keep their order through
        # merges, so ties on rank pop leftmost first, as in the list loop.
        heap = []
        for i in range(n - 1):
            rank = get(symbols[i], symbols[i + 1])
            if rank is not None:
                heap.append((rank, i, symbols[i], symbols[i + 1]))
        heapq.heapify(heap)
        while heap:
            rank, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            if symbols[i] != left or j >= n or symbols[j] != right:
                continue  # stale: one side has merged since this entry was pushed
            merged = merged_of(rank)
            symbols[i], symbols[j] = merged, _MERGED
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                p = prv[i]
                r = get(symbols[p], merged)
                if r is not None:
                    heapq.heappush(heap, (r, p, symbols[p], merged))
            if nxt[i] < n:
                r = get(merged, symbols[nxt[i]])
                if r is not None:
                    heapq.heappush(heap, (r, i, merged, symbols[nxt[i]]))
        return [s for s in symbols if s != _MERGED]
