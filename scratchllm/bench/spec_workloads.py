"""The prompt sets of `bench spec` (scratchllm/bench/workloads/prompts/*.json): chat requests,
each rendered by the target's chat template, so that ours and llama.cpp's programs get the same
text (llama.cpp reads it from a file and parses its special tokens as the template wrote them).

  code-edits      a function and an instruction that changes a small part of it; the answer gives
                  the whole code back (where n-gram lookup drafts well)
  code-questions  questions whose answers are written fresh (where it finds little)

A file: {"name", "description", "system", "max_tokens", "cases": [{"id", "messages"}]}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchllm.errors import ConfigError

PROMPT_DIR = Path(__file__).resolve().parent / "workloads" / "prompts"
WORKLOADS = ("code-edits", "code-questions")


@dataclass(frozen=True)
class Case:
    workload: str
    case_id: str
    messages: list[dict[str, Any]]  # the system message first
    max_tokens: int


def load_cases(names: list[str], limit: int | None = None) -> list[Case]:
    """The cases of each named workload (a shipped name or a path), at most `limit` of each."""
    out: list[Case] = []
    for name in names:
        path = Path(name) if Path(name).is_file() else PROMPT_DIR / f"{name}.json"
        if not path.is_file():
            shipped = ", ".join(sorted(p.stem for p in PROMPT_DIR.glob("*.json")))
            raise ConfigError(f"no prompt set {name!r}: give a JSON file or one of {shipped}")
        spec = json.loads(path.read_text())
        try:
            system = [{"role": "system", "content": spec["system"]}] if spec.get("system") else []
            cases = [Case(spec["name"], c["id"], system + c["messages"], int(spec["max_tokens"]))
                     for c in spec["cases"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: not a prompt set ({e!r}): see scratchllm/bench/spec_workloads.py") from None
        out += cases[:limit]
    return out
