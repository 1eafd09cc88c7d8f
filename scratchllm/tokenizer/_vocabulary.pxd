"""A vocabulary in one str and C arrays: scratchllm/tokenizer/_vocabulary.pyx."""

from libc.stdint cimport int32_t


cdef class Vocabulary:
    cdef str blob  # every token's text, joined in id order
    cdef int kind  # the blob's storage width (1, 2 or 4 bytes a character)
    cdef char* data
    cdef int32_t* starts  # [n + 1]: token i is blob[starts[i]:starts[i + 1]]
    cdef Py_hash_t* hashes  # [n]: hash(text) of each token
    cdef int32_t* index  # [capacity]: ids by hash, open addressing; -1 empty
    cdef Py_ssize_t n, distinct, capacity
    cdef int shift
    cdef int32_t chars[512]  # the id of each one-character token below U+0200, or -1
    cdef readonly list numbers  # the int objects of the ids, by id (None: not made yet)

    cdef Py_ssize_t _slot(self, Py_hash_t h)
    cdef bint _equal_at(self, Py_ssize_t begin, str text, Py_ssize_t start, Py_ssize_t length)
    cdef object number(self, Py_ssize_t j)
    cdef Py_ssize_t find(self, str text) except -2
    cdef bint is_joined(self, Py_ssize_t token, str line, Py_ssize_t cut)
