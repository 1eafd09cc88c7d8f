"""Model files that other tools keep on disk: the Hugging Face cache, Ollama's model store, and any
folder the user names. Each found model gets the name it runs by (`scratchllm generate NAME`).

Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), as
huggingface_hub writes it:
    models--ORG--REPO/refs/main                      the commit `main` points to
    models--ORG--REPO/snapshots/COMMIT/PATH          a symlink to ../../blobs/ETAG
    models--ORG--REPO/blobs/ETAG                     the bytes (ETAG: sha256 of an LFS file)
One snapshot per repository is read: the one refs/main names, else the newest. Its .gguf files
are named ORG/REPO/PATH; a snapshot that is a model folder (config.json and weights) is ORG/REPO.

Ollama's store ($OLLAMA_MODELS, else ~/.ollama/models), as `ollama pull` writes it:
    manifests/HOST/NAMESPACE/MODEL/TAG   JSON; the layer of mediaType MODEL_LAYER names the GGUF
    blobs/sha256-HEX                     the bytes, named by their digest
A manifest of registry.ollama.ai/library is named MODEL:TAG, as `ollama list` shows it; another
namespace NAMESPACE/MODEL:TAG, another host HOST/NAMESPACE/MODEL:TAG. A name without a tag means
:latest, as in Ollama.

A split GGUF model (NAME-00001-of-0000N.gguf and its other shards, in one folder: gguf_split.py)
is one model wherever it is found, named and opened by its first shard, its size all its
shards'; a shard that is not there is its `problem`, and it is listed all the same. A manifest
with several model layers (Ollama's import of a split model) is one model too, but not one that
runs here: its shards are blobs named by digest, and a split model's shards are found by name.

Only file names and headers are read here; nothing is loaded, nothing downloaded. Listing
(`header_problem`) also parses each GGUF file's header, as a load would, so that a truncated
file, an empty one or a text file named .gguf is shown broken with the reason before anyone
tries to run it; resolving a name does not (it would parse every file of every store).
"""

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from scratchllm.errors import FormatError
from scratchllm.formats.files import is_gguf
from scratchllm.formats.folder import PREFERENCE
from scratchllm.formats.gguf_split import group_shards, shard_path
from scratchllm.formats.names import model_dirs

MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class StoredModel:
    """One model found on disk. `path` is what resolve_model hands the loaders: a GGUF file or a
    model folder; `owner` is what removing it removes (the manifest, the cached file or repository)."""

    name: str  # what the user types: llama3.2:1b, ORG/REPO/file.gguf, ORG/REPO, or a path
    kind: str  # "gguf" | "folder"
    store: str  # "ollama" | "hf-cache" | "folder"
    path: Path
    size: int  # bytes of the model's files (a split model's: those of the shards there)
    owner: Path  # the Ollama manifest, the snapshot's file or the repository's folder, or the path
    shards: int = 1  # the files a split GGUF model is cut into; 1 for any other model
    parts: tuple[Path, ...] = ()  # a split model's shards that are there (the snapshot's links, the paths)
    problem: str = ""  # why it cannot run as it is (a shard missing); "" when it can


def hf_hub_cache() -> Path:
    """Where huggingface_hub keeps downloads, by the environment variables it reads."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def ollama_models() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any((folder / name).is_file() for name in PREFERENCE)


def _folder_size(folder: Path) -> int:
    """Bytes of the files in `folder` (symlinks followed: a snapshot's files are links to blobs)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _gguf_model(name: str, store: str, first: Path, shards: list[Path | None]) -> StoredModel | None:
    """A GGUF model from its file, or a split one from its shards (gguf_split.group_shards: the
    first shard's path, each shard's or None); None when none of its files is there (a link to a
    blob that is gone, as an interrupted download leaves, is not there)."""
    there = [s for s in shards if s is not None and s.is_file()]
    if not there:
        return None
    if len(shards) == 1:
        return StoredModel(name, "gguf", store, first, first.stat().st_size, first)
    missing = [k for k, s in enumerate(shards, 1) if s is None or not s.is_file()]
    problem = ""
    if missing:
        problem = (f"incomplete: shard{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} of {len(shards)} "
                   f"missing ({', '.join(shard_path(first, k).name for k in missing)})")
    return StoredModel(name, "gguf", store, first, sum(p.stat().st_size for p in there), first,
                       shards=len(shards), parts=tuple(there), problem=problem)


# ---- the Hugging Face cache -----------------------------------------------------------------------
def repo_folder(repo_id: str, root: Path | None = None) -> Path:
    """models--ORG--REPO: the folder huggingface_hub keeps a model repository in."""
    return (root or hf_hub_cache()) / ("models--" + repo_id.replace("/", "--"))


def snapshot(repo: Path) -> Path | None:
    """The snapshot of a cached repository that we read: refs/main's commit, else the newest."""
    try:
        commit = (repo / "refs" / "main").read_text().strip()
        if (repo / "snapshots" / commit).is_dir():
            return repo / "snapshots" / commit
    except OSError:
        pass
    snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime_ns) if snapshots else None


