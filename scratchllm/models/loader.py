"""load_model(ref): a checkpoint (GGUF, safetensors, pytorch_model.bin, folder) -> a runnable model.

The architecture comes from config.json "architectures" (Hugging Face folders) or GGUF metadata
"general.architecture", and its description (models/architectures.py) says the rest. Every model
sees Hugging Face tensor names: GGUF names are mapped here by the description's `names`, and
llama.cpp's reordering of the q/k rows is undone where it says so (see `unpermute_rotary`).
Loading fails loudly on a missing, extra or mis-shaped tensor, and on a config field that names a
piece no forward builds.
"""

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from scratchllm.dtypes import DTYPES, storage
from scratchllm.errors import ConfigError, FormatError
from scratchllm.formats import Checkpoint, load_checkpoint
from scratchllm.formats import ggml_quants as gq
from scratchllm.formats.checkpoint import TensorInfo
from scratchllm.formats.mapped import release_pages
from scratchllm.formats.refs import resolve_model
from scratchllm.kernels import packed_gemm
from scratchllm.models import architecture, panel_cache, panel_cache_files
from scratchllm.models.bert import BertModel
from scratchllm.models.config import ModelConfig, NotBuilt, from_gguf_metadata, from_hf_config
from scratchllm.models.gpt2 import GPT2Model
from scratchllm.models.heap import release_free_heap
from scratchllm.models.llama import LlamaModel
from scratchllm.models.packed import QuantizedPart

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=np.generic)
FamilyModel = LlamaModel | GPT2Model | BertModel  # what load_model returns: one per family
Weights = Mapping[str, npt.NDArray[Any]]  # a checkpoint's tensors under Hugging Face names
# (type name, raw uint8 [rows, row bytes], row order or None): a GGUF tensor's blocks (GGUFAsHF.blocks)
Blocks = tuple[str, npt.NDArray[np.uint8], npt.NDArray[np.integer[Any]] | None]

FAMILIES: dict[str, type[FamilyModel]] = {"llama": LlamaModel, "gpt2": GPT2Model, "bert": BertModel}

# Tensors a checkpoint may carry that the forward pass never needs: buffers older transformers
# saved, task heads and poolers we do not run, a stored copy of a tied LM head.
IGNORABLE = re.compile(
    r"(.*rotary_emb\.inv_freq|.*attn\.(masked_)?bias|.*embeddings\.position_ids|(bert\.)?pooler\..*|cls\..*|lm_head\.weight)$"
)

def unpermute_rotary(w: npt.NDArray[S], n_head: int) -> npt.NDArray[S]:  # [n_head * D, ...] -> [n_head * D, ...]
    """Undo llama.cpp's q/k row permutation.

    Hugging Face Llama rotates the pair (x_i, x_{i + D/2}) of each head ("rotate half"); ggml's
    default rope rotates adjacent pairs (x_{2i}, x_{2i+1}). So convert_hf_to_gguf.py reorders each
    head's D output rows from [2, D/2] to [D/2, 2] (pair members side by side), which makes the
    two rotations the same computation. We rotate the HF way, so we put the rows back:
    view the rows as [n_head, D/2, 2] and swap the last two axes to [n_head, 2, D/2].
    (Qwen2 files use the "neox" rope = rotate half, and are stored unpermuted.)
    """
    rows = w.shape[0]
    assert rows % (2 * n_head) == 0, "rows must split into heads of even size"
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


PLAIN_VECTORS = {"F32": np.float32, "F16": np.float16}  # GGUF types of norms and biases


def _read_vector(info: TensorInfo) -> npt.NDArray[Any]:
    """A 1-D tensor (a norm's weight, a bias) read from its file, not through the mapping: a read
    of a few KB through the mapping maps the whole page-cache folio around it (up to 2 MiB of the
    neighbouring matrices), which on a load whose panels come from the cache added about 50 MB to
    Gemma 3 270M's peak (18 layers of norms), pages of matrices nobody reads."""
    dtype = np.dtype(PLAIN_VECTORS[info.dtype]).newbyteorder("<")
    with open(info.file, "rb") as f:
        data = os.pread(f.fileno(), info.nbytes, info.offset)
    if len(data) != info.nbytes:
        raise ValueError(f"tensor {info.name!r}: the file ends inside its bytes")
    return np.frombuffer(bytearray(data), dtype=dtype)


