"""The buffers of one Llama forward step, allocated once and reused by every layer and every step.

Why: a decode step is 30 layers of a dozen small operations on one row. Written as expressions
(`x @ w`, `x + h`, `rms_norm(x)`), each makes a new array: about 300 small allocations per step,
plus the Python that goes with them. Here each intermediate has one buffer, sized for the step's
N rows, that the kernels write into (`out=`): the layers of a step allocate nothing.

Sizing: a model keeps one `Workspace`, grown to the most rows it has seen up to `CACHED_ROWS`
(decode batches); a larger step (a long prefill chunk) gets buffers of its own for that one
forward, freed after it, so that a prefill does not keep megabytes resident between requests.
A forward that finds the cached buffers in use (another thread running the same model) gets
its own as well: the buffers are never shared by two forwards at once.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from scratchllm.models.arena import anonymous_mapping
from scratchllm.models.config import ModelConfig

CACHED_ROWS = 64  # steps of at most this many tokens reuse the model's buffers


@dataclass(frozen=True)
class StepBuffers:
    """Views of N rows. Invariant: qkv_rows, q, k, v are views of qkv, attn_rows of attn (the same memory)."""

    h: np.ndarray  # [N, C] a sublayer's normed input
    qkv_rows: np.ndarray  # [N, q + 2 kv] the fused q|k|v product
    qkv: np.ndarray  # [N, H + 2 KVH, D] the same, by head
    q: np.ndarray  # [N, H, D]
    k: np.ndarray  # [N, KVH, D]
    v: np.ndarray  # [N, KVH, D]
    attn: np.ndarray  # [N, H, D] attention's output, for an attention that writes into it (accepts_out)
    attn_rows: np.ndarray  # [N, H D] the same, as the o projection's input
    delta: np.ndarray  # [N, C] a sublayer's output, added into the residual stream by the next norm
    gate_up: np.ndarray  # [N, 2 I]
    act: np.ndarray  # [N, I] silu(gate) * up

    @classmethod
    def allocate(cls, cfg: ModelConfig, rows: int) -> "StepBuffers":
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        C, I = cfg.hidden_size, cfg.intermediate_size
        h, qkv, attn, delta, gate_up, act = _carve([(rows, C), (rows, H + 2 * KVH, D), (rows, H, D), (rows, C),
                                                     (rows, 2 * I), (rows, I)])
        return cls(h=h, qkv_rows=qkv.reshape(rows, -1), qkv=qkv, q=qkv[:, :H], k=qkv[:, H : H + KVH],
                   v=qkv[:, H + KVH :], attn=attn, attn_rows=attn.reshape(rows, -1), delta=delta, gate_up=gate_up,
                   act=act)

    @property
    def rows(self) -> int:
        return int(self.h.shape[0])

    def head(self, n: int) -> "StepBuffers":
        """The first n rows (views; slicing the leading axis keeps every buffer C-contiguous)."""
        assert n <= self.rows
        if n == self.rows:
            return self
        qkv = self.qkv[:n]
        return StepBuffers(h=self.h[:n], qkv_rows=self.qkv_rows[:n], qkv=qkv, q=self.q[:n], k=self.k[:n],
                           v=self.v[:n], attn=self.attn[:n], attn_rows=self.attn_rows[:n], delta=self.delta[:n],
                           gate_up=self.gate_up[:n], act=self.act[:n])


def _carve(shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """float32 arrays of these shapes, each 64-byte aligned, in one anonymous mapping of their own
    (the arrays keep it alive; it is unmapped when the last of them goes).

    Why not np.empty: a prefill step's buffers are megabytes, which glibc's malloc serves by mmap,
    and freeing such a block raises malloc's mmap threshold to its size. Every later allocation
    under that size (the next step's buffers, logits, embeddings) then comes from the heap,
    which keeps its high-water mark: 15 MB of the 16-prompt batched run stayed resident that way
    (docs/memory.md). A mapping of our own goes back to the kernel whole and leaves malloc as it was."""
    sizes = [-(-int(np.prod(s)) * 4 // 64) * 64 for s in shapes]
    region = anonymous_mapping(max(sum(sizes), 1), huge_pages=True)  # every byte is written by the step
    out, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(np.frombuffer(region, np.float32, int(np.prod(shape)), offset).reshape(shape))
        offset += size
    return out


class Workspace:
    """A model's cached StepBuffers; `rows(n)` lends n rows of them for one forward."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._lock = threading.Lock()
        self._buffers: StepBuffers | None = None
        self._views: dict[int, StepBuffers] = {}  # n -> head(n): built once per row count

    @contextmanager
    def rows(self, n: int) -> Iterator[StepBuffers]:
        if n > CACHED_ROWS or not self._lock.acquire(blocking=False):
            yield StepBuffers.allocate(self.cfg, n)  # this forward's own, freed after it
            return
        try:
            if self._buffers is None or self._buffers.rows < n:
                grown = max(n, 2 * self._buffers.rows) if self._buffers is not None else n
                self._buffers = StepBuffers.allocate(self.cfg, min(grown, CACHED_ROWS))
                self._views = {}
            views = self._views.get(n)
            if views is None:
                views = self._views[n] = self._buffers.head(n)
            yield views
        finally:
            self._lock.release()
