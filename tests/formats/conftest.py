"""Writers of test files: every one uses a reference library nobody here wrote (gguf, torch,
safetensors), so a parser bug cannot hide behind a writer bug of ours."""

from pathlib import Path

import numpy as np
import pytest

QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def write_gguf(path, tensors: dict, metadata: dict | None = None, arch: str = "llama", split_max_tensors: int = 0):
    """tensors: name -> (float32 array, GGML type name). Quantized with the gguf package's own quantizer.
    split_max_tensors: write a split model of shards of at most that many tensors (the gguf package's
    own split writer: PATH's stem-00001-of-0000N.gguf, ...); returns the first shard's path."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for key, (value, vtype, sub) in (metadata or {}).items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for name, (array, type_name) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        if array.dtype == np.uint8:  # already the type's raw block bytes (types gguf cannot quantize)
            writer.add_tensor(name, array, raw_dtype=qtype)
        elif type_name in ("F32", "F16"):
            writer.add_tensor(name, array.astype(np.float32 if type_name == "F32" else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    first = writer.format_shard_names(Path(path))[0]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return first


@pytest.fixture
def small_gguf(tmp_path):
    """A GGUF with one tensor of every type we decode, odd row counts, 2-D and 3-D."""
    rng = np.random.default_rng(0)
    tensors = {
        f"t.{kind}": (rng.standard_normal((3, 5, 64)).astype(np.float32) * 3, kind) for kind in QUANT_TYPES
    }
    tensors["vec"] = (rng.standard_normal(7).astype(np.float32), "F32")
    return write_gguf(tmp_path / "small.gguf", tensors)


@pytest.fixture
def gguf_writer():
    return write_gguf
