# cython: language_level=3, boundscheck=False, wraparound=False
"""The merge loop of a SentencePiece BPE vocabulary, over the text of one piece.

Start from one symbol per character: its token, or, for a character that is no token, the
tokens of its UTF-8 bytes (<0xNN>, byte fallback), or else the unknown token (runs of unknown
characters fused into one). Then merge, best pair first, until no adjacent pair makes a token.

A pair (left, right) merges when the joined text is a token; its rank is (order[product], longer
left first), order being the merge order of the products (sentencepiece.py builds it from the
file). This is the merge list Hugging Face derives from such a vocabulary (every split of every
token into two tokens, best product first, then longer left half first) without building that
list: the pair's product is found by looking the joined text up in the vocabulary, when it is
asked. Ties in rank go to the leftmost pair, taken from a binary heap as `tokenizers` takes them
(a popped pair whose symbols changed since it was pushed is dropped).

Cost: one substring and one hash lookup per pair considered (pairs longer than the longest token
are skipped without either): about n + 2 * merges for a piece of n characters.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t

from scratchllm.tokenizer._vocabulary cimport Vocabulary


cdef extern from "Python.h":
    Py_ssize_t PyUnicode_GET_LENGTH(object s)
    object PyUnicode_Substring(object s, Py_ssize_t start, Py_ssize_t end)
    Py_UCS4 PyUnicode_READ_CHAR(object s, Py_ssize_t index)

cdef Py_ssize_t CHARS = 512  # Vocabulary.chars: the ids of one-character tokens below this code point
cdef int64_t LEFT_SLOTS = 1 << 20  # a rank is order * LEFT_SLOTS + (LEFT_SLOTS - 1 - left length)


cdef struct Symbol:
    int32_t id
    int32_t start  # where its text begins in the piece; -1: its text is not the piece's (byte, unknown)
    int32_t length  # characters of its token text
    int32_t prev, next  # neighbours, -1 at the ends; length 0: merged into its left neighbour


cdef struct Entry:
    int64_t rank
    int32_t pos  # the left symbol
    int32_t product


cdef inline bint _before(Entry* a, Entry* b):
    return a.rank < b.rank or (a.rank == b.rank and a.pos < b.pos)


cdef void _push(Entry* heap, Py_ssize_t* size, Entry e):
    cdef Py_ssize_t i = size[0], parent
    size[0] += 1
    heap[i] = e
    while i > 0:
        parent = (i - 1) >> 1
        if not _before(&heap[i], &heap[parent]):
            break
        heap[i], heap[parent] = heap[parent], heap[i]
        i = parent


cdef Entry _pop(Entry* heap, Py_ssize_t* size):
    cdef Entry top = heap[0]
    cdef Py_ssize_t i = 0, child, n
    size[0] -= 1
    n = size[0]
    heap[0] = heap[n]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and _before(&heap[child + 1], &heap[child]):
            child += 1
        if not _before(&heap[child], &heap[i]):
            break
        heap[i], heap[child] = heap[child], heap[i]
        i = child
    return top


cdef class PieceMerger:
    """vocab: the pieces by id; order: int64 per id, the merge order of a pair making that
    token (lower first); byte_ids: the id of <0xNN> for each byte (-1: none); unk_id: the unknown
    token (-1: none); max_length: the longest token, in characters."""
    cdef Vocabulary vocab
    cdef int64_t* order
    cdef int32_t byte_ids[256]
    cdef int32_t unk_id
    cdef Py_ssize_t max_length

    def __cinit__(self, Vocabulary vocab, const int64_t[:] order, list byte_ids, int unk_id, Py_ssize_t max_length):
        cdef Py_ssize_t i
        if order.shape[0] != vocab.n or len(byte_ids) != 256:
            raise ValueError("order needs one entry per token and byte_ids one per byte")
        if max_length >= LEFT_SLOTS:
            raise OverflowError(f"a token of {max_length} characters is longer than this merge loop ranks")
        self.vocab = vocab
        self.order = <int64_t*>PyMem_Malloc(max(vocab.n, 1) * sizeof(int64_t))
        if not self.order:
            raise MemoryError()
        for i in range(vocab.n):
            self.order[i] = order[i]
        for i in range(256):
            self.byte_ids[i] = byte_ids[i]
        self.unk_id = unk_id
        self.max_length = max_length

    def __dealloc__(self):
        PyMem_Free(self.order)

    cdef int _pair(self, str piece, Symbol* sym, int32_t left, int32_t right, Entry* out) except -1:
        """Fill `out` and return 1 where sym[left] + sym[right] is a token, else return 0."""
        cdef Symbol* a = &sym[left]
        cdef Symbol* b = &sym[right]
        cdef Py_ssize_t j
        if a.length + b.length > self.max_length:
            return 0
        if a.start >= 0 and b.start >= 0:  # both texts are the piece's own, side by side
            j = self.vocab.find(PyUnicode_Substring(piece, a.start, b.start + b.length))
        else:
            j = self.vocab.find(self.vocab.text(a.id) + self.vocab.text(b.id))
        if j < 0:
            return 0
        out.rank = self.order[j] * LEFT_SLOTS + (LEFT_SLOTS - 1 - a.length)
        out.pos = left
        out.product = <int32_t>j
        return 1

    cdef int _add(self, Symbol* sym, Py_ssize_t* m, int32_t token, int32_t start, int32_t length) except -1:
        cdef Py_ssize_t k = m[0]
        sym[k].id = token
        sym[k].start = start
        sym[k].length = length
        sym[k].prev = <int32_t>(k - 1)
        sym[k].next = -1
        if k > 0:
            sym[k - 1].next = <int32_t>k
        m[0] = k + 1
        return 0

    def encode(self, str piece):
        """The ids of one piece of text (already normalized: spaces as U+2581)."""
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(piece), i, m = 0, size = 0, nb, b
        cdef Py_UCS4 c
        cdef Py_ssize_t j
        cdef int32_t unk_pending = 0, unk_length = 0, right
        cdef unsigned char utf8[4]
        cdef bint bytes_ok
        cdef Entry e, f
        cdef int32_t pos
        if n == 0:
            return []
        if n >= 2**31 - 1:
            raise OverflowError("a piece this long is beyond this merge loop")
        # At most four byte symbols a character; at most one heap entry per pair considered.
        cdef Symbol* sym = <Symbol*>PyMem_Malloc(4 * n * sizeof(Symbol))
        cdef Entry* heap = <Entry*>PyMem_Malloc(3 * 4 * n * sizeof(Entry))
        if not sym or not heap:
            PyMem_Free(sym)
            PyMem_Free(heap)
            raise MemoryError()
        try:
            for i in range(n):
                c = PyUnicode_READ_CHAR(piece, i)
                j = self.vocab.chars[c] if c < CHARS else self.vocab.find(PyUnicode_Substring(piece, i, i + 1))
                if j >= 0:
                    if unk_pending:
                        self._add(sym, &m, self.unk_id, -1, unk_length)
                        unk_pending = 0
                    self._add(sym, &m, <int32_t>j, <int32_t>i, 1)
                    continue
                nb = _utf8(c, utf8)
                bytes_ok = True
                for b in range(nb):
                    if self.byte_ids[utf8[b]] < 0:
                        bytes_ok = False
                if bytes_ok:  # (a pending unknown stays pending, as in tokenizers' BPE)
                    for b in range(nb):
                        self._add(sym, &m, self.byte_ids[utf8[b]], -1, 6)  # "<0xNN>"
                    continue
                if self.unk_id < 0:
                    raise ValueError(f"character {chr(c)!r} is no token, has no byte tokens and there is no unknown token")
                if not unk_pending:  # fused: one unknown for a run of them
                    unk_pending, unk_length = 1, <int32_t>PyUnicode_GET_LENGTH(self.vocab.text(self.unk_id))
            if unk_pending:
                self._add(sym, &m, self.unk_id, -1, unk_length)
            for i in range(m - 1):
                if self._pair(piece, sym, <int32_t>i, <int32_t>(i + 1), &e):
                    _push(heap, &size, e)
            while size > 0:
                e = _pop(heap, &size)
                pos = e.pos
                if sym[pos].length == 0 or sym[pos].next < 0:
                    continue
                right = sym[pos].next
                # A stale entry (its symbols changed since it was pushed) makes another token now.
                if not self._pair(piece, sym, pos, right, &f) or f.product != e.product:
                    continue
                if sym[right].start < 0:
                    sym[pos].start = -1
                sym[pos].id = e.product
                sym[pos].length += sym[right].length
                sym[right].length = 0
                sym[pos].next = sym[right].next
                if sym[right].next >= 0:
                    sym[sym[right].next].prev = pos
                if sym[pos].prev >= 0 and self._pair(piece, sym, sym[pos].prev, pos, &f):
                    _push(heap, &size, f)
                if sym[pos].next >= 0 and self._pair(piece, sym, pos, sym[pos].next, &f):
                    _push(heap, &size, f)
            out = []
            i = 0 if m > 0 else -1
            while i >= 0:
                out.append(sym[i].id)
                i = sym[i].next
            return out
        finally:
            PyMem_Free(sym)
            PyMem_Free(heap)


cdef inline Py_ssize_t _utf8(Py_UCS4 ch, unsigned char* out):
    """ch's UTF-8 bytes into out; their count. (A lone surrogate gets its three-byte form.)"""
    cdef unsigned int c = ch
    if c < 0x80:
        out[0] = <unsigned char>c
        return 1
    if c < 0x800:
        out[0] = <unsigned char>(0xC0 | (c >> 6))
        out[1] = <unsigned char>(0x80 | (c & 0x3F))
        return 2
    if c < 0x10000:
        out[0] = <unsigned char>(0xE0 | (c >> 12))
        out[1] = <unsigned char>(0x80 | ((c >> 6) & 0x3F))
        out[2] = <unsigned char>(0x80 | (c & 0x3F))
        return 3
    out[0] = <unsigned char>(0xF0 | (c >> 18))
    out[1] = <unsigned char>(0x80 | ((c >> 12) & 0x3F))
    out[2] = <unsigned char>(0x80 | ((c >> 6) & 0x3F))
    out[3] = <unsigned char>(0x80 | (c & 0x3F))
    return 4
