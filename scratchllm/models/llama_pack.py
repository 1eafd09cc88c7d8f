"""Packing a Llama-family checkpoint's tensors into the parameters its forward reads (models/llama.py).

How the weights are stored, for speed:
- Every matrix is a PackedWeight ([in, out], so a layer is `x @ w`): packed once into the panel
  layout of our GEMM kernel (scratchllm/kernels/packed_gemm.pyx). NumPy's `x @ w` would have
  OpenBLAS repack the weights on every call, which dominates a decode step of a few rows; the
  packed kernel streams each weight once per step and is 1.2-2.4x faster at 1-64 rows.
- Fused: q|k|v as one [C, q+2kv] matrix and gate|up as one [C, 2I]: two matmuls per block instead
  of five; at batch 1 the cost of one call (microseconds) is not negligible.
- dtype "quantized" (the default `auto` for a GGUF file's quantized matrices; dtypes.py) keeps
  the file's blocks of every type the kernels read (models/packed.py); "bfloat16" packs the
  matrices as bfloat16; "float32" as float32.
- Tied embeddings live once, as the [C, V] LM head; an embedding lookup reads its columns. An
  untied table a file stores in blocks stays in them (QuantizedRows): a lookup dequantizes the
  rows it reads.
Each role of a block is read under the name the architecture's description gives it
(models/architecture.py), so nothing here asks which architecture it packs.

Whether the fused C blocks (kernels/llama_blocks.pyx) run the model is decided here, once, from
its config and dtype (`check_fused_coverage`): where they do not, the load says why in one log
line and the forward runs `blocks_into`, the same arithmetic from Python.
The Hugging Face names stay available in `model.weights`, as [out, in] float32 arrays made from
the packed matrices when asked for (CheckpointView).
"""

import logging
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from scratchllm.formats.mapped import release_range
from scratchllm.kernels import packed_gemm
from scratchllm.kernels.llama_blocks import LlamaBlocks
from scratchllm.models import progress
from scratchllm.models.architecture import global_name, hf_name
from scratchllm.models.arena import PanelArena
from scratchllm.models.config import ModelConfig
from scratchllm.models.llama_params import (
    F32,
    Embedding,
    LayerParams,
    LlamaParams,
    QuantizedRows,
    local_rope_layers,
    rope_frequencies,
)
from scratchllm.models.packed import PackedWeight, QuantizedPart

if TYPE_CHECKING:  # for the annotations only: the loader hands the cache in
    from scratchllm.models.panel_cache import PanelCache, QuantizedPanels

logger = logging.getLogger(__name__)

LOAD_THREADS = min(2, os.cpu_count() or 1)


class FusedPathNotCovered(Exception):
    """The fused C blocks (kernels/llama_blocks.pyx) do not run this model: `blocks_into` does."""


def check_fused_coverage(cfg: ModelConfig, dtype: str) -> None:
    """Raise FusedPathNotCovered, saying why, for a model the fused C blocks do not run: they
    multiply float32 and quantized panels, not bfloat16 ones. Every piece of the family (q|k|v
    and o biases, QK-norm, sandwich norms, GeGLU, a second rope, windows, soft-caps) they run."""
    if dtype == "bfloat16":
        raise FusedPathNotCovered("its matrices are bfloat16")


_LOGGED: set[str] = set()  # the reasons said already: once per process, not once per load


def _fused_blocks(layers: list[LayerParams], cfg: ModelConfig, dtype: str) -> LlamaBlocks | None:
    """The fused blocks of the model where they cover it, else None (logged once per reason)."""
    try:
        check_fused_coverage(cfg, dtype)
    except FusedPathNotCovered as why:
        if str(why) not in _LOGGED:
            _LOGGED.add(str(why))
            logger.info("%s runs its blocks from Python (blocks_into), not in one C call: %s", cfg.model_type, why)
        return None
    return LlamaBlocks(layers, cfg, local_rope_layers(cfg))


