"""Model stores laid out on disk as their tools write them, for tests: the Hugging Face cache as
huggingface_hub's hf_hub_download leaves it, and Ollama's store as `ollama pull` leaves it.

Blob files are hard links to the source where the file system allows (the real models are
100 MB; the layouts are what matter, and a link is a file like any other to the reader)."""

import hashlib
import json
import os
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_DIGESTS: dict[tuple[str, int, int], str] = {}


def sha256_of(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def place(source: Path | bytes, target: Path) -> None:
    """`target` gets the bytes of `source` (a hard link to a file, else a copy)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(source, bytes):
        target.write_bytes(source)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def hf_file(cache: Path, repo_id: str, filename: str, source: Path | bytes, commit: str = COMMIT) -> Path:
    """One file of a model repository in the cache: blobs/SHA256 (the ETag of an LFS file),
    snapshots/COMMIT/FILENAME a relative symlink to it, refs/main = COMMIT. Returns the link."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    digest = hashlib.sha256(source).hexdigest() if isinstance(source, bytes) else sha256_of(source)
    blob = repo / "blobs" / digest
    if not blob.exists():
        place(source, blob)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    link = repo / "snapshots" / commit / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return link


def ollama_model(root: Path, name: str, tag: str, gguf: Path | bytes | list[Path], namespace: str = "library",
                 host: str = "registry.ollama.ai") -> Path:
    """A model as `ollama pull` stores it: blobs/sha256-HEX for the GGUF, its template and its
    config, and manifests/HOST/NAMESPACE/NAME/TAG naming them by digest. Returns the manifest.
    A list of GGUF files is a split model's shards, a model layer each, as Ollama's import of a
    split model writes them."""
    def blob(data: Path | bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest() if isinstance(data, bytes) else sha256_of(data)
        path = root / "blobs" / f"sha256-{digest}"
        if not path.exists():
            place(data, path)
        return {"digest": f"sha256:{digest}", "size": path.stat().st_size}

    template = b"{{ .Prompt }}"
    config = json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "Q4_1"}).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **blob(config)},
        "layers": [*({"mediaType": "application/vnd.ollama.image.model", **blob(g)}
                     for g in (gguf if isinstance(gguf, list) else [gguf])),
                   {"mediaType": "application/vnd.ollama.image.template", **blob(template)}],
    }
    path = root / "manifests" / host / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path
