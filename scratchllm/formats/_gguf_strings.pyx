# cython: language_level=3, boundscheck=False, wraparound=False
"""GGUF string arrays in one C pass: the vocabulary and merges of a tokenizer (about 100k strings).

A GGUF string array is `count x (u64 length, length bytes of UTF-8)`, back to back. Its end is
only known after walking every length, so the walk is sequential; in Python it costs a struct
unpack, a slice and a decode call per string (most of a header's parse time), here a few
instructions and one decode per string.

Every length is checked against the end of the buffer before it is used, so a file that lies
about a length is refused (ValueError with the index and offset; gguf.py names the file),
never read past. Bytes that are not UTF-8 are kept with surrogateescape, as gguf.py's own
string reader does, so a vocabulary's odd tokens round-trip.
"""

from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint64_t


cdef inline uint64_t _u64le(const unsigned char* p) noexcept nogil:
    # Assembled byte by byte: little-endian whatever the host, and no unaligned load.
    return (<uint64_t>p[0] | <uint64_t>p[1] << 8 | <uint64_t>p[2] << 16 | <uint64_t>p[3] << 24
            | <uint64_t>p[4] << 32 | <uint64_t>p[5] << 40 | <uint64_t>p[6] << 48 | <uint64_t>p[7] << 56)


def read_strings(const unsigned char[::1] buf, Py_ssize_t pos, Py_ssize_t count):
    """(list of `count` str, the position after the last) for the string array at `pos` of `buf`.

    Where string i runs past the end, raises ValueError("length", i, offset) when its length
    field does not fit, ValueError("bytes", i, offset, length) when its bytes do not (the file's
    fault); IndexError for a `pos` outside the buffer or a negative `count` (the caller's)."""
    cdef Py_ssize_t end = buf.shape[0]
    cdef Py_ssize_t i
    cdef uint64_t n
    cdef const unsigned char* base = &buf[0] if end else NULL
    if pos < 0 or pos > end or count < 0:
        raise IndexError(f"read_strings: position {pos} or count {count} outside a buffer of {end} bytes")
    out = [None] * count
    for i in range(count):
        if end - pos < 8:
            raise ValueError("length", i, pos)
        n = _u64le(base + pos)
        pos += 8
        # Compared unsigned: a length of 2**63 or more must not wrap to a negative size.
        if n > <uint64_t>(end - pos):
            raise ValueError("bytes", i, pos, n)
        out[i] = PyUnicode_DecodeUTF8(<const char*>(base + pos), <Py_ssize_t>n, "surrogateescape")
        pos += <Py_ssize_t>n
    return out, pos