class CheckpointView(Mapping[str, F32]):
    """The model's tensors under their Hugging Face names: norms as the arrays the model uses,
    matrices as [out, in] float32 copies unpacked from their PackedWeight on lookup, a table kept
    in blocks dequantized whole on lookup."""

    def __init__(self) -> None:
        self.arrays: dict[str, F32] = {}  # name -> array
        self.parts: dict[str, tuple[PackedWeight, slice]] = {}  # name -> (PackedWeight, slice of its out columns)
        self.tables: dict[str, QuantizedRows] = {}  # name -> a table kept in its file's blocks

    def __getitem__(self, name: str) -> F32:
        if name in self.arrays:
            return self.arrays[name]
        if name in self.tables:
            table = self.tables[name]
            return table[np.arange(table.shape[0])]
        packed, cols = self.parts[name]
        return np.ascontiguousarray(packed.numpy()[:, cols].T)

    def __iter__(self) -> Iterator[str]:
        yield from self.arrays
        yield from self.tables
        yield from self.parts

    def __len__(self) -> int:
        return len(self.arrays) + len(self.tables) + len(self.parts)

    def __contains__(self, name: object) -> bool:
        return name in self.arrays or name in self.tables or name in self.parts


def pack(cfg: ModelConfig, w: Mapping[str, npt.NDArray[Any]], dtype: str = "float32",
         panel_cache: "PanelCache | None" = None,
         activations: str = "float32") -> tuple[LlamaParams, CheckpointView]:
    """HF-named arrays -> (params for `llama`, a CheckpointView of them). Shapes are asserted.

    Every matrix becomes a PackedWeight [in, out], q|k|v and gate|up fused along `out`; see the
    module docstring for why. `panel_cache` (models/panel_cache.py): panels packed by an earlier
    load of the same file, and where this load's go."""
    return Packer(cfg, w, dtype, panel_cache, activations).pack()


