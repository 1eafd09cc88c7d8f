"""The panel cache: the first load of a GGUF file packs and writes it, later loads map it, with
the same logits bit for bit; a damaged or unwritable cache costs a repack, never a wrong model."""

import logging
import mmap
import os
import re

import numpy as np
import pytest

from scratchllm.models import ContiguousKVCache, load_model
from scratchllm.models import panel_cache as pc

IDS = np.array([1, 500, 9000, 42, 7, 31337])


def logits(model):
    return model.forward(IDS, np.arange(len(IDS)), ContiguousKVCache.for_model(model.config, len(IDS)))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRATCHLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SCRATCHLLM_PANEL_CACHE", raising=False)
    return tmp_path / "cache" / "panels"


def test_second_load_maps_the_first_loads_panels_with_the_same_logits(cache_dir, monkeypatch):
    monkeypatch.setenv("SCRATCHLLM_PANEL_CACHE", "0")
    reference = logits(load_model("default"))
    assert not cache_dir.exists()  # off means off
    monkeypatch.delenv("SCRATCHLLM_PANEL_CACHE")
    first = load_model("default")
    files = list(cache_dir.glob("*.panels"))
    assert len(files) == 1 and files[0].stat().st_size > 90e6  # the default model's ~100 MB of panels
    assert first.params.lm_head.panels.q.flags.writeable  # packed now, in memory
    second = load_model("default")
    assert not second.params.lm_head.panels.q.flags.writeable  # mapped from the cache file
    assert not second.params.layers[3].gate_up.panels.q4.flags.writeable
    np.testing.assert_array_equal(logits(first), reference)
    np.testing.assert_array_equal(logits(second), reference)
    assert list(cache_dir.glob("*.panels")) == files  # nothing rewritten on a hit


def test_a_damaged_cache_is_repacked_and_an_unwritable_one_skipped(cache_dir, monkeypatch, caplog):
    reference = logits(load_model("default"))
    (path,) = cache_dir.glob("*.panels")
    path.write_bytes(b"SLLMPNL1" + b"\xff" * 64)  # a truncated, garbled file
    with caplog.at_level(logging.WARNING, logger="scratchllm.models.panel_cache"):
        np.testing.assert_array_equal(logits(load_model("default")), reference)
    assert "unreadable panel cache" in caplog.text
    assert path.stat().st_size > 90e6  # rewritten whole
    blocked = cache_dir.parent.parent / "blocked"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setenv("SCRATCHLLM_CACHE_DIR", str(blocked))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scratchllm.models.panel_cache"):
        np.testing.assert_array_equal(logits(load_model("default")), reference)
    assert "could not write the panel cache" in caplog.text


def test_the_key_changes_with_the_file(tmp_path, default_gguf):
    copy = tmp_path / "model.gguf"
    copy.write_bytes(default_gguf.read_bytes()[:4096])
    before = pc.PanelCache(copy, tmp_path).path
    copy.write_bytes(copy.read_bytes() + b"\0")  # another size (and time)
    assert pc.PanelCache(copy, tmp_path).path != before


def test_the_key_is_the_content_read_in_part(tmp_path, monkeypatch):
    """The same bytes under two paths (two times, two inodes) have one key; a byte changed in the
    header or in a sampled piece of the data is another; a 4 GiB file is read about 9 MB, not whole."""
    a, b = tmp_path / "a.gguf", tmp_path / "b" / "blob"
    b.parent.mkdir()
    for path in (a, b):
        with open(path, "wb") as f:
            f.truncate(4 << 30)  # sparse: no disk
    os.utime(b, ns=(10**18, 10**18))
    read = []
    real_pread = os.pread

    def pread(fd, n, offset):
        read.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(pc.os, "pread", pread)
    key = pc.content_key([a])
    assert sum(read) == pc.SAMPLES * pc.SAMPLE_BYTES and pc.content_key([b]) == key
    with open(b, "r+b") as f:
        f.seek((4 << 30) - pc.SAMPLE_BYTES)  # inside the last sample
        f.write(b"\1")
    assert pc.content_key([b]) != key
    with open(a, "r+b") as f:
        f.seek(100)  # the header
        f.write(b"\1")
    assert pc.content_key([a]) not in (key, pc.content_key([b]))