class GGUFAsHF(Mapping[str, npt.NDArray[Any]]):
    """A GGUF checkpoint seen through Hugging Face names; q/k rows unpermuted on lookup (Llama only)."""

    def __init__(self, ckpt: Checkpoint, config: ModelConfig) -> None:
        self.ckpt, self.config = ckpt, config
        arch = config.arch
        to_hf = architecture.gguf_to_hf_names(arch, config.num_layers, config.qkv_bias, config.o_bias)
        self.names: dict[str, str] = {}  # Hugging Face name -> the file's name
        for name in ckpt:
            if name not in to_hf:
                raise FormatError(ckpt.path, f"tensor '{name}' has no place in a {config.model_type} model")
            self.names[to_hf[name]] = name
        # llama.cpp's converter reordered these rows for its rope (unpermute_rotary): name -> heads
        self.permuted: dict[str, int] = {}
        if arch.gguf_permuted_rope_rows:
            for layer in range(config.num_layers):
                for role, heads in (("q", config.num_heads), ("k", config.num_kv_heads)):
                    for kind in ("weight", "bias"):
                        self.permuted[architecture.hf_name(arch, layer, role, kind)] = heads

    def __getitem__(self, hf_name: str) -> npt.NDArray[Any]:
        name = self.names[hf_name]
        info = self.ckpt.tensor_info(name)
        if len(info.shape) == 1 and info.dtype in PLAIN_VECTORS:
            return self._unpermute(hf_name, _read_vector(info))
        return self._unpermute(hf_name, self.ckpt[name])

    def _unpermute(self, hf_name: str, a: npt.NDArray[S]) -> npt.NDArray[S]:
        heads = self.permuted.get(hf_name)
        return a if heads is None else unpermute_rotary(a, heads)

    def quantized(self, hf_name: str) -> QuantizedPart | None:
        """(q, d, m) of a 2-D tensor of a type the quantized kernels keep (ggml_quants.KERNEL_TYPES),
        value = d * q + m exactly as the dequantized tensor: Q4_0 / Q4_1 as 4-bit values (q uint8
        0..15, d and m float16; ggml_quants.as_q4), the others (Q8_0, Q5_0, Q5_1, Q4_K, Q5_K,
        IQ4_NL, IQ4_XS) as q int8 with float32 d and m (ggml_quants.as_q8); None for any other
        type (the model dequantizes those to float32)."""
        info = self.ckpt.tensor_info(self.names[hf_name])
        if info.dtype not in gq.KERNEL_TYPES or len(info.shape) != 2:
            return None
        four = gq.as_q4(info.dtype, self.ckpt.raw(info.name), info.shape) if info.dtype in ("Q4_0", "Q4_1") else None
        q, d, m = four or gq.as_q8(info.dtype, self.ckpt.raw(info.name), info.shape)
        # whole rows move: blocks stay intact
        return self._unpermute(hf_name, q), self._unpermute(hf_name, d), self._unpermute(hf_name, m)

    def blocks(self, hf_name: str) -> Blocks | None:
        """(type name, raw uint8 [rows, row bytes], row order or None) of a 2-D tensor of a type
        with panels of its own (packed_gemm.PANEL_TYPES: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K): its blocks
        as the file stores them (a view of the mapped file, nothing read yet), and for q/k rows
        the order that undoes llama.cpp's permutation (output row i is stored row order[i]); None
        for any other type. What packed_gemm.pack_blocks takes."""
        info = self.ckpt.tensor_info(self.names[hf_name])
        if info.dtype not in packed_gemm.PANEL_TYPES or len(info.shape) != 2:
            return None
        rows = info.shape[0]
        raw = self.ckpt.raw(info.name).reshape(rows, -1)
        order = self._unpermute(hf_name, np.arange(rows))
        return info.dtype, raw, None if np.array_equal(order, np.arange(rows)) else order

    def rows(self, hf_name: str) -> tuple[str, npt.NDArray[np.uint8]] | None:
        """(type name, raw uint8 [rows, row bytes]) of a 2-D tensor stored in blocks of any
        quantized type, rows in their order (a view of the mapped file, nothing read yet): what
        a table read a row at a time keeps (models/llama_params.QuantizedRows); None for a
        tensor of a plain type or with permuted rows."""
        info = self.ckpt.tensor_info(self.names[hf_name])
        if info.dtype not in gq.BLOCK_DTYPES or len(info.shape) != 2 or hf_name in self.permuted:
            return None
        return info.dtype, self.ckpt.raw(info.name).reshape(info.shape[0], -1)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, hf_name: object) -> bool:  # Mapping's default would read (dequantize) the tensor to answer
        return hf_name in self.names


