"""Q5_0, Q5_1, the K-quants (Q2_K..Q6_K) and IQ4_NL / IQ4_XS: decoded bit for bit as the gguf
package decodes them, described by inspect, and refused cleanly when a file lies about them."""

import struct

import numpy as np
import pytest

from scratchllm import FormatError, load_checkpoint
from scratchllm.formats import ggml_quants as gq

gguf = pytest.importorskip("gguf")

NEW_TYPES = ["Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
SCALE_FIELDS = ("d", "dmin", "m")  # the float16 fields of a block


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, so NaN == NaN and -0.0 != 0.0: 'equal' means bit for bit."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def random_raw(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes]: random bytes, each float16 field any finite value (zeros, subnormals,
    negatives and 65504 included): every bit of the layout matters and no value is special-cased."""
    rng = np.random.default_rng(seed)
    block = gq.BLOCK_DTYPES[kind]
    n = rows * cols // gq.BLOCK_SIZE[kind]
    raw = rng.integers(0, 256, n * block.itemsize, dtype=np.uint8)
    blocks = raw.view(block)
    for field in SCALE_FIELDS:
        if field in block.names:
            h = rng.integers(0, 1 << 16, n).astype(np.uint16)
            h[(h & 0x7C00) == 0x7C00] &= 0x83FF  # exponent all ones (inf, NaN) -> a finite value
            blocks[field] = h.view(np.float16)
    return raw.reshape(rows, -1)


def gguf_reference(kind: str, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)


@pytest.mark.parametrize("kind", NEW_TYPES)
def test_dequantize_equals_gguf_bit_for_bit(kind):
    rows, cols = 6, 2 * gq.BLOCK_SIZE[kind] + (256 if gq.BLOCK_SIZE[kind] == 32 else 0)
    for seed in range(3):
        raw = random_raw(kind, rows, cols, seed)
        ours = gq.dequantize(kind, raw.reshape(-1), rows * cols).reshape(rows, cols)
        np.testing.assert_array_equal(bits(ours), bits(gguf_reference(kind, raw)), err_msg=f"{kind} seed {seed}")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0"])
def test_chunks_and_a_callers_buffer_give_the_same_floats(kind, monkeypatch):
    """More blocks than one chunk (a loop over chunks), into a caller's buffer (an arena slot)."""
    monkeypatch.setattr(gq, "CHUNK_ELEMENTS", 1024)
    rows, cols = 9, 1024
    raw = random_raw(kind, rows, cols, seed=4)
    out = np.full(rows * cols, np.nan, np.float32)
    got = gq.dequantize(kind, raw.reshape(-1), rows * cols, out=out)
    assert got.base is out or got is out
    np.testing.assert_array_equal(bits(out.reshape(rows, cols)), bits(gguf_reference(kind, raw)))


def test_types_written_to_a_file_read_back_as_the_gguf_reader_reads_them(gguf_writer, tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"t.{k}": (random_raw(k, 3, 512, seed=i), k) for i, k in enumerate(NEW_TYPES)}
    tensors["q.Q5_0"] = (rng.standard_normal((5, 96)).astype(np.float32), "Q5_0")  # the gguf package's quantizer
    tensors["q.Q5_1"] = (rng.standard_normal((5, 96)).astype(np.float32), "Q5_1")
    path = gguf_writer(tmp_path / "k.gguf", tensors)
    ckpt = load_checkpoint(path)
    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == len(tensors)
    for t in reader.tensors:
        ours = ckpt[t.name]
        assert ours.dtype == np.float32 and ours.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        np.testing.assert_array_equal(bits(ours), bits(gguf_reference(t.tensor_type.name, t.data)), err_msg=t.name)
        info = ckpt.tensor_info(t.name)
        assert info.dtype == t.tensor_type.name and info.nbytes == t.n_bytes and info.offset == t.data_offset
    x = ckpt["q.Q5_1"]  # and the values are the originals to within a quantum
    np.testing.assert_allclose(x, tensors["q.Q5_1"][0], atol=np.ptp(tensors["q.Q5_1"][0], axis=1).max() / 31)


