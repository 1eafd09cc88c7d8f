# cython: language_level=3, boundscheck=False, wraparound=False
"""The BPE merge table over token ids, built in one C loop.

A pair of symbols (left, right) is keyed by one int, left * PAIR_KEY + right (bpe.pair_key),
whose value is the pair's rank; merged[rank] is the symbol the pair becomes. A symbol is the
vocabulary id of its text, or, for a text that is no token (a merge half or product missing from
the vocabulary: legal in a file, never seen in the ones we test), an extra number from
`first_extra` up, kept in `extra` (text -> number) so that such merges still happen as they
would over strings.

Why ids and not {(left, right): rank} over str: the strings version held 97800 new half strings
and 48900 tuples for SmolLM2's merges (10.3 MiB traced); the id table holds 48900 int keys and
a list (4.5 MiB), and every int value is the vocabulary's own id object (`numbers`).

GGUF lines follow llama.cpp's rule: "left right" is cut at the first space after its first
character, and a pair listed twice keeps its first (best) rank, as tokenizers does.
"""

from cpython.object cimport PyObject


cdef extern from "Python.h":
    Py_ssize_t PyUnicode_GET_LENGTH(object s)
    Py_ssize_t PyUnicode_FindChar(object s, Py_UCS4 ch, Py_ssize_t start, Py_ssize_t end, int direction) except -2
    object PyUnicode_Substring(object s, Py_ssize_t start, Py_ssize_t end)
    object PyUnicode_Concat(object left, object right)
    Py_UCS4 PyUnicode_READ_CHAR(object s, Py_ssize_t index)
    # Borrowed references (NULL: missing or error), declared as raw pointers so that Cython does
    # not release references it never owned.
    PyObject* PyDict_SetDefault(object d, object key, object default) except NULL
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL
    dict _PyDict_NewPresized(Py_ssize_t minused)

# Must equal bpe.PAIR_KEY: odd, so that keys of consecutive lefts spread over the dict's low
# bits (an int hashes to itself); larger than any symbol, so that a key names one pair.
cdef long long PAIR_KEY = 0x9E3779B1
# Symbols stay below this: left * PAIR_KEY + right then fits a signed 64-bit integer.
cdef long long MAX_SYMBOL = 1 << 31


# Single characters below this code point get their symbol from an array, not the vocabulary
# (GPT-2's byte alphabet ends at U+0143).
cdef Py_ssize_t CHARS = 512


