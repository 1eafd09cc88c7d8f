"""The optional dependencies (scratchllm/extras.py): serving needs none of them, and a command that
needs a missing one says in one line which `pip install 'scratchllm[...]'` brings it.

A package is made missing the way the import system allows: None in sys.modules makes `import`
raise ModuleNotFoundError for that name, as if it were not installed."""

import subprocess
import sys

import numpy as np
import pytest

from scratchllm import extras
from scratchllm.errors import ScratchLLMError

PYPROJECT_EXTRAS = {"plots": ["matplotlib"], "eval": ["krippendorff"], "bench": ["threadpoolctl"]}


def test_the_extras_are_the_pyproject_s():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    deps = " ".join(project["dependencies"])
    for extra, packages in PYPROJECT_EXTRAS.items():
        assert [p.split(">")[0] for p in project["optional-dependencies"][extra]] == packages
        for package in packages:
            assert extras.EXTRA_OF[package] == extra and package not in deps  # not a run-time dependency


@pytest.mark.parametrize("package", sorted(extras.EXTRA_OF))
def test_a_missing_extra_names_its_pip_install(monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(extras.MissingExtraError) as err:
        extras.need(package, "this command")
    assert str(err.value) == (f"this command needs {package}, which is not installed: "
                              f"pip install 'scratchllm[{extras.EXTRA_OF[package]}]'")
    assert isinstance(err.value, ScratchLLMError)  # the CLI prints it as one line, exit 2


def test_the_heatmap_and_the_report_name_theirs(monkeypatch, tmp_path):
    from scratchllm.evaluate.agreement import ordinal_alpha
    from scratchllm.trace.views.heatmap import draw_heatmap

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(extras.MissingExtraError, match=r"scratchllm\[plots\]"):
        draw_heatmap(None, [], tmp_path / "h.png")  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "krippendorff", None)
    with pytest.raises(extras.MissingExtraError, match=r"scratchllm\[eval\]"):
        ordinal_alpha(np.array([[1.0, 0.0], [1.0, -1.0]]))


def run_without(packages: list[str], code: str) -> subprocess.CompletedProcess[str]:
    block = "".join(f"sys.modules[{p!r}] = None\n" for p in packages)
    return subprocess.run([sys.executable, "-c", f"import sys\n{block}{code}"], capture_output=True, text=True,
                          timeout=300)


def test_bench_matmul_without_threadpoolctl_is_one_line():
    out = run_without(["threadpoolctl"], "from scratchllm.cli.main import main\n"
                                         "sys.exit(main(['bench', 'matmul', '--sizes', '3']))")
    assert out.returncode == 2, out.stderr
    assert out.stderr == ("scratchllm bench: error: bench matmul (to set NumPy's BLAS threads) needs threadpoolctl, "
                          "which is not installed: pip install 'scratchllm[bench]'\n")


def test_serving_imports_none_of_them():
    """Every module of the package imports without the extras: they are needed only when called."""
    code = ("import importlib, pkgutil, scratchllm\n"
            "names = [m.name for m in pkgutil.walk_packages(scratchllm.__path__, 'scratchllm.')]\n"
            "for name in names:\n"
            "    importlib.import_module(name)\n"
            "print(len(names))\n")
    out = run_without(sorted(extras.EXTRA_OF), code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout) > 100
