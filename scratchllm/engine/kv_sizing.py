"""KV-cache sizing: what K and V take, in bytes, for a model at a KV dtype. The pool
(paged_attention.py), the memory plan (memory_plan.py), the static baseline's reservation and
the benches all size KV here, and nowhere else.

  KV_DTYPES               the element types, each with the NumPy dtype it is stored in
  layer_groups            which layers share a pool: the full-attention ones, the windowed ones
  kv_bytes_per_token      K and V of one token of context over some layers (int8: its scales)
  block_bytes             one block of K and V
  window_blocks           most blocks a windowed table holds between steps
  sequence_kv_bytes       most bytes one sequence of a given context holds between steps

Sliding windows: a layer with a window of w tokens reads the last w positions only
(ModelConfig.window), so its pool holds windows, not contexts: between steps a sequence holds,
per windowed layer, at most ceil((w - 1) / block_size) + 1 blocks, the window plus the block
being filled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from scratchllm.errors import ConfigError

if TYPE_CHECKING:
    from scratchllm.models.config import ModelConfig


# the KV-cache dtypes: the NumPy dtype each is stored in (bfloat16 as its bits)
KV_DTYPES: dict[str, np.dtype[Any]] = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                                       "bfloat16": np.dtype(np.uint16), "int8": np.dtype(np.int8)}
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)
# what "auto" means (docs/memory.md says why: measured, half the bytes of float32 per token for the
# same decode speed, and the logits stay within float16's rounding of the float32 cache's)
DEFAULT_KV_DTYPE = "float16"


def resolve_kv_dtype(name: str) -> str:
    """A --kv-cache-dtype value -> the dtype it means; a clear error for one that is not a choice."""
    if name == "auto":
        return DEFAULT_KV_DTYPE
    if name not in KV_DTYPES:
        raise ConfigError(f"KV-cache dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, got {name!r}")
    return name


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share a KV pool and a block table per sequence: the full-attention layers, or
    the windowed ones (window: the largest window among them, 0 for full attention)."""

    layers: tuple[int, ...]
    window: int


def layer_groups(config: ModelConfig) -> list[LayerGroup]:
    """The KV pools of a model: one of every layer when no layer has a window, or when every layer
    has one; else the full-attention layers first, then the windowed ones. Group g's block table
    is Request.block_table for g = 0 and Request.window_table for g = 1 (block_manager.py)."""
    windows = [config.window(i) or 0 for i in range(config.num_layers)]
    full = tuple(i for i, w in enumerate(windows) if not w)
    windowed = tuple(i for i, w in enumerate(windows) if w)
    if not windowed:
        return [LayerGroup(full, 0)]
    group = LayerGroup(windowed, max(windows))
    return [group] if not full else [LayerGroup(full, 0), group]


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str = "float32", num_layers: int | None = None,
                       block_size: int = 16) -> float:
    """Bytes of K and V one token of context takes over `num_layers` layers (default: every layer)
    in `kv_dtype`; int8 counts its per-block scales (2 x 4 bytes per kv head per block)."""
    layers = config.num_layers if num_layers is None else num_layers
    per_layer: float = 2 * config.num_kv_heads * config.head_dim * KV_DTYPES[resolve_kv_dtype(kv_dtype)].itemsize
    if resolve_kv_dtype(kv_dtype) == "int8":
        per_layer += 2 * config.num_kv_heads * 4 / block_size
    return layers * per_layer


def block_bytes(config: ModelConfig, block_size: int, num_layers: int | None = None, kv_dtype: str = "float32") -> int:
    """Bytes of one block of K and V (with an int8 block's scales) over `num_layers` layers
    (default: every layer) in `kv_dtype`."""
    return round(kv_bytes_per_token(config, kv_dtype, num_layers, block_size) * block_size)


def window_blocks(window: int, block_size: int) -> int:
    """Most blocks a windowed table holds between steps: those of the last `window` positions."""
    return (window - 1 + block_size - 1) // block_size + 1


def sequence_kv_bytes(mc: ModelConfig, context_len: int, block_size: int, windows: bool = True,
                      kv_dtype: str = "float32") -> int:
    """Most KV bytes one sequence of `context_len` tokens holds between steps: each full-attention
    layer its context, each windowed layer its window plus the block being filled (in whole blocks).
    windows=False: as if every layer attended to the whole context."""
    blocks = -(-context_len // block_size)
    layer_block = block_bytes(mc, block_size, 1, kv_dtype)
    total = 0
    for layer in range(mc.num_layers):
        w = mc.window(layer) if windows else None
        total += layer_block * (min(blocks, window_blocks(w, block_size)) if w else blocks)
    return total
