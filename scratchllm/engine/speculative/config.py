"""SpeculativeConfig: how the engine drafts tokens for the target to verify, checked once.

Spelled as vLLM spells it (`--speculative-config` JSON, `LLM(..., speculative_config={...})`):
  {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
  {"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5}     (method "draft_model")
and as llama.cpp spells a draft model (`--model-draft NAME --draft-max 5 --draft-min 1
--draft-p-min 0.5`; `from_llama_cpp`). What each field does is said beside it; anything else
(an unknown key, a method this engine does not have, a number out of range) is one ConfigError
that names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from scratchllm.errors import ConfigError

METHODS = ("ngram", "draft_model")
# vLLM's other methods: named so that asking for one says it is not here, rather than "unknown"
OTHER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
# prompt_lookup_min / _max when neither is given (vLLM's defaults)
DEFAULT_LOOKUP = 5
# llama.cpp's draft length when --draft-max is not given (its --spec-draft-n-max default)
LLAMA_CPP_DRAFT_MAX = 3
# Speculation is off for a step in which at least this many requests decode: verifying k drafts
# costs k more rows of every matrix product, and at this batch the products are no longer bound
# by reading the weights (docs/speculative-decoding.md, "When it pays", has the measurement).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    # "ngram" (prompt lookup) or "draft_model"; None: "draft_model" when `model` is given
    method: str | None = None
    # k: the most tokens drafted for a request in one step (each verified in that step's forward)
    num_speculative_tokens: int | None = None
    # the draft model (a model reference, file or folder) of method "draft_model"; it must have
    # the target's vocabulary
    model: str | None = None
    # ngram: the n-gram sizes looked up, longest first (both default to 5; one given sets both)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # fewer drafts than this are not verified (llama.cpp's --draft-min); 0: any draft is
    draft_min: int = 0
    # draft model: stop drafting at a token the draft gives less than this probability
    # (llama.cpp's --draft-p-min); 0: always draft num_speculative_tokens
    draft_p_min: float = 0.0
    # the draft length follows each request's acceptance rate (and drops to 0 where drafting does
    # not pay); False: always num_speculative_tokens
    adaptive: bool = True
    # a step with at least this many decoding requests drafts nothing (vLLM's name); None: never off
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        method = self.method
        if method in ("[ngram]",):  # vLLM's older spelling
            method = "ngram"
        if method is None and self.model in ("ngram", "[ngram]"):
            method = "ngram"
            object.__setattr__(self, "model", None)
        if method is None:
            if self.model is None:
                raise ConfigError("speculative config: give a method (\"ngram\") or a draft \"model\"")
            method = "draft_model"
        if method in OTHER_METHODS:
            raise ConfigError(f"speculative config: method {method!r} is not available here; "
                              f"the methods are {', '.join(METHODS)}")
        if method not in METHODS:
            raise ConfigError(f"speculative config: method must be one of {', '.join(METHODS)}, got {method!r}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if k is None:
            raise ConfigError("speculative config: num_speculative_tokens is required (the most tokens drafted "
                              "per step, e.g. 5)")
        _need("num_speculative_tokens", _is_int(k) and 1 <= k <= 64, "an integer in [1, 64]", k)
        if method == "draft_model":
            if not self.model or not isinstance(self.model, str):
                raise ConfigError("speculative config: method \"draft_model\" needs \"model\" (the draft model)")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ConfigError("speculative config: prompt_lookup_min/max are the ngram method's, "
                                  "not the draft model's")
        else:
            if self.model is not None:
                raise ConfigError(f"speculative config: method \"ngram\" takes no model (got {self.model!r})")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_LOOKUP
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            assert lo is not None and hi is not None
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                _need(name, _is_int(v) and v >= 1, "an integer >= 1", v)
            if lo > hi:
                raise ConfigError(f"speculative config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.draft_p_min:
                raise ConfigError("speculative config: draft_p_min is the draft model's, not the ngram method's")
        _need("draft_min", _is_int(self.draft_min) and 0 <= self.draft_min <= k,
              f"an integer in [0, num_speculative_tokens={k}]", self.draft_min)
        _need("draft_p_min", isinstance(self.draft_p_min, (int, float)) and not isinstance(self.draft_p_min, bool)
              and 0.0 <= self.draft_p_min <= 1.0, "a number in [0, 1]", self.draft_p_min)
        _need("adaptive", isinstance(self.adaptive, bool), "true or false", self.adaptive)
        b = self.disable_by_batch_size
        _need("disable_by_batch_size", b is None or (_is_int(b) and b >= 1), "an integer >= 1 or null", b)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def describe(self) -> dict[str, Any]:
        """The fields that apply to the method, for stats and logs."""
        keep = ("prompt_lookup_min", "prompt_lookup_max") if self.method == "ngram" else ("model", "draft_p_min")
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        out |= {name: getattr(self, name) for name in keep}
        out |= {"draft_min": self.draft_min, "adaptive": self.adaptive,
                "disable_by_batch_size": self.disable_by_batch_size}
        return out

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """vLLM's forms: a dict, its JSON text (`--speculative-config`), or a SpeculativeConfig;
        None (or JSON null) is no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative config is not valid JSON: {e}") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ConfigError(f"speculative config: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return cls(**value)

    @classmethod
    def from_llama_cpp(cls, model_draft: str | None, draft_max: int | None = None, draft_min: int | None = None,
                       draft_p_min: float | None = None) -> SpeculativeConfig | None:
        """llama.cpp's spelling: --model-draft, --draft-max (its default 3), --draft-min, --draft-p-min."""
        if model_draft is None:
            given = [n for n, v in (("--draft-max", draft_max), ("--draft-min", draft_min),
                                    ("--draft-p-min", draft_p_min)) if v is not None]
            if given:
                raise ConfigError(f"{given[0]} needs --model-draft (n-gram lookup: --speculative-config)")
            return None
        return cls(model=model_draft, num_speculative_tokens=LLAMA_CPP_DRAFT_MAX if draft_max is None else draft_max,
                   draft_min=draft_min or 0, draft_p_min=draft_p_min or 0.0)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(name: str, ok: bool, rule: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"speculative config: {name} must be {rule}, got {value!r}")
