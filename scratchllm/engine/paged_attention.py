"""The paged KV pool and the attention call the model makes into it.

The model calls `attention(layer, q [N, H, D], k [N, KVH, D], v [N, KVH, D]) -> [N, H, D]` for
the N packed tokens of a step (with `out=`, into the model's buffer: `accepts_out` says this
object takes one, so a decode step makes no array per layer). Before the forward the model runner tells this object the
layout of those tokens (`set_layout`): which sequence each belongs to (a row of the block
table array) and its position. The Cython kernel writes k/v into the pool and attends through
the block tables (scratchllm/kernels/paged_attention.pyx).

Sliding windows: a layer with a window of w tokens attends to the last w positions only
(ModelConfig.window). Its layers form a group of their own with a pool of its own: the block
manager frees a windowed group's blocks once every later query of the sequence is past them
(block_manager.py), so that pool grows with the window, not the context. `layer_groups` says
which layers share a pool; a model without windows has one group, every layer, as before. The
softmax scale (ModelConfig.softmax_scale) and the tanh soft-capping of scores (attn_softcap)
are the kernel's too.

Pool layout, per layer: V as [num_blocks, block_size, KVH, D] (a slot's values are one
contiguous row) and K as [num_blocks, KVH, D, block_size] (a block's keys transposed, so a
block's scores are computed 16 lanes at a time without a horizontal sum per key).

The KV-cache dtype (EngineConfig.kv_cache_dtype): float32, float16, bfloat16 (kept as its uint16
bits: NumPy has no bfloat16) or int8 with a float32 scale per (block, kv head) for K and for V
(k_scale, v_scale: [L, num_blocks, KVH]). The kernel reads each in place (widened in registers;
scratchllm/kernels/paged_attention.pyx says how int8 is kept), so a smaller dtype is fewer bytes
per token of context, resident and read per step (kv_sizing.py says how many).

`reference_attention` is the NumPy twin the kernel is tested against: gather each sequence's keys
through its block table into a padded batch and use the 3-D mask generator.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from scratchllm.engine.kv_sizing import KV_DTYPES, resolve_kv_dtype
from scratchllm.engine.masks import varlen_causal_mask
from scratchllm.kernels.paged_attention import copy_blocks, layout_context, paged_attention
from scratchllm.models.arena import anonymous_mapping

if TYPE_CHECKING:
    from scratchllm.models.config import ModelConfig

Floats = npt.NDArray[np.floating[Any]]
Ints = npt.NDArray[np.integer[Any]]


def lazy_zeros(shape: tuple[int, ...], dtype: npt.DTypeLike = np.float32) -> npt.NDArray[Any]:
    """An array of zeros in an anonymous mapping of its own, in 4 KiB pages that the kernel
    maps on first write: untouched blocks cost address space, not memory. Not np.zeros: NumPy
    asks for transparent huge pages on large arrays, and then writing one 12 KiB block of a
    layer made 2 MiB resident (a 16-sequence run of the default model grew RSS by twice its KV)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    if size == 0:
        return np.zeros(shape, dtype=dtype)
    region = anonymous_mapping(size, huge_pages=False)
    return np.frombuffer(region, dtype=dtype).reshape(shape)  # the array keeps the mapping alive


