"""`Draft`: what a proposer hands the scheduler for one decoding request, the tokens it guesses
come next and, for a sampled request drafted by a model, the distribution each was drawn from."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # the draft's distribution q [V] of each token (acceptance.py's rejection rule); None: point
    # masses (an n-gram's tokens, a greedy request's argmax)
    probs: list[npt.NDArray[np.float32]] | None = None

    def head(self, k: int) -> Draft:
        """The first k drafted tokens (the scheduler cuts a draft to what the step can hold)."""
        return Draft(self.tokens[:k], None if self.probs is None else self.probs[:k])
