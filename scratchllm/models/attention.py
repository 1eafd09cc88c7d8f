"""Scaled dot-product attention, and the simple one-sequence KV cache.

The model computes q, k, v and rotates them; then it calls ``attention(layer, q, k, v)``. The
object behind that call decides which keys each query sees and keeps the keys/values of earlier
steps. ``ContiguousKVCache`` is the simplest such object: one sequence, one preallocated array per
layer, causal. The engine supplies a paged one with the same call.

What a layer's queries see is ModelConfig's attention contract: a sliding window (a query at
position p sees keys p - w + 1 .. p; Mistral, Gemma), the softmax scale (Gemma's
query_pre_attn_scalar) and tanh soft-capping of the scores (Gemma 2: cap * tanh(s / cap), before
the mask). ``ContiguousKVCache.for_model`` takes them from the config.

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


def causal_attention(q: Floats, k: Floats, v: Floats, offset: int, window: int | None = None,
                     scale: float | None = None, softcap: float | None = None) -> Floats:
    # [T, H, D], [KVH, S, D], [KVH, S, D] -> [T, H, D]
    """Query i sits at position offset + i and sees keys 0 .. offset + i (keys are positions 0..S-1),
    or with a `window` only the last `window` of them: offset + i - window + 1 .. offset + i.
    `scale`: of the scores (None: 1/sqrt(D)); `softcap`: scores -> softcap * tanh(scores / softcap).

    Long prefills go in blocks of QUERY_BLOCK queries, each against only the keys it may see: for
    a 500-token prompt that skips ~40% of the score matrix (the part above the diagonal)."""
    T = q.shape[0]
    assert k.shape[1] >= offset + T, "the cache must already hold this step's keys"
    if T <= QUERY_BLOCK:
        return _attend(q, k, v, offset, offset + T, window, scale, softcap)
    xp = array_module(q)
    out: Floats = xp.empty_like(q)
    for i in range(0, T, QUERY_BLOCK):
        j = min(i + QUERY_BLOCK, T)
        out[i:j] = _attend(q[i:j], k, v, offset + i, offset + j, window, scale, softcap)
    return out


def _attend(q: Floats, k: Floats, v: Floats, first: int, end: int, window: int | None,
            scale: float | None, softcap: float | None) -> Floats:
    # [T, H, D] at positions first .. end - 1, [KVH, >= end, D] x2 -> [T, H, D]
    T, H, D = q.shape
    KVH = k.shape[0]
    G = H // KVH
    assert H == KVH * G and end == first + T
    start = 0 if window is None else max(0, first - window + 1)  # the first key any of these queries sees
    k, v = k[:, start:end], v[:, start:end]
    S = end - start
    # [T, H, D] -> [KVH, G, T, D] -> [KVH, G*T, D]; the scale goes on q, the smaller tensor
    s = (1.0 / math.sqrt(D)) if scale is None else scale
    qg = (q * s).reshape(T, KVH, G, D).transpose(1, 2, 0, 3).reshape(KVH, G * T, D)
    scores = qg @ k.transpose(0, 2, 1)  # [KVH, G*T, S]
    if softcap is not None:
        scores /= softcap
        array_module(scores).tanh(scores, out=scores)
        scores *= softcap
    if T > 1 or (window is not None and S > window):  # one decode token sees every key but the window's
        xp = array_module(scores)
        key_pos, query_pos = start + xp.arange(S)[None, :], (first + xp.arange(T))[:, None]
        hidden = key_pos > query_pos  # [T, S]
        if window is not None:
            hidden |= key_pos <= query_pos - window
        # one additive pass (0 or -inf) is far cheaper than a boolean-mask assignment
        scores.reshape(KVH, G, T, S)[...] += xp.where(hidden, -np.inf, 0.0).astype(scores.dtype)
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
                 dtype: npt.DTypeLike = np.float32, xp: Any = np, windows: tuple[int, ...] = (),
                 scale: float | None = None, softcap: float | None = None) -> None:
        """`windows`: per-layer sliding windows (0 or () = full causal); `scale`, `softcap`: see
        causal_attention. `for_model` reads all three from a ModelConfig."""
        if windows and len(windows) != num_layers:
            raise ValueError(f"{len(windows)} windows for {num_layers} layers")
        self.max_len = max_len
        self.windows = tuple(windows) or (0,) * num_layers
        self.scale, self.softcap = scale, softcap
        self.k: Floats = xp.zeros((num_layers, num_kv_heads, max_len, head_dim), dtype=dtype)
        self.v: Floats = xp.zeros_like(self.k)
        self.lengths = [0] * num_layers

    @classmethod
    def for_model(cls, config: ModelConfig, max_len: int, dtype: npt.DTypeLike = np.float32) -> "ContiguousKVCache":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, max_len, dtype,
                   windows=config.layer_windows, scale=config.attn_scale, softcap=config.attn_softcap)

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
        return causal_attention(q, self.k[layer, :, :end], self.v[layer, :, :end], offset=start,
                                window=self.windows[layer] or None, scale=self.scale, softcap=self.softcap)
