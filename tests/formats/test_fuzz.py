"""Fuzz: real headers of each format, mutated by hypothesis, give FormatError or a valid load, never
another exception and never a hang."""

import io
import os
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchllm import FormatError, load_checkpoint

# SCRATCHLLM_FUZZ_EXAMPLES=5000 for a long, randomized run; CI runs a fixed 150 per format.
EXAMPLES = int(os.environ.get("SCRATCHLLM_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=5000, derandomize=EXAMPLES == 150,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """One small valid file per format, each written by the reference library."""
    gguf = pytest.importorskip("gguf")
    torch = pytest.importorskip("torch")
    st_numpy = pytest.importorskip("safetensors.numpy")
    root = tmp_path_factory.mktemp("seeds")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(root / "s.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("f32", rng.standard_normal((2, 32)).astype(np.float32))
    q = gguf.GGMLQuantizationType.Q4_1
    w.add_tensor("q41", gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    st_numpy.save_file({"a": rng.standard_normal((3, 4)).astype(np.float32), "b": np.arange(5)},
                       root / "s.safetensors", metadata={"k": "v"})
    base = torch.randn(3, 4)
    torch.save({"a": base, "t": base.t(), "h": torch.ones(2, dtype=torch.bfloat16)}, root / "s.bin")
    return Seeds({kind: (root / f"s.{kind}").read_bytes() for kind in ("gguf", "safetensors", "bin")})


class Seeds(dict):
    def __repr__(self):  # hypothesis prints the fixture with each failure; the bytes would drown it
        return f"Seeds({', '.join(f'{k}: {len(v)} B' for k, v in self.items())})"


def load_all(path):
    try:
        ckpt = load_checkpoint(path)
        for name in ckpt:
            np.asarray(ckpt[name]).sum()
    except FormatError:
        pass


mutation = st.tuples(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),  # byte sets
    st.one_of(st.none(), st.integers(0, 10**6)),  # truncation point
)


def mutate(data: bytes, head: int, change) -> bytes:
    flips, cut = change
    out = bytearray(data)
    for pos, value in flips:
        out[pos % min(head, len(out))] = value  # the header region, where the lies matter
    return bytes(out[: cut % len(out)] if cut is not None else out)


@FUZZ
@given(change=mutation)
def test_fuzz_gguf(seeds, tmp_path, change):
    path = tmp_path / "f.gguf"
    path.write_bytes(mutate(seeds["gguf"], 400, change))
    load_all(path)


@FUZZ
@given(change=mutation)
def test_fuzz_safetensors(seeds, tmp_path, change):
    path = tmp_path / "f.safetensors"
    path.write_bytes(mutate(seeds["safetensors"], 200, change))
    load_all(path)


@FUZZ
@given(change=mutation)
def test_fuzz_torch_pickle(seeds, tmp_path, change):
    # Mutate data.pkl itself (re-zipped, so the zip stays valid and the unpickler sees the damage).
    src = zipfile.ZipFile(io.BytesIO(seeds["bin"]))
    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info)
            out.writestr(info.filename, mutate(data, len(data), change) if info.filename.endswith("data.pkl") else data)
    load_all(path)


@FUZZ
@given(change=mutation)
def test_fuzz_torch_zip(seeds, tmp_path, change):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(mutate(seeds["bin"], len(seeds["bin"]), change))
    load_all(path)