def test_one_file_reached_by_three_paths_is_packed_once(cache_dir, tmp_path, default_gguf, capsys):
    """An Ollama blob, a Hugging Face snapshot's symlink and a folder's copy of the same bytes share
    one cache: the first load packs, the others map it; `models cache` names every path it serves."""
    from scratchllm.cli.main import main

    blob = tmp_path / "ollama" / "blobs" / "sha256-0123"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(default_gguf.read_bytes())
    snapshot = tmp_path / "hf" / "snapshots" / "abc" / "model.gguf"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(blob)
    folder = tmp_path / "folder" / "model.gguf"
    folder.parent.mkdir()
    folder.write_bytes(default_gguf.read_bytes())
    loads = [load_model(str(p)) for p in (blob, snapshot, folder)]
    assert [m.panels_from_cache for m in loads] == [False, True, True]
    assert len(list(cache_dir.glob("*.panels"))) == 1
    np.testing.assert_array_equal(logits(loads[0]), logits(loads[2]))
    assert main(["models", "cache", "--json"]) == 0
    import json

    (entry,) = json.loads(capsys.readouterr().out)["panel_caches"]
    assert sorted(entry["sources"]) == sorted([str(blob), str(folder)])  # the snapshot resolves to the blob
    assert main(["models", "cache"]) == 0
    out = capsys.readouterr().out
    assert "8.0 GiB cap (SCRATCHLLM_PANEL_CACHE_MAX)" in out and str(folder) in out and str(blob) in out


def test_a_load_that_writes_a_cache_keeps_the_folder_under_the_cap(cache_dir, tmp_path, monkeypatch):
    """The cap applies by default: the least recently used caches go, never the one just written."""
    import json
    import struct

    cache_dir.mkdir(parents=True)
    sources = []
    for i in range(3):
        source = tmp_path / f"m{i}.gguf"
        source.write_bytes(b"GGUF")
        sources.append(source)
        body = json.dumps({pc.SOURCE: str(source), pc.SOURCE_STAT: pc.source_stat(source),
                           pc.FORMAT_KEY: pc.FORMAT}).encode()
        path = cache_dir / f"old{i}.panels"
        path.write_bytes(pc.MAGIC + struct.pack("<Q", len(body)) + body + bytes(30 << 20))
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # old0 the least recently used
    monkeypatch.setenv("SCRATCHLLM_PANEL_CACHE_MAX", "170MiB")  # the default model's ~92 MiB + 3 x 30 MiB is over
    load_model("default")
    names = sorted(p.stem for p in cache_dir.glob("*.panels"))
    assert "old0" not in names and "old1" in names and "old2" in names and len(names) == 3
    monkeypatch.setenv("SCRATCHLLM_PANEL_CACHE_MAX", "1MiB")  # below the new cache alone: it stays
    for old in cache_dir.glob("old*.panels"):
        old.unlink()
    (new,) = cache_dir.glob("*.panels")
    new.unlink()
    load_model("default")
    assert len(list(cache_dir.glob("*.panels"))) == 1


def test_writing_a_cache_prunes_those_of_files_that_are_gone(cache_dir, tmp_path):
    import json
    import struct

    cache_dir.mkdir(parents=True)
    live_source = tmp_path / "still-here.gguf"
    live_source.write_bytes(b"x")
    for name, source in (("dead", "/nonexistent/model.gguf"), ("live", str(live_source))):
        stat = pc.source_stat(live_source) if name == "live" else [1, 2]
        body = json.dumps({pc.SOURCE: source, pc.SOURCE_STAT: stat, pc.FORMAT_KEY: pc.FORMAT}).encode()
        (cache_dir / f"{name}.panels").write_bytes(pc.MAGIC + struct.pack("<Q", len(body)) + body)
    load_model("default")  # packs, writes its cache, prunes
    names = sorted(p.stem for p in cache_dir.glob("*.panels"))
    assert "dead" not in names and "live" in names and len(names) == 2