class _Recorder(Mapping[str, npt.NDArray[Any]]):
    """Remembers which tensors the model read, so that leftovers can be reported."""

    def __init__(self, inner: Weights) -> None:
        self.inner = inner
        self.read: set[str] = set()
        self.names = set(inner)  # membership from the table of contents, never by reading a tensor

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        value = self.inner[name]
        self.read.add(name)
        return value

    def quantized(self, name: str) -> QuantizedPart | None:
        """The inner checkpoint's quantized form of `name` (GGUF only), or None."""
        value: QuantizedPart | None = self.inner.quantized(name) if hasattr(self.inner, "quantized") else None
        if value is not None:
            self.read.add(name)
        return value

    def blocks(self, name: str) -> Blocks | None:
        """The inner checkpoint's raw blocks of `name` (GGUF only; see GGUFAsHF.blocks), or None."""
        value: Blocks | None = self.inner.blocks(name) if hasattr(self.inner, "blocks") else None
        if value is not None:
            self.read.add(name)
        return value

    def rows(self, name: str) -> tuple[str, npt.NDArray[np.uint8]] | None:
        """The inner checkpoint's blocks of a table read by rows (GGUF only; see GGUFAsHF.rows), or None."""
        value: tuple[str, npt.NDArray[np.uint8]] | None = self.inner.rows(name) if hasattr(self.inner, "rows") else None
        if value is not None:
            self.read.add(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, name: object) -> bool:
        return name in self.names


def read_config(path: Path, ckpt: Checkpoint) -> ModelConfig:
    """The checkpoint's ModelConfig. A field that names a piece no forward builds (config.NotBuilt)
    is the file's FormatError, naming the field."""
    if ckpt.format == "gguf":
        names = set(ckpt)
        try:
            return from_gguf_metadata(ckpt.metadata, "output.weight" in names, "blk.0.attn_q.bias" in names,
                                      "rope_freqs.weight" in names)
        except NotBuilt as err:
            raise FormatError(ckpt.path, str(err)) from None
    folder = path if path.is_dir() else path.parent
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{path}: no config.json beside the weights, so the architecture is unknown")
    try:
        return from_hf_config(json.loads(config_file.read_text(encoding="utf-8")))
    except NotBuilt as err:
        raise FormatError(config_file, str(err)) from None
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{config_file}: not a usable model config ({err!r})") from None


def _has_quantized_blocks(ckpt: Checkpoint) -> bool:
    """True when a GGUF file has tensors of a type the quantized kernels keep (ggml_quants.KERNEL_TYPES)."""
    return ckpt.format == "gguf" and any(i.dtype in gq.KERNEL_TYPES for i in ckpt.infos.values())


def check_tensor_types(ckpt: Checkpoint) -> None:
    """Refuse, before anything is read, a GGUF tensor of a type we cannot decode."""
    if ckpt.format != "gguf":
        return
    for info in ckpt.infos.values():
        if info.dtype not in gq.SUPPORTED:
            raise FormatError(ckpt.path, f"tensor '{info.name}' is {info.dtype}, a GGML type we do not read; "
                                         f"supported: {', '.join(sorted(gq.SUPPORTED))}")


