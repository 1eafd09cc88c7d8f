"""`pull`: a model from the Hugging Face Hub into the Hugging Face cache, checked, through
huggingface_hub (the one way this project downloads anything, and only when asked to).

`pull("ORG/REPO/FILE")` fetches one file, or every shard of the split GGUF model FILE is a shard
of (NAME-0000K-of-0000N.gguf: the repository's listing says which are there, and a model with a
shard missing is not pulled); `pull("ORG/REPO")` fetches the repository's GGUF model when it has
exactly one, a split model's shards counting as one (naming them all when it has several), else
its model folder (config, tokenizer, weights). The files land where huggingface_hub puts them ($HF_HUB_CACHE, ...; see
stores.py), so `models list` finds them and other tools share them; $HF_ENDPOINT names another
hub (a mirror, a test server), read at each call.

Every file is checked after the download, against the hub's own checksum: the ETag the hub
gave the file, which names its blob in the cache, is the SHA-256 of an LFS file's bytes and the
git blob SHA-1 of a small file's (for an LFS file the repository listing's lfs.sha256 too, when
it was read). huggingface_hub checks only the size. A file that fails is deleted (blob and
snapshot link) and the pull fails naming both digests: no corrupted model stays to be run.

Before anything else a pull asks the hub one question whose connection may take CONNECT_TIMEOUT_S:
huggingface_hub retries a file whose hub cannot be reached five times, 1 + 2 + 4 + 8 + 8 s apart
(each connection as long as HF_HUB_ETAG_TIMEOUT), so a hub that is down or a machine that is
offline would keep `pull` silent for 24 s or more before the one line that says so. Only that
first connection is cut short: the hub's answers and the downloads keep huggingface_hub's own
timeouts (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT: how long a read may wait).
"""

import functools
import hashlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from scratchllm.errors import ConfigError
from scratchllm.formats import stores
from scratchllm.formats.gguf_split import group_shards, shard_path

FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.txt", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_HEX = re.compile(r"[0-9a-f]+")
_BLOCK = 8 << 20
CONNECT_TIMEOUT_S = 5.0  # to open the first connection to the hub (TCP and TLS, through a proxy if one is set)


@dataclass(frozen=True)
class Pulled:
    name: str  # what it runs by: ORG/REPO/FILE for a GGUF file (a split one's first shard), ORG/REPO for a folder
    files: tuple[Path, ...]  # the snapshot's links to the checked blobs
    size: int
    offline: bool = False  # found in the cache with HF_HUB_OFFLINE set: nothing was asked of the hub


def split_ref(ref: str) -> tuple[str, str | None]:
    """ORG/REPO[/FILE] -> (repo id, file in the repository or None)."""
    parts = ref.strip("/").split("/")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"'{ref}' is not ORG/REPO or ORG/REPO/FILE (a Hugging Face repository, a file in it)")
    return "/".join(parts[:2]), ("/".join(parts[2:]) or None)


def _endpoint() -> str | None:
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


def _reach(repo_id: str, revision: str) -> None:
    """Ask the hub for its front page, through huggingface_hub's own HTTP client (its proxy,
    certificates and headers), with a short connection timeout and no retry: any answer at all
    says it is there; no connection is the one-line error (see the module doc)."""
    import httpx2
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return  # huggingface_hub answers from the cache alone, or says it is offline
    timeout = httpx2.Timeout(float(constants.HF_HUB_ETAG_TIMEOUT), connect=CONNECT_TIMEOUT_S)
    try:
        get_session().head((_endpoint() or constants.ENDPOINT) + "/", timeout=timeout, follow_redirects=False)
    except httpx2.TransportError as err:
        raise _hub_error(err, repo_id, revision, None) from None


