"""The planned layout, the arena that follows it, `scratchllm inspect` and `scratchllm bench load`."""

import json
import subprocess
import sys

import numpy as np
import pytest

from scratchllm import load_checkpoint
from scratchllm.formats.arena import load_arena
from scratchllm.formats.checkpoint import TensorInfo
from scratchllm.formats.layout import plan_arena, shared_pages


def info(name, shape, out_dtype="float32"):
    return TensorInfo(name=name, dtype="F32", shape=shape, strides=(), offset=0, nbytes=0, file="x",
                      out_dtype=out_dtype, contiguous=True)


def test_plan_packs_aligned_and_counts_pages():
    # 4196 B, then 10 B, then 8 KiB: offsets 0, 4224 (the next multiple of 64), 4288.
    plan = plan_arena([info("a", (1049,)), info("b", (10,), "uint8"), info("c", (2048,))])
    assert [p.offset for p in plan.placements] == [0, 4224, 4288]
    assert [(p.first_page, p.last_page) for p in plan.placements] == [(0, 1), (1, 1), (1, 3)]
    assert plan.nbytes == 4 * 4096 and plan.padding == plan.nbytes - (4196 + 10 + 8192)
    assert shared_pages(plan) == {1}
    own = plan_arena([info("a", (1049,)), info("b", (10,), "uint8")], tensor_align=4096)
    assert [p.offset for p in own.placements] == [0, 8192] and shared_pages(own) == set()


def test_arena_equals_lookups(small_gguf):
    ckpt = load_checkpoint(small_gguf)
    arrays, plan = load_arena(ckpt)
    base = arrays[next(iter(ckpt))]
    assert base.ctypes.data % 4096 == 0  # the arena starts on a page
    for place in plan.placements:
        a = arrays[place.name]
        assert a.ctypes.data - base.ctypes.data == place.offset
        np.testing.assert_array_equal(a, ckpt[place.name])
        assert a.flags.c_contiguous and a.flags.writeable


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "scratchllm.cli.main", *args], capture_output=True, text=True)


def test_inspect_gguf_text_and_json(small_gguf):
    out = run_cli("inspect", str(small_gguf))
    assert out.returncode == 0, out.stderr
    head = small_gguf.read_bytes()[:16]
    assert " ".join(f"{b:02x}" for b in head[:8]) in out.stdout and "|GGUF" in out.stdout
    for name in ("t.Q4_1", "t.Q8_0", "t.BF16", "vec"):
        assert name in out.stdout
    assert "├── t.F32 (3x5x64, float32)" in out.stdout and "float32 <- Q4_1" in out.stdout
    report = json.loads(run_cli("inspect", str(small_gguf), "--json").stdout)
    ckpt = load_checkpoint(small_gguf)
    assert report["format"] == "gguf" and report["first_bytes"] == small_gguf.read_bytes()[:64].hex()
    assert [t["name"] for t in report["tensors"]] == list(ckpt)
    assert report["totals"]["loaded_bytes"] == sum(ckpt[n].nbytes for n in ckpt)
    assert report["arena"]["bytes"] % 4096 == 0


def test_inspect_torch_shows_the_zip_and_the_pickle(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "pytorch_model.bin"
    w = torch.randn(4, 3)
    torch.save({"w": w, "wt": w.t()}, path)
    out = run_cli("inspect", str(path))
    assert out.returncode == 0, out.stderr
    assert "pytorch_model/data.pkl" in out.stdout and "pytorch_model/data/0" in out.stdout
    assert "torch._utils._rebuild_tensor_v2" in out.stdout and "torch.FloatStorage" in out.stdout
    assert " NO " in out.stdout  # the transpose is not contiguous


def test_inspect_minilm_and_default_run():
    for ref, needle in (("minilm", "safetensors: 8-byte header length"), ("default", "GGUF v3: 272 tensors")):
        out = run_cli("inspect", ref, "--limit", "3")
        assert out.returncode == 0 and needle in out.stdout, out.stderr


def test_inspect_says_the_memory_plans_weight_figure():
    """What loading the file as a model holds is the plan's figure (tests/models/test_weight_memory.py
    holds the loader to it), not the float32 arena of every tensor that the layout draws."""
    from scratchllm.engine.shared_memory_plan import estimated_weights_bytes
    from scratchllm.formats.refs import resolve_model
    from scratchllm.models.loader import auto_dtype, read_config

    report = json.loads(run_cli("inspect", "default", "--json").stdout)
    ckpt = load_checkpoint("default")
    dtype = auto_dtype(ckpt, read_config(resolve_model("default"), ckpt))
    totals = report["totals"]
    assert totals["model_dtype"] == dtype and totals["model_bytes"] == estimated_weights_bytes(ckpt, dtype)
    assert totals["model_bytes"] < totals["loaded_bytes"] / 3  # 4-bit panels, not float32
    text = run_cli("inspect", "default", "--limit", "1").stdout
    assert f"{totals['model_bytes'] / 1e6:,.1f} MB once loaded as a model ({dtype}; the memory plan's figure)" in text
    assert "as float32 arrays (the arena below" in text


def test_bench_load_on_a_small_file(small_gguf):
    out = run_cli("bench", "load", "--model", str(small_gguf), "--repeat", "1", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["figures"]["ours"]["elements"] == r["figures"]["gguf"]["elements"] == 6 * 960 + 7
    assert r["ratios"]["gguf_over_ours"] > 0 and "cpu" in r["machine"]


def test_membership_reads_no_tensor(small_gguf):
    ckpt = load_checkpoint(small_gguf)
    ckpt.readers = dict.fromkeys(ckpt.readers, lambda info, out=None: pytest.fail("a tensor was read"))
    assert "t.Q4_1" in ckpt and "nope" not in ckpt and "vec" in ckpt.keys()
