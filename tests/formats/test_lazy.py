"""Only what is used is read: looking up one tensor of a large file does not read the others.

The measure is the process's resident memory (RSS): a page of a memory-mapped file joins the RSS
only when the process touches it. The big tensors live in sparse files (holes read as zeros),
so the test costs no disk. A control lookup of a big tensor proves that the measure does see reads.
"""

import json
import struct
import sys

import numpy as np
import pytest

from scratchllm import load_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")

BIG = 64 * 1024 * 1024  # bytes per big tensor
MB = 1024 * 1024


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def sparse_gguf(path):
    """big0 (64 MiB F32) | small (4 KiB F32, values 0..1023) | big1 (64 MiB F32), all holes but `small`."""
    def s(text):
        return struct.pack("<Q", len(text)) + text.encode()
    n_big, n_small = BIG // 4, 1024
    head = b"GGUF" + struct.pack("<IQQ", 3, 3, 0)
    offsets = {"big0": 0, "small": BIG, "big1": BIG + 4096}
    for name, n in (("big0", n_big), ("small", n_small), ("big1", n_big)):
        head += s(name) + struct.pack("<IQIQ", 1, n, 0, offsets[name])
    head += b"\0" * (-len(head) % 32)
    with open(path, "wb") as f:
        f.write(head)
        f.seek(len(head) + BIG)
        f.write(np.arange(n_small, dtype="<f4").tobytes())
        f.truncate(len(head) + BIG + 4096 + BIG)
    return path


def sparse_safetensors(path):
    header = {"big0": {"dtype": "F32", "shape": [BIG // 4], "data_offsets": [0, BIG]},
              "small": {"dtype": "F32", "shape": [1024], "data_offsets": [BIG, BIG + 4096]},
              "big1": {"dtype": "F32", "shape": [BIG // 4], "data_offsets": [BIG + 4096, 2 * BIG + 4096]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.seek(8 + len(raw) + BIG)
        f.write(np.arange(1024, dtype="<f4").tobytes())
        f.truncate(8 + len(raw) + 2 * BIG + 4096)
    return path


def torch_file(path):
    torch = pytest.importorskip("torch")
    torch.save({"big0": torch.zeros(BIG // 4), "small": torch.arange(1024, dtype=torch.float32),
                "big1": torch.zeros(BIG // 4)}, path)
    return path


@pytest.mark.parametrize("make", [sparse_gguf, sparse_safetensors, torch_file])
def test_one_lookup_reads_one_tensor(tmp_path, make):
    suffix = {"sparse_gguf": ".gguf", "sparse_safetensors": ".safetensors"}.get(make.__name__, ".bin")
    path = make(tmp_path / f"big{suffix}")
    before = rss()
    ckpt = load_checkpoint(path)
    small = ckpt["small"]
    assert float(small.sum()) == sum(range(1024))  # touches every byte of `small`
    after_small = rss()
    grew = (after_small - before) / MB
    assert grew < 8, f"opening + one 4 KiB tensor grew RSS by {grew:.1f} MiB"
    # Control: reading a big tensor does show up, so the measure above could have failed.
    assert float(ckpt["big1"].sum()) == 0.0
    assert rss() - after_small > BIG // 2
