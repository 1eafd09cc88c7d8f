"""The package's structure, checked: each type that crosses the engine's contract is defined
once (in scratchllm/engine/protocol.py), no two modules define a class of the same name, and
only the scheduler touches its queues and the block tables."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "scratchllm"
CONTRACT = {"TokenEvent", "RequestMetrics", "RequestOutput", "RequestStream", "EngineClient"}
SCHEDULER_STATE = {"running", "resumed", "policy", "high", "low", "queue"}
BLOCK_MUTATORS = {"free", "allocate_prefix", "ensure_slots", "cache_full_blocks", "begin_step", "end_step", "fork"}


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