def scan_hf_cache(root: Path | None = None) -> Iterator[StoredModel]:
    root = root or hf_hub_cache()
    for repo in sorted(root.glob("models--*--*")):
        snap = snapshot(repo)
        if snap is None:
            continue
        repo_id = repo.name[len("models--"):].replace("--", "/", 1)
        if _is_model_folder(snap):
            yield StoredModel(repo_id, "folder", "hf-cache", snap, _folder_size(snap), repo)
        for first, shards in group_shards(sorted(snap.rglob("*.gguf"))).items():
            model = _gguf_model(f"{repo_id}/{first.relative_to(snap).as_posix()}", "hf-cache", first, shards)
            if model is not None:
                yield model


# ---- Ollama's store --------------------------------------------------------------------------------
def ollama_name(manifest: Path, root: Path) -> str:
    host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
    if host == OLLAMA_REGISTRY:
        return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def manifest_blobs(manifest: Path, root: Path) -> list[tuple[str, Path]]:
    """(mediaType, blob file) of each layer (and the config) that a manifest names, in its order
    (a split model has a model layer per shard)."""
    doc = json.loads(manifest.read_text())
    blobs = []
    for layer in [doc.get("config") or {}, *doc.get("layers", [])]:
        digest = str(layer.get("digest", ""))
        # only a well-formed digest names a file: anything else could point outside blobs/
        # (and `rm` deletes what manifests name)
        if DIGEST.fullmatch(digest):
            # `ollama pull` names blobs sha256-HEX; a digest is written sha256:HEX
            blobs.append((str(layer.get("mediaType")), root / "blobs" / digest.replace(":", "-")))
    return blobs


def scan_ollama(root: Path | None = None) -> Iterator[StoredModel]:
    root = root or ollama_models()
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        try:
            blobs = [blob for kind, blob in manifest_blobs(manifest, root) if kind == MODEL_LAYER]
        except (OSError, ValueError, AttributeError):
            continue  # not a manifest we can read: not ours to judge
        there = [b for b in blobs if b.is_file()]
        if not there or not is_gguf(there[0]):
            continue
        name = ollama_name(manifest, root)
        if len(blobs) == 1:
            yield StoredModel(name, "gguf", "ollama", blobs[0], blobs[0].stat().st_size, manifest)
            continue
        missing = [str(k) for k, b in enumerate(blobs, 1) if not b.is_file()]
        problem = (f"incomplete: shard blob{'s' * (len(missing) > 1)} {', '.join(missing)} of {len(blobs)} missing"
                   if missing else f"not runnable here: its {len(blobs)} shards are blobs named by digest, and a "
                   "split model's shards are found by their names (NAME-0000K-of-0000N.gguf)")
        yield StoredModel(name, "gguf", "ollama", blobs[0], sum(b.stat().st_size for b in there), manifest,
                          shards=len(blobs), parts=tuple(there), problem=problem)


# ---- a folder --------------------------------------------------------------------------------------
def scan_folder(folder: Path) -> Iterator[StoredModel]:
    """GGUF files and model folders under `folder`, each named by its path inside the folder
    (`deep/m.gguf`; the folder itself, when it is a model folder, by its own name): short names
    that run it wherever the folder is searched (`--dir`, or names.model_dirs())."""
    folder = folder.expanduser()

    def short(path: Path) -> str:
        return path.relative_to(folder).as_posix() if path != folder else folder.name

    if _is_model_folder(folder):
        yield StoredModel(short(folder), "folder", "folder", folder, _folder_size(folder), folder)
    ggufs = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix == ".gguf" and is_gguf(path):
            ggufs.append(path)
        elif path.is_dir() and _is_model_folder(path):
            yield StoredModel(short(path), "folder", "folder", path, _folder_size(path), path)
    for first, shards in group_shards(ggufs).items():
        model = _gguf_model(short(first), "folder", first, shards)
        if model is not None:
            yield model


