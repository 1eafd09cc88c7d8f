"""The package's structure, checked: each type that crosses the engine's contract is defined
once (in scratchllm/engine/protocol.py), no two modules define a class of the same name, and
only the scheduler touches its queues and the block tables."""

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "scratchllm"
CONTRACT = {"TokenEvent", "RequestMetrics", "RequestOutput", "RequestStream", "EngineClient", "EngineStats"}
SCHEDULER_STATE = {"running", "resumed", "policy", "high", "low", "queue"}
BLOCK_MUTATORS = {"free", "allocate_prefix", "ensure_slots", "cache_full_blocks", "begin_step", "end_step", "fork",
                  "trim"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path))


def test_every_class_name_is_defined_once_and_the_contract_in_protocol():
    where = defaultdict(list)
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    twice = {cls: mods for cls, mods in where.items() if len(mods) > 1}
    assert twice == {}
    assert {cls: where[cls] for cls in CONTRACT} == {cls: ["engine/protocol.py"] for cls in CONTRACT}
    assert "StepOutput" not in where  # the engine's step yields the contract's TokenEvent


def _chain(node):
    """a.b.c -> ['a', 'b', 'c'] for a chain of names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def test_only_the_scheduler_touches_its_queues_and_the_block_tables():
    offences = []
    for name, tree in _modules():
        if name in ("engine/scheduler.py", "engine/policy.py", "engine/block_manager.py"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain = _chain(node)
            if len(chain) >= 2 and chain[-2] == "scheduler" and chain[-1] in SCHEDULER_STATE:
                offences.append(f"{name}:{node.lineno} {'.'.join(chain)}")
            if len(chain) >= 2 and chain[-2] in ("block_manager", "bm") and chain[-1] in BLOCK_MUTATORS:
                offences.append(f"{name}:{node.lineno} {'.'.join(chain)}")
    assert offences == []


def test_the_checks_can_fail():
    """The scanners above do find what they look for (so an empty result means something)."""
    tree = ast.parse("self.engine.scheduler.running.remove(r)\nself.block_manager.free(r)\n")
    chains = [_chain(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    assert ["self", "engine", "scheduler", "running"] in chains and ["self", "block_manager", "free"] in chains


# ---- the layers and the import graph ------------------------------------------------------------
# The package's layers, lowest first. A module may import modules of its own entry and of any
# lower layer; the entries that share a layer are peers and import neither each other nor
# anything above. An entry names a package or a module and everything under it; the longest
# entry that matches a module is its place (so `scratchllm.trace.views` sits above
# `scratchllm.trace`).
LAYERS = [
    ("scratchllm.errors", "scratchllm.dtypes"),  # the error types; the dtype names (no imports)
    ("scratchllm",),  # the package's __init__: its version and lazily imported public names
    ("scratchllm.formats",),  # model files -> arrays, and the layout of their quantized blocks
    # the compiled kernels (which pack a file's quantized blocks into their panels); the trace
    # ring (record format, writer, reader) and the OTLP span export, which the engine and the
    # server write; the logit processors
    ("scratchllm.kernels", "scratchllm.trace", "scratchllm.logits"),
    ("scratchllm.tokenizer", "scratchllm.models"),
    ("scratchllm.structured",),  # grammars and their matchers over a tokenizer's vocabulary
    ("scratchllm.sampling",),  # SamplingParams and the sampler (a grammar's mask among its steps)
    ("scratchllm.engine",),  # the engine, its contract (engine/protocol.py) and its model loader
    # over the engine: the offline API, the HTTP server, and the views of a trace ring (which
    # read what the engine wrote, and nothing below them reads)
    ("scratchllm.llm", "scratchllm.server", "scratchllm.trace.views"),
    ("scratchllm.cluster",),  # replicas behind the server's routes (Ray Serve)
    ("scratchllm.bench", "scratchllm.evaluate"),  # the benchmarks; the evaluation loop (HTTP clients)
    ("scratchllm.cli",),
    ("scratchllm.demo",),
]


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Cython sources import by the same rules; their lines are read with a pattern, not ast.
_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+(\.*[\w.]*)\s+c?import\s+([\w, ]+)|c?import\s+([\w.]+))", re.M)


def _resolve(modules, importer, is_package, module, names, level):
    """The modules an import statement reaches: `from a.b import c` is a.b.c where that is a
    module, else a.b; relative imports count from the importer's package."""
    if level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (level - 1)]
        module = ".".join(base + ([module] if module else []))
    if names is None:
        return [module]
    return [f"{module}.{n}" if f"{module}.{n}" in modules else module for n in names]