@pytest.mark.parametrize("kind", sorted(gq.KERNEL_TYPES))
def test_as_q8_is_the_dequantization_bit_for_bit(kind):
    """The kernels' form (int8 q, float32 d and m per 32, value d * q + m) makes the dequantized floats;
    + 0.0 on both sides: a type without offsets gets m = +0, which turns a -0 product into +0."""
    rows, cols = 5, 512
    raw = random_raw(kind, rows, cols, seed=7)
    q, d, m = gq.as_q8(kind, raw.reshape(-1), (rows, cols))
    assert q.dtype == np.int8 and q.shape == (rows, cols) and d.shape == m.shape == (rows, cols // 32)
    assert d.dtype == m.dtype == np.float32
    w = q.astype(np.float32).reshape(rows, cols // 32, 32)
    w *= d[:, :, None]
    w += m[:, :, None]
    want = gq.dequantize(kind, raw.reshape(-1), rows * cols).reshape(rows, cols)
    np.testing.assert_array_equal(bits(w.reshape(rows, cols) + 0.0), bits(want + 0.0))


def test_groups_say_what_the_kernels_can_keep():
    assert gq.KERNEL_TYPES == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "IQ4_XS"}
    for kind in ("Q2_K", "Q3_K", "Q6_K"):
        q, d, m = gq.groups(kind, random_raw(kind, 1, 256).reshape(-1).view(gq.BLOCK_DTYPES[kind]))
        assert q.shape == (1, 16, 16) and d.shape == (1, 16)  # 16 scales per block: no 32-wide kernel
    q, d, m = gq.groups("Q4_K", random_raw("Q4_K", 1, 256).reshape(-1).view(gq.BLOCK_DTYPES["Q4_K"]))
    assert q.min() >= 0 and q.max() <= 15 and q.shape == (1, 8, 32) and (m <= 0).all()  # m = -(Dmin * min)


def test_every_type_we_decode_is_described(gguf_writer, tmp_path):
    from scratchllm.formats.describe import describe

    assert set(gq.QUANT_LAYOUT) == set(gq.BLOCK_DTYPES)
    path = gguf_writer(tmp_path / "d.gguf", {k: (random_raw(k, 2, 256), k) for k in NEW_TYPES})
    tensors = {t["name"]: t for t in describe(path)["tensors"]}
    for kind in NEW_TYPES:
        assert tensors[kind]["dtype"] == kind and tensors[kind]["quantization"] == gq.QUANT_LAYOUT[kind]
    assert "per 16" in gq.QUANT_LAYOUT["Q6_K"] and "5-bit" in gq.QUANT_LAYOUT["Q5_K"]


def header(tensors, data: bytes) -> bytes:
    """A GGUF v3 file built field by field (so a tensor can lie about its size): (name, ne, type id)."""
    def s(text):
        return struct.pack("<Q", len(text)) + text.encode()
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 0)
    for name, ne, type_id in tensors:
        out += s(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", type_id, 0)
    return out + b"\0" * (-len(out) % 32) + data


TYPE_IDS = {name: i for i, (name, _, _) in gq.GGML_TYPES.items()}


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q2_K", "IQ4_XS"])
def test_rows_of_partial_blocks_are_refused_naming_the_tensor(tmp_path, kind):
    path = tmp_path / "partial.gguf"
    path.write_bytes(header([("blk.0.ffn_up.weight", [128, 2], TYPE_IDS[kind])], bytes(4096)))
    with pytest.raises(FormatError, match=f"'blk.0.ffn_up.weight': innermost dimension 128 is not a multiple of "
                                          f"the {kind} block size 256"):
        load_checkpoint(path)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_short_block_bytes_are_refused_naming_the_tensor(tmp_path, kind):
    nbytes = 2 * 512 // gq.BLOCK_SIZE[kind] * gq.BLOCK_DTYPES[kind].itemsize
    path = tmp_path / "short.gguf"
    path.write_bytes(header([("output.weight", [512, 2], TYPE_IDS[kind])], bytes(nbytes - 1)))
    with pytest.raises(FormatError, match=r"'output.weight' ends at byte \d+ but the file has \d+ bytes \(truncated"):
        load_checkpoint(path)
