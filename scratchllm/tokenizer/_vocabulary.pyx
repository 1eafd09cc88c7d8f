# cython: language_level=3, boundscheck=False, wraparound=False
"""A byte-level BPE vocabulary in one str and C arrays: text -> id and id -> text.

Why not dict(zip(tokens, ids)) and the list of tokens: for SmolLM2's 49152 tokens the 49152 str
objects took 4.0 MiB and the dict 1.8 MiB; here the texts are one str of 319k characters (two
bytes each: GPT-2's byte alphabet ends at U+0143) and the lookup an open-addressing index of ids
by the texts' own str hash, 1.7 MiB in all. A text is made again (a new str) when asked for by
id: decoding memoizes token bytes, so that happens once per token in use.

The mapping follows dict(zip(tokens, ids)): a text listed twice has its last id, and len() counts
distinct texts.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t
from libc.string cimport memcmp


cdef extern from "Python.h":
    Py_ssize_t PyUnicode_GET_LENGTH(object s)
    int PyUnicode_KIND(object s)
    char* PyUnicode_DATA(object s)
    Py_UCS4 PyUnicode_READ(int kind, void* data, Py_ssize_t index)
    Py_UCS4 PyUnicode_READ_CHAR(object s, Py_ssize_t index)
    object PyUnicode_Substring(object s, Py_ssize_t start, Py_ssize_t end)

cdef Py_ssize_t CHARS = 512


cdef class Vocabulary:
    """tokens: the texts by id (a list of str). numbers: the int objects of the ids that this
    vocabulary hands out (and the merge table with it, and so the Tokenizer's cached pieces):
    by default made as ids are first asked for, [None] * n until then (the 49152 ints made up
    front took 1.5 MiB; a process meets only the ids of what it encodes)."""

    def __cinit__(self, list tokens, list numbers=None):
        cdef Py_ssize_t n = len(tokens), i, at = 0, slot
        cdef int32_t j
        if n >= 2**31 - 1:
            raise OverflowError(f"{n} tokens: more than this vocabulary indexes")
        self.n = n
        self.numbers = numbers if numbers is not None else [None] * n
        assert len(self.numbers) >= n
        self.capacity, self.shift = 16, 60
        while self.capacity < 2 * n:  # at most half full: short probes for texts that are no token
            self.capacity *= 2
            self.shift -= 1
        self.starts = <int32_t*>PyMem_Malloc((n + 1) * sizeof(int32_t))
        self.hashes = <Py_hash_t*>PyMem_Malloc(max(n, 1) * sizeof(Py_hash_t))
        self.index = <int32_t*>PyMem_Malloc(self.capacity * sizeof(int32_t))
        if not self.starts or not self.hashes or not self.index:
            raise MemoryError()
        for i in range(self.capacity):
            self.index[i] = -1
        for i in range(CHARS):
            self.chars[i] = -1
        self.blob = "".join(tokens)  # raises TypeError where a token is not a str
        self.kind = PyUnicode_KIND(self.blob)
        self.data = PyUnicode_DATA(self.blob)
        self.distinct = 0
        for i in range(n):
            token = tokens[i]
            self.starts[i] = <int32_t>at
            at += PyUnicode_GET_LENGTH(token)
            self.hashes[i] = hash(token)
            slot = self._slot(self.hashes[i])
            while True:
                j = self.index[slot]
                if j < 0:
                    self.index[slot] = <int32_t>i
                    self.distinct += 1
                    break
                if self.hashes[j] == self.hashes[i] and tokens[j] == token:
                    self.index[slot] = <int32_t>i  # listed twice: the last id, as dict(zip) keeps
                    break
                slot = (slot + 1) & (self.capacity - 1)
            if PyUnicode_GET_LENGTH(token) == 1 and PyUnicode_READ_CHAR(token, 0) < CHARS:
                self.chars[PyUnicode_READ_CHAR(token, 0)] = <int32_t>i
        self.starts[n] = <int32_t>at
        assert at == PyUnicode_GET_LENGTH(self.blob)

    def __dealloc__(self):
        PyMem_Free(self.starts)
        PyMem_Free(self.hashes)
        PyMem_Free(self.index)

    cdef Py_ssize_t _slot(self, Py_hash_t h):
        return <Py_ssize_t>((<unsigned long long>h * <unsigned long long>0x9E3779B97F4A7C15) >> self.shift)

    cdef Py_ssize_t find(self, str text) except -2:
        """The id of `text`, or -1."""
        cdef Py_ssize_t length = PyUnicode_GET_LENGTH(text), slot
        cdef int32_t j
        if length == 1 and PyUnicode_READ_CHAR(text, 0) < CHARS:
            return self.chars[PyUnicode_READ_CHAR(text, 0)]
        cdef Py_hash_t h = hash(text)
        slot = self._slot(h)
        while True:
            j = self.index[slot]
            if j < 0:
                return -1
            if self.hashes[j] == h and self.starts[j + 1] - self.starts[j] == length \
                    and self._equal_at(self.starts[j], text, 0, length):
                return j
            slot = (slot + 1) & (self.capacity - 1)

    cdef bint is_joined(self, Py_ssize_t token, str line, Py_ssize_t cut):
        """token's text == line without its character at `cut` (a merge line's product)."""
        cdef Py_ssize_t length = PyUnicode_GET_LENGTH(line)
        if not 0 <= token < self.n or self.starts[token + 1] - self.starts[token] != length - 1:
            return False
        cdef Py_ssize_t begin = self.starts[token]
        # Compare the two halves in place: the token's first `cut` characters, then the rest.
        if not self._equal_at(begin, line, 0, cut):
            return False
        return self._equal_at(begin + cut, line, cut + 1, length - cut - 1)

    cdef bint _equal_at(self, Py_ssize_t begin, str text, Py_ssize_t start, Py_ssize_t length):
        """blob[begin:begin + length] == text[start:start + length], compared in place. Equal
        texts may be stored in different widths here (the blob is as wide as its widest token)."""
        cdef int kind = PyUnicode_KIND(text)
        cdef char* data = PyUnicode_DATA(text)
        cdef Py_ssize_t i
        if kind == self.kind:
            return memcmp(self.data + begin * kind, data + start * kind, length * kind) == 0
        for i in range(length):
            if PyUnicode_READ(self.kind, self.data, begin + i) != PyUnicode_READ(kind, data, start + i):
                return False
        return True

    # ---- the mapping text -> id (what BPE and Tokenizer.token_to_id ask) ----------------------
    cdef object number(self, Py_ssize_t j):
        got = self.numbers[j]
        if got is None:
            got = self.numbers[j] = j
        return got

    def get(self, text, default=None):
        if type(text) is not str:
            return default
        cdef Py_ssize_t j = self.find(text)
        return default if j < 0 else self.number(j)

    def __contains__(self, text):
        return type(text) is str and self.find(text) >= 0

    def __getitem__(self, text):
        got = self.get(text)
        if got is None:
            raise KeyError(text)
        return got

    def __len__(self):
        return self.distinct

    def items(self):
        """[(text, id)] in id order, each text once (with its last id)."""
        return [(t, self.number(i)) for i in range(self.n) if self.find(t := self.text(i)) == i]

    # ---- id -> text ---------------------------------------------------------------------------
    @property
    def size(self):
        """Ids 0..size - 1 (texts listed twice included)."""
        return self.n

    def text(self, Py_ssize_t token):
        if not 0 <= token < self.n:
            raise IndexError(f"token id {token} is outside 0..{self.n - 1}")
        return PyUnicode_Substring(self.blob, self.starts[token], self.starts[token + 1])

    def symbols(self, str word):
        """The id of each character of `word` (-1: no token), as BPE starts merging."""
        cdef Py_ssize_t i, n = PyUnicode_GET_LENGTH(word), j
        cdef Py_UCS4 c
        out = [None] * n
        for i in range(n):
            c = PyUnicode_READ_CHAR(word, i)
            j = self.chars[c] if c < CHARS else self.find(PyUnicode_Substring(word, i, i + 1))
            out[i] = self.number(j) if j >= 0 else -1
        return out

    def nbytes(self):
        return ((self.n + 1) * sizeof(int32_t) + self.n * sizeof(Py_hash_t) + self.capacity * sizeof(int32_t)
                + PyUnicode_GET_LENGTH(self.blob) * self.kind)


class TokenTexts:
    """A vocabulary's texts by id, as a read-only sequence (TokenizerSpec.id_to_token)."""

    __slots__ = ("vocabulary",)

    def __init__(self, vocabulary: Vocabulary):
        self.vocabulary = vocabulary

    def __len__(self):
        return self.vocabulary.size

    def __getitem__(self, token_id):
        n = self.vocabulary.size
        if isinstance(token_id, slice):
            return [self.vocabulary.text(i) for i in range(*token_id.indices(n))]
        token_id = int(token_id)
        return self.vocabulary.text(token_id + n if token_id < 0 else token_id)

    def __iter__(self):
        return (self.vocabulary.text(i) for i in range(self.vocabulary.size))

    def __eq__(self, other):
        return isinstance(other, (list, TokenTexts)) and len(self) == len(other) and list(self) == list(other)

    __hash__ = None
