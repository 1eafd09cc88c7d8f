"""The Llama family forward pass (Llama 2/3, SmolLM, Mistral, Qwen2/3, Phi-3, Gemma 2/3), in paper order.

    x = embed[ids] (* sqrt(C): Gemma)
    for each block:  x += post_norm?( o( attention( rope(q_norm?(q(rms_norm(x)))), rope(k_norm?(k(...))), v(...) ) ) )
                     x += post_norm?( down( act(gate(rms_norm(x))) * up(rms_norm(x)) ) )
    logits = softcap?( rms_norm(x) @ lm_head.T )

The variations are ModelConfig's named fields, each one small piece here: QK-norm (Qwen3, Gemma 3:
`head_norm_`), the sublayers' output norms (Gemma 2/3: `post_norms`), GeGLU (Gemma: `gated_act`),
the embedding scale and the final soft-capping (Gemma), Gemma 3's second rope base for the
sliding-window layers (`layer_angles`), rope scaling (`rope_frequencies`). Which keys a query
sees, the softmax scale and the scores' soft-capping are the attention object's (ModelConfig's
layer_windows / softmax_scale / attn_softcap; models/attention.py).

`block` says it in those words, one expression per step; `blocks_into` runs the same float
operations in the same order (the same logits, bit for bit) with every intermediate written into
the step's preallocated buffers (scratchllm/models/workspace.py) and each residual add fused into
the RMSNorm after it. The model runs the second; the first is its definition and its test.

How the weights are stored, for speed (`pack`):
- Every matrix is a PackedWeight ([in, out], so a layer is `x @ w`): packed once into the panel
  layout of our GEMM kernel (scratchllm/kernels/packed_gemm.pyx). NumPy's `x @ w` would have
  OpenBLAS repack the weights on every call, which dominates a decode step of a few rows; the
  packed kernel streams each weight once per step and is 1.2-2.4x faster at 1-64 rows.
- Fused: q|k|v as one [C, q+2kv] matrix and gate|up as one [C, 2I]: two matmuls per block instead
  of five; at batch 1 the cost of one call (microseconds) is not negligible.
- Tied embeddings live once, as the [C, V] LM head; an embedding lookup reads its columns.
- dtype "bfloat16" (opt-in) packs the matrices as bfloat16, "quantized" (opt-in, GGUF) keeps the
  file's Q8_0 / Q4_0 / Q4_1 blocks: see scratchllm/models/packed.py.
The Hugging Face names stay available in `model.weights`, as [out, in] float32 arrays made from
the packed matrices when asked for (CheckpointView).
"""

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from scratchllm.formats.mapped import release_range
from scratchllm.kernels import packed_gemm, pointwise
from scratchllm.kernels.llama_blocks import LlamaBlocks
from scratchllm.models import progress
from scratchllm.models.arena import PanelArena
from scratchllm.models.array import array_module
from scratchllm.models.config import ModelConfig, RopeScaling
from scratchllm.models.packed import DTYPES, PackedWeight, QuantizedPart
from scratchllm.models.protocol import Attention, Ints, Logits
from scratchllm.models.threads import single_blas_thread
from scratchllm.models.workspace import StepBuffers, Workspace

if TYPE_CHECKING:  # for the annotations only: the loader hands the cache in
    from scratchllm.models.panel_cache import PanelCache, QuantizedPanels

LOAD_THREADS = min(2, os.cpu_count() or 1)

Floats = npt.NDArray[np.floating[Any]]
F32 = npt.NDArray[np.float32]
Matrix = PackedWeight | F32  # a layer's [in, out] weight: packed (as `pack` stores them) or a plain array
Layer = dict[str, PackedWeight | F32]  # one block's params, by the names `block` reads (Packer.layer)
Angles = tuple[F32, F32]  # cos, sin [N, D/2] of one layer's rotation


class AttentionInto(Protocol):
    """An Attention that writes its output into a buffer the model passes (it has ``accepts_out =
    True``: the engine's PagedAttention, PagedSequence)."""

    def __call__(self, layer: int, q: Floats, k: Floats, v: Floats, out: F32 | None = None) -> F32: ...


