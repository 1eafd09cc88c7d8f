"""The attention mask generator: 3-D boolean masks [batch, q_len, k_len] for batches of
variable-length sequences, vectorized NumPy on the CPU (True = the query may see the key).

Two layouts, one per user:
  * right-aligned, variable length (`varlen_causal_mask`): sequence b has k_lens[b] keys and its
    q_lens[b] queries are the last q_lens[b] of them (a prefill chunk over a cached prefix, or a
    decode with q_len 1). Rows i >= q_lens[b] are padding. Used by the packed reference attention.
  * left-padded (`left_padded_causal_mask`): the static baseline pads every prompt on the left to
    the longest; sequence b's real tokens start at column pad[b], and the q_len queries sit in the
    last q_len columns. Padding queries see only themselves, so no softmax row is empty (NaN).

Both take a sliding window (`window`, in tokens; 0 = none): a query at position p then sees
only the keys at p - window + 1..p, the convention of transformers' sliding-window masks for
Mistral, Gemma 2 and Gemma 3 (a key is visible when p - window < k <= p) and of
ModelConfig.window.

Each has two loop twins: `*_python`, the starting point as the design article writes it (a
nested list comprehension, one Python bool per element), and `*_loop`, a per-row loop filling
slices. `scratchllm bench masks` times all three; tests check they agree.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

# Lengths and pads arrive as Python lists (tests, benches) or integer arrays (the callers' own).
Lengths = Sequence[int] | npt.NDArray[np.integer[Any]]
BoolMask = npt.NDArray[np.bool_]


def varlen_causal_mask(q_lens: Lengths, k_lens: Lengths, window: int = 0) -> BoolMask:
    # [B], [B] -> [B, max_q, max_k] bool
    q_lens, k_lens = np.asarray(q_lens, dtype=np.int32), np.asarray(k_lens, dtype=np.int32)
    assert q_lens.shape == k_lens.shape and np.all(q_lens <= k_lens), "queries are among the keys"
    assert window >= 0, "a window is >= 0 tokens (0: none)"
    i = np.arange(q_lens.max(), dtype=np.int32)[None, :]  # [1, Q] query row
    q_pos = (k_lens - q_lens)[:, None] + i  # [B, Q] the query's position; it sees keys 0..q_pos
    q_pos[i >= q_lens[:, None]] = -1  # padding rows see nothing
    j = np.arange(k_lens.max(), dtype=np.int32)[None, None, :]
    if not window:  # the only pass over [B, Q, K]: one broadcast comparison
        return j <= q_pos[:, :, None]
    return (j <= q_pos[:, :, None]) & (j > q_pos[:, :, None] - window)


def varlen_causal_mask_loop(q_lens: Lengths, k_lens: Lengths, window: int = 0) -> BoolMask:
    B = len(q_lens)
    mask = np.zeros((B, max(q_lens), max(k_lens)), dtype=bool)
    for b in range(B):
        for i in range(q_lens[b]):
            p = k_lens[b] - q_lens[b] + i
            mask[b, i, max(0, p - window + 1) if window else 0 : p + 1] = True
    return mask


def left_padded_causal_mask(pad: Lengths, q_len: int, k_len: int, window: int = 0) -> BoolMask:
    # [B] -> [B, q_len, k_len]
    assert window >= 0, "a window is >= 0 tokens (0: none)"
    pad = np.asarray(pad, dtype=np.int32)
    j = np.arange(k_len, dtype=np.int32)
    c = k_len - q_len + np.arange(q_len, dtype=np.int32)  # [Q] the query's column
    upper = j[None, :] <= c[:, None]  # [Q, K] causal, the same for every row of the batch
    if window:  # a token's position is its column minus the pad: the window is in columns too
        upper &= j[None, :] > c[:, None] - window
    lo = np.where(c[None, :] >= pad[:, None], pad[:, None], c[None, :])  # [B, Q] a pad query sees itself
    return (j[None, None, :] >= lo[:, :, None]) & upper[None]


def left_padded_causal_mask_loop(pad: Lengths, q_len: int, k_len: int, window: int = 0) -> BoolMask:
    B = len(pad)
    mask = np.zeros((B, q_len, k_len), dtype=bool)
    for b in range(B):
        for i in range(q_len):
            c = k_len - q_len + i
            mask[b, i, max(pad[b], c - window + 1) if window else pad[b] : c + 1] = True
            mask[b, i, c] = True
    return mask


def varlen_causal_mask_python(q_lens: Lengths, k_lens: Lengths, window: int = 0) -> BoolMask:
    """The starting point, as the design article writes it: a nested list comprehension, one Python bool per element."""
    Q, K = max(q_lens), max(k_lens)
    return np.array([[[i < q and j <= k - q + i and (not window or j > k - q + i - window) for j in range(K)]
                      for i in range(Q)] for q, k in zip(q_lens, k_lens, strict=True)], dtype=bool)


def left_padded_causal_mask_python(pad: Lengths, q_len: int, k_len: int, window: int = 0) -> BoolMask:
    def seen(p: int, i: int, j: int) -> bool:
        c = k_len - q_len + i
        return j == c or (p <= j <= c and (not window or j > c - window))

    return np.array([[[seen(p, i, j) for j in range(k_len)] for i in range(q_len)] for p in pad], dtype=bool)
