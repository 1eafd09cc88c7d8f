"""torch zip checkpoints: files written by torch.save, read by ours without torch, bit for bit."""

import numpy as np
import pytest

from scratchllm import load_checkpoint

torch = pytest.importorskip("torch")


def as_numpy(t):
    t = t.detach()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_and_non_contiguous_tensors(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g).to(dtype)
    state = {
        "plain": base,
        "transposed": base.t(),  # shares base's storage, strides (1, 10)
        "sliced": base[1:5, 2:9:3],  # storage offset 12, strides (10, 3)
        "expanded": torch.randn(1, 4, generator=g).to(dtype).expand(3, 4),  # stride 0
        "param": torch.nn.Parameter(torch.randn(3, generator=g).to(dtype)),
        "scalar": torch.tensor(2.5, dtype=dtype),
        "empty": torch.zeros(0, 3, dtype=dtype),
        "ids": torch.arange(7),
        "mask": torch.tensor([True, False]),
    }
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    ckpt = load_checkpoint(path)
    assert ckpt.format == "torch" and set(ckpt) == set(state)
    for name, t in state.items():
        ours, ref = ckpt[name], as_numpy(t)
        assert ours.shape == ref.shape and ours.dtype == ref.dtype, name
        np.testing.assert_array_equal(ours, ref, err_msg=name)
        assert ckpt.tensor_info(name).contiguous == t.is_contiguous(), name
    if dtype != torch.bfloat16:  # zero-copy: the transpose is a strided view of the same mapped bytes
        assert np.shares_memory(ckpt["plain"], ckpt["transposed"])
        assert ckpt["transposed"].strides == (ckpt["plain"].itemsize, 10 * ckpt["plain"].itemsize)


def test_module_state_dict_with_metadata(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    path = tmp_path / "pytorch_model.bin"
    torch.save(model.state_dict(), path)  # an OrderedDict with a _metadata attribute (BUILD)
    ckpt = load_checkpoint(path)
    ref = model.state_dict()
    assert list(ckpt) == list(ref)
    for name, t in ref.items():
        np.testing.assert_array_equal(ckpt[name], as_numpy(t))


def test_folder_with_pytorch_model_bin(tmp_path):
    torch.save({"w": torch.ones(2, 2)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.format == "torch"
    np.testing.assert_array_equal(ckpt["w"], np.ones((2, 2), np.float32))