# NumPy arrays take the fused C kernels of scratchllm/kernels/pointwise.pyx (one pass each, no
# temporaries); the NumPy lines are what those compute, and what other array modules run.


def rms_norm(x: Floats, w: F32, eps: float) -> Floats:  # [N, C], [C] -> [N, C]
    if isinstance(x, np.ndarray):
        return pointwise.rms_norm(np.ascontiguousarray(x), w, eps)
    xp = array_module(x)
    ms = xp.einsum("nc,nc->n", x, x)[:, None] * (1.0 / x.shape[-1])  # mean of squares, [N, 1]
    ms += eps
    y: Floats = x * (1.0 / xp.sqrt(ms, out=ms)) * w
    return y


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


def rope_angles(positions: npt.ArrayLike, inv_freq: Floats) -> Angles:  # [N] ints, [D/2] -> cos, sin [N, D/2] float32
    """Angles pos * theta^(-2i/D), computed in float64 (exact at long positions), rounded to float32."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_tables(head_dim: int, theta: float, max_pos: int) -> Angles:  # -> cos, sin [max_pos, D/2] float32
    """rope_angles of every position 0..max_pos-1: the same floats, tabulated."""
    return rope_angles(np.arange(max_pos), rope_frequencies(head_dim, theta))


def rope(x: Floats, cos: F32, sin: F32) -> Floats:  # [N, h, D], [N, D/2], [N, D/2] -> [N, h, D]
    """Rotate pairs (x_i, x_{i+D/2}) by the position's angle: the "rotate half" layout of HF Llama
    (GGUF files store q/k rows permuted for llama.cpp's adjacent-pair layout; the loader undoes it)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out: Floats = array_module(x).empty_like(x)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s
    return out


def rope_(qkv: Floats, heads: int, cos: F32, sin: F32) -> None:  # [N, h, D]: rotate heads 0..heads-1 in place
    if isinstance(qkv, np.ndarray) and qkv.flags.c_contiguous:
        pointwise.rope_(qkv, heads, cos, sin)
    else:
        qkv[:, :heads] = rope(qkv[:, :heads], cos, sin)


def linear(x: Floats, w: Matrix, b: F32 | None = None) -> Floats:  # [N, in], [in, out], [out] -> [N, out]
    y = x @ w
    if b is not None:
        y += b
    return y


def swiglu(x: Floats, gate_up: Matrix, down: Matrix) -> Floats:  # [N, C], [C, 2I], [I, C] -> [N, C]
    return gated_act(x @ gate_up, "silu") @ down


def gelu_tanh(x: Floats) -> Floats:  # [...] -> [...]   Gemma's gelu_pytorch_tanh
    y: Floats = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    return y


def gated_act(gu: Floats, act: str, out: Floats | None = None) -> Floats:  # [N, 2I] -> [N, I]
    """act(gate) * up: SwiGLU ("silu") or GeGLU ("gelu_tanh", Gemma), the fused kernels on NumPy arrays."""
    if isinstance(gu, np.ndarray) and gu.dtype == np.float32 and gu.flags.c_contiguous:
        kernel = pointwise.silu_mul if act == "silu" else pointwise.gelu_tanh_mul
        return kernel(gu) if out is None else kernel(gu, out=out)
    I = gu.shape[1] // 2
    y = gelu_tanh(gu[:, :I]) * gu[:, I:] if act == "gelu_tanh" else swiglu_act(gu)
    if out is None:
        return y
    out[...] = y
    return out


def swiglu_act(gu: Floats) -> Floats:  # [N, 2I] -> [N, I]   silu(gate) * up for any array module
    I = gu.shape[1] // 2
    g, u = gu[:, :I], gu[:, I:]
    # silu(g) = g * sigmoid(g), sigmoid(g) = (1 + tanh(g/2)) / 2: tanh cannot overflow the way
    # exp(-g) does for large negative g (which would raise a RuntimeWarning), and stays in place
    xp = array_module(gu)
    t = g * 0.5
    xp.tanh(t, out=t)
    t += 1.0
    t *= 0.5
    t *= g
    t *= u
    out: Floats = t
    return out


def head_norm_(qkv: Floats, p: Mapping[str, Any], H: int, KVH: int, eps: float) -> None:
    """QK-norm (Qwen3, Gemma 3), in place: an RMSNorm over each head of q and of k, [N, H + 2 KVH, D]."""
    N, _, D = qkv.shape
    for heads, w in ((slice(0, H), p["q_norm"]), (slice(H, H + KVH), p["k_norm"])):
        part = np.ascontiguousarray(qkv[:, heads])
        qkv[:, heads] = rms_norm(part.reshape(-1, D), w, eps).reshape(part.shape)


def attention_block(x: Floats, layer: int, p: Mapping[str, Any], cfg: ModelConfig, cos: F32, sin: F32,
                    attention: Attention) -> Floats:  # [N, C] -> [N, C]
    N = x.shape[0]
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = linear(x, p["qkv_proj"], p.get("qkv_bias")).reshape(N, H + 2 * KVH, D)
    if cfg.qk_norm:
        head_norm_(qkv, p, H, KVH, cfg.norm_eps)
    rope_(qkv, H + KVH, cos, sin)  # q and k rotate together, in place: one pass instead of two
    q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]
    out = attention(layer, q, k, v)  # [N, H, D]
    return linear(out.reshape(N, H * D), p["o_proj"], p.get("o_bias"))


