"""Per-request sampling: parameters, and the choice of the next token from one row of logits.

The pipeline is the usual one, in this order: temperature -> top-k -> top-p (nucleus) -> draw.
Temperature 0 means greedy (argmax; ties go to the lowest id, like torch and llama.cpp).
Every request owns its random generator, seeded from `SamplingParams.seed`, so a request's
tokens do not depend on what else runs beside it (batched output equals single output).
"""

from dataclasses import dataclass

import numpy as np

from scratchllm.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to report per token (None = none)

    def __post_init__(self):
        # Lists are accepted for convenience, stored as tuples so params stay hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and self.logprobs >= 0):
            raise ConfigError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_rng(params: SamplingParams) -> np.random.Generator:
    """The request's own generator: seeded -> reproducible; unseeded -> fresh OS entropy."""
    return np.random.default_rng(params.seed)


def log_softmax(logits: np.ndarray) -> np.ndarray:  # [V] -> [V], in float64 for stable logprobs
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:  # [V] -> [V]
    """The distribution we draw from: temperature, then top-k, then top-p; zeros elsewhere."""
    assert params.temperature > 0, "greedy requests never build a distribution"
    x = logits.astype(np.float64) / params.temperature
    V = x.shape[0]
    if 0 < params.top_k < V:
        # keep the k largest; argpartition is O(V), a full sort is not needed for this step
        kth = np.argpartition(-x, params.top_k - 1)[params.top_k - 1]
        x = np.where(x >= x[kth], x, -np.inf)
    p = np.exp(x - x.max())
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
    return p


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from one row of logits [V]."""
    if params.greedy:
        return int(np.argmax(logits))
    p = filtered_probs(logits, params)
    # inverse-CDF draw with one uniform: the same seed gives the same token on every machine
    u = rng.random()
    idx = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
    return min(idx, p.shape[0] - 1)


def top_logprobs(logits: np.ndarray, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the k most likely (id, logprob) pairs, from raw logits."""
    lp = log_softmax(logits)
    top = np.argsort(-lp, kind="stable")[:k] if k > 0 else np.empty(0, dtype=np.int64)
    return float(lp[token_id]), [(int(i), float(lp[i])) for i in top]