def _hub_error(err: Exception, repo_id: str, revision: str, filename: str | None,
               listing: Callable[[], list[str]] | None = None) -> ConfigError:
    """The one-line error for what huggingface_hub raised."""
    from huggingface_hub import errors

    hub = _endpoint() or "the Hugging Face Hub"
    if isinstance(err, errors.RepositoryNotFoundError):
        return ConfigError(f"no repository '{repo_id}' on {hub} (or it is private or gated: log in with "
                           "`hf auth login` or set HF_TOKEN)")
    if isinstance(err, errors.RevisionNotFoundError):
        return ConfigError(f"repository '{repo_id}' has no revision '{revision}' on {hub}")
    if isinstance(err, errors.RemoteEntryNotFoundError):
        files = ""
        if listing is not None:
            try:
                names = listing()
                files = f"; its files: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}"
            except Exception:  # noqa: BLE001 - the listing only decorates the message
                files = ""
        return ConfigError(f"repository '{repo_id}' has no file '{filename}' at revision '{revision}'{files}")
    if isinstance(err, errors.HFValidationError):
        return ConfigError(f"'{repo_id}': {err}")
    if isinstance(err, errors.HfHubHTTPError):
        return ConfigError(f"{hub} refused '{repo_id}': {str(err).splitlines()[0]}")
    # hf_hub_download says LocalEntryNotFoundError when the hub did not answer and the cache has
    # no copy; the listing lets the HTTP client's own ConnectError / timeout through
    if isinstance(err, errors.LocalEntryNotFoundError | ConnectionError | TimeoutError) \
            or "Connect" in type(err).__name__ or "Timeout" in type(err).__name__:
        return ConfigError(f"cannot reach {hub} to pull '{repo_id}' ({err.__class__.__name__}); check the network, "
                           "HF_ENDPOINT, or HF_HUB_OFFLINE")
    return ConfigError(f"pulling '{repo_id}' from {hub} failed: {err.__class__.__name__}: {err}")


def _digest(path: Path, kind: str) -> str:
    """SHA-256 of the bytes, or the git blob SHA-1 (of 'blob SIZE\\0' then the bytes)."""
    h = hashlib.sha256() if kind == "sha256" else hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def check(link: Path, lfs_sha256: str | None = None) -> None:
    """Check a downloaded file against its ETag (its blob's name) and the listing's SHA-256; on a
    mismatch delete the blob and the link and raise."""
    blob = link.resolve()
    etag = blob.name
    wanted: list[tuple[str, str]] = []
    if lfs_sha256:
        wanted.append(("sha256", lfs_sha256.lower()))
    if _HEX.fullmatch(etag) and len(etag) in (40, 64):
        wanted.append(("sha256" if len(etag) == 64 else "git-sha1", etag))
    problem = None
    if not wanted:
        problem = f"the hub gave no checksum for it (ETag '{etag}')"
    for kind, expected in wanted:
        got = _digest(blob, kind)
        if got != expected:
            problem = f"its {kind} is {got}, the hub says {expected}"
            break
    if problem is not None:
        blob.unlink(missing_ok=True)
        link.unlink(missing_ok=True)
        repo = next((p for p in link.parents if p.name.startswith("models--")), None)
        if repo is not None and not any(p.is_file() for p in (repo / "snapshots").rglob("*")):
            shutil.rmtree(repo, ignore_errors=True)  # nothing else of the repository was kept
        raise ConfigError(f"{link.name}: refused: {problem}; the download was deleted (pull it again)")


def _folder_files(names: list[str]) -> list[str]:
    """The files of a model folder: config, tokenizer, and the safetensors weights (else the
    torch ones), at the repository's top level."""
    top = [n for n in names if "/" not in n]
    weights = [n for n in top if n.endswith(".safetensors")] or [
        n for n in top if n.startswith("pytorch_model") and n.endswith(".bin")]
    return [n for n in top if n in FOLDER_FILES] + weights


def _all_shards(repo_id: str, first: PurePosixPath, shards: list[PurePosixPath | None]) -> list[str]:
    """The files of one GGUF model in the repository's listing (gguf_split.group_shards), every
    shard of a split one, or why not."""
    missing = [k for k, s in enumerate(shards, 1) if s is None]
    if missing:
        named = [shard_path(first, k).as_posix() for k in missing]
        raise ConfigError(f"'{repo_id}' has {len(shards) - len(missing)} of the {len(shards)} shards of the split "
                          f"model {first}: no {', '.join(named)}; nothing pulled")
    return [str(s) for s in shards]


