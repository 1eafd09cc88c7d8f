"""The one rule set for a request an engine can never run, checked at submit by every engine (the
continuous engine, the static baseline, the fake engine and the cluster's RemoteEngine), so the
same request is accepted or refused alike by all of them, with the same message.

Refused (ConfigError, naming the problem):
  - params that are not SamplingParams;
  - an empty prompt;
  - a prompt id that is not an int in [0, vocab_size);
  - a prompt at or over the context (max_model_len): no room to generate one token.
Accepted: a prompt + max_tokens over the context. The request ends with finish_reason "length"
when the context is full (as vLLM's engine does); `new_tokens` is what it may generate, the
bound an engine reserves memory for. The HTTP server is stricter, like OpenAI's API: it refuses
prompt + max_tokens over the context with a 400 before anything reaches an engine
(server/generation.py, max_tokens_for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can run: prompt + generated tokens up to max_model_len, ids below vocab_size."""

    max_model_len: int
    vocab_size: int

    def __post_init__(self) -> None:
        assert self.max_model_len >= 1 and self.vocab_size >= 1, self

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ConfigError for a request no engine with these limits can run."""
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be SamplingParams, got {type(params).__name__}")
        if len(prompt_token_ids) == 0:
            raise ConfigError("the prompt is empty: it has no tokens to continue from")
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ConfigError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ConfigError(f"the prompt has {len(prompt_token_ids)} tokens; this engine's context is "
                              f"{self.max_model_len} (at least one must be left to generate)")

    def new_tokens(self, prompt_tokens: int, params: SamplingParams) -> int:
        """The most tokens a valid request generates: max_tokens, or less where the context ends."""
        return min(params.max_tokens, self.max_model_len - prompt_tokens)
