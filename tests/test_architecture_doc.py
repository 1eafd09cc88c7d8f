"""docs/architecture.md's "Every module, one line each" names every module of the package, and
only modules that exist: a module added without its line, or a line left behind by a module
removed or renamed, fails here with the names."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Every module, one line each"
MODULE = re.compile(r"`([\w/]+\.(?:py|pyx|html))`")  # a module's file name, as the list writes it
PACKAGE = re.compile(r"^`([\w/]+)/`")  # a package's heading line: `engine/` (...)


def listed_modules(text: str) -> set[str]:
    """The files the section names, as paths under scratchllm/. A bullet belongs to the package
    whose heading it follows without a blank line; a bullet after a blank line is a top-level
    module of the package."""
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    out: set[str] = set()
    package = ""
    for line in body.splitlines():
        if not line.strip():
            package = ""
            continue
        heading = PACKAGE.match(line)
        if heading:
            package = heading.group(1) + "/"
            continue
        if line.startswith(("- ", "  ")):
            out.update(package + name for name in MODULE.findall(line))
    return out


def package_modules(root: Path, inits: bool = False) -> set[str]:
    """Every module file of the package (Python, Cython, and the HTML pages it serves); the
    subpackages' __init__.py only with `inits` (the package heading stands for them, though a
    line may name one that holds more than imports)."""
    out = set()
    for path in (root / "scratchllm").rglob("*"):
        rel = path.relative_to(root / "scratchllm").as_posix()
        if path.suffix not in (".py", ".pyx", ".html") or "__pycache__" in rel:
            continue
        if path.name == "__init__.py" and "/" in rel and not inits:
            continue
        if path.name.startswith("test_") or "/workloads/" in rel:
            continue
        out.add(rel)
    return out


def drift(doc_text: str, root: Path) -> tuple[list[str], list[str]]:
    """(modules the doc leaves out, names in the doc that are no module)."""
    listed = listed_modules(doc_text)
    return sorted(package_modules(root) - listed), sorted(listed - package_modules(root, inits=True))


def test_the_doc_names_every_module_and_no_other():
    missing, extra = drift(DOC.read_text(), ROOT)
    assert not missing, "docs/architecture.md leaves out: " + ", ".join(missing)
    assert not extra, "docs/architecture.md names modules that do not exist: " + ", ".join(extra)


def test_the_check_fails_on_a_module_without_a_line_and_a_line_without_a_module(tmp_path):
    pkg = tmp_path / "scratchllm"
    (pkg / "engine").mkdir(parents=True)
    for name in ("__init__.py", "engine/__init__.py", "engine/step.py", "engine/new.py"):
        (pkg / name).write_text("")
    doc = f"# x\n{SECTION}\n\n- `__init__.py`: the package.\n\n`engine/` (the engine)\n- `step.py`: one step.\n" \
          "- `gone.py`: removed.\n\n## Next\n- `ignored.py`\n"
    assert drift(doc, tmp_path) == (["engine/new.py"], ["engine/gone.py"])
