"""The Llama family forward pass (Llama 2/3, SmolLM, Mistral, Qwen2/3, Phi-3, Gemma 2/3), in paper order.

    x = embed[ids] (* embed_scale)
    for each block:  x += attn_out_norm?( o( attention( rope(q_norm?(q)), rope(k_norm?(k)), v ) ) )
                                                                  q|k|v = qkv(attn_norm(x)) (+ qkv_bias)
                     x += mlp_out_norm?( down( act(gate) * up ) )     gate|up = gate_up(mlp_norm(x))
    logits = softcap?( rms_norm(x) @ lm_head )

A block's tensors are a LayerParams (models/llama_params.py), named for their roles; which
pieces a model's blocks have is its architecture's description (models/architectures.py), and
the values they take are ModelConfig's: the embedding scale and the final soft-capping, Gemma 3's
second rope base for the sliding-window layers (`layer_angles`), rope scaling
(`rope_frequencies`). Which keys a query sees, the softmax scale and the scores' soft-capping are
the attention object's (ModelConfig's layer_windows / softmax_scale / attn_softcap;
models/attention.py).

`block` says it in those words, one expression per step; `blocks_into` runs the same float
operations in the same order (the same logits, bit for bit) with every intermediate written into
the step's preallocated buffers (scratchllm/models/workspace.py) and each residual add fused into
the RMSNorm after it; `fused_blocks` runs blocks_into's arithmetic in one C call
(kernels/llama_blocks.pyx) where the packer found that it covers the model. The model runs the
fastest of these it can; the first is their definition and their test. How the weights are
stored, and why: models/llama_pack.py.
"""

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from scratchllm.kernels import pointwise
from scratchllm.kernels.llama_blocks import LlamaBlocks
from scratchllm.models.array import array_module
from scratchllm.models.config import ModelConfig
from scratchllm.models.llama_pack import CheckpointView, pack
from scratchllm.models.llama_params import (
    F32,
    Floats,
    LayerParams,
    LlamaParams,
    Matrix,
    local_rope_layers,
    rope_frequencies,
)
from scratchllm.models.packed import DTYPES, PackedWeight
from scratchllm.models.protocol import Attention, Ints, Logits
from scratchllm.models.threads import single_blas_thread
from scratchllm.models.workspace import StepBuffers, Workspace

if TYPE_CHECKING:  # for the annotations only: the loader hands the cache in
    from scratchllm.models.panel_cache import PanelCache

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


def head_norm_(qkv: Floats, p: LayerParams, H: int, KVH: int, eps: float) -> None:
    """QK-norm (Qwen3, Gemma 3), in place: an RMSNorm over each head of q and of k, [N, H + 2 KVH, D]."""
    N, _, D = qkv.shape
    assert p.q_norm is not None and p.k_norm is not None, "a model with QK-norm has both"
    for heads, w in ((slice(0, H), p.q_norm), (slice(H, H + KVH), p.k_norm)):
        part = np.ascontiguousarray(qkv[:, heads])
        qkv[:, heads] = rms_norm(part.reshape(-1, D), w, eps).reshape(part.shape)


def attention_block(x: Floats, layer: int, p: LayerParams, cfg: ModelConfig, cos: F32, sin: F32,
                    attention: Attention) -> Floats:  # [N, C] -> [N, C]
    N = x.shape[0]
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = linear(x, p.qkv, p.qkv_bias).reshape(N, H + 2 * KVH, D)
    if p.q_norm is not None:
        head_norm_(qkv, p, H, KVH, cfg.norm_eps)
    rope_(qkv, H + KVH, cos, sin)  # q and k rotate together, in place: one pass instead of two
    q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]
    out = attention(layer, q, k, v)  # [N, H, D]
    return linear(out.reshape(N, H * D), p.o, p.o_bias)


def post_norm(y: Floats, w: F32 | None, eps: float) -> Floats:
    # [N, C] -> [N, C]: the sandwich norm of a sublayer's output (None: none)
    return y if w is None else rms_norm(y, w, eps)


def block(x: Floats, layer: int, p: LayerParams, cfg: ModelConfig, cos: F32, sin: F32,
          attention: Attention) -> Floats:  # [N, C] -> [N, C]
    eps = cfg.norm_eps
    x = x + post_norm(attention_block(rms_norm(x, p.attn_norm, eps), layer, p, cfg, cos, sin, attention),
                      p.attn_out_norm, eps)
    h = rms_norm(x, p.mlp_norm, eps)
    x += post_norm(gated_act(h @ p.gate_up, cfg.hidden_act) @ p.down, p.mlp_out_norm, eps)
    return x


