"""The Llama family forward pass (Llama 2/3, SmolLM, Mistral-style, Qwen2), in paper order.

    x = embed[ids]
    for each block:  x += o( attention( rope(q(rms_norm(x))), rope(k(...)), v(...) ) )
                     x += down( silu(gate(rms_norm(x))) * up(rms_norm(x)) )
    logits = rms_norm(x) @ lm_head.T

How the weights are stored, for speed (`pack`):
- Pre-transposed to [in, out], so a layer is `x @ w`. With Hugging Face's [out, in] layout,
  `x @ w.T` makes OpenBLAS (1 thread) read weights at ~11.5 GB/s at batch 1; `x @ w` on the
  [in, out] copy reads at ~21.5 GB/s, the np.sum speed of this machine. Decode reads every weight
  once per token, so that is nearly 2x decode speed. (Prefill GEMMs run equally fast either way.)
- Fused: q|k|v as one [C, q+2kv] matrix and gate|up as one [C, 2I]: two matmuls per block instead
  of five; at batch 1 the cost of one NumPy call (microseconds) is not negligible.
- Tied embeddings live once, as the [C, V] LM head; an embedding lookup reads its columns.
The Hugging Face names stay available, as [out, in] views into these arrays (no second copy).
"""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from scratchllm.models.array import array_module
from scratchllm.models.config import ModelConfig

LOAD_THREADS = min(2, os.cpu_count() or 1)


def rms_norm(x, w, eps: float):  # [N, C], [C] -> [N, C]
    xp = array_module(x)
    ms = xp.einsum("nc,nc->n", x, x)[:, None] * (1.0 / x.shape[-1])  # mean of squares, [N, 1]
    ms += eps
    return x * (1.0 / xp.sqrt(ms, out=ms)) * w


def rope_tables(head_dim: int, theta: float, max_pos: int):  # -> cos, sin [max_pos, D/2] float32
    """Angles pos * theta^(-2i/D), computed in float64 (exact at long positions) and stored float32."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]  # [P, D/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope(x, cos, sin):  # [N, h, D], [N, D/2], [N, D/2] -> [N, h, D]
    """Rotate pairs (x_i, x_{i+D/2}) by the position's angle: the "rotate half" layout of HF Llama
    (GGUF files store q/k rows permuted for llama.cpp's adjacent-pair layout; the loader undoes it)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = array_module(x).empty_like(x)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s
    return out


def linear(x, w, b=None):  # [N, in], [in, out] (pre-transposed), [out] -> [N, out]
    y = x @ w
    if b is not None:
        y += b
    return y


def swiglu(x, gate_up, down):  # [N, C], [C, 2I], [I, C] -> [N, C]
    gu = x @ gate_up  # [N, 2I]
    I = gu.shape[1] // 2
    g, u = gu[:, :I], gu[:, I:]
    # silu(g) = g * sigmoid(g), sigmoid(g) = (1 + tanh(g/2)) / 2: tanh cannot overflow the way
    # exp(-g) does for large negative g (which would raise a RuntimeWarning), and stays in place
    xp = array_module(x)
    t = g * 0.5
    xp.tanh(t, out=t)
    t += 1.0
    t *= 0.5
    t *= g
    t *= u
    return t @ down


def attention_block(x, layer: int, p: dict, cfg: ModelConfig, cos, sin, attention):  # [N, C] -> [N, C]
    N = x.shape[0]
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = linear(x, p["qkv_proj"], p.get("qkv_bias")).reshape(N, H + 2 * KVH, D)
    qk = rope(qkv[:, : H + KVH], cos, sin)  # q and k rotate together: one pass instead of two
    q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH :]
    out = attention(layer, q, k, v)  # [N, H, D]
    return linear(out.reshape(N, H * D), p["o_proj"], p.get("o_bias"))


def block(x, layer: int, p: dict, cfg: ModelConfig, cos, sin, attention):  # [N, C] -> [N, C]
    x = x + attention_block(rms_norm(x, p["input_layernorm"], cfg.norm_eps), layer, p, cfg, cos, sin, attention)
    h = rms_norm(x, p["post_attention_layernorm"], cfg.norm_eps)
    x += swiglu(h, p["gate_up_proj"], p["down_proj"])
    return x


def llama(input_ids, positions, attention, params: dict, cfg: ModelConfig, logits_rows=None):
    """[N] ids, [N] positions -> logits [len(logits_rows) or N, V]."""
    x = embed(params, input_ids)  # [N, C]
    cos, sin = params["rope_cos"][positions], params["rope_sin"][positions]  # [N, D/2]
    for layer, p in enumerate(params["layers"]):
        x = block(x, layer, p, cfg, cos, sin, attention)
    if logits_rows is not None:
        x = x[logits_rows]  # the LM head is the biggest matmul: only rows that need logits pay it
    return rms_norm(x, params["norm"], cfg.norm_eps) @ params["lm_head"]  # [rows, C] @ [C, V]


def embed(params: dict, input_ids):  # [N] -> [N, C]
    if params["embed_tokens"] is not None:
        return params["embed_tokens"][input_ids]
    # tied: the embedding rows are the LM head's columns (copied to row-major for what follows)
    return array_module(params["lm_head"]).ascontiguousarray(params["lm_head"][:, input_ids].T)


