"""The Llama family forward pass (Llama 2/3, SmolLM, Mistral-style, Qwen2), in paper order.

    x = embed[ids]
    for each block:  x += o( attention( rope(q(rms_norm(x))), rope(k(...)), v(...) ) )
                     x += down( silu(gate(rms_norm(x))) * up(rms_norm(x)) )
    logits = rms_norm(x) @ lm_head.T

Weights keep Hugging Face's [out, in] layout and names. For speed at batch 1, where the cost of
one NumPy call (a few microseconds) rivals the arithmetic of a 135M model, the loader stores
q|k|v as one [q+2kv, C] matrix and gate|up as one [2I, C] matrix: two matmuls per block instead
of five. The Hugging Face names stay available as views into those matrices (no second copy).
"""

import numpy as np

from scratchllm.models.array import array_module
from scratchllm.models.config import ModelConfig
from scratchllm.models.ops import linear


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


def swiglu(x, gate_up, down):  # [N, C], [2I, C], [C, I] -> [N, C]
    gu = x @ gate_up.T  # [N, 2I]
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
    return t @ down.T


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
    x = params["embed_tokens"][input_ids]  # [N, C]
    cos, sin = params["rope_cos"][positions], params["rope_sin"][positions]  # [N, D/2]
    for layer, p in enumerate(params["layers"]):
        x = block(x, layer, p, cfg, cos, sin, attention)
    if logits_rows is not None:
        x = x[logits_rows]  # the LM head is the biggest matmul: only rows that need logits pay it
    return rms_norm(x, params["norm"], cfg.norm_eps) @ params["lm_head"].T  # [rows, V]


class LlamaModel:
    """A loaded Llama-family model: config, packed params, and the HF-named weight views."""

    def __init__(self, config: ModelConfig, weights):
        """`weights`: name -> array with Hugging Face names (model.layers.N.self_attn.q_proj.weight ...)."""
        self.config = config
        self.params, self.weights = pack(config, weights)

    def forward(self, input_ids, positions, attention, logits_rows=None):
        if positions[-1] >= self.params["rope_cos"].shape[0]:
            raise ValueError(f"position {positions[-1]} exceeds the context of {self.params['rope_cos'].shape[0]}")
        return llama(input_ids, positions, attention, self.params, self.config, logits_rows)


def pack(cfg: ModelConfig, w) -> tuple[dict, dict]:
    """HF-named arrays -> (params for `llama`, HF-named views into them). Shapes are asserted."""
    C, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)

    def get(name, shape):
        if name not in w:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        a = w[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
        return a

    def cat(names, shapes):  # fused matrix filled part by part: no temporary list of float32 copies
        rows = sum(s[0] for s in shapes)
        out = np.empty((rows,) + shapes[0][1:], dtype=np.float32)
        r = 0
        for name, shape in zip(names, shapes, strict=True):
            out[r : r + shape[0]] = get(name, shape)
            r += shape[0]
        return out

    views = {}
    qkv_rows = [(cfg.q_size, C), (cfg.kv_size, C), (cfg.kv_size, C)]
    layers = []
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv_names = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        gu_names = [m + "gate_proj.weight", m + "up_proj.weight"]
        p = {
            "input_layernorm": f32(get(f"model.layers.{i}.input_layernorm.weight", (C,))),
            "qkv_proj": cat(qkv_names, qkv_rows),
            "o_proj": f32(get(a + "o_proj.weight", (C, cfg.q_size))),
            "post_attention_layernorm": f32(get(f"model.layers.{i}.post_attention_layernorm.weight", (C,))),
            "gate_up_proj": cat(gu_names, [(I, C), (I, C)]),
            "down_proj": f32(get(m + "down_proj.weight", (C, I))),
        }
        if cfg.qkv_bias:
            p["qkv_bias"] = cat([n.replace(".weight", ".bias") for n in qkv_names], [r[:1] for r in qkv_rows])
        if cfg.o_bias:
            p["o_bias"] = f32(get(a + "o_proj.bias", (C,)))
        if cfg.mlp_bias:
            raise NotImplementedError("mlp_bias")
        layers.append(p)
        # HF names as row views of the fused matrices: same memory, checkpoint names
        r0, r1 = cfg.q_size, cfg.q_size + cfg.kv_size
        for name, rows in zip(qkv_names, [slice(0, r0), slice(r0, r1), slice(r1, None)], strict=True):
            views[name] = p["qkv_proj"][rows]
            if cfg.qkv_bias:
                views[name.replace(".weight", ".bias")] = p["qkv_bias"][rows]
        views[gu_names[0]], views[gu_names[1]] = p["gate_up_proj"][:I], p["gate_up_proj"][I:]
        views[a + "o_proj.weight"], views[m + "down_proj.weight"] = p["o_proj"], p["down_proj"]
        if cfg.o_bias:
            views[a + "o_proj.bias"] = p["o_bias"]
        views[f"model.layers.{i}.input_layernorm.weight"] = p["input_layernorm"]
        views[f"model.layers.{i}.post_attention_layernorm.weight"] = p["post_attention_layernorm"]
    embed = f32(get("model.embed_tokens.weight", (V, C)))
    # tied embeddings: the LM head is the embedding matrix itself (x @ embed.T reads it transposed
    # through BLAS flags, no copy)
    lm_head = embed if cfg.tie_word_embeddings else f32(get("lm_head.weight", (V, C)))
    cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    params = {"embed_tokens": embed, "layers": layers, "norm": f32(get("model.norm.weight", (C,))),
              "lm_head": lm_head, "rope_cos": cos, "rope_sin": sin}
    views["model.embed_tokens.weight"], views["model.norm.weight"] = embed, params["norm"]
    if not cfg.tie_word_embeddings:
        views["lm_head.weight"] = lm_head
    return params, views
