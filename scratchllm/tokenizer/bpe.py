"""Byte-pair encoding of one pre-token: start from single symbols, merge the best pair, repeat.

"Best" is the adjacent pair with the lowest merge rank; ties go to the leftmost pair. This is the
rule of Hugging Face `tokenizers` (rank = line of the merges list) and of tiktoken (rank of the
concatenated bytes); both reduce to a table (left, right) -> rank, built once here.

Cost: almost all encode time is spent in `_merge`, once per distinct pre-token, because the
Tokenizer caches the ids of every pre-token (prose repeats its words; the cache turns BPE into a
dict lookup).
"""

import heapq
from collections.abc import Iterable

# Pieces longer than this (in symbols) merge through a heap: the list loop below rescans every
# pair per merge, O(n^2), which a 100 kB run of letters in a prompt would turn into minutes.
HEAP_ABOVE = 64

# Rank of a pair that cannot merge: larger than any real rank, and still a plain int so that
# min() over the pair ranks compares ints only.
NO_MERGE = 1 << 62


class BPE:
    """vocab: token text -> id; ranks: (left, right) -> rank; the merge of a pair is left + right.

    ignore_merges: look the whole pre-token up in the vocabulary first (tiktoken and Llama 3 do;
    GPT-2 style tokenizers do not, and the two can differ when a token is in the vocabulary but
    the merges reach the word by another path).
    """

    def __init__(
        self,
        vocab: dict[str, int],
        ranks: dict[tuple[str, str], int],
        *,
        ignore_merges: bool = False,
        unk_id: int | None = None,
    ):
        self.vocab = vocab
        self.ranks = ranks
        self.ignore_merges = ignore_merges
        self.unk_id = unk_id

    @classmethod
    def from_merges(cls, vocab: dict[str, int], merges: Iterable[tuple[str, str]], **kw) -> "BPE":
        ranks: dict[tuple[str, str], int] = {}
        for rank, pair in enumerate(merges):
            # A pair listed twice keeps its first (best) rank, as tokenizers does.
            ranks.setdefault(pair, rank)
        return cls(vocab, ranks, **kw)

    @classmethod
    def from_ranked_tokens(cls, ranked: dict[str, int], **kw) -> "BPE":
        """tiktoken's form: each token's rank is its id and the rank of any pair that concatenates
        to it. Every split of a token into two tokens becomes a pair (a few per token)."""
        ranks: dict[tuple[str, str], int] = {}
        for token, rank in ranked.items():
            for cut in range(1, len(token)):
                left, right = token[:cut], token[cut:]
                if left in ranked and right in ranked:
                    ranks[(left, right)] = rank
        return cls(dict(ranked), ranks, ignore_merges=True, **kw)

    def encode_uncached(self, word: str) -> list[int]:
        """One pre-token, already in the vocabulary's alphabet (byte-level text for GPT-2 style),
        -> ids; the Tokenizer caches the result per raw pre-token. Symbols missing from the
        vocabulary become unk_id, or are dropped without one (what tokenizers does)."""
        vocab = self.vocab
        if self.ignore_merges and word in vocab:
            return [vocab[word]]
        ids = []
        for symbol in self._merge(word):
            token_id = vocab.get(symbol, self.unk_id)
            if token_id is not None:
                ids.append(token_id)
        return ids

    def _merge(self, word: str) -> list[str]:
        if len(word) > HEAP_ABOVE:
            return self._merge_heap(word)
        symbols = list(word)
        get = self.ranks.get
        # pair_ranks[i] is the rank of (symbols[i], symbols[i + 1]): kept in step with symbols,
        # so each merge recomputes two entries instead of the whole row.
        pair_ranks = [get((a, b), NO_MERGE) for a, b in zip(symbols, symbols[1:], strict=False)]
        while pair_ranks:
            best = min(pair_ranks)
            if best == NO_MERGE:
                break
            i = pair_ranks.index(best)  # leftmost of the lowest rank
            merged = symbols[i] + symbols[i + 1]
            symbols[i : i + 2] = [merged]
            del pair_ranks[i]
            if i > 0:
                pair_ranks[i - 1] = get((symbols[i - 1], merged), NO_MERGE)
            if i < len(pair_ranks):
                pair_ranks[i] = get((merged, symbols[i + 1]), NO_MERGE)
        assert len(pair_ranks) == max(len(symbols) - 1, 0)
        return symbols

    def _merge_heap(self, word: str) -> list[str]:
        """The same merges as _merge in O(n log n): a heap of candidate pairs (rank, position)
        over a linked list of symbols. Entries go stale when a neighbour merges; each is checked
        against the current symbols when popped instead of being removed."""
        get = self.ranks.get
        symbols: list[str | None] = list(word)  # None: merged into the symbol on its left
        n = len(symbols)
        nxt = list(range(1, n + 1))  # n: no right neighbour
        prv = list(range(-1, n - 1))
        # (rank, left position, left text, right text); positions keep their order through
        # merges, so ties on rank pop leftmost first, as in the list loop.
        heap = []
        for i in range(n - 1):
            rank = get((symbols[i], symbols[i + 1]))
            if rank is not None:
                heap.append((rank, i, symbols[i], symbols[i + 1]))
        heapq.heapify(heap)
        while heap:
            rank, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            if symbols[i] != left or j >= n or symbols[j] != right:
                continue  # stale: one side has merged since this entry was pushed
            merged = left + right
            symbols[i], symbols[j] = merged, None
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                p = prv[i]
                r = get((symbols[p], merged))
                if r is not None:
                    heapq.heappush(heap, (r, p, symbols[p], merged))
            if nxt[i] < n:
                r = get((merged, symbols[nxt[i]]))
                if r is not None:
                    heapq.heappush(heap, (r, i, merged, symbols[nxt[i]]))
        return [s for s in symbols if s is not None]