def test_another_builds_newest_cache_of_the_same_file_is_kept(cache_dir, default_gguf):
    """Two installs loading one file keep a cache each (the newest other build's), not packing at every
    load; older builds' caches and caches of the file as it was before are removed."""
    import json
    import os
    import struct

    cache_dir.mkdir(parents=True)
    source, stat = str(default_gguf.resolve()), pc.source_stat(default_gguf)
    for i, (name, recorded) in enumerate((("build-old", stat), ("build-new", stat), ("file-before", [1, 2]))):
        body = json.dumps({pc.SOURCE: source, pc.SOURCE_STAT: recorded, pc.FORMAT_KEY: pc.FORMAT}).encode()
        path = cache_dir / f"{name}.panels"
        path.write_bytes(pc.MAGIC + struct.pack("<Q", len(body)) + body)
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # build-new is the newer
    load_model("default")  # packs, writes this build's cache, prunes
    names = sorted(p.stem for p in cache_dir.glob("*.panels"))
    assert "build-new" in names and "build-old" not in names and "file-before" not in names and len(names) == 2


def _fs_type(path) -> str:
    """The file system type of the mount holding `path` (/proc/mounts, longest matching mount point)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1:3] for line in f]
    for point, fstype in mounts:
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


def _vma_fields(path) -> dict:
    """/proc/self/smaps fields of this process's mapping of `path`."""
    with open("/proc/self/smaps") as f:
        smaps = f.read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
        if block.split("\n", 1)[0].endswith(str(path)):
            return dict(line.split(":", 1) for line in block.split("\n")[1:] if ":" in line)
    raise AssertionError(f"{path} is not mapped")


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_a_new_cache_leaves_the_page_cache_and_is_mapped_with_huge_page_advice(cache_dir):
    """save() writes the file out and drops it from the page cache (its written pages are small
    folios, which no mapping can map in huge pages); a load maps it advised MADV_HUGEPAGE, so
    that the pages read back come in 2 MiB folios."""
    from scratchllm.models.arena import resident_bytes

    load_model("default")  # packs and writes
    (path,) = cache_dir.glob("*.panels")
    if _fs_type(path) in ("tmpfs", "ramfs"):
        pytest.skip("a memory file system keeps its pages")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mm, dtype=np.uint8)
    assert resident_bytes(view) < 0.05 * view.nbytes  # the ~96 MB are not in the page cache
    del view
    mm.close()
    model = load_model("default")  # maps it
    fields = _vma_fields(path)
    if hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage"):
        assert "hg" in fields["VmFlags"].split()
    assert int(fields["Rss"].split()[0]) * 1024 > 0.9 * path.stat().st_size  # populated at load
    np.testing.assert_array_equal(logits(model), logits(load_model("default")))


def test_k_quant_panels_round_trip(tmp_path):
    """Q4_K and Q6_K panels (kernels/kpanels.py), and a matrix of both in parts, come back from the
    cache file as they went in."""
    from scratchllm.kernels import packed_gemm
    from scratchllm.kernels.kpanels import KPanels

    model = tmp_path / "model.gguf"
    model.write_bytes(b"stands for a model file")
    rng = np.random.default_rng(0)
    panels = {}
    for kind, block in (("Q4_K", 144), ("Q6_K", 210)):
        raw = rng.integers(0, 256, (40, 2 * block), dtype=np.uint8)  # any bytes: compared as bytes
        panels[kind] = packed_gemm.pack_blocks([(kind, raw, None)], 512)
    panels["both"] = packed_gemm.SegmentedPanels((panels["Q6_K"], panels["Q4_K"]), (packed_gemm.NR, 40))
    cache = pc.PanelCache(model, tmp_path)
    for kind, p in panels.items():
        cache.put(kind, p)
    cache.save()
    again = pc.PanelCache(model, tmp_path)
    for kind in ("Q4_K", "Q6_K"):
        got, p = again.get(kind, panels[kind].q4.shape), panels[kind]
        assert isinstance(got, KPanels) and got.kind == kind and not got.q4.flags.writeable  # mapped
        for a, b in zip(got[:6], p[:6], strict=True):
            assert (a is None and b is None) or np.array_equal(a.view(np.uint8), b.view(np.uint8))
        assert again.get(kind, (1, 2, 3)) is None  # another shape: not these panels
    both = again.get("both", (panels["Q6_K"].q4.shape[0] + panels["Q4_K"].q4.shape[0], 256, packed_gemm.NR))
    assert isinstance(both, packed_gemm.SegmentedPanels) and both.cols == (packed_gemm.NR, 40)
    assert [p.kind for p in both.parts] == ["Q6_K", "Q4_K"]
    assert np.array_equal(both.parts[1].sc, panels["Q4_K"].sc)