def post_norm(y: Floats, w: F32 | None, eps: float) -> Floats:
    # [N, C] -> [N, C]: Gemma's norm of a sublayer's output (None: none)
    return y if w is None else rms_norm(y, w, eps)


def block(x: Floats, layer: int, p: Mapping[str, Any], cfg: ModelConfig, cos: F32, sin: F32,
          attention: Attention) -> Floats:  # [N, C] -> [N, C]
    eps = cfg.norm_eps
    x = x + post_norm(attention_block(rms_norm(x, p["input_layernorm"], eps), layer, p, cfg, cos, sin, attention),
                      p.get("attn_out_norm"), eps)
    h = rms_norm(x, p["post_attention_layernorm"], eps)  # the MLP's input norm, under Llama's name
    x += post_norm(gated_act(h @ p["gate_up_proj"], cfg.hidden_act) @ p["down_proj"], p.get("mlp_out_norm"), eps)
    return x


def linear_into(x: F32, w: Matrix, b: F32 | None, out: F32) -> F32:  # [N, in], [in, out], [out] or None, [N, out]
    if isinstance(w, PackedWeight):  # straight to the kernel: no __rmatmul__ dispatch, no new array
        w.matmul_into(x, out)
    else:
        np.matmul(x, w, out=out)
    if b is not None:
        out += b
    return out


def blocks_into(x: F32, params: Mapping[str, Any], cfg: ModelConfig, angles: Sequence[Angles], attention: Attention,
                buf: StepBuffers) -> F32:  # [N, C], in place
    """Every `block` over x, the residual stream, updated in place; the intermediates live in buf.
    The order of float operations is block's: `x = x + attn; h = rms_norm(x)` is add_rms_norm,
    and the MLP's `x += mlp` waits in buf.delta to be added by the next layer's first norm.
    `angles[layer]`: the (cos, sin) of its rotation (layer_angles)."""
    assert x.dtype == np.float32 and x.flags.c_contiguous and x.shape[0] == buf.rows
    N, eps = x.shape[0], cfg.norm_eps
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    into = getattr(attention, "accepts_out", False)  # the paged attention writes into buf.attn
    attention_into = cast(AttentionInto, attention)  # the same object, as what `into` says it is
    pending = False  # buf.delta holds the last sublayer's output, not yet added into x
    for layer, p in enumerate(params["layers"]):
        if pending:
            pointwise.add_rms_norm(x, buf.delta, p["input_layernorm"], eps, buf.h)
        else:
            pointwise.rms_norm(x, p["input_layernorm"], eps, out=buf.h)
        linear_into(buf.h, p["qkv_proj"], p.get("qkv_bias"), buf.qkv_rows)
        if cfg.qk_norm:
            head_norm_(buf.qkv, p, H, KVH, eps)
        cos, sin = angles[layer]
        pointwise.rope_(buf.qkv, H + KVH, cos, sin)
        if into:
            attention_into(layer, buf.q, buf.k, buf.v, out=buf.attn)
            out = buf.attn_rows
        else:  # any other cache object: its own array
            out = attention(layer, buf.q, buf.k, buf.v).reshape(N, H * D)
        linear_into(out, p["o_proj"], p.get("o_bias"), buf.delta)
        if p.get("attn_out_norm") is not None:
            buf.delta[...] = rms_norm(buf.delta, p["attn_out_norm"], eps)
        pointwise.add_rms_norm(x, buf.delta, p["post_attention_layernorm"], eps, buf.h)
        linear_into(buf.h, p["gate_up_proj"], None, buf.gate_up)
        gated_act(buf.gate_up, cfg.hidden_act, out=buf.act)
        linear_into(buf.act, p["down_proj"], None, buf.delta)
        if p.get("mlp_out_norm") is not None:
            buf.delta[...] = rms_norm(buf.delta, p["mlp_out_norm"], eps)
        pending = True
    if pending:
        x += buf.delta
    return x


