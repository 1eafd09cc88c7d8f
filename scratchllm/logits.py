"""Logits processors: the rules that reshape one request's logits row before the draw.

Applied in this order on the raw row [V], before temperature/top-k/top-p (sampling.py):

  repetition_penalty r  over every distinct token of prompt + output (the rule of the
                        CTRL paper as transformers and vLLM apply it): a positive logit is
                        divided by r, a negative one multiplied by r, so r > 1 always makes a
                        seen token less likely.
  frequency_penalty f,  over the generated tokens only, OpenAI's rule:
  presence_penalty p    logit[t] -= count[t] * f + (count[t] > 0) * p
  logit_bias            logit[t] += bias[t]; a bias of -100 bans t (the logit becomes -inf), so
                        a banned token is never drawn, whatever the temperature.

min_p is a filter on the distribution, not on logits: it runs after temperature, top-k and
top-p, as transformers' MinPLogitsWarper does (sampling.filtered_probs).

The processors are stateless: each step they take the request's prompt and output ids, so a
request preempted by recompute (tokens kept) needs nothing reset. They touch only the positions
of tokens seen (np.unique over the ids), never a [V]-sized count array, and a request that uses
none of them costs one attribute read (SamplingParams.uses_processors).
"""

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt


class ProcessorParams(Protocol):
    """What the processors read of a request's sampling parameters (SamplingParams has them)."""

    @property
    def presence_penalty(self) -> float: ...

    @property
    def frequency_penalty(self) -> float: ...

    @property
    def repetition_penalty(self) -> float: ...

    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...


# A bias at or below this bans the token outright (OpenAI: "-100 should result in a ban").
BAN_BIAS = -100.0


def apply_processors(logits: npt.NDArray[np.floating[Any]], params: ProcessorParams, prompt_ids: Sequence[int],
                     output_ids: Sequence[int]) -> npt.NDArray[np.float32]:
    """[V] float -> a new [V] float32 row with every processor the params ask for applied."""
    x = np.array(logits, dtype=np.float32, copy=True)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64))
        v = x[seen]
        # A penalty near 0 (or 100 on a huge logit) overflows float32: the result is clamped to
        # the largest finite value (an inf would make the draw's softmax NaN); -inf stays a ban.
        with np.errstate(divide="ignore", over="ignore"):
            x[seen] = np.minimum(np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty),
                                 np.finfo(np.float32).max)
    if (params.frequency_penalty or params.presence_penalty) and len(output_ids):
        tokens, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        x[tokens] -= counts * np.float32(params.frequency_penalty) + np.float32(params.presence_penalty)
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64, count=len(params.logit_bias))
        bias = np.fromiter((b for _, b in params.logit_bias), dtype=np.float32, count=len(params.logit_bias))
        x[ids] = np.where(bias <= BAN_BIAS, -np.inf, x[ids] + bias)
    return x


def min_p_filter(p: npt.NDArray[np.float64], min_p: float) -> npt.NDArray[np.float64]:
    """[V] probabilities -> the same with every p < min_p * max(p) zeroed (not renormalized)."""
    if min_p <= 0.0:
        return p
    # the most likely token always survives: its p equals the max, and min_p <= 1
    return np.where(p >= min_p * p.max(), p, 0.0)
