"""Each architecture is described once (models/architectures.py), and the code that reads the
descriptions branches on their data, never on an architecture's name."""

import ast
from pathlib import Path

from scratchllm.models.architecture import GLOBAL_NAMES, gguf_to_hf_names, layer_roles
from scratchllm.models.architectures import ARCHITECTURES

PACKAGE = Path(__file__).resolve().parents[2] / "scratchllm"
# where an architecture's name may be written: its description, and the tokenizer and chat code,
# which name families for their own formats (tool calls, templates), not for the forward
DESCRIBED = {"models/architectures.py"}
READERS = ("models", "kernels", "engine")  # the code that builds and runs a model
NAME_FIELDS = {"model_type", "name", "gguf_architecture", "hf_model_type", "architecture"}


def test_each_checkpoint_name_belongs_to_one_description():
    for key in ("hf_model_type", "gguf_architecture"):
        names = [getattr(a, key) for a in ARCHITECTURES if getattr(a, key) is not None]
        assert len(names) == len(set(names)), key
    hf = [n for a in ARCHITECTURES for n in a.hf_architectures]
    assert len(hf) == len(set(hf))
    assert len({a.name for a in ARCHITECTURES}) == len(ARCHITECTURES)


def test_every_gguf_name_of_a_model_has_one_hugging_face_name():
    for arch in (a for a in ARCHITECTURES if a.forward == "llama"):
        for bias in (False, True):
            names = gguf_to_hf_names(arch, 3, bias, bias)
            assert len(set(names.values())) == len(names), arch.name  # no two GGUF names meet
            assert len(names) == len(GLOBAL_NAMES) + 3 * len(layer_roles(arch, bias, bias))


def _name_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a name-like attribute or a string subscript with a string literal."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides) or any(
            isinstance(s, (ast.Tuple, ast.List, ast.Set))
            and any(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in s.elts) for s in sides)
        named = any(isinstance(s, ast.Attribute) and s.attr in NAME_FIELDS for s in sides) or any(
            isinstance(s, ast.Name) and s.id in ("arch", "model_type") for s in sides)
        if literal and named:
            lines.append(node.lineno)
    return lines


def test_no_reader_branches_on_an_architectures_name():
    offences = []
    for area in READERS:
        for path in sorted((PACKAGE / area).rglob("*.py")):
            rel = path.relative_to(PACKAGE).as_posix()
            if rel in DESCRIBED:
                continue
            offences += [f"{rel}:{line}" for line in _name_comparisons(ast.parse(path.read_text()))]
    assert offences == []


def test_the_check_finds_what_it_looks_for():
    code = 'gemma = model_type in ("gemma2", "gemma3_text")\nif config.model_type == "llama": pass\n'
    assert _name_comparisons(ast.parse(code)) == [1, 2]
    assert _name_comparisons(ast.parse('if cfg.hidden_act == "silu": pass\n')) == []


def test_a_config_with_its_description_pickles_and_copies():
    """A ModelConfig crosses processes (Ray's replicas) and is copied: its description with it."""
    import copy
    import pickle

    from scratchllm.models.config import ModelConfig

    for arch in (a for a in ARCHITECTURES if a.forward == "llama"):
        cfg = ModelConfig(family="llama", model_type=arch.name, vocab_size=8, hidden_size=8, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8, norm_eps=1e-6,
                          max_position_embeddings=16, arch=arch)
        again = pickle.loads(pickle.dumps(cfg))
        assert again == cfg and hash(again) == hash(cfg) and again.arch.names == arch.names
        assert copy.deepcopy(cfg) == cfg