def fused_blocks(x: F32, blocks: LlamaBlocks, angles: tuple[Angles, Angles | None], attention: Any,
                 buf: StepBuffers, out_rows: npt.NDArray[np.int32] | None = None) -> None:
    """blocks_into's arithmetic in one C call (kernels/llama_blocks.pyx): the same bits, without
    Python between the kernels. `angles`: the rotation of the rope and of the second rope (Gemma
    3's sliding-window layers; None without one). `attention` is the engine's paged attention (or
    a sequence of its own, engine/paged_attention.PagedSequence): `paged_step(n)` lays out this
    step's n tokens and yields the PagedAttention that holds the pools, the windows and the
    soft-cap. (Typed Any: that class lives in the engine, a layer above this one.) `out_rows`: the
    rows that get logits (strictly increasing): the last block finishes those alone, into
    x[:len(out_rows)] (LlamaBlocks.run)."""
    (cos, sin), local = angles
    with attention.paged_step(x.shape[0]) as paged:
        window = paged.pools[1] if len(paged.pools) > 1 else (None, None)
        # an int8 KV cache's scales, of the windowed pool too (None for the other dtypes)
        window_scales = (paged.scales[1] if len(paged.scales) > 1 else None) or (None, None)
        blocks.run(x, buf, cos, sin, paged.k_cache, paged.v_cache, paged.block_tables, paged.token_seq,
                   paged.token_pos, paged.max_ctx, paged.scale, paged.num_threads,
                   cos_local=None if local is None else local[0], sin_local=None if local is None else local[1],
                   k_window=window[0], v_window=window[1], window_tables=paged.window_tables,
                   layer_slots=paged.layer_slots, softcap=paged.softcap, k_scale=paged.k_scale,
                   v_scale=paged.v_scale, k_window_scale=window_scales[0], v_window_scale=window_scales[1],
                   out_rows=out_rows)
        paged.elapsed_ns += blocks.attention_ns  # the trace's attention share of a step


def llama(input_ids: Ints, positions: Ints, attention: Attention, params: Mapping[str, Any], cfg: ModelConfig,
          logits_rows: Ints | Sequence[int] | None = None, workspace: Workspace | None = None) -> Logits:
    """[N] ids, [N] positions -> logits [len(logits_rows) or N, V]. With a workspace the blocks
    run in its buffers (blocks_into); without, as the expressions of `block`: the same logits."""
    x = embed(params, input_ids)  # [N, C], a new array: the residual stream
    if cfg.embed_scale is not None:
        x *= np.float32(cfg.embed_scale)
    pair = rope_pair(positions, params)
    angles = layer_angles(pair, cfg)
    if workspace is not None and isinstance(x, np.ndarray):
        with workspace.rows(x.shape[0]) as buf:
            if params.get("blocks") is not None and hasattr(attention, "paged_step"):
                kept = used_rows(logits_rows, x.shape[0])
                fused_blocks(x, params["blocks"], pair, attention, buf, None if kept is None else kept[0])
                if kept is not None:  # the used rows lie first, in order: logits_rows picks among them
                    x, logits_rows = x[: len(kept[0])], kept[1]
            else:
                x = blocks_into(x, params, cfg, angles, attention, buf)
    else:
        for layer, p in enumerate(params["layers"]):
            x = block(x, layer, p, cfg, *angles[layer], attention)
    if logits_rows is not None:
        x = x[logits_rows]  # the LM head is the biggest matmul: only rows that need logits pay it
    logits: Logits = rms_norm(x, params["norm"], cfg.norm_eps) @ params["lm_head"]  # [rows, C] @ [C, V]
    if cfg.final_softcap is not None:  # Gemma 2
        cap = np.float32(cfg.final_softcap)
        logits /= cap
        np.tanh(logits, out=logits)
        logits *= cap
    return logits