class PagedAttention:
    accepts_out = True  # __call__ writes into a buffer the model passes (its step workspace)

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 num_threads: int = 0, *, windows: Sequence[int] = (), scale: float | None = None,
                 softcap: float | None = None, num_window_blocks: int | None = None,
                 kv_dtype: str = "float32") -> None:
        """`windows`: each layer's sliding window in tokens (0: full attention; (): none has one).
        With both kinds of layer, the windowed ones keep a pool of `num_window_blocks` blocks
        (default num_blocks) and read their tables from set_layout's `window_tables`.
        `kv_dtype`: the element type of the pools (KV_DTYPES; "auto" is DEFAULT_KV_DTYPE)."""
        windows = tuple(windows) or (0,) * num_layers
        assert len(windows) == num_layers and min(windows, default=0) >= 0, "one window >= 0 per layer"
        full = [i for i in range(num_layers) if not windows[i]]
        windowed = [i for i in range(num_layers) if windows[i]]
        groups = [full, windowed] if full and windowed else [list(range(num_layers))]
        sizes = [num_blocks, num_blocks if num_window_blocks is None else num_window_blocks]
        self.kv_dtype = resolve_kv_dtype(kv_dtype)
        store = KV_DTYPES[self.kv_dtype]
        # K is stored transposed per block (see the kernel): [L, blocks, KVH, D, BS]; one pair per group
        self.pools = [(lazy_zeros((len(g), size, num_kv_heads, head_dim, block_size), store),
                       lazy_zeros((len(g), size, block_size, num_kv_heads, head_dim), store))
                      for g, size in zip(groups, sizes, strict=False)]
        # int8: a float32 scale per (layer, block, kv head) for K and for V, per group; None otherwise
        self.scales: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None] = [
            (lazy_zeros((len(g), size, num_kv_heads)), lazy_zeros((len(g), size, num_kv_heads)))
            if self.kv_dtype == "int8" else None for g, size in zip(groups, sizes, strict=False)]
        self.k_cache, self.v_cache = self.pools[0]  # the first group's (every layer's, without windows)
        self.k_scale: npt.NDArray[np.float32] | None = None  # the first group's int8 scales
        self.v_scale: npt.NDArray[np.float32] | None = None
        if self.scales[0] is not None:
            self.k_scale, self.v_scale = self.scales[0]
        # each layer's pools and scales as views made once (indexing k_cache[layer] makes two arrays
        # per call), its group and its window
        self._layers: list[tuple[Any, Any, Any, Any, int, int]] = [None] * num_layers  # type: ignore[list-item]
        # the same per layer for the fused block loop (kernels/llama_blocks.pyx): [L, 3] int32 of
        # (pool, index in the pool, window)
        self.layer_slots = np.zeros((num_layers, 3), dtype=np.int32)
        for n, g in enumerate(groups):
            scales = self.scales[n]
            for i, layer in enumerate(g):
                ks, vs = (scales[0][i], scales[1][i]) if scales is not None else (None, None)
                self._layers[layer] = (self.pools[n][0][i], self.pools[n][1][i], ks, vs, n, windows[layer])
                self.layer_slots[layer] = (n, i, windows[layer])
        self.windows = windows
        self.block_size = block_size
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.softcap = float(softcap or 0.0)  # 0: off
        self.num_threads = num_threads  # 0: the kernel pool's count (scratchllm/kernels/pool.pyx)
        self.block_tables: npt.NDArray[np.int32] | None = None  # [S, MB], set per step by set_layout
        self.window_tables: npt.NDArray[np.int32] | None = None  # [S, MBW], with two groups
        self.token_seq: npt.NDArray[np.int32] | None = None  # [N]
        self.token_pos: npt.NDArray[np.int32] | None = None  # [N]
        self.max_ctx = 0
        self.elapsed_ns = 0  # attention time of the current step's forward, summed over layers

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int, num_threads: int = 0,
                  num_window_blocks: int | None = None, kv_dtype: str = "float32") -> PagedAttention:
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, num_threads,
                   windows=[config.window(i) or 0 for i in range(config.num_layers)], scale=config.softmax_scale,
                   softcap=config.attn_softcap, num_window_blocks=num_window_blocks, kv_dtype=kv_dtype)

    def arrays(self) -> list[npt.NDArray[Any]]:
        """Every array of the pools (K, V and int8 scales, every group): what the KV cache maps."""
        out = [a for pair in self.pools for a in pair]
        return out + [a for pair in self.scales if pair is not None for a in pair]

    def dequantized(self, layer: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """A layer's K and V pools as float32 copies ([blocks, KVH, D, BS], [blocks, BS, KVH, D]):
        the values the kernel reads, for tests and the NumPy reference."""
        k, v, ks, vs, _, _ = self._layers[layer]
        if self.kv_dtype == "bfloat16":
            return ((k.astype(np.uint32) << 16).view(np.float32), (v.astype(np.uint32) << 16).view(np.float32))
        if self.kv_dtype == "int8":
            return (k.astype(np.float32) * ks[:, :, None, None], v.astype(np.float32) * vs[:, None, :, None])
        return k.astype(np.float32), v.astype(np.float32)

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    def set_layout(self, block_tables: npt.ArrayLike, token_seq: npt.ArrayLike,
                   token_pos: npt.ArrayLike, window_tables: npt.ArrayLike | None = None) -> None:
        # [S, MB], [N], [N]; with two groups also the windowed layers' tables [S, MBW]
        self.block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        self.token_seq = np.ascontiguousarray(token_seq, dtype=np.int32)
        self.token_pos = np.ascontiguousarray(token_pos, dtype=np.int32)
        # checked once per step here, so that the 30 calls per step need not
        self.max_ctx = layout_context(self.block_tables, self.token_seq, self.token_pos, self.block_size,
                                      self.k_cache.shape[1])
        if self.num_groups == 2:
            if window_tables is None:
                raise ValueError("a model with full-attention and windowed layers needs window_tables")
            self.window_tables = np.ascontiguousarray(window_tables, dtype=np.int32)
            layout_context(self.window_tables, self.token_seq, self.token_pos, self.block_size,
                           self.pools[1][0].shape[1])
        self.elapsed_ns = 0  # attention time of this step's forward, summed over layers

    @contextmanager
    def paged_step(self, n: int) -> Iterator[PagedAttention]:
        """A forward of n tokens that runs every layer itself (models/llama.fused_blocks) on this
        pool and the layout set_layout gave it, windows, scale and soft-cap included."""
        if self.token_pos is None or len(self.token_pos) != n:
            have = None if self.token_pos is None else len(self.token_pos)
            raise ValueError(f"the layout holds {have} tokens, the step {n}: call set_layout first")
        yield self

    def copy_blocks(self, pairs: Sequence[tuple[int, int]] | Ints, group: int = 0) -> None:
        """Copy-on-write: block dst becomes a copy of block src in `group`'s pool, every layer, K and V
        (and an int8 block's scales)."""
        if not len(pairs):
            return
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        for cache in (*self.pools[group], *(self.scales[group] or ())):
            for layer in range(cache.shape[0]):
                copy_blocks(cache[layer], pairs)

    def __call__(self, layer: int, q: Floats, k: Floats, v: Floats,
                 out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
        # [N, H, D], [N, KVH, D], [N, KVH, D] -> out [N, H, D] (new unless given; the kernel checks its shape)
        start = time.perf_counter_ns()
        if q.dtype != np.float32:
            q, k, v = (a.astype(np.float32) for a in (q, k, v))
        if out is None:
            out = np.empty(q.shape, dtype=np.float32)
        k_pool, v_pool, k_scale, v_scale, group, window = self._layers[layer]
        tables = self.window_tables if group else self.block_tables
        assert tables is not None and self.token_seq is not None and self.token_pos is not None, "set_layout first"
        paged_attention(q, k, v, k_pool, v_pool, tables, self.token_seq, self.token_pos, self.scale, out,
                        self.max_ctx, self.num_threads, window, self.softcap, k_scale, v_scale)
        self.elapsed_ns += time.perf_counter_ns() - start  # the trace's attention share of a step
        return out


class PagedSequence:
    """One sequence in a pool of its own, through the engine's kernel: the call of the simple
    ContiguousKVCache (`cache(layer, q, k, v)`, `cache.length`), with the attention a served
    request gets. The single-stream benches run on it, so that they time that attention rather
    than the NumPy reference one."""

    accepts_out = True

    def __init__(self, config: ModelConfig, max_len: int, block_size: int = 16, num_threads: int = 0,
                 kv_dtype: str = "float32") -> None:
        blocks = -(-max_len // block_size)
        self.attention = PagedAttention.for_model(config, blocks, block_size, num_threads, kv_dtype=kv_dtype)
        self.table = np.arange(blocks, dtype=np.int32)[None]  # the sequence owns every block, in order (each group)
        self.capacity = blocks * block_size
        self.num_layers = config.num_layers
        self.length = 0  # positions every layer holds (between forward passes)

    def _lay_out(self, n: int) -> None:  # a forward pass begins: its n tokens take the next positions
        if self.length + n > self.capacity:
            raise ValueError(f"this sequence holds {self.capacity} positions; the step needs {self.length + n}")
        pos = np.arange(self.length, self.length + n, dtype=np.int32)
        window_tables = self.table if self.attention.num_groups == 2 else None
        self.attention.set_layout(self.table, np.zeros(n, dtype=np.int32), pos, window_tables)

    @contextmanager
    def paged_step(self, n: int) -> Iterator[PagedAttention]:
        """A forward of n tokens that runs every layer itself (models/llama.fused_blocks)."""
        self._lay_out(n)
        yield self.attention
        self.length += n

    def __call__(self, layer: int, q: Floats, k: Floats, v: Floats,
                 out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
        n = q.shape[0]
        if layer == 0:
            self._lay_out(n)
        out = self.attention(layer, q, k, v, out)
        if layer == self.num_layers - 1:
            self.length += n
        return out


def reference_attention(q: Floats, k: Floats, v: Floats, k_cache: Floats, v_cache: Floats, block_tables: Ints,
                        token_seq: Ints, token_pos: Ints, window: int = 0, scale: float | None = None,
                        softcap: float = 0.0, write: bool = True) -> npt.NDArray[np.float32]:
    """NumPy paged attention for one layer: the same contract as the kernel, written plainly.
    Writes k, v into the (float32) caches unless `write` is False (the caches then already hold
    them: a quantized pool's values, dequantized); returns [N, H, D]. Tokens of a sequence must be
    contiguous and in position order (as the model runner packs them). With a window, only the
    table entries inside the window of the sequence's first query are read (the ones before may
    be dropped)."""
    N, H, D = q.shape
    KVH, BS = k.shape[1], v_cache.shape[1]
    G = H // KVH
    blocks = block_tables[token_seq, token_pos // BS]
    if write:
        k_cache[blocks, :, :, token_pos % BS] = k  # k_cache: [NB, KVH, D, BS]
        v_cache[blocks, token_pos % BS] = v  # v_cache: [NB, BS, KVH, D]
    seqs = list(dict.fromkeys(token_seq.tolist()))  # in order of first appearance
    rows = [np.flatnonzero(token_seq == s) for s in seqs]
    q_lens = np.array([len(r) for r in rows])
    k_lens = np.array([token_pos[r[-1]] + 1 for r in rows])
    B, Q, K = len(seqs), q_lens.max(), k_lens.max()
    qb = np.zeros((B, Q, H, D), np.float32)
    kb = np.zeros((B, K, KVH, D), np.float32)
    vb = np.zeros((B, K, KVH, D), np.float32)
    for b, (s, r) in enumerate(zip(seqs, rows, strict=True)):
        qb[b, : len(r)] = q[r]
        t = np.arange(max(0, token_pos[r[0]] - window + 1) if window else 0, k_lens[b])
        kb[b, t] = k_cache[block_tables[s, t // BS], :, :, t % BS]  # the gather the kernel avoids
        vb[b, t] = v_cache[block_tables[s, t // BS], t % BS]
    kb, vb = np.repeat(kb, G, axis=2), np.repeat(vb, G, axis=2)  # [B, K, H, D]
    scores = np.einsum("bqhd,bkhd->bhqk", qb, kb) * (1 / math.sqrt(D) if scale is None else scale)  # [B, H, Q, K]
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    mask = varlen_causal_mask(q_lens, k_lens, window)  # [B, Q, K]
    scores = np.where(mask[:, None], scores, -np.inf)
    scores = np.where(mask[:, None].any(-1, keepdims=True), scores, 0.0)  # padding rows: no NaN
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    ob = np.einsum("bhqk,bkhd->bqhd", probs, vb)  # [B, Q, H, D]
    out = np.empty((N, H, D), np.float32)
    for b, r in enumerate(rows):
        out[r] = ob[b, : len(r)]
    return out