def log_float32_matrices(model: FamilyModel, weights: GGUFAsHF, ckpt: Checkpoint) -> None:
    """One line saying which quantized matrices of a "quantized" model run in float32 (a K-quant
    fused with a type that has no panels of its own) and what it costs."""
    parts = getattr(getattr(model, "weights", None), "parts", {})
    names, f32_bytes, file_bytes, seen = [], 0, 0, set()
    for hf_name, (packed, _) in parts.items():
        info = ckpt.tensor_info(weights.names[hf_name]) if hf_name in weights.names else None
        if packed.dtype != "float32" or info is None or info.dtype not in gq.BLOCK_DTYPES:
            continue
        names.append((info.offset, f"{info.name} ({info.dtype})"))
        file_bytes += info.nbytes
        if id(packed) not in seen:
            seen.add(id(packed))
            f32_bytes += packed.nbytes
    if names:
        logger.info("dtype quantized: %d matrices dequantized to float32 (no exact quantized kernel for their "
                    "blocks, or fused with such a part), %.1f MiB in memory for %.1f MiB in the file: %s",
                    len(names), f32_bytes / 2**20, file_bytes / 2**20, ", ".join(n for _, n in sorted(names)))


# "auto" rounds x to 8 bits (dtype "int8") for models of at least this many parameters, to 16
# bits ("int16") below. Measured with `scratchllm bench accuracy` against the dequantized float32
# model (docs/kernels.md): on Qwen2.5-Coder 0.5B and 1.5B, int8's logits are closer to float32's
# than llama.cpp's on every count (largest difference, argmax, greedy agreement); on SmolLM2-135M
# and Gemma 3 270M they are further on some prompts' greedy agreement, so those keep int16.
# int8 halves the products' arithmetic: at 1.5B, 1.4x int16's prefill and 16-sequence throughput.
INT8_MIN_PARAMETERS = 400_000_000


def parameter_count(ckpt: Checkpoint) -> int:
    """Elements of every tensor in the checkpoint (the model's parameters)."""
    return sum(info.numel for info in ckpt.infos.values())


def auto_dtype(ckpt: Checkpoint, config: ModelConfig) -> str:
    """What dtype "auto" means for this checkpoint: its own quantized blocks where the model can
    compute on them (Llama family, GGUF tensors of ggml_quants.KERNEL_TYPES), else float32. The
    blocks are multiplied by activations rounded to integers where this build has a dot-product
    instruction (AVX512-VNNI, AVX-VNNI), with which that beats the exact "quantized" products at
    every batch size measured: to 8 bits ("int8", as llama.cpp does) for models of
    INT8_MIN_PARAMETERS or more, where that was measured no further from float32's logits than
    llama.cpp's, to 16 bits ("int16": within about 1e-3 of the exact logits) for smaller ones.
    Without such an instruction (AVX2), the integer products are faster at decode but slower at
    prefill, and auto keeps the exact path (docs/kernels.md)."""
    if config.family != "llama" or not _has_quantized_blocks(ckpt):
        return "float32"
    if not packed_gemm.INT_DOT_INSTRUCTION:
        return "quantized"
    return "int8" if parameter_count(ckpt) >= INT8_MIN_PARAMETERS else "int16"