class LlamaModel:
    """A loaded Llama-family model: config, packed params, and the HF-named weight views."""

    def __init__(self, config: ModelConfig, weights):
        """`weights`: name -> array with Hugging Face names (model.layers.N.self_attn.q_proj.weight ...)."""
        self.config = config
        self.params, self.weights = pack(config, weights)

    def forward(self, input_ids, positions, attention, logits_rows=None):
        context = self.params["rope_cos"].shape[0]
        if positions.max() >= context:  # packed sequences: positions need not be sorted
            raise ValueError(f"position {positions.max()} exceeds the model's context of {context}")
        return llama(input_ids, positions, attention, self.params, self.config, logits_rows)


def pack(cfg: ModelConfig, w) -> tuple[dict, dict]:
    """HF-named arrays -> (params for `llama`, HF-named views into them). Shapes are asserted.

    Every matrix is stored transposed ([in, out], C-contiguous) and q|k|v, gate|up fused along
    `out`; see the module docstring for why."""
    C, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)

    def get(name, shape):
        if name not in w:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        a = w[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
        return a

    def transposed(names, shapes):  # [out_i, in] each -> one [in, sum(out_i)] array
        out = np.empty((shapes[0][1], sum(s[0] for s in shapes)), dtype=np.float32)
        col = 0
        for name, shape in zip(names, shapes, strict=True):
            a = get(name, shape)
            # in blocks of 128 rows: a whole-matrix strided copy thrashes the cache (2x slower)
            for r in range(0, shape[0], 128):
                rows = a[r : r + 128]
                out[:, col + r : col + r + rows.shape[0]] = rows.T
            col += shape[0]
        return out

    qkv_shapes = [(cfg.q_size, C), (cfg.kv_size, C), (cfg.kv_size, C)]

    def pack_layer(i):  # -> (params of block i, its HF-named views)
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv_names = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        gu_names = [m + "gate_proj.weight", m + "up_proj.weight"]
        p = {
            "input_layernorm": f32(get(f"model.layers.{i}.input_layernorm.weight", (C,))),
            "qkv_proj": transposed(qkv_names, qkv_shapes),  # [C, q+2kv]
            "o_proj": transposed([a + "o_proj.weight"], [(C, cfg.q_size)]),  # [q, C]
            "post_attention_layernorm": f32(get(f"model.layers.{i}.post_attention_layernorm.weight", (C,))),
            "gate_up_proj": transposed(gu_names, [(I, C), (I, C)]),  # [C, 2I]
            "down_proj": transposed([m + "down_proj.weight"], [(C, I)]),  # [I, C]
        }
        bias_names = [n.replace(".weight", ".bias") for n in qkv_names]
        if cfg.qkv_bias:
            p["qkv_bias"] = np.concatenate([f32(get(n, (s[0],))) for n, s in zip(bias_names, qkv_shapes, strict=True)])
        if cfg.o_bias:
            p["o_bias"] = f32(get(a + "o_proj.bias", (C,)))
        if cfg.mlp_bias:
            raise NotImplementedError("mlp_bias")
        # HF names as [out, in] views of the fused, transposed matrices: same memory, checkpoint names
        views = {}
        r0, r1 = cfg.q_size, cfg.q_size + cfg.kv_size
        for name, bias, cols in zip(qkv_names, bias_names, [slice(0, r0), slice(r0, r1), slice(r1, None)], strict=True):
            views[name] = p["qkv_proj"][:, cols].T
            if cfg.qkv_bias:
                views[bias] = p["qkv_bias"][cols]
        views[gu_names[0]], views[gu_names[1]] = p["gate_up_proj"][:, :I].T, p["gate_up_proj"][:, I:].T
        views[a + "o_proj.weight"], views[m + "down_proj.weight"] = p["o_proj"].T, p["down_proj"].T
        if cfg.o_bias:
            views[a + "o_proj.bias"] = p["o_bias"]
        views[f"model.layers.{i}.input_layernorm.weight"] = p["input_layernorm"]
        views[f"model.layers.{i}.post_attention_layernorm.weight"] = p["post_attention_layernorm"]
        return p, views

    # Dequantizing and transposing are NumPy calls that release the GIL: two layers at a time
    # use both cores of a small machine (load time is a goal: under 1 s for the default model).
    with ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
        packed = list(pool.map(pack_layer, range(cfg.num_layers)))
    layers = [p for p, _ in packed]
    views = {name: a for _, v in packed for name, a in v.items()}
    if cfg.tie_word_embeddings:
        # one copy serves both: the LM head reads it as [C, V], the lookup reads its columns
        lm_head, embed_tokens = transposed(["model.embed_tokens.weight"], [(V, C)]), None
        views["model.embed_tokens.weight"] = lm_head.T
    else:
        lm_head = transposed(["lm_head.weight"], [(V, C)])
        embed_tokens = f32(get("model.embed_tokens.weight", (V, C)))
        views["model.embed_tokens.weight"], views["lm_head.weight"] = embed_tokens, lm_head.T
    cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    params = {"embed_tokens": embed_tokens, "layers": layers, "norm": f32(get("model.norm.weight", (C,))),
              "lm_head": lm_head, "rope_cos": cos, "rope_sin": sin}
    views["model.norm.weight"] = params["norm"]
    return params, views
