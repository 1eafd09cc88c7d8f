"""GGUF string arrays (the C reader in scratchllm/formats/_gguf_strings.pyx): the values equal what
the gguf package wrote and Python's own UTF-8 codec decodes, and every lie about a length is
refused with a FormatError naming the array and the element, never read past."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchllm import FormatError, load_checkpoint
from scratchllm.formats.gguf import GGUFFile

gguf = pytest.importorskip("gguf")

STRING, ARRAY = 8, 9


def header(kv: list[tuple[str, int, bytes]]) -> bytes:
    """A GGUF with no tensors and the given (key, value type, payload) metadata."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, vtype, payload in kv:
        raw = key.encode()
        out += struct.pack("<Q", len(raw)) + raw + struct.pack("<I", vtype) + payload
    return out + b"\0" * (-len(out) % 32)


def string_array(items: list[bytes]) -> bytes:
    return struct.pack("<IQ", STRING, len(items)) + b"".join(struct.pack("<Q", len(b)) + b for b in items)


def refused(tmp_path, content: bytes, match: str) -> FormatError:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(FormatError, match=match) as err:
        load_checkpoint(path)
    assert err.value.path == str(path)
    return err.value


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(max_size=12), min_size=1, max_size=40))  # the writer refuses empty arrays
def test_string_arrays_equal_what_the_gguf_writer_wrote(tmp_path_factory, items):
    path = tmp_path_factory.mktemp("s") / "s.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value("arr", items, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    writer.add_tensor("x", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    assert f.metadata["arr"] == items
    assert f.metadata["arr"] == gguf.GGUFReader(path).fields["arr"].contents()
    np.testing.assert_array_equal(f.tensor("x"), np.ones(32, np.float32))  # the walk ended where it should


def test_bytes_that_are_not_utf8_round_trip_as_surrogateescape(tmp_path):
    items = [b"ok", b"\xff\xfe", b"caf\xc3\xa9", b"\xc3", b"", b"\xe4\xb8\x96\xe7\x95\x8c"]
    path = tmp_path / "odd.gguf"
    path.write_bytes(header([("arr", ARRAY, string_array(items)), ("after", 4, struct.pack("<I", 7))]))
    f = GGUFFile(path)
    assert f.metadata["arr"] == [b.decode("utf-8", "surrogateescape") for b in items]
    assert [s.encode("utf-8", "surrogateescape") for s in f.metadata["arr"]] == items
    assert f.metadata["after"] == 7  # the value after the array is read from the right offset


@pytest.mark.parametrize("cut_at,match", [
    ("length", r"truncated: metadata 'arr'\[2\] at offset"),  # inside the third length field
    ("bytes", r"truncated: metadata 'arr'\[2\] needs 5 bytes at offset"),  # inside its bytes
])
def test_a_cut_inside_a_string_array_names_the_element(tmp_path, cut_at, match):
    # The first string is long enough that the cut passes the check of 8 bytes per string.
    body = header([("arr", ARRAY, string_array([b"a" * 20, b"bc", b"defgh"]))])
    third = body.index(struct.pack("<Q", 5))  # the third string's length field
    refused(tmp_path, body[:third + (4 if cut_at == "length" else 8 + 3)], match)


@pytest.mark.parametrize("length", [2**31, 2**63, 2**64 - 1])
def test_absurd_string_lengths_are_refused_not_wrapped(tmp_path, length):
    payload = struct.pack("<IQ", STRING, 2) + struct.pack("<Q", 1) + b"a" + struct.pack("<Q", length) + b"x" * 64
    err = refused(tmp_path, header([("arr", ARRAY, payload)]), rf"'arr'\[1\] needs {length} bytes")
    assert "truncated" in str(err)


def test_a_count_the_file_cannot_hold_is_refused_before_any_string_is_read(tmp_path):
    payload = struct.pack("<IQ", STRING, 2**40) + struct.pack("<Q", 1) + b"a"
    refused(tmp_path, header([("arr", ARRAY, payload)]), r"truncated: metadata 'arr' \(1099511627776 strings\)")