def _from_cache(repo_id: str, filename: str | None) -> Pulled:
    """Offline (HF_HUB_OFFLINE): the model as the cache already holds it, or why not. Without
    this, huggingface_hub's listing fails with OfflineModeIsEnabled even when the file is there."""
    ref = f"{repo_id}/{filename}" if filename else repo_id
    found = stores.candidates(ref, list(stores.scan_hf_cache()))
    if len(found) == 1 and not found[0].problem:
        model = found[0]
        files = model.parts or ((model.path,) if model.kind == "gguf" else tuple(
            p for p in model.path.iterdir() if p.is_file()))
        return Pulled(model.name, files, model.size, offline=True)
    why = found[0].problem if len(found) == 1 else (
        "it names several: " + ", ".join(m.name for m in found) if found else "it is not in the cache")
    raise ConfigError(f"offline (HF_HUB_OFFLINE is set): cannot pull '{ref}': {why} ({stores.hf_hub_cache()}); "
                      "unset HF_HUB_OFFLINE to download it")


def pull(ref: str, revision: str = "main", progress: Callable[..., Any] | None = None,
         out: IO[str] | None = None) -> Pulled:
    """Download ORG/REPO[/FILE] into the Hugging Face cache (see the module doc). `progress`: a
    class from formats/progress.py for each file's bar; `out`: where a line per file goes.
    huggingface_hub's telemetry (a user agent naming the calling tool, fetched from the hub) is
    off unless HF_HUB_DISABLE_TELEMETRY says otherwise: a pull asks the hub for the files only."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # read when huggingface_hub is first imported
    from huggingface_hub import HfApi, hf_hub_download

    repo_id, filename = split_ref(ref)
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return _from_cache(repo_id, filename)
    _reach(repo_id, revision)
    endpoint, cache = _endpoint(), stores.hf_hub_cache()
    api = HfApi(endpoint=endpoint)
    lfs: dict[str, str] = {}

    def listing() -> list[str]:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
        for s in info.siblings or []:
            if s.lfs is not None:
                lfs[s.rfilename] = s.lfs.sha256
        return [s.rfilename for s in info.siblings or []]

    def listed() -> list[str]:
        try:
            return listing()
        except Exception as err:  # noqa: BLE001 - whatever the hub client raises ends the pull, named in one line
            raise _hub_error(err, repo_id, revision, None) from None

    if filename is None:
        names = listed()
        ggufs = group_shards(PurePosixPath(n) for n in names if n.endswith(".gguf"))
        if len(ggufs) > 1:
            raise ConfigError(f"'{repo_id}' has {len(ggufs)} GGUF models; pull one of: " + ", ".join(
                f"{repo_id}/{first}" + (f" ({len(shards)} shards)" if len(shards) > 1 else "")
                for first, shards in ggufs.items()))
        wanted = _all_shards(repo_id, *next(iter(ggufs.items()))) if ggufs else _folder_files(names)
        if not wanted or (not ggufs and "config.json" not in wanted):
            raise ConfigError(f"'{repo_id}' has no GGUF file and no model folder (config.json and weights); "
                              f"its files: {', '.join(names[:20])}")
    else:
        ((first, shards),) = group_shards([PurePosixPath(filename)]).items()
        wanted = [filename]
        if len(shards) > 1:  # a shard's name: the split model it is part of
            names = listed()
            models = group_shards(PurePosixPath(n) for n in names)
            if first not in models:
                raise ConfigError(f"repository '{repo_id}' has no file '{filename}' at revision '{revision}'; its "
                                  f"files: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}")
            wanted = _all_shards(repo_id, first, models[first])
    links = []
    for name in wanted:
        if out is not None:
            print(f"pulling {repo_id}/{name} (revision {revision})", file=out, flush=True)
        try:
            bar = functools.partial(progress, label=f"{repo_id}/{name}") if progress is not None else None
            path = hf_hub_download(repo_id, name, revision=revision, cache_dir=cache, endpoint=endpoint,
                                   tqdm_class=bar)  # type: ignore[arg-type]  # a partial of a tqdm class
        except Exception as err:  # noqa: BLE001 - as above
            raise _hub_error(err, repo_id, revision, name, listing) from None
        link = Path(str(path))
        check(link, lfs.get(name))
        links.append(link)
    runs_as = f"{repo_id}/{wanted[0]}" if wanted[0].endswith(".gguf") else repo_id
    return Pulled(runs_as, tuple(links), sum(p.stat().st_size for p in links))
