"""The sampling a model's file recommends, when it says: a GGUF's `general.sampling.*` keys
(temp, top_p, top_k, min_p, as llama.cpp's converter writes them from the model's
generation_config.json), or a model folder's generation_config.json itself (`do_sample: false`
meaning greedy). The chat page starts from these; a file that says nothing gets {}.
"""

import json
from pathlib import Path
from typing import Any

from scratchllm.formats.checkpoint import Checkpoint

GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"}
CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p")


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def recommended_sampling(ckpt: Checkpoint) -> dict[str, float | int]:
    """{temperature, top_p, top_k, min_p}: those the file names (see the module doc)."""
    out: dict[str, float | int] = {}
    if ckpt.format == "gguf":
        for key, name in GGUF_KEYS.items():
            value = _number(ckpt.metadata.get(key))
            if value is not None:
                out[name] = value
        return out
    path = Path(ckpt.path)
    config = (path if path.is_dir() else path.parent) / "generation_config.json"
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError):
        return out
    if not isinstance(doc, dict):
        return out
    if doc.get("do_sample") is False:
        return {"temperature": 0}
    for name in CONFIG_KEYS:
        value = _number(doc.get(name))
        if value is not None:
            out[name] = value
    return out
