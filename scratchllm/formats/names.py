"""The user's own model names and model folders, kept in one small file:
`$SCRATCHLLM_CONFIG_DIR/models.json`, else `$XDG_CONFIG_HOME/scratchllm/models.json`, else
`~/.config/scratchllm/models.json`.

    {"names": {"mybot:latest": {"from": "default", "system": "...", "parameters": {...},
                                "messages": [...], "template": null, "origin": "create"}},
     "dirs": ["~/models"]}

A name (made by Ollama's /api/create, /api/copy or /api/pull on `scratchllm serve`) runs the
model its `from` names (any model reference: a package name, a path, a store name, another
name) with what it adds: a system prompt, sampling parameters by Ollama's option names, earlier
messages, a chat template. `resolve_model` (refs.py) resolves a name to its model's file, so
`scratchllm serve NAME`, `generate NAME` and `LLM(NAME)` run it, and `models list` shows it.
An Ollama name without a tag means `:latest`, as in Ollama.

`dirs`, with the folders of `$SCRATCHLLM_MODEL_DIRS` (separated by the path separator, `:`), are
searched as `models list --dir` searches a folder, every time: their models run by short names.

The file is written whole to a temporary file and renamed over the old one, under an exclusive
lock on a lock file beside it, so a server and a command line changing names at once lose
neither change and a reader never sees half a file.
"""

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scratchllm.errors import ConfigError

FILE = "models.json"


@dataclass(frozen=True)
class Named:
    """A user's name for a model, and what it adds to every request through that name."""

    name: str
    base: str  # the model reference it runs (Ollama's FROM)
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)  # Ollama's option names
    messages: tuple[dict[str, str], ...] = ()  # earlier turns, before the request's own
    template: str | None = None  # a chat template (Jinja, as the model files carry) over the model's own
    origin: str = "create"  # create | copy | pull
    created: float = 0.0

    def adds_nothing(self) -> bool:
        return self.system is None and not self.parameters and not self.messages and self.template is None


def config_dir() -> Path:
    base = os.environ.get("SCRATCHLLM_CONFIG_DIR") or os.path.join(
        os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "scratchllm")
    return Path(base).expanduser()


def canonical(name: str) -> str:
    """An Ollama-style name with its tag: `mybot` -> `mybot:latest`; a tagged name, a file
    (`ORG/REPO/FILE.gguf`, a path) or a folder path is left alone."""
    last = name.rsplit("/", 1)[-1]
    if not name or ":" in last or last.endswith((".gguf", ".safetensors", ".bin")) or name.startswith(("/", ".", "~")):
        return name
    return name + ":latest"


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"names": {}, "dirs": []}
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: not a JSON file of model names ({err})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("names", {}), dict) or \
            not isinstance(doc.get("dirs", []), list):
        raise ConfigError(f"{path}: expected {{\"names\": {{...}}, \"dirs\": [...]}}")
    doc.setdefault("names", {})
    doc.setdefault("dirs", [])
    return doc


def _named(name: str, entry: Any, path: Path) -> Named:
    if not isinstance(entry, dict) or not isinstance(entry.get("from"), str):
        raise ConfigError(f"{path}: name '{name}' has no 'from' model")
    return Named(name, entry["from"], entry.get("system"), dict(entry.get("parameters") or {}),
                 tuple(entry.get("messages") or ()), entry.get("template"), entry.get("origin", "create"),
                 float(entry.get("created", 0.0)))


def all_names() -> dict[str, Named]:
    path = config_dir() / FILE
    return {name: _named(name, entry, path) for name, entry in _read(path)["names"].items()}


def lookup(name: str) -> Named | None:
    names = all_names()
    return names.get(name) or names.get(canonical(name))


@contextlib.contextmanager
def _changing() -> Iterator[dict[str, Any]]:
    """The file's contents to change in place, written back (atomically, under the lock) on exit."""
    folder = config_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / (FILE + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = folder / FILE
        doc = _read(path)
        yield doc
        tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def save(named: Named) -> Named:
    """Add or replace a name."""
    named = Named(**{**asdict(named), "name": canonical(named.name), "created": named.created or time.time()})
    entry = {k: v for k, v in asdict(named).items() if k not in ("name", "base")}
    entry["messages"] = list(named.messages)
    with _changing() as doc:
        doc["names"][named.name] = {"from": named.base, **entry}
    return named


def remove(name: str) -> Named | None:
    """Delete a name; the one deleted, or None when there was none."""
    with _changing() as doc:
        key = name if name in doc["names"] else canonical(name)
        entry = doc["names"].pop(key, None)
    return _named(key, entry, config_dir() / FILE) if entry is not None else None


def model_dirs() -> list[Path]:
    """The folders searched for models every time: $SCRATCHLLM_MODEL_DIRS, then the file's `dirs`."""
    from_env = [p for p in (os.environ.get("SCRATCHLLM_MODEL_DIRS") or "").split(os.pathsep) if p]
    listed = [str(p) for p in _read(config_dir() / FILE)["dirs"]]
    return [Path(p).expanduser() for p in dict.fromkeys(from_env + listed)]
