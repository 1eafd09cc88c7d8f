"""The panel cache folder kept in bounds (models/panel_cache_files.py, `scratchllm models cache`):
caches of gone or changed model files pruned, a size cap that evicts the least recently used
first, a load recording its use, and files that are not whole caches left alone."""

import json
import os
import struct
import time

import pytest

from scratchllm.cli.main import main
from scratchllm.models import panel_cache, panel_cache_files


def write_cache(path, source, size=4096):
    """A cache file with panel_cache's header (magic, index length, index) naming `source`, padded
    to `size` bytes: what cache_files reads of a cache (no panels: nothing here maps them)."""
    st = os.stat(source)
    index = json.dumps({panel_cache.SOURCE: str(source), panel_cache.SOURCE_STAT: [st.st_size, st.st_mtime_ns],
                        panel_cache.FORMAT_KEY: panel_cache.FORMAT})
    head = panel_cache.MAGIC + struct.pack("<Q", len(index)) + index.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + bytes(size - len(head)))
    return path


def test_prune_deletes_the_caches_of_gone_or_changed_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SCRATCHLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = panel_cache.cache_dir()
    models = [tmp_path / f"m{i}.gguf" for i in range(3)]
    for m in models:
        m.write_bytes(b"GGUF" + bytes(10))
    live, gone, changed = (write_cache(folder / f"{i}.panels", m) for i, m in enumerate(models))
    models[1].unlink()
    models[2].write_bytes(b"GGUF" + bytes(20))  # packed from the file as it was
    (folder / "half.panels").write_bytes(b"SLLMPN")  # another process mid-write: not ours to judge
    found = {f.path.name: f.stale for f in panel_cache_files.cache_files()}
    assert found == {"0.panels": False, "1.panels": True, "2.panels": True}
    assert main(["models", "cache", "--prune", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(r["path"] for r in report["removed"]) == [str(gone), str(changed)]
    assert [p["path"] for p in report["panel_caches"]] == [str(live)] and report["panel_bytes"] == 4096
    assert sorted(p.name for p in folder.iterdir()) == ["0.panels", "half.panels"]


def test_a_cache_of_another_format_is_stale(tmp_path):
    """A cache this version cannot read (written before the format was recorded, or in another)
    says so: stale, whatever its model file."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    st = model.stat()
    for name, meta in (("old", {}), ("other", {panel_cache.FORMAT_KEY: panel_cache.FORMAT - 1})):
        index = json.dumps({panel_cache.SOURCE: str(model), panel_cache.SOURCE_STAT: [st.st_size, st.st_mtime_ns]}
                           | meta).encode()
        (tmp_path / f"{name}.panels").write_bytes(panel_cache.MAGIC + struct.pack("<Q", len(index)) + index)
    write_cache(tmp_path / "now.panels", model)
    assert {f.path.stem: f.stale for f in panel_cache_files.cache_files(tmp_path)} == \
        {"old": True, "other": True, "now": False}


def test_a_size_cap_evicts_the_least_recently_used_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SCRATCHLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = panel_cache.cache_dir()
    now = time.time_ns()
    for i, age_s in enumerate((300, 100, 200)):  # used 5, 1.7 and 3.3 minutes ago
        model = tmp_path / f"m{i}.gguf"
        model.write_bytes(b"GGUF")
        cache = write_cache(folder / f"{i}.panels", model, size=1 << 20)
        os.utime(cache, ns=(now - age_s * 10**9, now - 10**12))
    assert main(["models", "cache", "--max-size", "2MiB"]) == 0
    out = capsys.readouterr().out
    assert "removed 0.panels (1.0 MiB" in out and "2 files, 2.0 MiB" in out
    assert main(["models", "cache", "--max-size", "1.5MiB"]) == 0
    assert "removed 2.panels" in capsys.readouterr().out
    assert [p.name for p in folder.iterdir()] == ["1.panels"]
    with pytest.raises(SystemExit):  # a usage error: a size is more than 0 bytes
        main(["models", "cache", "--max-size", "0"])
    assert "must be more than 0 bytes" in capsys.readouterr().err


def test_a_load_records_its_use(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    cache = write_cache(panel_cache.PanelCache(model, tmp_path / "panels").path, model)
    os.utime(cache, ns=(10**18, 10**18))  # last used long ago
    before = time.time_ns()
    panel_cache.PanelCache(model, tmp_path / "panels")  # maps the cache (it has no panels: none used)
    st = cache.stat()
    assert st.st_atime_ns >= before and st.st_mtime_ns == 10**18
    assert panel_cache_files.cache_files(tmp_path / "panels")[0].last_used_ns == st.st_atime_ns
