"""Per-request sampling: parameters, and the choice of the next token from one row of logits.

The pipeline is the usual one, in this order: logits processors (penalties, logit_bias;
scratchllm/logits.py) -> grammar mask (structured output; scratchllm/structured) ->
temperature -> top-k -> top-p (nucleus) -> min_p -> draw.
Temperature 0 means greedy (argmax; ties go to the lowest id, like torch and llama.cpp).
Every request owns its random generator, seeded from `SamplingParams.seed`, so a request's
tokens do not depend on what else runs beside it (batched output equals single output).
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import numpy.typing as npt

from scratchllm.errors import ConfigError
from scratchllm.logits import apply_processors, min_p_filter

if TYPE_CHECKING:
    from scratchllm.structured.grammar import CompiledGrammar

# OpenAI's ranges for the penalties and for one logit_bias entry.
PENALTY_RANGE = (-2.0, 2.0)
BIAS_RANGE = (-100.0, 100.0)

Logits = npt.NDArray[np.floating[Any]]  # one row [V] of a model's logits (float32 from our models)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found
    stop_token_ids: tuple[int, ...] = ()  # end tokens besides the EOS (their text is not shown)
    ignore_eos: bool = False
    # No end token can be drawn before this many tokens are generated, and stop strings are not
    # looked for before then. The end tokens it masks: the engine's (every token that ends
    # generation, unless ignore_eos), eos_token_ids and stop_token_ids.
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True  # special tokens (e.g. <|im_end|>) show no text
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text
    logprobs: int | None = None  # how many top alternatives to report per token (None = none)
    # The prompt's own logprobs: each prompt token's (from position 1 on) logprob, rank and this
    # many top alternatives, computed during the prefill (None = not computed, nothing kept)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI's, over generated tokens; 0 = off
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted
    min_p: float = 0.0  # 0 = off
    # A compiled grammar (scratchllm.structured.CompiledGrammar) the output must match, or None.
    grammar: "CompiledGrammar | None" = None
    # Not sampling but admission: the priority policy (engine/policy.py) queues the request as low
    # priority whatever its max_tokens (the Batch API's requests, which fill interactive gaps).
    low_priority: bool = False
    # derived: True when any logits processor is on (set in __post_init__)
    uses_processors: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience, stored as tuples so params stay hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                              f"got {self.min_tokens!r}")
        if any(t < 0 for t in (*self.stop_token_ids, *self.eos_token_ids)):
            raise ConfigError("stop_token_ids must be token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
                raise ConfigError(f"{name} must be None or an integer >= 0, got {k!r}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, getattr(self, name), *PENALTY_RANGE)
        if not (_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0):
            raise ConfigError(f"repetition_penalty must be in (0, 100] (1 = off), got {self.repetition_penalty!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.grammar is not None and not hasattr(self.grammar, "new_matcher"):
            raise ConfigError("grammar must be a CompiledGrammar (scratchllm.structured.GrammarCompiler)")
        # Read once per token per request: a request that uses no processor pays nothing more.
        object.__setattr__(self, "uses_processors", bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.min_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the params name must exist in the model's vocabulary (the engine's validate)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ConfigError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ConfigError(f"stop_token_ids names token id {bad[0]}, outside the vocabulary [0, {vocab_size})")

    def end_tokens_masked(self, num_generated: int, end_token_ids: Iterable[int] = ()) -> tuple[int, ...]:
        """The end tokens that cannot be drawn after `num_generated` tokens (min_tokens):
        `end_token_ids` (the engine's, every token that ends generation) unless ignore_eos,
        eos_token_ids and stop_token_ids."""
        if num_generated >= self.min_tokens:
            return ()
        return (*(() if self.ignore_eos else end_token_ids), *self.eos_token_ids, *self.stop_token_ids)


def _is_number(x: object) -> TypeGuard[int | float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_range(name: str, value: object, lo: float, hi: float) -> None:
    if not (_is_number(value) and lo <= value <= hi):
        raise ConfigError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} dict or (id, bias) pairs -> sorted, validated pairs (one per id)."""
    items: Any = bias.items() if isinstance(bias, dict) else bias
    pairs: dict[int, float] = {}
    for entry in items:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise ConfigError(f"logit_bias entries are (token id, bias) pairs, got {entry!r}")
        token, value = entry
        if isinstance(token, str) and token.strip().isdigit():  # JSON object keys are strings
            token = int(token)
        if not (isinstance(token, int) and not isinstance(token, bool) and token >= 0):
            raise ConfigError(f"logit_bias keys must be token ids >= 0, got {token!r}")
        _check_range(f"logit_bias[{token}]", value, *BIAS_RANGE)
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def make_rng(params: SamplingParams) -> np.random.Generator:
    """The request's own generator: seeded -> reproducible; unseeded -> fresh OS entropy."""
    return np.random.default_rng(params.seed)


def log_softmax(logits: Logits) -> npt.NDArray[np.float64]:  # [V] -> [V], in float64 for stable logprobs
    x = logits.astype(np.float64)
    x = x - x.max()
    out: npt.NDArray[np.float64] = x - np.log(np.exp(x).sum())
    return out


def filtered_probs(logits: Logits, params: SamplingParams) -> npt.NDArray[np.float64]:  # [V] -> [V]
    """The distribution we draw from: temperature, then top-k, top-p, min_p; zeros elsewhere."""
    assert params.temperature > 0, "greedy requests never build a distribution"
    x = logits.astype(np.float64)
    # shifted to a max of 0 before the division: a tiny temperature sends the others to -inf
    # (greedy in the limit) instead of overflowing the largest to inf and the softmax to NaN
    with np.errstate(over="ignore"):
        x = (x - x.max()) / params.temperature
    V = x.shape[0]
    if 0 < params.top_k < V:
        # keep the k largest; argpartition is O(V), a full sort is not needed for this step
        kth = np.argpartition(-x, params.top_k - 1)[params.top_k - 1]
        x = np.where(x >= x[kth], x, -np.inf)
    p: npt.NDArray[np.float64] = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass
        # *before* it is still below top_p (so the most likely token always stays)
        keep = (cum - p[order]) < params.top_p
        mask = np.zeros(V, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if params.min_p > 0.0:
        p = min_p_filter(p, params.min_p)
        p /= p.sum()
    return p


def shaped_logits(logits: Logits, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
                  allowed: npt.NDArray[np.bool_] | None = None,
                  end_token_ids: Iterable[int] = ()) -> npt.NDArray[np.float32]:
    """[V] raw logits -> the row the draw sees: processors, min_tokens' end-token mask (the
    engine's `end_token_ids` among them), then the grammar's mask (if any).

    The grammar wins over logit_bias and min_tokens: if they banned every token the grammar
    allows, the bans are dropped for this token rather than leave nothing to draw."""
    row = apply_processors(logits, params, prompt_ids, output_ids) if params.uses_processors \
        else np.array(logits, dtype=np.float32, copy=True)
    held = params.end_tokens_masked(len(output_ids), end_token_ids)
    if held:
        row[np.asarray(held, dtype=np.int64)] = -np.inf
    if allowed is not None:
        from scratchllm.structured.matcher import apply_mask

        apply_mask(row, allowed)
        if not np.isfinite(row).any():
            row = apply_mask(np.array(logits, dtype=np.float32, copy=True), allowed)
    return row


def sample_token(logits: Logits, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from one row of logits [V]."""
    if params.greedy:
        return int(np.argmax(logits))
    return draw(filtered_probs(logits, params), rng)


def draw(p: npt.NDArray[np.float64], rng: np.random.Generator) -> int:
    """One index drawn from the weights p [V] (not necessarily summing to 1): the inverse CDF at
    one uniform, so that the same seed gives the same token on every machine."""
    u = rng.random()
    idx = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
    return min(idx, len(p) - 1)


def top_logprobs(logits: Logits, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the k most likely (id, logprob) pairs, from raw logits."""
    lp = log_softmax(logits)
    top = np.argsort(-lp, kind="stable")[:k] if k > 0 else np.empty(0, dtype=np.int64)
    return float(lp[token_id]), [(int(i), float(lp[i])) for i in top]
