"""`scratchllm models pull` against a local server that answers as the Hugging Face Hub does
(tests/formats/fake_hub.py, found through HF_ENDPOINT): the file lands in the Hugging Face cache
as huggingface_hub writes it and runs by the name printed; a download whose bytes do not match
the hub's checksum is refused and deleted; a missing file or repository is one clear error, and
so is a hub that cannot be reached, at once. A split GGUF model comes whole, or not at all."""

import hashlib
import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from scratchllm.cli.main import main
from scratchllm.formats import hub as hub_module
from scratchllm.formats import load_checkpoint
from scratchllm.formats.gguf_split import shard_name
from scratchllm.formats.progress import Bar, LineProgress, progress_class
from scratchllm.formats.refs import resolve_model
from tests.formats.fake_hub import COMMIT, FakeHub


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The fake hub, an empty Hugging Face cache, and huggingface_hub's telemetry off (`pull`
    turns it off through the environment, which a library imported earlier in this process no
    longer reads: off, it asks nothing of the hub but the files)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def pull(capsys, ref):
    status = main(["models", "pull", ref])
    out, err = capsys.readouterr()
    return status, out, err


def test_pull_fetches_a_file_checks_it_and_it_loads_by_its_name(hub, capsys, tmp_path, small_gguf):
    data = small_gguf.read_bytes()
    hub.add("org/Small-GGUF", "small.gguf", data)
    hub.add("org/Small-GGUF", "README.md", b"# Small\n", lfs=False)
    status, out, err = pull(capsys, "org/Small-GGUF/small.gguf")
    assert status == 0, err
    name = "org/Small-GGUF/small.gguf"
    assert out == name + "\n" and "checksums checked" in err
    size = f"{len(data) / 1024:.1f} KiB"
    assert f"{name}: started, {size}\n" in err and f"{name}: done, 100% ({size} of {size}" in err  # no terminal
    link = tmp_path / "hub" / "models--org--Small-GGUF" / "snapshots" / COMMIT / "small.gguf"
    digest = hashlib.sha256(data).hexdigest()
    assert link.is_symlink() and link.resolve().name == digest  # blobs/SHA256, as huggingface_hub names it
    assert link.read_bytes() == data
    assert ("HEAD", "/org/Small-GGUF/resolve/main/small.gguf") in hub.requests
    assert ("GET", f"cdn/{digest}") in hub.requests  # an LFS file comes from the CDN the hub redirects to
    assert resolve_model(name) == link
    pulled, original = load_checkpoint(name), load_checkpoint(small_gguf)
    assert list(pulled) == list(original) and all(np.array_equal(pulled[k], original[k]) for k in original)
    assert main(["models", "list", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert models[name]["store"] == "hf-cache" and models[name]["size"] == len(data)
    # pulled again: nothing downloaded, the file checked again
    hub.requests.clear()
    assert pull(capsys, name)[0] == 0 and ("GET", f"cdn/{digest}") not in hub.requests


def test_a_corrupted_download_is_refused_and_deleted(hub, capsys, tmp_path):
    good = b"GGUF" + bytes(range(256)) * 4000
    bad = good[:-1] + b"\x00"  # the same size: huggingface_hub's own size check passes it
    hub.add("org/Broken-GGUF", "broken.gguf", good, served=bad)
    hub.add("org/Broken-GGUF", "notes.txt", b"a small git file", lfs=False, served=b"a small git fil!")
    status, out, err = pull(capsys, "org/Broken-GGUF/broken.gguf")
    assert status == 2 and out == ""
    assert (f"broken.gguf: refused: its sha256 is {hashlib.sha256(bad).hexdigest()}, the hub says "
            f"{hashlib.sha256(good).hexdigest()}; the download was deleted") in err
    assert not (tmp_path / "hub" / "models--org--Broken-GGUF").exists()
    status, _, err = pull(capsys, "org/Broken-GGUF/notes.txt")
    assert status == 2 and "notes.txt: refused: its git-sha1 is" in err  # a small file: its git blob id
    assert main(["models", "list", "--json"]) == 0
    assert not [m for m in json.loads(capsys.readouterr().out)["models"] if "Broken" in m["name"]]

    # huggingface_hub by itself keeps the corrupted file: the check above is what refuses it
    from huggingface_hub import hf_hub_download

    kept = hf_hub_download("org/Broken-GGUF", "broken.gguf", cache_dir=tmp_path / "plain", endpoint=hub.url)
    assert Path(kept).read_bytes() == bad


def test_missing_files_and_repositories_say_so(hub, capsys):
    hub.add("org/SmolLM2-GGUF", "a.gguf", b"GGUF" + bytes(100))
    hub.add("org/SmolLM2-GGUF", "b.gguf", b"GGUF" + bytes(200))
    status, _, err = pull(capsys, "org/SmolLM2-GGUF/missing.gguf")
    assert status == 2
    assert ("repository 'org/SmolLM2-GGUF' has no file 'missing.gguf' at revision 'main'; "
            "its files: a.gguf, b.gguf") in err
    status, _, err = pull(capsys, "org/nothing-here/x.gguf")
    assert status == 2 and f"no repository 'org/nothing-here' on {hub.url}" in err
    status, _, err = pull(capsys, "org/SmolLM2-GGUF")
    assert status == 2 and "pull one of: org/SmolLM2-GGUF/a.gguf, org/SmolLM2-GGUF/b.gguf" in err
    status, _, err = pull(capsys, "just-a-name")
    assert status == 2 and "is not ORG/REPO or ORG/REPO/FILE" in err
    assert main(["models", "pull", "org/SmolLM2-GGUF/a.gguf", "--revision", "v9"]) == 2
    assert "has no revision 'v9'" in capsys.readouterr().err


def test_pull_of_a_repository_takes_its_model_folder(hub, capsys, tmp_path):
    files = {"config.json": b'{"model_type": "bert"}', "tokenizer.json": b"{}", "vocab.txt": b"[PAD]\n",
             "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", "README.md": b"#", ".gitattributes": b""}
    for name, data in files.items():
        hub.add("org/encoder", name, data, lfs=name.endswith(".safetensors"))
    status, out, err = pull(capsys, "org/encoder")
    assert status == 0, err
    assert out == "org/encoder\n"
    snap = tmp_path / "hub" / "models--org--encoder" / "snapshots" / COMMIT
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json", "vocab.txt"]
    assert resolve_model("org/encoder") == snap


@pytest.fixture
def silent_port():
    """A port that takes no connection: a listener whose queue is full and which never accepts
    (a new connection waits, as to a host that drops packets)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    waiting = []
    for _ in range(3):  # fill the accept queue
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        waiting.append(client)
    time.sleep(0.1)
    yield port
    for s in [*waiting, server]:
        s.close()


@pytest.mark.parametrize("answer", ["refused", "silent"])
def test_an_unreachable_hub_is_one_line_at_once(answer, silent_port, tmp_path, monkeypatch, capsys):
    """huggingface_hub alone retries for 24 s (and a silent host for minutes); a pull says the hub
    cannot be reached within a few seconds, in one line that names what to check."""
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    if answer == "refused":
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # nothing listens there now
    else:
        port = silent_port
        monkeypatch.setattr(hub_module, "CONNECT_TIMEOUT_S", 0.5)
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    for ref in ("org/Small-GGUF/small.gguf", "org/Small-GGUF"):
        start = time.monotonic()
        status, out, err = pull(capsys, ref)
        assert time.monotonic() - start < 5, ref
        assert status == 2 and out == ""
        assert err.splitlines() == [f"scratchllm models: error: cannot reach {url} to pull 'org/Small-GGUF' "
                                    f"({'ConnectError' if answer == 'refused' else 'ConnectTimeout'}); check the "
                                    "network, HF_ENDPOINT, or HF_HUB_OFFLINE"], ref


def test_a_slow_hub_is_waited_for(hub, capsys, small_gguf, monkeypatch):
    """Only the connection is short: answers slower than CONNECT_TIMEOUT_S still arrive."""
    monkeypatch.setattr(hub_module, "CONNECT_TIMEOUT_S", 0.05)
    hub.delay_s = 0.3
    hub.add("org/Small-GGUF", "small.gguf", small_gguf.read_bytes())
    status, out, err = pull(capsys, "org/Small-GGUF/small.gguf")
    assert status == 0, err
    assert out == "org/Small-GGUF/small.gguf\n"


def test_a_split_model_is_pulled_whole_by_any_shard_or_its_repository(hub, capsys, tmp_path, gguf_writer):
    rng = np.random.default_rng(3)
    tensors = {f"t{i}": (rng.standard_normal((2, 32)).astype(np.float32), "F32") for i in range(6)}
    (tmp_path / "written").mkdir()
    first = gguf_writer(tmp_path / "written" / "m.gguf", tensors, split_max_tensors=2)
    shards = {shard_name("m", k, 3): first.with_name(shard_name("m", k, 3)).read_bytes() for k in (1, 2, 3)}
    for name, data in shards.items():
        hub.add("org/Split-GGUF", f"Q4_0/{name}", data)
        hub.add("org/Mixed", name, data)
        if name != shard_name("m", 2, 3):
            hub.add("org/Half", name, data)
    hub.add("org/Split-GGUF", "README.md", b"# split\n", lfs=False)
    hub.add("org/Mixed", "one.gguf", b"GGUF" + bytes(64))
    name = "org/Split-GGUF/Q4_0/m-00001-of-00003.gguf"
    snap = tmp_path / "hub" / "models--org--Split-GGUF" / "snapshots" / COMMIT / "Q4_0"
    for ref in ("org/Split-GGUF/Q4_0/m-00002-of-00003.gguf", name, "org/Split-GGUF"):
        status, out, err = pull(capsys, ref)
        assert status == 0, err
        assert out == name + "\n", ref  # runs by its first shard's name
        assert f"({sum(map(len, shards.values())) / 1024:.1f} KiB, checksums checked)" in err
        assert sorted(p.name for p in snap.iterdir()) == sorted(shards)
        assert all((snap / n).read_bytes() == data for n, data in shards.items())
    assert list(load_checkpoint(name)) == list(tensors)
    assert main(["models", "list", "--json"]) == 0
    listed = [m for m in json.loads(capsys.readouterr().out)["models"] if m["store"] == "hf-cache"]
    assert [(m["name"], m["shards"]) for m in listed] == [(name, 3)]

    status, _, err = pull(capsys, "org/Mixed")  # a split model is one choice among the repository's GGUFs
    assert status == 2 and ("'org/Mixed' has 2 GGUF models; pull one of: org/Mixed/m-00001-of-00003.gguf "
                            "(3 shards), org/Mixed/one.gguf") in err
    status, _, err = pull(capsys, "org/Half/m-00001-of-00003.gguf")
    assert status == 2 and ("'org/Half' has 2 of the 3 shards of the split model m-00001-of-00003.gguf: no "
                            "m-00002-of-00003.gguf; nothing pulled") in err
    assert not (tmp_path / "hub" / "models--org--Half").exists()
    status, _, err = pull(capsys, "org/Half/x-00001-of-00002.gguf")
    assert status == 2 and "repository 'org/Half' has no file 'x-00001-of-00002.gguf' at revision 'main'" in err


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(capsys):
    class Terminal:
        def isatty(self):
            return True

    class Pipe:
        def isatty(self):
            return False

    assert progress_class(Terminal()) is Bar and progress_class(Pipe()) is LineProgress
    with LineProgress(total=4096, desc="a URL", label="org/repo/x.gguf", unit="B", unit_scale=True) as bar:
        for _ in range(4):
            bar.update(1024)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "org/repo/x.gguf: started, 4.0 KiB"
    assert [line.split(" (")[0] for line in lines[1:4]] == [f"org/repo/x.gguf: {p}%" for p in (25, 50, 75)]
    assert lines[4].startswith("org/repo/x.gguf: done, 100% (4.0 KiB of 4.0 KiB")


def test_an_offline_pull_of_a_cached_file_says_it_is_there(hub, capsys, small_gguf, monkeypatch):
    hub.add("org/Small-GGUF", "small.gguf", small_gguf.read_bytes())
    hub.add("org/Small-GGUF", "README.md", b"# Small\n", lfs=False)
    assert pull(capsys, "org/Small-GGUF/small.gguf")[0] == 0
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    for ref in ("org/Small-GGUF/small.gguf", "org/Small-GGUF"):
        status, out, err = pull(capsys, ref)
        assert status == 0, err
        assert out == "org/Small-GGUF/small.gguf\n" and "already in the cache" in err and "offline" in err, err
    assert hub.requests == []  # nothing asked of the hub
    status, out, err = pull(capsys, "org/Other-GGUF/other.gguf")
    assert status == 2 and "offline" in err and "not in the cache" in err and "OfflineMode" not in err, err
