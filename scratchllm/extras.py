"""Optional dependencies: what serving does not need, installed as pip extras, and the one-line
error that names the extra when one is missing.

| extra | brings | needed by |
|---|---|---|
| `plots` | matplotlib | `trace heatmap`, the benches' `--plot`, the soak's picture |
| `eval` | krippendorff | `eval report` (Krippendorff's alpha of the annotators' scores) |
| `bench` | threadpoolctl | `bench matmul` (NumPy's BLAS threads), the BLAS line of the benches' machine facts |

`pip install scratchllm` serves, generates and benchmarks the rest without them (pyproject.toml,
[project.optional-dependencies]); `make demo` and `make test` install all three
(requirements/extras.txt, pinned).
"""

import importlib
from types import ModuleType

from scratchllm.errors import ScratchLLMError

EXTRA_OF = {"matplotlib": "plots", "krippendorff": "eval", "threadpoolctl": "bench"}


class MissingExtraError(ScratchLLMError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def need(module: str, what: str) -> ModuleType:
    """`module` (a package of one of the extras, or a submodule of it), imported for `what` (e.g.
    "trace heatmap"); MissingExtraError naming `pip install 'scratchllm[extra]'` if it is not installed."""
    package = module.split(".")[0]
    assert package in EXTRA_OF, package
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != package:
            raise  # the package is there but something it imports is not: its own problem, shown whole
        raise MissingExtraError(f"{what} needs {package}, which is not installed: "
                                f"pip install 'scratchllm[{EXTRA_OF[package]}]'") from None
