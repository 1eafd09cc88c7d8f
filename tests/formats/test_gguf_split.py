"""Split GGUF models (formats/gguf_split.py): NAME-00001-of-0000N.gguf and its other shards open as one
checkpoint, equal to the file they were split from; every inconsistency is one error naming a file.

The oracle for the layout is the gguf package's own split writer (GGUFWriter with
split_max_tensors: what convert_hf_to_gguf.py --split-max-tensors runs), which lays shards out as
llama.cpp's gguf-split tool does: the metadata in the first shard, split.no / split.count /
split.tensors.count in each. llama.cpp's gguf-split itself is not built here, so it is not run.
Bad shards are written one by one with the same writer and the split keys set by hand."""

import json
import subprocess
import sys

import numpy as np
import pytest

from scratchllm import FormatError, load_checkpoint
from scratchllm.formats.gguf_split import shard_name

gguf = pytest.importorskip("gguf")

KINDS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def tensors(n: int = 8) -> dict:
    """n tensors of the types we decode (name -> (float32 array, GGML type name))."""
    rng = np.random.default_rng(1)
    return {f"t{i}.{KINDS[i % len(KINDS)]}": (rng.standard_normal((3, 64)).astype(np.float32), KINDS[i % len(KINDS)])
            for i in range(n)}


@pytest.fixture
def single_and_split(tmp_path, gguf_writer):
    """The same 8 tensors as one file and as 3 shards (3 + 3 + 2 tensors)."""
    meta = {"general.name": ("split-me", gguf.GGUFValueType.STRING, None)}
    for folder in ("one", "split"):
        (tmp_path / folder).mkdir()
    single = gguf_writer(tmp_path / "one" / "m.gguf", tensors(), meta)
    first = gguf_writer(tmp_path / "split" / "m.gguf", tensors(), meta, split_max_tensors=3)
    return single, first


def test_a_split_model_reads_as_the_file_it_was_split_from(single_and_split):
    single, first = single_and_split
    assert first.name == "m-00001-of-00003.gguf"
    one, split = load_checkpoint(single), load_checkpoint(first)
    assert list(split) == list(one) and len(split) == 8
    shards = [first.with_name(shard_name("m", k, 3)) for k in (1, 2, 3)]
    assert split.files == [str(s) for s in shards]
    for s in shards:  # each tensor is where the gguf package's reader finds it, in its own shard
        for t in gguf.GGUFReader(s).tensors:
            info = split.tensor_info(t.name)
            assert info.file == str(s) and info.offset == t.data_offset and info.nbytes == t.n_bytes
    for name in one:
        np.testing.assert_array_equal(split[name], one[name])
        np.testing.assert_array_equal(split.raw(name), one.raw(name))
        info = split.tensor_info(name)
        with open(info.file, "rb") as f:  # read in place: the raw bytes are the shard's own
            f.seek(info.offset)
            assert f.read(info.nbytes) == split.raw(name).tobytes()
    assert split.metadata["general.name"] == "split-me" and split.metadata["general.architecture"] == "llama"
    assert {k: split.metadata[k] for k in ("split.no", "split.count", "split.tensors.count")} == \
        {"split.no": 0, "split.count": 3, "split.tensors.count": 8}
    # any shard names the model: it opens from the first
    for later in shards[1:]:
        assert list(load_checkpoint(later)) == list(one) and load_checkpoint(later).path == str(first)


def test_a_folder_of_shards_is_one_model(single_and_split):
    _, first = single_and_split
    ckpt = load_checkpoint(first.parent)
    assert ckpt.path == str(first) and len(ckpt) == 8


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "scratchllm.cli.main", *args], capture_output=True, text=True)


def test_inspect_describes_the_whole_model_and_its_shards(single_and_split):
    _, first = single_and_split
    out = run_cli("inspect", str(first.with_name(shard_name("m", 2, 3))))  # any shard
    assert out.returncode == 0, out.stderr
    assert "GGUF v3: 8 tensors" in out.stdout and "split into 3 shards" in out.stdout
    for k, n in ((1, 3), (2, 3), (3, 2)):
        assert f"{first.with_name(shard_name('m', k, 3))}: {n} tensors" in out.stdout
    report = json.loads(run_cli("inspect", str(first), "--json").stdout)
    assert report["totals"]["tensors"] == 8 and [s["tensors"] for s in report["container"]["shards"]] == [3, 3, 2]
    assert report["container"]["file_size"] == sum(first.with_name(shard_name("m", k, 3)).stat().st_size
                                                   for k in (1, 2, 3))


# --- bad shards --------------------------------------------------------------------------------

U16, I32 = gguf.GGUFValueType.UINT16, gguf.GGUFValueType.INT32


