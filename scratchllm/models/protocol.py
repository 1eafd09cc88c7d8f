"""The contracts between the models and the engine above them, as code.

The engine runs any object that is a `Model`: a config and one packed forward pass over N tokens
of any number of sequences. The forward does not keep keys and values itself: it computes q, k,
v and calls the `Attention` it is handed, which stores them and decides which keys each query
sees (models.attention.ContiguousKVCache for one sequence, the engine's PagedAttention for the
paged pool, engine.static.PaddedKVCache for the padded static batch). An `Encoder` (BERT) has no
forward of that kind: it embeds whole padded batches.
"""

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from scratchllm.models.config import ModelConfig

Floats = npt.NDArray[np.floating[Any]]
Ints = npt.NDArray[np.integer[Any]]
Logits = npt.NDArray[np.float32]

# (input_ids [B, T], attention_mask [B, T] with 1 = token, 0 = padding) -> [B, hidden] float32, unit length
Embed = Callable[[Ints, Ints], npt.NDArray[np.float32]]


class Attention(Protocol):
    """``attention(layer, q, k, v)``: this step's q [N, H, D], k and v [N, KVH, D] of one layer
    (already rotated) -> the attention output [N, H, D]. The object keeps k and v for later steps."""

    def __call__(self, layer: int, q: Floats, k: Floats, v: Floats) -> Floats: ...


class Model(Protocol):
    """What the engine needs of a decoder model (engine/engine.py, model_runner.py, static.py,
    memory_plan.py): its shape, and the packed forward."""

    @property
    def config(self) -> ModelConfig: ...

    def forward(self, input_ids: Ints, positions: Ints, attention: Attention,
                logits_rows: Ints | None = None) -> Logits:
        """input_ids [N], positions [N] (each token's position in its own sequence) -> float32
        logits [len(logits_rows), V] of the rows asked for (all N rows when None)."""
        ...


class Encoder(Protocol):
    """What the server's embeddings endpoint needs of an encoder model (server/backend.py)."""

    @property
    def config(self) -> ModelConfig: ...

    def embed(self, input_ids: Ints, attention_mask: Ints) -> npt.NDArray[np.float32]: ...