def used_rows(logits_rows: Ints | Sequence[int] | None,
              n: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.intp]] | None:
    """The distinct rows of n that logits_rows takes (increasing), and logits_rows as indices into
    them; None where every row is used (or logits_rows is None). The last block computes only
    these rows past its attention, as llama.cpp does for the tokens whose output is unused."""
    if logits_rows is None:
        return None
    rows, inverse = np.unique(np.arange(n)[np.asarray(logits_rows, dtype=np.intp)], return_inverse=True)
    return None if len(rows) == n else (rows.astype(np.int32), inverse.reshape(-1))


def rope_pair(positions: Ints, params: Mapping[str, Any]) -> tuple[Angles, Angles | None]:
    """The rotations at these positions by the rope and by the second rope (Gemma 3's sliding-window
    layers; None without one). Computed per step for its positions, not tabulated for the whole
    context (2 MB for 8192 positions): the same float64 products and roundings, a few
    microseconds per decode step."""
    local = params.get("rope_local_inv_freq")
    return rope_angles(positions, params["rope_inv_freq"]), None if local is None else rope_angles(positions, local)


def local_rope_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer, whether it rotates by the second rope: Gemma 3's sliding-window layers."""
    return [cfg.rope_local_theta is not None and cfg.window(i) is not None for i in range(cfg.num_layers)]


def layer_angles(pair: tuple[Angles, Angles | None], cfg: ModelConfig) -> list[Angles]:  # -> per layer
    """The rotation of each layer: rope_pair's second where local_rope_layers says so."""
    angles, local = pair
    if local is None:
        return [angles] * cfg.num_layers
    return [local if is_local else angles for is_local in local_rope_layers(cfg)]


def embed(params: Mapping[str, Any], input_ids: Ints) -> F32:  # [N] -> [N, C]
    if params["embed_tokens"] is not None:
        rows: F32 = params["embed_tokens"][input_ids]
        return rows
    # tied: the embedding rows are the LM head's columns
    head: PackedWeight = params["lm_head"]
    return head.columns(input_ids)