cdef class _Table:
    cdef dict vocab, extra
    cdef list keys, ranks  # the pairs' keys and ranks in merge order, until result() makes the table
    cdef list merged, tokens, numbers
    cdef list chars  # [CHARS]: the symbol of a one-character text, once looked up
    cdef long long next_extra

    def __init__(self, dict vocab, long long first_extra, Py_ssize_t size, list tokens=None, list numbers=None):
        self.vocab = vocab
        self.extra = {}
        self.keys, self.ranks = [], []
        self.merged = [None] * size
        self.next_extra = first_extra
        self.chars = [None] * CHARS
        # tokens: the vocabulary as a list without duplicates (a text at position i has id i), for
        # guessing a product's id; numbers: the int objects of those ids.
        self.tokens = tokens
        self.numbers = numbers
        assert tokens is None or (numbers is not None and len(numbers) >= len(tokens))

    cdef object symbol(self, str text):
        # Why the shortcut: a lookup in the 49k-entry vocabulary is a cache miss or more, and
        # 13164 of SmolLM2's 97800 halves are single characters.
        cdef Py_ssize_t c
        if PyUnicode_GET_LENGTH(text) == 1:
            c = <Py_ssize_t>PyUnicode_READ_CHAR(text, 0)
            if c < CHARS:
                if self.chars[c] is None:
                    self.chars[c] = self.lookup(text)
                return self.chars[c]
        return self.lookup(text)

    cdef object lookup(self, text):
        cdef PyObject* got = PyDict_GetItemWithError(self.vocab, text)
        if got != NULL:
            return <object>got
        got = PyDict_GetItemWithError(self.extra, text)
        if got != NULL:
            return <object>got
        number = self.next_extra
        self.next_extra += 1
        self.extra[text] = number
        return number

    cdef object product(self, text, Py_ssize_t guess):
        """The symbol of a pair's product. guess: the id it likely has (GPT-2 style files number
        each merge's product after the one before), checked by comparing its text: one look at
        the token list, in order, instead of a lookup."""
        if self.tokens is not None and 0 <= guess < len(self.tokens) and self.tokens[guess] == text:
            return self.numbers[guess]
        return self.symbol(text)

    cdef Py_ssize_t add(self, left, right, rank, Py_ssize_t index, Py_ssize_t guess=-1) except -2:
        """One merge of rank `rank` at merged[index]; returns the product's symbol."""
        cdef long long a = self.symbol(left), b = self.symbol(right)
        merged = self.product(PyUnicode_Concat(left, right), guess)
        if not (0 <= a < MAX_SYMBOL and 0 <= b < MAX_SYMBOL):
            raise OverflowError(f"token id of {left!r} or {right!r} is outside 0..{MAX_SYMBOL - 1}")
        self.keys.append(a * PAIR_KEY + b)
        self.ranks.append(rank)
        previous = self.merged[index]
        # Pairs that share a rank (tiktoken: every split of one token) must merge to one text.
        if previous is not None and previous != merged:
            raise ValueError(f"pairs of rank {rank} merge to different texts (one is {left + right!r})")
        self.merged[index] = merged
        return merged

    def result(self):
        """(pairs, merged, extra). The pairs go into their dict in a second pass: interleaved
        with the vocabulary lookups, the two tables' cache misses doubled the build time."""
        cdef Py_ssize_t i, n = len(self.keys)
        cdef dict pairs = _PyDict_NewPresized(n)  # sized once: no growth through 5 larger tables
        for i in range(n):
            PyDict_SetDefault(pairs, self.keys[i], self.ranks[i])
        self.keys = self.ranks = None
        return pairs, self.merged, self.extra


def table_from_lines(list merges, dict vocab, long long first_extra, list numbers=None, list tokens=None):
    """GGUF merge lines -> ((pairs, merged, extra), -1), or (None, i) where line i has no space
    after its first character. numbers: int objects to use as the ranks where long enough
    (numbers[i] == i), the vocabulary's own ids instead of 48900 new ones. tokens: the
    vocabulary's texts by id, given only where no text is listed twice. Raises TypeError where a
    line is not a str."""
    cdef Py_ssize_t n = len(merges)
    cdef Py_ssize_t shared = min(n, len(numbers)) if numbers is not None else 0
    cdef _Table table = _Table(vocab, first_extra, n, tokens, numbers)
    cdef Py_ssize_t i, cut, length, offset = -1
    for i in range(n):
        line = merges[i]
        if type(line) is not str:
            raise TypeError(f"merge #{i} is {type(line).__name__}, not str")
        length = PyUnicode_GET_LENGTH(line)
        cut = PyUnicode_FindChar(line, 32, 1, length, 1) if length > 1 else -1  # 32: ' '
        if cut < 0:
            return None, i
        # The guess: this line's product has the id of the last one's plus one.
        offset = table.add(PyUnicode_Substring(line, 0, cut), PyUnicode_Substring(line, cut + 1, length),
                           numbers[i] if i < shared else i, i, i + offset) - i
    return table.result(), -1


def table_from_ranks(dict ranks, dict vocab, long long first_extra):
    """{(left, right): rank} (ranks >= 0) -> (pairs, merged, extra); merged is indexed by rank."""
    cdef Py_ssize_t size = max(ranks.values(), default=-1) + 1
    cdef _Table table = _Table(vocab, first_extra, size)
    for (left, right), rank in ranks.items():
        if not 0 <= rank < size:
            raise ValueError(f"merge {(left, right)!r} has rank {rank!r}; ranks are ints >= 0")
        table.add(left, right, rank, rank)
    return table.result()