def load_model(ref: str | Path = "default", dtype: str = "auto", checkpoint: Checkpoint | None = None) -> FamilyModel:
    """`default`, `minilm`, a .gguf / .safetensors / pytorch_model.bin file or a model folder.

    `dtype`: how the weight matrices are stored and multiplied. "auto" (default) is, for a
    Llama-family GGUF file that has quantized matrices, "int8" (0.4B parameters or more) or
    "int16" (smaller models) where the build has VNNI dot products and "quantized" elsewhere
    (auto_dtype), and "float32" otherwise. "float32" computes
    what the reference computes; "bfloat16" (Llama family) halves the weight bytes and runs the
    matmuls on AVX512-BF16, at the price of logits that differ in the third digit; "quantized"
    (Llama family, GGUF files) keeps the file's quantized matrices in memory (Q4_0 / Q4_1 as 4 bits
    per weight, Q4_K, Q5_K and Q6_K at about the file's bits, Q8_0, Q5_0, Q5_1, IQ4_NL, IQ4_XS as
    one int8 per weight with a scale and offset per 32) and dequantizes them inside the GEMM
    exactly as the float32 path does: the same logits, bit for bit, from a third of the bytes or
    less; Q3_K and Q2_K in 4-bit words. Matrices the file stores unquantized, or that fuse a
    K-quant with a 32-wide type, are float32 (dequantized once
    at load; logged). "int16" and "int8" store them as "quantized" does and
    multiply them by activations rounded to integers per 32 values with integer dot products:
    faster, with logits close to float32's but not equal (scratchllm/bench/accuracy.py measures
    how close): "int8" rounds x to 8 bits, as llama.cpp does; "int16" to 16, in two 8-bit levels.

    `checkpoint`: `ref` already opened with formats.load_checkpoint, for a caller that reads
    the same file's tokenizer too (the header is then parsed once)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = resolve_model(ref)
    if checkpoint is not None and Path(checkpoint.path) != path:
        raise ConfigError(f"load_model({str(ref)!r}) was handed the checkpoint of {checkpoint.path}, another file")
    ckpt = checkpoint if checkpoint is not None else load_checkpoint(path)
    check_tensor_types(ckpt)
    config = read_config(path, ckpt)
    if dtype == "auto":
        dtype = auto_dtype(ckpt, config)
        logger.info("dtype auto: %s runs as %s", path, dtype)
    if dtype != "float32" and config.family != "llama":
        raise ConfigError(f"dtype {dtype} is implemented for the Llama family; {config.model_type} runs in float32")
    stored, activations = storage(dtype)
    if stored == "quantized" and not _has_quantized_blocks(ckpt):
        raise ConfigError(f"dtype {dtype} keeps a GGUF file's {' / '.join(sorted(gq.KERNEL_TYPES))} matrices "
                          f"quantized; {path} has none (use float32 or bfloat16)")
    weights = _Recorder(GGUFAsHF(ckpt, config) if ckpt.format == "gguf" else ckpt)
    try:
        options: dict[str, Any] = {"dtype": stored, "activations": activations} if config.family == "llama" else {}
        if config.family == "llama" and stored == "quantized" and ckpt.format == "gguf" and panel_cache.enabled():
            shards = [f for f in ckpt.files if Path(f) != Path(ckpt.path)]  # a split GGUF's later shards
            options["panel_cache"] = panel_cache.PanelCache(ckpt.path, shards=shards)
        model = FAMILIES[config.family](config, weights, **options)
    except (KeyError, ValueError) as err:
        raise FormatError(ckpt.path, str(err.args[0])) from None
    extra = sorted(n for n in weights if n not in weights.read and not IGNORABLE.fullmatch(n))
    if extra:
        raise FormatError(ckpt.path, f"{len(extra)} tensors the {config.model_type} model does not use: "
                                     + ", ".join(extra[:5]))
    if ckpt.format == "gguf" and stored == "quantized":
        assert isinstance(weights.inner, GGUFAsHF), "a GGUF file is read through GGUFAsHF"
        log_float32_matrices(model, weights.inner, ckpt)
        # every matrix now lives in panels and every norm in a copy (models/llama_pack.py): the
        # forward reads nothing of the file but the rows of an untied embedding table, a page at a time
        for name in {info.file: name for name, info in ckpt.infos.items()}.values():
            release_pages(ckpt.raw(name))  # one tensor of each file (each shard of a split GGUF) names its mapping
    cache = options.get("panel_cache")
    if cache is not None and cache.fresh:  # this load wrote the cache: the folder kept in bounds
        panel_cache_files.after_write(cache)
    model.panels_from_cache = bool(cache is not None and cache.hits and not cache.fresh)  # packed by an earlier load
    model.path = str(path)
    model.format = ckpt.format
    model.dtype = dtype  # what "auto" resolved to, for every family (Llama sets it too)
    release_free_heap()  # the loader's temporaries, freed in the middle of the heap (models/heap.py)
    return model