class LlamaModel:
    """A loaded Llama-family model: config, packed params, and the HF-named weight views."""

    params: dict[str, Any]  # what `llama` reads: "layers" (a Layer each), "norm", "lm_head", "blocks", ...
    weights: "CheckpointView"
    # set by models.loader.load_model:
    path: str  # the file or folder it was loaded from
    format: str  # the checkpoint's format, "gguf", "safetensors", ...
    panels_from_cache: bool  # its panels were mapped from the panel cache, packed by an earlier load

    def __init__(self, config: ModelConfig, weights: Mapping[str, npt.NDArray[Any]], dtype: str = "float32",
                 panel_cache: "PanelCache | None" = None, activations: str = "float32") -> None:
        """`weights`: name -> array with Hugging Face names (model.layers.N.self_attn.q_proj.weight ...).
        `dtype`: how the matrices are stored and multiplied: "float32", "bfloat16" or "quantized".
        `panel_cache`: a models.panel_cache.PanelCache of the weights' file (quantized only).
        `activations`: how quantized matrices multiply x: dtypes.ACTIVATIONS, "float32" (exact),
        "int8" or "int16" (PackedWeight.activations)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.config = config
        self.dtype = dtype
        self.params, self.weights = pack(config, weights, dtype, panel_cache, activations)
        self.workspace = Workspace(config)  # a step's buffers, reused across layers and steps

    def forward(self, input_ids: Ints, positions: Ints, attention: Attention,
                logits_rows: Ints | Sequence[int] | None = None) -> Logits:  # Model's, lists of rows too
        context = self.params["context"]
        if positions.max() >= context:  # packed sequences: positions need not be sorted
            raise ValueError(f"position {positions.max()} exceeds the model's context of {context}")
        with single_blas_thread():  # the matmuls run on our pool; see threads.single_blas_thread
            return llama(input_ids, positions, attention, self.params, self.config, logits_rows, self.workspace)


class CheckpointView(Mapping[str, F32]):
    """The model's tensors under their Hugging Face names: norms as the arrays the model uses,
    matrices as [out, in] float32 copies unpacked from their PackedWeight on lookup."""

    def __init__(self) -> None:
        self.arrays: dict[str, F32] = {}  # name -> array
        self.parts: dict[str, tuple[PackedWeight, slice]] = {}  # name -> (PackedWeight, slice of its out columns)

    def __getitem__(self, name: str) -> F32:
        if name in self.arrays:
            return self.arrays[name]
        packed, cols = self.parts[name]
        return np.ascontiguousarray(packed.numpy()[:, cols].T)

    def __iter__(self) -> Iterator[str]:
        yield from self.arrays
        yield from self.parts

    def __len__(self) -> int:
        return len(self.arrays) + len(self.parts)

    def __contains__(self, name: object) -> bool:
        return name in self.arrays or name in self.parts


def pack(cfg: ModelConfig, w: Mapping[str, npt.NDArray[Any]], dtype: str = "float32",
         panel_cache: "PanelCache | None" = None,
         activations: str = "float32") -> tuple[dict[str, Any], CheckpointView]:
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

    def pack(self) -> tuple[dict[str, Any], CheckpointView]:
        cfg = self.cfg
        # Packing runs in kernels and NumPy calls that release the GIL: two matrices at a time use
        # both cores of a small machine (load time is a goal). The LM head, the largest, goes first,
        # so that it overlaps the layers instead of following them.
        with ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
            head = pool.submit(self.head)
            layers: list[Layer] = []
            for layer in pool.map(self.layer, range(cfg.num_layers)):  # in order, as each is packed
                layers.append(layer)
                progress.report(progress.PACKING, len(layers), cfg.num_layers + 1)
            lm_head, embed_tokens = head.result()
            progress.report(progress.PACKING, cfg.num_layers + 1, cfg.num_layers + 1)
        params: dict[str, Any] = {"embed_tokens": embed_tokens, "layers": layers,
                                  "norm": self.norm("model.norm.weight"), "lm_head": lm_head,
                                  "context": cfg.max_position_embeddings} | self.rope()
        params["blocks"] = None
        try:  # every block in one C call where the kernels cover it (not bfloat16)
            params["blocks"] = LlamaBlocks(layers, cfg, local_rope_layers(cfg))
        except TypeError:
            pass
        if self.panel_cache is not None:
            self.panel_cache.save()  # writes only when this load packed something
        return params, self.view

    # --- the kinds of tensor ---------------------------------------------------------------------

    def head(self) -> tuple[PackedWeight, F32 | None]:  # -> (lm_head [C, V], embed_tokens [V, C] or None)
        if self.cfg.tie_word_embeddings:
            # one copy serves both: the LM head multiplies by it as [C, V], the lookup reads its columns
            return self.matrix(["model.embed_tokens.weight"], [(self.cfg.vocab_size, self.cfg.hidden_size)]), None
        return self.lm_head(), self.embedding()

    def lm_head(self) -> PackedWeight:  # [C, V]
        return self.matrix(["lm_head.weight"], [(self.cfg.vocab_size, self.cfg.hidden_size)])

    def embedding(self) -> F32:  # the untied table [V, C]
        return self.vector("model.embed_tokens.weight", (self.cfg.vocab_size, self.cfg.hidden_size))

    def rope(self) -> dict[str, Floats | None]:
        # the rotary frequencies [D/2] float64 (and Gemma 3's of its sliding layers)
        cfg = self.cfg
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if "rope_freqs.weight" in self.w:  # Llama 3 GGUF: llama.cpp divides each frequency by its factor
            inv_freq = inv_freq / self.vector("rope_freqs.weight", (cfg.head_dim // 2,))
        local = None if cfg.rope_local_theta is None else rope_frequencies(cfg.head_dim, cfg.rope_local_theta)
        return {"rope_inv_freq": inv_freq, "rope_local_inv_freq": local}

    def norm(self, name: str, size: int | None = None) -> F32:  # an RMSNorm's weight [C] (or [D]: QK-norm)
        w = self.vector(name, (size or self.cfg.hidden_size,))
        if self.cfg.norm_weight_offset:  # Gemma's x * (1 + w), as the weight the kernel multiplies by
            w += np.float32(self.cfg.norm_weight_offset)
        return w

    def layer(self, i: int) -> Layer:  # -> params of block i
        prefix = f"model.layers.{i}."
        p: Layer = {"input_layernorm": self.norm(prefix + "input_layernorm.weight")}
        p |= self.attention(prefix + "self_attn.")
        # "post_attention_layernorm" in params is the MLP's input norm (Llama's name, the fused
        # kernel's key); Gemma's file calls that one pre_feedforward_layernorm and gives its own
        # post_attention_layernorm to the attention's output
        if self.cfg.post_norms:
            p["attn_out_norm"] = self.norm(prefix + "post_attention_layernorm.weight")
            p["post_attention_layernorm"] = self.norm(prefix + "pre_feedforward_layernorm.weight")
            p["mlp_out_norm"] = self.norm(prefix + "post_feedforward_layernorm.weight")
        else:
            p["post_attention_layernorm"] = self.norm(prefix + "post_attention_layernorm.weight")
        p |= self.mlp(prefix + "mlp.")
        return p

    def attention(self, a: str) -> Layer:  # q|k|v fused [C, q+2kv], o [q, C], biases, QK-norms
        cfg, C = self.cfg, self.cfg.hidden_size
        names = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        shapes = [(cfg.q_size, C), (cfg.kv_size, C), (cfg.kv_size, C)]
        fused = ([a + "qkv_proj.weight"], [(cfg.q_size + 2 * cfg.kv_size, C)])  # Phi-3's file
        p: Layer = {"qkv_proj": self.matrix(*(fused if cfg.fused_checkpoint else (names, shapes))),
                    "o_proj": self.matrix([a + "o_proj.weight"], [(C, cfg.q_size)])}
        if cfg.qk_norm:
            p["q_norm"] = self.norm(a + "q_norm.weight", cfg.head_dim)
            p["k_norm"] = self.norm(a + "k_norm.weight", cfg.head_dim)
        if cfg.qkv_bias:
            biases = [self.vector(n.replace(".weight", ".bias"), (s[0],)) for n, s in zip(names, shapes, strict=True)]
            p["qkv_bias"] = np.concatenate(biases)
        if cfg.o_bias:
            p["o_bias"] = self.vector(a + "o_proj.bias", (C,))
        return p

    def mlp(self, m: str) -> Layer:  # gate|up fused [C, 2I], down [I, C]
        C, I = self.cfg.hidden_size, self.cfg.intermediate_size
        gate_up = ([m + "gate_up_proj.weight"], [(2 * I, C)]) if self.cfg.fused_checkpoint else \
            ([m + "gate_proj.weight", m + "up_proj.weight"], [(I, C), (I, C)])
        p: Layer = {"gate_up_proj": self.matrix(*gate_up),
                    "down_proj": self.matrix([m + "down_proj.weight"], [(C, I)])}
        if self.cfg.mlp_bias:
            raise NotImplementedError("mlp_bias")
        return p

    # --- how a tensor is read and stored ---------------------------------------------------------

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
        packed = PackedWeight.from_blocks(parts, shape, self.arena.zeros)
        if packed is not None:
            for _, raw, _ in parts:  # the file's copy is not needed any more: not resident beside the panels
                release_range(raw)
            if cache is not None:
                cache.put("|".join(names), cast("QuantizedPanels", packed.panels))  # pack_blocks' kinds
        return packed
