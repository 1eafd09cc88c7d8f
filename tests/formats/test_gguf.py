"""GGUF: files written by the gguf package's writer, read by ours, checked against its reader."""

import numpy as np
import pytest

from scratchllm import FormatError, load_checkpoint
from scratchllm.formats.gguf import GGUFFile

gguf = pytest.importorskip("gguf")


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, so NaN == NaN and -0.0 != 0.0: 'equal' means bit for bit."""
    return a.view(np.uint32) if a.dtype == np.float32 else a.view(np.uint16)


def test_every_type_equals_gguf_dequantize_bit_for_bit(small_gguf):
    ckpt = load_checkpoint(small_gguf)
    reader = gguf.GGUFReader(small_gguf)
    assert ckpt.format == "gguf" and len(ckpt) == len(reader.tensors) == 7
    for t in reader.tensors:
        ours = ckpt[t.name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        kind = t.tensor_type.name
        expected_dtype = np.float16 if kind == "F16" else np.float32
        assert ours.dtype == expected_dtype, t.name
        assert ours.shape == ref.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        np.testing.assert_array_equal(bits(ours), bits(ref.astype(expected_dtype)), err_msg=t.name)
        info = ckpt.tensor_info(t.name)
        assert info.dtype == kind and info.offset == t.data_offset and info.nbytes == t.n_bytes


def test_as_q8_is_the_dequantization_bit_for_bit(gguf_writer, tmp_path):
    # the form a quantized kernel keeps (int8 q, scale d, offset m) makes the same floats
    from scratchllm.formats import ggml_quants as gq

    x = np.random.default_rng(2).uniform(-1, 1, (3, 96)).astype(np.float32)
    kinds = ("Q8_0", "Q4_0", "Q4_1")
    ckpt = load_checkpoint(gguf_writer(tmp_path / "q.gguf", {k: (x, k) for k in kinds}))
    for kind in kinds:
        q, d, m = gq.as_q8(kind, ckpt.raw(kind), (3, 96))
        assert q.dtype == np.int8 and q.shape == (3, 96) and d.shape == m.shape == (3, 3)
        w = q.astype(np.float32).reshape(3, 3, 32)
        w *= d[:, :, None]
        w += m[:, :, None]
        np.testing.assert_array_equal(bits(w.reshape(3, 96) + 0.0), bits(ckpt[kind] + 0.0), err_msg=kind)


def test_quantized_values_are_close_to_the_originals(gguf_writer, tmp_path):
    # Independent of the gguf package's dequantizer: a round trip must land within one quantum.
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (4, 256)).astype(np.float32)
    tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1 / 127 + 1e-6, "Q4_0": 1 / 7 + 1e-6, "Q4_1": 2 / 15 + 1e-6}
    path = gguf_writer(tmp_path / "rt.gguf", {k: (x, k) for k in tol})
    ckpt = load_checkpoint(path)
    for kind, t in tol.items():
        np.testing.assert_allclose(ckpt[kind].astype(np.float32), x, atol=t, rtol=0, err_msg=kind)


def test_plain_tensors_are_zero_copy_views(small_gguf):
    ckpt = load_checkpoint(small_gguf)
    for name in ("t.F32", "t.F16"):
        a = ckpt[name]
        assert not a.flags.owndata and not a.flags.writeable
        assert isinstance(a.base, np.ndarray) or a.base is not None


def test_metadata_of_every_value_type(gguf_writer, tmp_path):
    V = gguf.GGUFValueType
    meta = {
        "u8": (200, V.UINT8, None), "i8": (-5, V.INT8, None), "u16": (65000, V.UINT16, None),
        "i16": (-30000, V.INT16, None), "u32": (4_000_000_000, V.UINT32, None), "i32": (-7, V.INT32, None),
        "f32": (0.5, V.FLOAT32, None), "bool": (True, V.BOOL, None), "str": ("héllo 世界", V.STRING, None),
        "u64": (2**63 + 5, V.UINT64, None), "i64": (-(2**62), V.INT64, None), "f64": (0.1, V.FLOAT64, None),
        "arr.i32": ([3, -1, 2], V.ARRAY, V.INT32), "arr.str": (["a", "", "Ġt"], V.ARRAY, V.STRING),
        "arr.bool": ([True, False], V.ARRAY, V.BOOL), "arr.f32": ([0.25, -1.5], V.ARRAY, V.FLOAT32),
    }
    path = gguf_writer(tmp_path / "meta.gguf", {"x": (np.ones(32, np.float32), "F32")}, meta)
    f = GGUFFile(path)
    for key, (value, _, _) in meta.items():
        assert f.metadata[key] == value, key
        assert type(f.metadata[key]) is type(value), key
    assert f.metadata["general.architecture"] == "llama"
    assert f.metadata_types["arr.str"] == "ARRAY[STRING]"
    reader = gguf.GGUFReader(path)
    assert f.data_offset == reader.data_offset and f.version == 3 and f.alignment == 32


def test_version_2_reads_like_version_3(small_gguf, tmp_path):
    data = bytearray(small_gguf.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")  # v2 and v3 share the layout (v3 added big-endian files)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(data))
    a, b = load_checkpoint(small_gguf), load_checkpoint(v2)
    assert GGUFFile(v2).version == 2
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_custom_alignment(gguf_writer, tmp_path):
    V = gguf.GGUFValueType
    path = gguf_writer(tmp_path / "a.gguf", {"x": (np.arange(64, dtype=np.float32), "F32"),
                                             "y": (np.arange(32, dtype=np.float32), "Q8_0")},
                       {"general.alignment": (64, V.UINT32, None)})
    f = GGUFFile(path)
    assert f.alignment == 64 and f.data_offset % 64 == 0
    np.testing.assert_array_equal(f.tensor("x"), np.arange(64, dtype=np.float32))


def test_types_we_do_not_decode_are_listed_but_refused_on_read(tmp_path, gguf_writer):
    path = gguf_writer(tmp_path / "iq.gguf", {"k": (np.zeros((2, 66), np.uint8), "IQ2_XXS")})
    ckpt = load_checkpoint(path)
    assert ckpt.tensor_info("k").dtype == "IQ2_XXS" and ckpt.tensor_info("k").shape == (2, 256)
    with pytest.raises(FormatError, match=r"'k' is IQ2_XXS; we decode only .*Q4_K.*Q6_K"):
        ckpt["k"]


@pytest.mark.slow
def test_default_model_every_tensor_equals_the_gguf_reader(default_gguf):
    ckpt = load_checkpoint("default")
    reader = gguf.GGUFReader(default_gguf)
    assert len(ckpt) == len(reader.tensors) == 272
    for t in reader.tensors:
        ours = ckpt[t.name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(ours.dtype)
        np.testing.assert_array_equal(bits(ours), bits(ref), err_msg=t.name)
    # Metadata the tokenizer and the models read, against the reference reader's fields.
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert ckpt.metadata[key] == reader.fields[key].contents(), key
    assert ckpt.metadata["llama.block_count"] == reader.fields["llama.block_count"].contents()
    assert ckpt.metadata["tokenizer.chat_template"] == reader.fields["tokenizer.chat_template"].contents()
    assert ckpt["token_embd.weight"].shape == (49152, 576)  # [vocab, hidden], HF row-major


def test_default_model_header_parses_fast(default_gguf):
    import time

    GGUFFile(default_gguf)  # warm the page cache
    times = []
    for _ in range(3):
        start = time.perf_counter()
        GGUFFile(default_gguf)
        times.append(time.perf_counter() - start)
    assert sorted(times)[1] < 0.5, times  # 49152 tokens + 48900 merges
