# cython: language_level=3, boundscheck=False, wraparound=False
"""The BPE merge table over token ids (PairTable), its merge loop, and its builders.

A symbol is the vocabulary id of its text, or, for a text that is no token (a merge half or
product missing from the vocabulary: legal in a file, never seen in the ones we test), an extra
number from `first_extra` up, kept in `extra` (text -> number) so that such merges still happen
as they would over strings. The table maps a pair of symbols to its rank, in open addressing
over C arrays, and a rank to the symbol its pair becomes.

Why C arrays and not {(left, right): rank} over str: that dict held 97800 new half strings,
48900 tuples and the dict itself for SmolLM2's merges (10.3 MiB traced); an int-keyed dict
still took 4.5 MiB (48900 int keys, 2.6 MB of dict); this table takes 1.7 MB.

GGUF lines follow llama.cpp's rule: "left right" is cut at the first space after its first
character, and a pair listed twice keeps its first (best) rank, as tokenizers does.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, uint64_t
from libc.string cimport memmove

from scratchllm.tokenizer._vocabulary cimport Vocabulary


cdef extern from "Python.h":
    Py_ssize_t PyUnicode_GET_LENGTH(object s)
    Py_ssize_t PyUnicode_FindChar(object s, Py_UCS4 ch, Py_ssize_t start, Py_ssize_t end, int direction) except -2
    object PyUnicode_Substring(object s, Py_ssize_t start, Py_ssize_t end)
    object PyUnicode_Concat(object left, object right)
    Py_UCS4 PyUnicode_READ_CHAR(object s, Py_ssize_t index)
    # A borrowed reference (NULL: missing or error), declared as a raw pointer so that Cython does
    # not release a reference it never owned.
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL

# Symbols and ranks stay below this: a pair packs into 62 bits, a rank into an int32.
cdef long long LIMIT = (1 << 31) - 1
cdef uint64_t EMPTY = <uint64_t>-1  # a slot no pair fills (both halves < LIMIT)
cdef int32_t NO_RANK = 0x7FFFFFFF
# Single characters below this code point get their symbol from an array, not the vocabulary
# (GPT-2's byte alphabet ends at U+0143).
cdef Py_ssize_t CHARS = 512


cdef inline uint64_t _code(long long left, long long right):
    return (<uint64_t>left << 32) | <uint64_t>right


cdef class PairTable:
    """(left, right) -> rank, and rank -> the symbol the pair becomes. `numbers`: the int
    objects of the ids by id (the vocabulary's own; None where not made yet, then made and kept),
    so that the lists merge() returns, which the Tokenizer caches per word, share them instead
    of holding new ones."""
    cdef uint64_t* codes  # [capacity]: _code(left, right), or EMPTY
    cdef int32_t* ranks  # [capacity]
    cdef int32_t* products  # [n_ranks]: the symbol a pair of that rank becomes, or -1
    cdef Py_ssize_t capacity, count, n_ranks
    cdef int shift  # 64 - log2(capacity), for Fibonacci hashing
    cdef list numbers

    def __cinit__(self, Py_ssize_t pairs, Py_ssize_t n_ranks, list numbers):
        self.capacity, self.shift = 16, 60
        while self.capacity < 2 * pairs:  # at most half full: short probes for absent pairs
            self.capacity *= 2
            self.shift -= 1
        self.n_ranks = n_ranks
        self.count = 0
        self.numbers = numbers
        self.codes = <uint64_t*>PyMem_Malloc(self.capacity * sizeof(uint64_t))
        self.ranks = <int32_t*>PyMem_Malloc(self.capacity * sizeof(int32_t))
        self.products = <int32_t*>PyMem_Malloc(max(n_ranks, 1) * sizeof(int32_t))
        if not self.codes or not self.ranks or not self.products:
            raise MemoryError()
        cdef Py_ssize_t i
        for i in range(self.capacity):
            self.codes[i] = EMPTY
        for i in range(n_ranks):
            self.products[i] = -1

    def __dealloc__(self):
        PyMem_Free(self.codes)
        PyMem_Free(self.ranks)
        PyMem_Free(self.products)

    cdef inline Py_ssize_t _slot(self, uint64_t code):
        cdef Py_ssize_t slot = <Py_ssize_t>((code * <uint64_t>0x9E3779B97F4A7C15) >> self.shift)
        while self.codes[slot] != EMPTY and self.codes[slot] != code:
            slot = (slot + 1) & (self.capacity - 1)
        return slot

    cdef inline int32_t _rank(self, long long left, long long right):
        if left < 0 or right < 0:
            return NO_RANK  # a character that is neither a token nor a merge half
        cdef Py_ssize_t slot = self._slot(_code(left, right))
        return NO_RANK if self.codes[slot] == EMPTY else self.ranks[slot]

    cdef add(self, long long left, long long right, long long rank, long long product):
        """One merge; a pair already in the table keeps its first rank."""
        if not (0 <= left < LIMIT and 0 <= right < LIMIT and 0 <= product < LIMIT and 0 <= rank < self.n_ranks):
            raise OverflowError(f"merge symbols ({left}, {right}) -> {product} or rank {rank} out of range")
        cdef Py_ssize_t slot = self._slot(_code(left, right))
        if self.codes[slot] == EMPTY:
            assert self.count < self.capacity // 2
            self.codes[slot] = _code(left, right)
            self.ranks[slot] = <int32_t>rank
            self.count += 1
        # Pairs that share a rank (tiktoken: every split of one token) must merge to one text.
        if self.products[rank] != -1 and self.products[rank] != product:
            raise ValueError(f"pairs of rank {rank} merge to different texts")
        self.products[rank] = <int32_t>product

    cdef object _number(self, long long symbol):
        if not 0 <= symbol < len(self.numbers):
            return symbol  # an extra symbol (never an id encode returns)
        got = self.numbers[symbol]
        if got is None:  # made on first use, then shared (Vocabulary.numbers)
            got = self.numbers[symbol] = symbol
        return got

    def rank(self, long long left, long long right):
        """The pair's rank, or None."""
        cdef int32_t r = self._rank(left, right)
        return None if r == NO_RANK else r

    def product(self, long long rank):
        """The symbol a pair of this rank becomes."""
        assert 0 <= rank < self.n_ranks and self.products[rank] >= 0, rank
        return self._number(self.products[rank])

    def merge(self, list symbols):
        """Merge the leftmost lowest-ranked adjacent pair until none merges; a new list. The
        scan is O(n^2): for short pieces (bpe.HEAP_ABOVE), where it beats a heap."""
        cdef Py_ssize_t n = len(symbols), m, i, best_at
        cdef int32_t best
        cdef long long* sym = <long long*>PyMem_Malloc(max(n, 1) * sizeof(long long))
        cdef int32_t* pair = <int32_t*>PyMem_Malloc(max(n, 1) * sizeof(int32_t))
        if not sym or not pair:
            PyMem_Free(sym)
            PyMem_Free(pair)
            raise MemoryError()
        try:
            for i in range(n):
                sym[i] = symbols[i]
            # pair[i] is the rank of (sym[i], sym[i + 1]): kept in step with sym, so each merge
            # recomputes two entries instead of the whole row.
            for i in range(n - 1):
                pair[i] = self._rank(sym[i], sym[i + 1])
            m = n
            while m > 1:
                best, best_at = NO_RANK, -1
                for i in range(m - 1):
                    if pair[i] < best:  # strict: the leftmost of the lowest rank
                        best, best_at = pair[i], i
                if best_at < 0:
                    break
                sym[best_at] = self.products[best]
                memmove(&sym[best_at + 1], &sym[best_at + 2], (m - best_at - 2) * sizeof(long long))
                if m - best_at - 3 > 0:
                    memmove(&pair[best_at + 1], &pair[best_at + 2], (m - best_at - 3) * sizeof(int32_t))
                m -= 1
                if best_at > 0:
                    pair[best_at - 1] = self._rank(sym[best_at - 1], sym[best_at])
                if best_at < m - 1:
                    pair[best_at] = self._rank(sym[best_at], sym[best_at + 1])
            return [self._number(sym[i]) for i in range(m)]
        finally:
            PyMem_Free(sym)
            PyMem_Free(pair)

    def items(self):
        """[(left, right, rank)] in slot order: for tests and inspection."""
        cdef Py_ssize_t i
        return [(<long long>(self.codes[i] >> 32), <long long>(self.codes[i] & 0xFFFFFFFF), self.ranks[i])
                for i in range(self.capacity) if self.codes[i] != EMPTY]

    def products_list(self):
        return [self.products[i] for i in range(self.n_ranks)]

    def __len__(self):
        return self.count

    def nbytes(self):
        return self.capacity * (sizeof(uint64_t) + sizeof(int32_t)) + self.n_ranks * sizeof(int32_t)


cdef class _Symbols:
    """Text -> symbol while a table is built: the vocabulary's id, or a new extra number.
    vocab: a dict, or a Vocabulary (compact)."""
    cdef dict vocab, extra
    cdef Vocabulary compact
    cdef list chars  # [CHARS]: the symbol of a one-character text, once looked up
    cdef long long next_extra

    def __init__(self, vocab, long long first_extra):
        if isinstance(vocab, Vocabulary):
            self.compact = vocab
        else:
            self.vocab = vocab
        self.extra = {}
        self.chars = [None] * CHARS
        self.next_extra = first_extra

    cdef long long of(self, str text) except -1:
        if PyUnicode_GET_LENGTH(text) == 1:
            return self.one(text, 0)
        return self.lookup(text)

    cdef long long one(self, str text, Py_ssize_t at) except -1:
        """The symbol of the one character text[at]. Why an array: a lookup in the 49k-entry
        vocabulary is a cache miss or more, and 13164 of SmolLM2's 97800 halves are single
        characters."""
        cdef Py_ssize_t c = <Py_ssize_t>PyUnicode_READ_CHAR(text, at)
        if c >= CHARS:
            return self.lookup(PyUnicode_Substring(text, at, at + 1))
        if self.chars[c] is None:
            self.chars[c] = self.lookup(PyUnicode_Substring(text, at, at + 1))
        return self.chars[c]

    cdef long long lookup(self, text) except -1:
        cdef PyObject* got
        cdef Py_ssize_t j
        if self.compact is not None:
            j = self.compact.find(text)
            if j >= 0:
                return j
        else:
            got = PyDict_GetItemWithError(self.vocab, text)
            if got != NULL:
                return <object>got
        got = PyDict_GetItemWithError(self.extra, text)
        if got != NULL:
            return <object>got
        number = self.next_extra
        self.next_extra += 1
        self.extra[text] = number
        return number


def table_from_lines(list merges, Vocabulary vocab):
    """GGUF merge lines -> ((PairTable, extra), -1), or (None, i) where line i has no space after
    its first character. Where no text of the vocabulary is listed twice, each product's id is
    guessed from the one before (GPT-2 style files number them in merge order) and checked by
    comparing texts in place, instead of a lookup. Raises TypeError where a line is not a str."""
    cdef Py_ssize_t n = len(merges), i, cut, length, guess
    cdef long long product, offset = -1
    cdef PairTable table = PairTable(n, n, vocab.numbers)
    cdef _Symbols symbols = _Symbols(vocab, vocab.n)
    cdef bint guessing = vocab.distinct == vocab.n  # then a text at position i has the id i
    cdef long long left, right
    for i in range(n):
        line = merges[i]
        if type(line) is not str:
            raise TypeError(f"merge #{i} is {type(line).__name__}, not str")
        length = PyUnicode_GET_LENGTH(line)
        cut = PyUnicode_FindChar(line, 32, 1, length, 1) if length > 1 else -1  # 32: ' '
        if cut < 0:
            return None, i
        left = symbols.one(line, 0) if cut == 1 else symbols.lookup(PyUnicode_Substring(line, 0, cut))
        right = symbols.one(line, cut + 1) if cut + 2 == length else \
            symbols.of(PyUnicode_Substring(line, cut + 1, length))
        guess = i + offset  # this line's product has the id of the last one's plus one
        if guessing and vocab.is_joined(guess, line, cut):
            product = guess
        else:
            product = symbols.of(PyUnicode_Concat(PyUnicode_Substring(line, 0, cut),
                                                  PyUnicode_Substring(line, cut + 1, length)))
        offset = product - i
        table.add(left, right, i, product)
    return (table, symbols.extra), -1


def table_from_ranks(dict ranks, dict vocab, long long first_extra):
    """{(left, right): rank} (ranks >= 0) -> (PairTable, extra)."""
    cdef Py_ssize_t size = max(ranks.values(), default=-1) + 1
    numbers = [None] * first_extra
    for i in vocab.values():
        if 0 <= i < first_extra:
            numbers[i] = i
    cdef PairTable table = PairTable(len(ranks), size, numbers)
    cdef _Symbols symbols = _Symbols(vocab, first_extra)
    for (left, right), rank in ranks.items():
        if not 0 <= rank < size:
            raise ValueError(f"merge {(left, right)!r} has rank {rank!r}; ranks are ints >= 0")
        table.add(symbols.of(left), symbols.of(right), rank, symbols.of(left + right))
    return table, symbols.extra
