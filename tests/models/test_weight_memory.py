"""The memory a model's weights take is what its file needs, and what the plan says before the load:
- an untied embedding table stays in its file's blocks, its rows dequantized when gathered, bit
  for bit the whole table's values;
- on every shipped model, the memory plan's weight figure from the header (what `serve` plans
  with before any weights are read, and what `inspect` prints) is within 5% of the bytes the
  loaded model holds, and the load's resident memory grows by no more than that;
- a first load (packing the panels) peaks below 1.3x the file's size; a later one maps them.
Each load runs in a fresh process, measured by /proc/self/status."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scratchllm.formats import ggml_quants
from scratchllm.models.llama_params import QuantizedRows

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["default", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]

CHILD = r"""
import json, os, sys

def status():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}

from scratchllm.engine.memory_plan import weights_bytes
from scratchllm.engine.shared_memory_plan import estimated_weights_bytes
from scratchllm.formats import load_checkpoint
from scratchllm.formats.refs import resolve_model
from scratchllm.models import load_model
from scratchllm.models.loader import auto_dtype, read_config

path = resolve_model(sys.argv[1])
ckpt = load_checkpoint(path)
planned = estimated_weights_bytes(ckpt, auto_dtype(ckpt, read_config(path, ckpt)))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak from here on: the load's
before = status()["VmRSS"]
model = load_model(path, checkpoint=ckpt)
after = status()
print(json.dumps({"planned": planned, "held": weights_bytes(model), "grown": after["VmRSS"] - before,
                  "peak": after["VmHWM"] - before, "file": os.path.getsize(path),
                  "from_cache": model.panels_from_cache}))
"""


def _load(name: str, cache: Path) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCRATCHLLM_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _installed(name: str) -> bool:
    """Installed, or its chunk packages are (joined on first use)."""
    from scratchllm.formats.refs import package_models

    return any(m.name == name and m.state.startswith("installed") for m in package_models())


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A panel cache of this module's own (the first load of each model packs), beside the joined
    model files of the session's cache (a package model is not joined twice)."""
    folder = tmp_path_factory.mktemp("panels")
    shared = Path(os.environ["SCRATCHLLM_CACHE_DIR"]) / "models"
    shared.mkdir(parents=True, exist_ok=True)
    (folder / "models").symlink_to(shared)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_the_plan_is_what_the_load_holds(name: str, cache: Path) -> None:
    if not _installed(name):
        pytest.skip(f"{name} is not installed")
    first, warm = _load(name, cache), _load(name, cache)
    assert not first["from_cache"] and warm["from_cache"]
    for load in (first, warm):
        assert abs(load["held"] - load["planned"]) <= 0.05 * load["planned"], load
        assert load["grown"] <= 1.05 * load["planned"] + (32 << 20), load  # nothing beside the weights
    assert first["peak"] <= 1.3 * first["file"], first  # packing holds one copy of the weights, not two
    assert warm["peak"] <= 1.05 * warm["planned"] + (32 << 20), warm


def _random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] of `kind` blocks: random bits, every float16 field a finite random value."""
    n = rows * cols // ggml_quants.BLOCK_SIZE[kind]
    dtype = ggml_quants.BLOCK_DTYPES[kind]
    blocks = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype).copy()
    for field, (ftype, _) in dtype.fields.items():
        if ftype == np.dtype("<f2"):
            blocks[field] = rng.uniform(-1, 1, n).astype(np.float16)
    return blocks.view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(ggml_quants.BLOCK_DTYPES))
def test_rows_gathered_from_blocks_equal_the_whole_table_dequantized(kind: str) -> None:
    rng = np.random.default_rng(0)
    raw = _random_blocks(kind, 40, 512, rng)
    whole = ggml_quants.dequantize(kind, raw.reshape(-1), raw.shape[0] * 512).reshape(40, 512)
    table = QuantizedRows(kind, raw, (40, 512))
    ids = np.array([3, 0, 39, 3, 17])
    assert table[ids].dtype == np.float32
    np.testing.assert_array_equal(table[ids], whole[ids])
    assert table.nbytes == raw.nbytes


def test_a_table_of_the_wrong_shape_is_refused() -> None:
    raw = _random_blocks("Q8_0", 4, 64, np.random.default_rng(1))
    with pytest.raises(ValueError, match=r"4 rows of 68 bytes of Q8_0 blocks are not a \[4, 96\] table"):
        QuantizedRows("Q8_0", raw, (4, 96))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0"])
def test_a_matrix_packed_a_run_of_panels_at_a_time_is_the_same(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PackedWeight.from_blocks packs a large matrix a few MB of the file at a time, each run into
    its panels of the whole, and hands each run's rows to `release` once packed: the panels equal
    those packed at once, runs crossing from one part to the next, a part in a row order of its own."""
    from scratchllm.kernels import packed_gemm
    from scratchllm.models import packed

    rng = np.random.default_rng(2)
    K, NR = 256, packed_gemm.NR
    a, b = _random_blocks(kind, 5 * NR + 3, K, rng), _random_blocks(kind, 2 * NR, K, rng)
    order = rng.permutation(b.shape[0])
    parts = [(kind, a, None), (kind, b, order)]
    shape = (K, a.shape[0] + b.shape[0])
    whole = packed.PackedWeight.from_blocks(parts, shape)
    monkeypatch.setattr(packed, "STREAM_BYTES", 2 * NR * a.shape[1])  # two panels a run
    released: list[int] = []
    runs = packed.PackedWeight.from_blocks(parts, shape, release=lambda rows: released.append(rows.shape[0]))
    assert whole is not None and runs is not None
    assert sum(released) == shape[1] and len(released) > 3
    for got, want in zip(runs.panels, whole.panels, strict=True):
        if isinstance(want, np.ndarray):
            assert got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8))
        else:
            assert got == want
    np.testing.assert_array_equal(runs.numpy(), whole.numpy())