def write_shards(folder, groups: list[list[str]], keys=None, skip=()):
    """Shards of `tensors()` as gguf-split lays them out (groups: the names in each shard; metadata in
    the first, split keys in each); keys(k) -> changes to shard k's split keys, None to drop one.
    Returns the shard paths (`skip`: shard numbers not written)."""
    every, count, total = tensors(), len(groups), sum(len(g) for g in groups)
    paths = []
    for k, names in enumerate(groups, 1):
        path = folder / shard_name("m", k, count)
        paths.append(path)
        if k in skip:
            continue
        writer = gguf.GGUFWriter(str(path), "llama")
        if k > 1:
            writer.kv_data[0].clear()  # later shards hold only their split keys, not even the architecture
        split = {"split.no": k - 1, "split.count": count, "split.tensors.count": total} | (keys(k) if keys else {})
        for key, value in split.items():
            if value is not None:
                writer.add_key_value(key, value, U16 if key != "split.tensors.count" else I32)
        for name in names:
            array, _ = every[name]
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return paths


NAMES = list(tensors())
GROUPS = [NAMES[:3], NAMES[3:6], NAMES[6:]]


def refused(path, *needles):
    """The one FormatError opening `path` raises; its message holds every needle."""
    with pytest.raises(FormatError) as err:
        load_checkpoint(path)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    return err.value


def test_well_formed_hand_written_shards_load(tmp_path):
    paths = write_shards(tmp_path, GROUPS)
    ckpt = load_checkpoint(paths[0])
    assert list(ckpt) == NAMES and ckpt.files == [str(p) for p in paths]


def test_a_missing_shard_is_named_with_the_count_expected(tmp_path):
    paths = write_shards(tmp_path, GROUPS, skip={2})
    err = refused(paths[0], "missing", "shard 2 of the 3 shards", "m-00001-of-00003.gguf .. m-00003-of-00003.gguf")
    assert err.path == str(paths[1])


def test_a_later_shard_whose_first_is_missing_says_so(tmp_path):
    paths = write_shards(tmp_path, GROUPS, skip={1})
    err = refused(paths[2], "shard 3 of a split model of 3", "m-00001-of-00003.gguf, which is missing")
    assert err.path == str(paths[2])


def test_shards_that_disagree_on_the_count(tmp_path):
    paths = write_shards(tmp_path, GROUPS, keys=lambda k: {"split.count": 4} if k == 3 else {})
    err = refused(paths[0], "split.count is 4, but the first shard m-00001-of-00003.gguf says 3")
    assert err.path == str(paths[2])


def test_a_split_no_that_does_not_match_the_name(tmp_path):
    paths = write_shards(tmp_path, GROUPS, keys=lambda k: {"split.no": 2} if k == 2 else {})
    err = refused(paths[0], "split.no is 2 (shard 3), but the file's name says shard 2 of 3")
    assert err.path == str(paths[1])
    paths = write_shards(tmp_path, GROUPS, keys=lambda k: {"split.no": 1} if k == 1 else {})
    err = refused(paths[0], "split.no 1 and split.count 3 make it shard 2 of 3, but its name says shard 1 of 3")
    assert err.path == str(paths[0])


def test_a_tensor_in_two_shards(tmp_path):
    paths = write_shards(tmp_path, [NAMES[:3], NAMES[2:6], NAMES[6:]])
    err = refused(paths[0], f"tensor '{NAMES[2]}' is in both {paths[0]} and {paths[1]}")
    assert err.path == str(paths[0])


def test_a_tensor_count_other_than_split_tensors_count(tmp_path):
    paths = write_shards(tmp_path, GROUPS, keys=lambda k: {"split.tensors.count": 9})
    err = refused(paths[0], "split.tensors.count is 9, but the 3 shards hold 8 tensors")
    assert err.path == str(paths[0])
    paths = write_shards(tmp_path, GROUPS, keys=lambda k: {"split.tensors.count": 9} if k == 2 else {})
    refused(paths[0], "split.tensors.count is 9, but the first shard m-00001-of-00003.gguf says 8")


def test_a_shard_without_its_split_keys(tmp_path):
    paths = write_shards(tmp_path, GROUPS, keys=lambda k: {"split.no": None} if k == 3 else {})
    err = refused(paths[0], "without the key split.no")
    assert err.path == str(paths[2])


def test_a_first_shard_not_named_as_one(tmp_path):
    paths = write_shards(tmp_path, GROUPS)
    renamed = paths[0].rename(tmp_path / "model.gguf")
    refused(renamed, "must be named NAME-00001-of-00003.gguf")


def test_a_file_without_split_keys_loads_as_one_whatever_its_name(tmp_path, gguf_writer):
    path = gguf_writer(tmp_path / "m-00002-of-00003.gguf", tensors(2))
    assert list(load_checkpoint(path)) == NAMES[:2]


def test_the_cli_prints_one_line_naming_the_file(tmp_path):
    paths = write_shards(tmp_path, GROUPS, skip={3})
    out = run_cli("inspect", str(paths[0]))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and str(paths[2]) in out.stderr and "missing" in out.stderr
