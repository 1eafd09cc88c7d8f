"""Taking weights out of a checkpoint by their Hugging Face names, every shape checked: a missing, extra
or mis-shaped tensor fails loudly at load."""

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt


class WeightTaker:
    """`take(name, shape)` finds `name` under any of `prefixes` (task-head checkpoints add one,
    e.g. "bert." or "transformer."), checks its shape and returns it as C-contiguous float32.
    `taken` maps each full name found to its array, so the caller can report leftovers."""

    def __init__(self, weights: Mapping[str, npt.NDArray[Any]], prefixes: tuple[str, ...]) -> None:
        self.weights = weights
        self.prefixes = prefixes
        self.taken: dict[str, npt.NDArray[np.float32]] = {}

    def take(self, name: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
        for full in (prefix + name for prefix in self.prefixes):
            if full in self.weights:
                a = self.weights[full]
                if tuple(a.shape) != shape:
                    raise ValueError(f"tensor {full!r} has shape {tuple(a.shape)}, expected {shape}")
                self.taken[full] = np.ascontiguousarray(a, dtype=np.float32)
                return self.taken[full]
        raise KeyError(f"checkpoint lacks tensor {name!r}")
