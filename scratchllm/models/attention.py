"""Scaled dot-product attention, and the simple one-sequence KV cache.

The model computes q, k, v and rotates them; then it calls ``attention(layer, q, k, v)``. The
object behind that call decides which keys each query sees and keeps the keys/values of earlier
steps. ``ContiguousKVCache`` is the simplest such object: one sequence, one preallocated array per
layer, causal. The engine supplies a paged one with the same call.

GQA without copies: query head h uses key/value head h // G (G = H / KVH, the grouping
transformers' ``repeat_kv`` produces). Reshaping q to [KVH, G*T, D] lets one batched matmul per
layer serve all G query heads of a kv head, instead of repeating k and v G times.
"""

import math
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from scratchllm.models.array import array_module
from scratchllm.models.config import ModelConfig

Floats = npt.NDArray[np.floating[Any]]
F = TypeVar("F", bound=Floats)


def softmax_(x: F) -> F:  # [..., S] -> [..., S], in place: each step of decode would otherwise allocate twice
    xp = array_module(x)
    x -= x.max(axis=-1, keepdims=True)
    xp.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


QUERY_BLOCK = 128  # prefill queries per block: later blocks see more keys, none computes the masked half


def causal_attention(q: Floats, k: Floats, v: Floats, offset: int) -> Floats:
    # [T, H, D], [KVH, S, D], [KVH, S, D] -> [T, H, D]
    """Query i sits at position offset + i and sees keys 0 .. offset + i (keys are positions 0..S-1).

    Long prefills go in blocks of QUERY_BLOCK queries, each against only the keys it may see: for
    a 500-token prompt that skips ~40% of the score matrix (the part above the diagonal)."""
    T = q.shape[0]
    assert k.shape[1] >= offset + T, "the cache must already hold this step's keys"
    if T <= QUERY_BLOCK:
        return _attend(q, k[:, : offset + T], v[:, : offset + T], offset)
    xp = array_module(q)
    out: Floats = xp.empty_like(q)
    for i in range(0, T, QUERY_BLOCK):
        j = min(i + QUERY_BLOCK, T)
        out[i:j] = _attend(q[i:j], k[:, : offset + j], v[:, : offset + j], offset + i)
    return out


def _attend(q: Floats, k: Floats, v: Floats, offset: int) -> Floats:
    # [T, H, D], [KVH, S, D], [KVH, S, D] with S = offset + T -> [T, H, D]
    T, H, D = q.shape
    KVH, S, _ = k.shape
    G = H // KVH
    assert H == KVH * G and S == offset + T
    # [T, H, D] -> [KVH, G, T, D] -> [KVH, G*T, D]; the 1/sqrt(D) goes on q, the smaller tensor
    qg = (q * (1.0 / math.sqrt(D))).reshape(T, KVH, G, D).transpose(1, 2, 0, 3).reshape(KVH, G * T, D)
    scores = qg @ k.transpose(0, 2, 1)  # [KVH, G*T, S]
    if T > 1:  # a single decode token sees every key; only chunks of queries need the triangle
        xp = array_module(scores)
        future = xp.arange(S)[None, :] > (offset + xp.arange(T))[:, None]  # [T, S]
        # one additive pass (0 or -inf) is far cheaper than a boolean-mask assignment
        scores.reshape(KVH, G, T, S)[...] += xp.where(future, -np.inf, 0.0).astype(scores.dtype)
    softmax_(scores)
    out: Floats = scores @ v  # [KVH, G*T, D]
    return out.reshape(KVH, G, T, D).transpose(2, 0, 1, 3).reshape(T, H, D)


def bidirectional_attention(q: Floats, k: Floats, v: Floats,
                            mask: npt.NDArray[Any]) -> Floats:
    # [B, T, H, D] x3, [B, T] (1 = token, 0 = pad) -> [B, T, H, D]
    """Encoder attention (BERT): every token sees every non-padding token of its own row."""
    xp = array_module(q)
    B, T, H, D = q.shape
    qh = (q * (1.0 / math.sqrt(D))).transpose(0, 2, 1, 3)  # [B, H, T, D]
    scores = qh @ k.transpose(0, 2, 3, 1)  # [B, H, T, T]
    scores += xp.where(mask[:, None, None, :] > 0, 0.0, -np.inf).astype(scores.dtype)
    softmax_(scores)
    out: Floats = (scores @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # [B, T, H, D]
    return out


class ContiguousKVCache:
    """KV cache of one sequence: k and v of every layer in preallocated [KVH, max_len, D] arrays.

    Each call appends this step's keys at the layer's current length and attends causally over
    everything stored. Layers advance independently, so after a whole forward pass all layers
    hold the same number of positions (`length`), which is the position the next token takes.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: npt.DTypeLike = np.float32, xp: Any = np) -> None:
        self.max_len = max_len
        self.k: Floats = xp.zeros((num_layers, num_kv_heads, max_len, head_dim), dtype=dtype)
        self.v: Floats = xp.zeros_like(self.k)
        self.lengths = [0] * num_layers

    @classmethod
    def for_model(cls, config: ModelConfig, max_len: int, dtype: npt.DTypeLike = np.float32) -> "ContiguousKVCache":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, max_len, dtype)

    @property
    def length(self) -> int:
        # invariant between forward passes: every layer holds the same positions
        assert all(n == self.lengths[0] for n in self.lengths), "a forward pass stopped half-way"
        return self.lengths[0]

    def reset(self) -> None:
        self.lengths = [0] * len(self.lengths)

    def __call__(self, layer: int, q: Floats, k: Floats, v: Floats) -> Floats:
        # [T, H, D], [T, KVH, D], [T, KVH, D] -> [T, H, D]
        start = self.lengths[layer]
        end = start + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; this step needs {end}")
        self.k[layer, :, start:end] = k.transpose(1, 0, 2)
        self.v[layer, :, start:end] = v.transpose(1, 0, 2)
        self.lengths[layer] = end
        return causal_attention(q, self.k[layer, :, :end], self.v[layer, :, :end], offset=start)
