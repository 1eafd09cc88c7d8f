"""Model references joined from chunk packages (formats/refs.py), on small fake packages."""

import hashlib

import pytest

from scratchllm.errors import ConfigError
from scratchllm.formats import refs


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Three chunk 'packages' on sys.path (folders find_spec finds), a model of their bytes."""
    chunks = [b"GGUF" + bytes(range(200)), b"middle" * 50, b"end"]
    for n, data in enumerate(chunks):
        pkg = tmp_path / "site" / f"fake_chunk_part{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / "m.part").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("SCRATCHLLM_CACHE_DIR", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    model = refs.JoinedModel(file="m.gguf", size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
                             parts=tuple((f"fake-chunk-part{n}==1", f"fake_chunk_part{n}", "data/m.part")
                                         for n in range(3)))
    monkeypatch.setitem(refs.JOINED_MODELS, "fake", model)
    return whole, tmp_path


def test_joined_once_then_reused(fake_model, monkeypatch):
    whole, tmp = fake_model
    path = refs.resolve_model("fake")
    assert path == tmp / "cache" / "models" / "m.gguf" and path.read_bytes() == whole
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    # The second call trusts the marker: it neither reads nor hashes the file again.
    monkeypatch.setattr(refs, "_sha256_of", lambda p: pytest.fail("hashed again"))
    monkeypatch.setattr(refs, "_join", lambda *a: pytest.fail("joined again"))
    assert refs.resolve_model("fake") == path


def test_a_damaged_join_is_redone(fake_model):
    whole, _ = fake_model
    path = refs.resolve_model("fake")
    path.write_bytes(b"x" * len(whole))  # same size, other bytes: the marker no longer matches
    assert refs.resolve_model("fake").read_bytes() == whole


def test_missing_package_is_named(fake_model, monkeypatch):
    model = refs.JOINED_MODELS["fake"]
    parts = list(model.parts)
    parts[1] = ("fake-chunk-missing==1", "fake_chunk_missing", "data/m.part")
    missing = refs.JoinedModel(model.file, model.size, model.sha256, tuple(parts))
    monkeypatch.setitem(refs.JOINED_MODELS, "fake", missing)
    with pytest.raises(ConfigError, match="fake-chunk-missing==1"):
        refs.resolve_model("fake")


def test_wrong_checksum_is_refused_and_nothing_is_left(fake_model, monkeypatch):
    _, tmp = fake_model
    model = refs.JOINED_MODELS["fake"]
    monkeypatch.setitem(refs.JOINED_MODELS, "fake", refs.JoinedModel(model.file, model.size, "0" * 64, model.parts))
    with pytest.raises(ConfigError, match="SHA-256"):
        refs.resolve_model("fake")
    assert list((tmp / "cache" / "models").iterdir()) == []


@pytest.mark.slow
def test_gemma3_270m_resolves_to_the_joined_file():
    path = refs.resolve_model("gemma3-270m")
    assert path.stat().st_size == 253_113_024
    assert refs._sha256_of(path) == refs.JOINED_MODELS["gemma3-270m"].sha256