def import_graph(sources):
    """{module: [(line, imported module)]} of every import of a scratchllm module, at any depth
    (in functions, in `if TYPE_CHECKING:`), from {module name: (path, source text)}."""
    modules = set(sources)
    graph = {}
    for name, (path, text) in sources.items():
        is_package = path.name.startswith("__init__.")
        found = []
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    targets = _resolve(modules, name, is_package, node.module, [a.name for a in node.names], node.level)
                    found += [(node.lineno, t) for t in targets]
        else:
            for m in _CYTHON_IMPORT.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                if m.group(3):
                    found.append((line, m.group(3)))
                else:
                    mod = m.group(1)
                    level = len(mod) - len(mod.lstrip("."))
                    names = [n.strip() for n in m.group(2).split(",")]
                    found += [(line, t) for t in _resolve(modules, name, is_package, mod.lstrip(".") or None,
                                                          names, level)]
        graph[name] = sorted({(line, t) for line, t in found if t == "scratchllm" or t.startswith("scratchllm.")})
    return graph


def _package_sources():
    sources = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in (".py", ".pyx", ".pxd") and _module_name(path) not in sources:
            sources[_module_name(path)] = (path, path.read_text())
    return sources


def layer_of(module):
    """(layer index, entry) of the longest LAYERS entry that is the module or a package above it."""
    best = None
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (index, entry)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def upward_imports(graph):
    """Each import of a module that is not below the importer (a higher layer, or a peer)."""
    offences = []
    for module, imports in sorted(graph.items()):
        own = layer_of(module)
        for line, target in imports:
            there = layer_of(target)
            if there[0] > own[0] or (there[0] == own[0] and there[1] != own[1]):
                where = "above" if there[0] > own[0] else "beside"
                offences.append(f"{module}:{line} imports {target} (layer {there[1]} {where} layer {own[1]})")
    return offences


def import_cycles(graph):
    """Each strongly connected component of more than one module (Tarjan), as one cycle through
    it, each step `module:line`: a -> b -> ... -> a."""
    edges = {m: {} for m in graph}
    for module, imports in graph.items():
        for line, target in imports:
            if target != module and target in edges:
                edges[module].setdefault(target, line)
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        paths, seen = {start: [start]}, {start}  # breadth first, inside the component, back to start
        queue = [start]
        while queue:
            v = queue.pop(0)
            if start in edges[v]:
                path = paths[v] + [start]
                break
            for w in sorted(edges[v]):
                if w in component and w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    queue.append(w)
        steps = [f"{a}:{edges[a][b]}" for a, b in zip(path, path[1:], strict=False)]
        cycles.append(" -> ".join(steps + [start]) + f"  (all of {sorted(component)})")
    return sorted(cycles)


def test_no_module_imports_a_higher_layer():
    graph = import_graph(_package_sources())
    offences = upward_imports(graph)
    assert not offences, "imports against the layers:\n" + "\n".join(offences)


def test_no_import_cycles():
    cycles = import_cycles(import_graph(_package_sources()))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layer_and_cycle_checks_can_fail(tmp_path):
    """A planted upward import, a peer import and a circle (one import inside a function,
    one relative) are found and named."""
    sources = {
        "scratchllm.engine.x": (tmp_path / "x.py", "def f():\n    from scratchllm.server import app\n"),
        "scratchllm.server": (tmp_path / "__init__.py", ""),
        "scratchllm.server.app": (tmp_path / "app.py", "from . import chat\n"),
        "scratchllm.server.chat": (tmp_path / "chat.py", "import scratchllm.server.app\nimport scratchllm.llm\n"),
        "scratchllm.llm": (tmp_path / "llm.py", ""),
    }
    graph = import_graph(sources)
    assert upward_imports(graph) == [
        "scratchllm.engine.x:2 imports scratchllm.server.app (layer scratchllm.server above layer scratchllm.engine)",
        "scratchllm.server.chat:2 imports scratchllm.llm (layer scratchllm.llm beside layer scratchllm.server)"]
    assert import_cycles(graph) == [
        "scratchllm.server.app:1 -> scratchllm.server.chat:1 -> scratchllm.server.app  "
        "(all of ['scratchllm.server.app', 'scratchllm.server.chat'])"]
