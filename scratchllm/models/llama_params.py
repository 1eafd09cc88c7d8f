"""A Llama-family model's parameters as its forward reads them (models/llama.py), made by the
packer (models/llama_pack.py): one `LayerParams` per block, named for the role each tensor plays
(models/architecture.py), and `LlamaParams` for the whole model.

Shapes: C hidden size, H query heads, KVH key/value heads, D head size, I the MLP's inner size,
V the vocabulary. Matrices are [in, out], so a layer is `x @ w`.
"""

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.formats import ggml_quants
from scratchllm.kernels.llama_blocks import LlamaBlocks
from scratchllm.models.config import ModelConfig, RopeScaling
from scratchllm.models.packed import PackedWeight

Floats = npt.NDArray[np.floating[Any]]
F32 = npt.NDArray[np.float32]
Matrix = PackedWeight | F32  # a layer's [in, out] weight: packed (as the packer stores them) or a plain array


@dataclass
class LayerParams:
    """One block's tensors (models/architecture.py draws the block); None: the block has no such piece."""

    attn_norm: F32  # [C] the attention's input RMSNorm
    qkv: Matrix  # [C, (H + 2 KVH) D] q|k|v, fused
    o: Matrix  # [H D, C] the attention's output projection
    mlp_norm: F32  # [C] the MLP's input RMSNorm
    gate_up: Matrix  # [C, 2 I] gate|up, fused
    down: Matrix  # [I, C]
    qkv_bias: F32 | None = None  # [(H + 2 KVH) D]
    o_bias: F32 | None = None  # [C]
    q_norm: F32 | None = None  # [D] QK-norm: an RMSNorm over each query head
    k_norm: F32 | None = None  # [D] and over each key head
    attn_out_norm: F32 | None = None  # [C] the attention output's RMSNorm (sandwich norms)
    mlp_out_norm: F32 | None = None  # [C] the MLP output's RMSNorm

    def matrices(self) -> dict[str, Matrix]:
        """The four matrices by role, in the order a block multiplies by them."""
        return {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}

    def tensors(self) -> dict[str, Matrix]:
        """Every tensor the block has, by role."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


class QuantizedRows:
    """A [V, C] table kept as its file's blocks (raw bytes [V, row bytes], a view of the mapped
    file): `table[ids]` dequantizes the rows asked for, bit for bit the values of the whole table
    dequantized (formats/ggml_quants.dequantize: the same operations, row by row). An embedding
    table is read a row per token; dequantized whole it is 4 bytes a weight (933 MB for a
    151,936 x 1,536 vocabulary, where its Q4_K blocks are 131 MB)."""

    def __init__(self, kind: str, raw: npt.NDArray[np.uint8], shape: tuple[int, int]) -> None:
        """`raw`: [V, row bytes] of `kind` blocks, which must hold a [V, C] table (`shape`)."""
        size = ggml_quants.BLOCK_SIZE[kind]
        if raw.ndim != 2 or raw.shape[0] != shape[0] or shape[1] % size or \
                raw.shape[1] != shape[1] // size * ggml_quants.BLOCK_DTYPES[kind].itemsize:
            raise ValueError(f"{raw.shape[0]} rows of {raw.shape[-1]} bytes of {kind} blocks are not a "
                             f"{list(shape)} table")
        self.kind, self.raw = kind, raw
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(np.float32)  # what a lookup returns

    def __getitem__(self, ids: npt.ArrayLike) -> F32:  # [N] -> [N, C]
        rows = np.ascontiguousarray(self.raw[np.asarray(ids)])  # [N, row bytes]: a copy of N rows only
        n = rows.shape[0]
        out: F32 = ggml_quants.dequantize(self.kind, rows.reshape(-1), n * self.shape[1]).reshape(n, self.shape[1])
        return out

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def __repr__(self) -> str:
        return f"QuantizedRows({self.kind}, shape={self.shape}, {self.nbytes / 2**20:.1f} MiB)"


Embedding = F32 | QuantizedRows | None  # [V, C] rows; None: tied, the LM head's columns


@dataclass
class LlamaParams:
    """The whole model's parameters."""

    layers: list[LayerParams]
    embed_tokens: Embedding  # [V, C]
    norm: F32  # [C] the final RMSNorm
    lm_head: Matrix  # [C, V]
    context: int  # positions the rotary tables are good for (max_position_embeddings)
    rope_inv_freq: Floats  # [D/2] float64, the rotation's frequencies
    rope_local_inv_freq: Floats | None = None  # [D/2] those of the sliding-window layers' own rope base
    blocks: LlamaBlocks | None = field(default=None)  # every block in one C call, where it covers the model


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Floats:  # -> [D/2] float64
    inv_freq: Floats = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # "llama3" (transformers' _compute_llama3_parameters): stretch the long wavelengths by factor,
    # keep the short ones, interpolate between the two bands
    old = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    stretched = np.where(wavelen > old / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    medium = (wavelen >= old / scaling.high_freq_factor) & (wavelen <= old / scaling.low_freq_factor)
    out: Floats = np.where(medium, smoothed, stretched)
    return out


def local_rope_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer, whether it rotates by the second rope: Gemma 3's sliding-window layers."""
    return [cfg.rope_local_theta is not None and cfg.window(i) is not None for i in range(cfg.num_layers)]
