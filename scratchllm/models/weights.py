"""Taking weights out of a checkpoint by their Hugging Face names, every shape checked: a missing, extra
or mis-shaped tensor fails loudly at load."""

import numpy as np


class WeightTaker:
    """`take(name, shape)` finds `name` under any of `prefixes` (task-head checkpoints add one,
    e.g. "bert." or "transformer."), checks its shape and returns it as C-contiguous float32.
    `taken` maps each full name found to its array, so the caller can report leftovers."""

    def __init__(self, weights, prefixes: tuple[str, ...]):
        self.weights = weights
        self.prefixes = prefixes
        self.taken: dict[str, np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        for full in (prefix + name for prefix in self.prefixes):
            if full in self.weights:
                a = self.weights[full]
                if tuple(a.shape) != shape:
                    raise ValueError(f"tensor {full!r} has shape {tuple(a.shape)}, expected {shape}")
                self.taken[full] = np.ascontiguousarray(a, dtype=np.float32)
                return self.taken[full]
        raise KeyError(f"checkpoint lacks tensor {name!r}")