class Packer:
    """One load's packing: a method per kind of tensor (embedding, norm, attention, MLP, LM head),
    each made of `matrix` and `vector`, which read the file's tensors under their HF names,
    assert their shapes and record them in the CheckpointView."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, npt.NDArray[Any]], dtype: str,
                 panel_cache: "PanelCache | None" = None, activations: str = "float32") -> None:
        self.cfg, self.w, self.dtype, self.panel_cache = cfg, w, dtype, panel_cache
        self.activations = activations  # of the quantized matrices (PackedWeight.activations)
        self.view = CheckpointView()
        self.arena = PanelArena()  # the panels of the file's blocks, in huge pages (see models/arena.py)

    def pack(self) -> tuple[LlamaParams, CheckpointView]:
        cfg = self.cfg
        # Packing runs in kernels and NumPy calls that release the GIL: two matrices at a time use
        # both cores of a small machine (load time is a goal). The LM head, the largest, goes first,
        # so that it overlaps the layers instead of following them.
        with ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
            head = pool.submit(self.head)
            layers: list[LayerParams] = []
            for layer in pool.map(self.layer, range(cfg.num_layers)):  # in order, as each is packed
                layers.append(layer)
                progress.report(progress.PACKING, len(layers), cfg.num_layers + 1)
            lm_head, embed_tokens = head.result()
            progress.report(progress.PACKING, cfg.num_layers + 1, cfg.num_layers + 1)
        params = LlamaParams(layers=layers, embed_tokens=embed_tokens, norm=self.norm(global_name("final_norm")),
                             lm_head=lm_head, context=cfg.max_position_embeddings, **self.rope())
        params.blocks = _fused_blocks(layers, cfg, self.dtype)
        if self.panel_cache is not None:
            self.panel_cache.save()  # writes only when this load packed something
        return params, self.view

    # --- the kinds of tensor ---------------------------------------------------------------------

    def head(self) -> tuple[PackedWeight, Embedding]:  # -> (lm_head [C, V], the embedding table [V, C] or None)
        V, C = self.cfg.vocab_size, self.cfg.hidden_size
        if self.cfg.tie_word_embeddings:
            # one copy serves both: the LM head multiplies by it as [C, V], the lookup reads its columns
            return self.matrix([global_name("embed")], [(V, C)]), None
        return self.matrix([global_name("lm_head")], [(V, C)]), self.embedding()

    def embedding(self) -> Embedding:
        """The untied table [V, C]: its file's blocks where it has them (rows dequantized when
        read), else float32 (a view of the file where it stores float32)."""
        name, shape = global_name("embed"), (self.cfg.vocab_size, self.cfg.hidden_size)
        rows = self.w.rows(name) if hasattr(self.w, "rows") and name in self.w else None
        if rows is None:
            return self.vector(name, shape)
        try:
            table = QuantizedRows(rows[0], rows[1], shape)
        except ValueError as err:
            raise ValueError(f"tensor {name!r}: {err}") from None
        self.view.tables[name] = table
        return table

    def rope(self) -> dict[str, Any]:
        # the rotary frequencies [D/2] float64 (and Gemma 3's of its sliding layers)
        cfg = self.cfg
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if global_name("rope_freqs") in self.w:  # Llama 3 GGUF: llama.cpp divides each frequency by its factor
            inv_freq = inv_freq / self.vector(global_name("rope_freqs"), (cfg.head_dim // 2,))
        local = None if cfg.rope_local_theta is None else rope_frequencies(cfg.head_dim, cfg.rope_local_theta)
        return {"rope_inv_freq": inv_freq, "rope_local_inv_freq": local}

    def norm(self, name: str, size: int | None = None) -> F32:  # an RMSNorm's weight [C] (or [D]: QK-norm)
        w = self.vector(name, (size or self.cfg.hidden_size,))
        if self.cfg.norm_weight_offset:  # Gemma's x * (1 + w), as the weight the kernel multiplies by
            w += np.float32(self.cfg.norm_weight_offset)
        return w

    def layer(self, i: int) -> LayerParams:  # -> params of block i, each role under its name
        cfg, arch, C = self.cfg, self.cfg.arch, self.cfg.hidden_size
        I, D = cfg.intermediate_size, cfg.head_dim
        qkv = ["qkv"] if arch.fused_projections else ["q", "k", "v"]
        qkv_rows = [cfg.q_size + 2 * cfg.kv_size] if arch.fused_projections else [cfg.q_size, cfg.kv_size, cfg.kv_size]
        gate_up = ["gate_up"] if arch.fused_projections else ["gate", "up"]
        gate_up_rows = [2 * I] if arch.fused_projections else [I, I]

        def name(role: str, kind: str = "weight") -> str:
            return hf_name(arch, i, role, kind)

        def norm(role: str, size: int = C) -> F32:
            return self.norm(name(role), size)

        return LayerParams(
            attn_norm=norm("attn_norm"),
            qkv=self.matrix([name(r) for r in qkv], [(rows, C) for rows in qkv_rows]),
            o=self.matrix([name("o")], [(C, cfg.q_size)]),
            mlp_norm=norm("mlp_norm"),
            gate_up=self.matrix([name(r) for r in gate_up], [(rows, C) for rows in gate_up_rows]),
            down=self.matrix([name("down")], [(C, I)]),
            qkv_bias=self.bias([name(r, "bias") for r in qkv], qkv_rows) if cfg.qkv_bias else None,
            o_bias=self.vector(name("o", "bias"), (C,)) if cfg.o_bias else None,
            q_norm=norm("q_norm", D) if arch.qk_norm else None,
            k_norm=norm("k_norm", D) if arch.qk_norm else None,
            attn_out_norm=norm("attn_out_norm") if arch.sandwich_norms else None,
            mlp_out_norm=norm("mlp_out_norm") if arch.sandwich_norms else None,
        )

    # --- how a tensor is read and stored ---------------------------------------------------------

    def bias(self, names: list[str], sizes: list[int]) -> F32:  # the biases of fused parts, one vector
        return np.concatenate([self.vector(n, (size,)) for n, size in zip(names, sizes, strict=True)])

    def tensor(self, name: str, shape: tuple[int, ...]) -> npt.NDArray[Any]:
        if name not in self.w:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        a = self.w[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
        return a

    def vector(self, name: str, shape: tuple[int, ...]) -> F32:  # a norm, a bias or the untied embedding table, float32
        a = self.tensor(name, shape)
        # Norms and biases (a few KiB each) are copied out of the file: a view would fault its
        # pages back in at every load's first forward, and each fault maps 64 KiB of neighbours
        # with it (the kernel's fault-around), 4 MB of RSS for 61 norms of the default model. The
        # untied embedding table stays a view: it is large and read a row at a time.
        a = np.array(a, dtype=np.float32) if len(shape) == 1 else np.ascontiguousarray(a, dtype=np.float32)
        self.view.arrays[name] = a
        return a

    def matrix(self, names: list[str], shapes: list[tuple[int, int]]) -> PackedWeight:
        """[out_i, in] each -> one PackedWeight [in, sum(out_i)], its parts recorded in the view."""
        packed = self.from_blocks(names, shapes)  # the fast path: the file's blocks, moved once
        if packed is None:
            parts = self.quantized(names, shapes)
            if parts is not None:
                packed = PackedWeight.from_quantized_rows(parts)
            else:  # "quantized" with a matrix the file stores unquantized: float32
                rows = [self.tensor(n, s) for n, s in zip(names, shapes, strict=True)]
                packed = PackedWeight.from_rows(rows, "float32" if self.dtype == "quantized" else self.dtype)
        if packed.dtype == "quantized":
            packed.activations = self.activations
        col = 0
        for name, shape in zip(names, shapes, strict=True):
            self.view.parts[name] = (packed, slice(col, col + shape[0]))
            col += shape[0]
        return packed

    def quantized(self, names: list[str], shapes: list[tuple[int, int]]) -> list[QuantizedPart] | None:
        # the file's quantized blocks of every part, or None
        w = self.w
        if self.dtype != "quantized" or not hasattr(w, "quantized"):
            return None
        parts: list[QuantizedPart] = []
        for name, shape in zip(names, shapes, strict=True):
            part = w.quantized(name) if name in w else None
            if part is None:
                return None
            if part[0].shape != shape:
                raise ValueError(f"tensor {name!r} has shape {part[0].shape}, expected {shape}")
            parts.append(part)
        return parts

    def from_blocks(self, names: list[str], shapes: list[tuple[int, int]]) -> PackedWeight | None:
        # the file's blocks moved into panels, or None
        w, cache = self.w, self.panel_cache
        if self.dtype != "quantized" or not hasattr(w, "blocks") or any(n not in w for n in names):
            return None
        parts = [w.blocks(n) for n in names]
        if any(p is None for p in parts):
            return None
        for name, shape, (kind, raw, _) in zip(names, shapes, parts, strict=True):
            if shape[1] % 32 or raw.shape != (shape[0], packed_gemm.row_bytes(kind, shape[1])):
                raise ValueError(f"tensor {name!r} has {raw.shape[0]} rows of {raw.shape[1]} bytes of {kind} "
                                 f"blocks, expected shape {shape}")
        shape = (shapes[0][1], sum(s[0] for s in shapes))
        rows = (shape[0] if parts[0][0] == "Q8_0" else shape[0] // 2)  # the first part's: Q8_0 a byte a k
        panel_shape = (-(-shape[1] // packed_gemm.NR), rows, packed_gemm.NR)
        cached = cache.get("|".join(names), panel_shape) if cache is not None else None
        if cached is not None:
            return PackedWeight.from_panels(cached, shape)
        # the file's pages of each run of rows go once it is packed: not resident beside the panels
        packed = PackedWeight.from_blocks(parts, shape, self.arena.zeros, release=release_range)
        if packed is not None and cache is not None:
            cache.put("|".join(names), cast("QuantizedPanels", packed.panels))  # pack_blocks' kinds
        return packed