def linear_into(x: F32, w: Matrix, b: F32 | None, out: F32) -> F32:  # [N, in], [in, out], [out] or None, [N, out]
    if isinstance(w, PackedWeight):  # straight to the kernel: no __rmatmul__ dispatch, no new array
        w.matmul_into(x, out)
    else:
        np.matmul(x, w, out=out)
    if b is not None:
        out += b
    return out


def blocks_into(x: F32, params: LlamaParams, cfg: ModelConfig, angles: Sequence[Angles], attention: Attention,
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
    for layer, p in enumerate(params.layers):
        if pending:
            pointwise.add_rms_norm(x, buf.delta, p.attn_norm, eps, buf.h)
        else:
            pointwise.rms_norm(x, p.attn_norm, eps, out=buf.h)
        linear_into(buf.h, p.qkv, p.qkv_bias, buf.qkv_rows)
        if p.q_norm is not None:
            head_norm_(buf.qkv, p, H, KVH, eps)
        cos, sin = angles[layer]
        pointwise.rope_(buf.qkv, H + KVH, cos, sin)
        if into:
            attention_into(layer, buf.q, buf.k, buf.v, out=buf.attn)
            out = buf.attn_rows
        else:  # any other cache object: its own array
            out = attention(layer, buf.q, buf.k, buf.v).reshape(N, H * D)
        linear_into(out, p.o, p.o_bias, buf.delta)
        if p.attn_out_norm is not None:
            buf.delta[...] = rms_norm(buf.delta, p.attn_out_norm, eps)
        pointwise.add_rms_norm(x, buf.delta, p.mlp_norm, eps, buf.h)
        linear_into(buf.h, p.gate_up, None, buf.gate_up)
        gated_act(buf.gate_up, cfg.hidden_act, out=buf.act)
        linear_into(buf.act, p.down, None, buf.delta)
        if p.mlp_out_norm is not None:
            buf.delta[...] = rms_norm(buf.delta, p.mlp_out_norm, eps)
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


def llama(input_ids: Ints, positions: Ints, attention: Attention, params: LlamaParams, cfg: ModelConfig,
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
            if params.blocks is not None and hasattr(attention, "paged_step"):
                kept = used_rows(logits_rows, x.shape[0])
                fused_blocks(x, params.blocks, pair, attention, buf, None if kept is None else kept[0])
                if kept is not None:  # the used rows lie first, in order: logits_rows picks among them
                    x, logits_rows = x[: len(kept[0])], kept[1]
            else:
                x = blocks_into(x, params, cfg, angles, attention, buf)
    else:
        for layer, p in enumerate(params.layers):
            x = block(x, layer, p, cfg, *angles[layer], attention)
    if logits_rows is not None:
        x = x[logits_rows]  # the LM head is the biggest matmul: only rows that need logits pay it
    logits = cast(Logits, rms_norm(x, params.norm, cfg.norm_eps) @ params.lm_head)  # [rows, C] @ [C, V]
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


def rope_pair(positions: Ints, params: LlamaParams) -> tuple[Angles, Angles | None]:
    """The rotations at these positions by the rope and by the second rope (Gemma 3's sliding-window
    layers; None without one). Computed per step for its positions, not tabulated for the whole
    context (2 MB for 8192 positions): the same float64 products and roundings, a few
    microseconds per decode step."""
    local = params.rope_local_inv_freq
    return rope_angles(positions, params.rope_inv_freq), None if local is None else rope_angles(positions, local)


def layer_angles(pair: tuple[Angles, Angles | None], cfg: ModelConfig) -> list[Angles]:  # -> per layer
    """The rotation of each layer: rope_pair's second where local_rope_layers says so."""
    angles, local = pair
    if local is None:
        return [angles] * cfg.num_layers
    return [local if is_local else angles for is_local in local_rope_layers(cfg)]


def embed(params: LlamaParams, input_ids: Ints) -> F32:  # [N] -> [N, C]
    if params.embed_tokens is not None:  # a float32 table, or its file's blocks dequantized row by row
        rows: F32 = params.embed_tokens[input_ids]
        return rows
    # tied: the embedding rows are the LM head's columns
    assert isinstance(params.lm_head, PackedWeight), "a tied LM head is packed"
    return params.lm_head.columns(input_ids)


class LlamaModel:
    """A loaded Llama-family model: config, packed params, and the HF-named weight views."""

    params: LlamaParams  # what `llama` reads
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
        context = self.params.context
        if positions.max() >= context:  # packed sequences: positions need not be sorted
            raise ValueError(f"position {positions.max()} exceeds the model's context of {context}")
        with single_blas_thread():  # the matmuls run on our pool; see threads.single_blas_thread
            return llama(input_ids, positions, attention, self.params, self.config, logits_rows, self.workspace)


