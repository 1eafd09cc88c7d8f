"""The seed's attention mask generator: 3-D boolean masks [batch, q_len, k_len] for batches of
variable-length sequences, vectorized NumPy on the CPU (True = the query may see the key).

Two layouts, one per user:
  * right-aligned, variable length (`varlen_causal_mask`): sequence b has k_lens[b] keys and its
    q_lens[b] queries are the last q_lens[b] of them (a prefill chunk over a cached prefix, or a
    decode with q_len 1). Rows i >= q_lens[b] are padding. Used by the packed reference attention.
  * left-padded (`left_padded_causal_mask`): the static baseline pads every prompt on the left to
    the longest; sequence b's real tokens start at column pad[b], and the q_len queries sit in the
    last q_len columns. Padding queries see only themselves, so no softmax row is empty (NaN).

Each has a Python-loop twin (`*_loop`): the obvious per-sequence, per-row code the vectorized
form replaces. `scratchllm bench masks` times the two; tests check they agree.
"""

import numpy as np


def varlen_causal_mask(q_lens, k_lens) -> np.ndarray:  # [B], [B] -> [B, max_q, max_k] bool
    q_lens, k_lens = np.asarray(q_lens, dtype=np.int64), np.asarray(k_lens, dtype=np.int64)
    assert q_lens.shape == k_lens.shape and np.all(q_lens <= k_lens), "queries are among the keys"
    i = np.arange(q_lens.max())[None, :, None]  # [1, Q, 1] query row
    j = np.arange(k_lens.max())[None, None, :]  # [1, 1, K] key column
    q_pos = (k_lens - q_lens)[:, None, None] + i  # [B, Q, 1] the query's position
    return (i < q_lens[:, None, None]) & (j <= q_pos)  # [B, Q, K]; j <= q_pos < k_len


def varlen_causal_mask_loop(q_lens, k_lens) -> np.ndarray:
    B = len(q_lens)
    mask = np.zeros((B, max(q_lens), max(k_lens)), dtype=bool)
    for b in range(B):
        for i in range(q_lens[b]):
            mask[b, i, : k_lens[b] - q_lens[b] + i + 1] = True
    return mask


def left_padded_causal_mask(pad, q_len: int, k_len: int) -> np.ndarray:  # [B] -> [B, q_len, k_len]
    pad = np.asarray(pad, dtype=np.int64)
    j = np.arange(k_len)[None, None, :]  # [1, 1, K]
    c = (k_len - q_len + np.arange(q_len))[None, :, None]  # [1, Q, 1] the query's column
    return ((j >= pad[:, None, None]) & (j <= c)) | (j == c)


def left_padded_causal_mask_loop(pad, q_len: int, k_len: int) -> np.ndarray:
    B = len(pad)
    mask = np.zeros((B, q_len, k_len), dtype=bool)
    for b in range(B):
        for i in range(q_len):
            c = k_len - q_len + i
            mask[b, i, pad[b] : c + 1] = True
            mask[b, i, c] = True
    return mask
