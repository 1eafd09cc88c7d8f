"""safetensors: files written by the safetensors package, read by ours, bit for bit."""

import json

import numpy as np
import pytest

from scratchllm import load_checkpoint

st_numpy = pytest.importorskip("safetensors.numpy")
torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def test_every_numpy_dtype_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f64": rng.standard_normal((2, 3)), "f32": rng.standard_normal((4, 5)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16), "i64": rng.integers(-9, 9, (3,)),
        "i32": rng.integers(-9, 9, (2, 2), dtype=np.int32), "i16": np.array([-3, 4], np.int16),
        "i8": np.array([-128, 127], np.int8), "u8": np.arange(10, dtype=np.uint8),
        "u16": np.array([65535], np.uint16), "u32": np.array([7], np.uint32), "u64": np.array([2**63], np.uint64),
        "bool": np.array([True, False, True]), "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    path = tmp_path / "all.safetensors"
    st_numpy.save_file(tensors, path, metadata={"who": "test"})
    ckpt = load_checkpoint(path)
    assert ckpt.format == "safetensors" and ckpt.metadata == {"who": "test"}
    assert set(ckpt) == set(tensors)
    for name, ref in tensors.items():
        ours = ckpt[name]
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, name
        np.testing.assert_array_equal(ours, ref, err_msg=name)
    assert not ckpt["f32"].flags.owndata and not ckpt["f32"].flags.writeable  # a view of the mapped file


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"])
def test_widened_dtypes_equal_torch(tmp_path, dtype):
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 33, generator=g) * 50).to(torch_dtype)
    if dtype != "bfloat16":  # every one of the 256 bit patterns, NaNs and infinities included
        x = torch.arange(256, dtype=torch.uint8).view(torch_dtype).reshape(8, 32)
    path = tmp_path / f"{dtype}.safetensors"
    st_torch.save_file({"x": x}, path)
    ours = load_checkpoint(path)["x"]
    ref = x.float().numpy()
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, ref)  # NaN positions must agree too


def test_minilm_every_tensor_equals_the_safetensors_package(minilm_dir):
    ckpt = load_checkpoint("minilm")
    ref = st_numpy.load_file(minilm_dir / "model.safetensors")
    assert ckpt.format == "safetensors" and set(ckpt) == set(ref) and len(ref) > 100
    for name, value in ref.items():
        assert ckpt[name].dtype == value.dtype, name
        np.testing.assert_array_equal(ckpt[name], value, err_msg=name)


def test_sharded_index_and_folder(tmp_path):
    rng = np.random.default_rng(2)
    a = {"embed.weight": rng.standard_normal((6, 4)).astype(np.float32)}
    b = {"head.weight": rng.standard_normal((3, 4)).astype(np.float32), "head.bias": np.ones(3, np.float32)}
    st_numpy.save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    st_numpy.save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {**dict.fromkeys(a, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(b, "model-00002-of-00002.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for ref in (tmp_path / "model.safetensors.index.json", tmp_path):
        ckpt = load_checkpoint(ref)
        assert set(ckpt) == set(weight_map)
        for name, value in {**a, **b}.items():
            np.testing.assert_array_equal(ckpt[name], value)
        assert ckpt.tensor_info("head.bias").file.endswith("00002-of-00002.safetensors")


def test_complex64(tmp_path):
    x = torch.randn(3, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    st_torch.save_file({"c": x}, tmp_path / "c.safetensors")
    np.testing.assert_array_equal(load_checkpoint(tmp_path / "c.safetensors")["c"], x.numpy())