def scan(folders: Iterable[Path] = ()) -> list[StoredModel]:
    """Everything in the Hugging Face cache, Ollama's store, the given folders and the folders
    the user set once (names.model_dirs(): $SCRATCHLLM_MODEL_DIRS and the names file's `dirs`)."""
    found = [*scan_ollama(), *scan_hf_cache()]
    for folder in dict.fromkeys([*(Path(f).expanduser() for f in folders), *model_dirs()]):
        if folder.is_dir():
            found += scan_folder(folder)
    return found


def header_problem(model: StoredModel) -> str:
    """"" when each of a GGUF model's files there parses as GGUF (its header, its metadata, and
    its tensors inside the file), else the reason the first one does not: what a load would say."""
    if model.kind != "gguf":
        return ""
    from scratchllm.formats.gguf import GGUFFile

    for path in model.parts or (model.path,):
        try:
            GGUFFile(path)
        except FormatError as err:
            return err.problem if len(model.parts) <= 1 else f"{path.name}: {err.problem}"
    return ""


def candidates(ref: str, stored: Iterable[StoredModel]) -> list[StoredModel]:
    """The stored models that `ref` names: the exact name (a split model's by any shard's name);
    ORG/REPO for each GGUF of a repository that is no model folder; an Ollama name without its
    tag (:latest) or with its host and namespace written out."""
    stored = list(stored)
    name = PurePosixPath(ref).name
    first = ref[:len(ref) - len(name)] + shard_path(PurePosixPath(name), 1).name  # a shard's name: its first's
    exact = [m for m in stored if m.name == ref or (m.shards > 1 and m.name == first)]
    if exact:
        return exact
    wanted = {ref}
    if ":" not in ref.rsplit("/", 1)[-1]:
        wanted.add(ref + ":latest")
    for prefix in (f"{OLLAMA_REGISTRY}/{OLLAMA_NAMESPACE}/", f"{OLLAMA_REGISTRY}/", f"{OLLAMA_NAMESPACE}/"):
        wanted |= {w[len(prefix):] for w in list(wanted) if w.startswith(prefix)}
    tagged = [m for m in stored if m.name in wanted and m.store == "ollama"]
    if tagged:
        return tagged
    if ref.count("/") != 1:
        return []
    return [m for m in stored if m.store == "hf-cache" and m.kind == "gguf" and m.name.startswith(ref + "/")]


# ---- removing --------------------------------------------------------------------------------------
def remove(model: StoredModel) -> int:
    """Delete a stored model the way its tool would, keeping what other models still use; returns
    the bytes freed. Ollama: the manifest, and each blob no other manifest names. The Hugging Face
    cache: a GGUF's snapshot link (each shard's, of a split model), and its blob unless another
    link points to it (the repository's folder once no file is left); a model folder: its
    repository's folder."""
    if model.store == "ollama":
        return _remove_ollama(model.owner)
    if model.store == "hf-cache":
        return _remove_hf(model)
    raise ValueError(f"{model.name} is in no store: its files are the user's")


def _remove_ollama(manifest: Path) -> int:
    root = manifest.parents[4]  # root/manifests/HOST/NAMESPACE/MODEL/TAG
    mine = {blob for _, blob in manifest_blobs(manifest, root)}
    for other in (root / "manifests").glob("*/*/*/*"):
        if other != manifest and other.is_file():
            try:
                mine -= {blob for _, blob in manifest_blobs(other, root)}
            except (OSError, ValueError, AttributeError):
                continue
    freed = 0
    manifest.unlink()
    for blob in mine:
        if blob.is_file():
            freed += blob.stat().st_size
            blob.unlink()
    _remove_empty_parents(manifest.parent, root / "manifests")
    return freed


def _remove_hf(model: StoredModel) -> int:
    repo = next(p for p in model.path.parents if p.name.startswith("models--"))
    if model.kind == "folder":
        freed = _folder_size(repo / "blobs") if (repo / "blobs").is_dir() else 0
        shutil.rmtree(repo)
        return freed
    mine = model.parts or (model.owner,)
    blobs = {link.resolve() for link in mine}
    for link in mine:
        link.unlink()
    links = [p for p in (repo / "snapshots").rglob("*") if p.is_symlink() or p.is_file()]
    freed = 0
    for blob in blobs:
        if blob.is_file() and blob.parent == repo / "blobs" and all(p.resolve() != blob for p in links):
            freed += blob.stat().st_size
            blob.unlink()
    if not any(p.is_file() for p in links):
        freed += _folder_size(repo)
        shutil.rmtree(repo)
    else:
        _remove_empty_parents(model.owner.parent, repo / "snapshots")
    return freed


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty
            return
        folder = folder.parent
