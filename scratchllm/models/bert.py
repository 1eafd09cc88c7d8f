"""BERT encoder and sentence embeddings (Devlin et al. 2019; Reimers & Gurevych 2019).

    x = layer_norm(word[ids] + position[0..T) + token_type[0])
    for each layer:  x = layer_norm(x + dense(bidirectional_attention(q(x), k(x), v(x), mask)))
                     x = layer_norm(x + out(gelu(intermediate(x))))
    embedding = normalize(mean of x over the non-padding tokens)

Post-norm (the residual is added before LayerNorm), exact erf GELU, no causal mask.
"""

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.models.array import array_module
from scratchllm.models.attention import bidirectional_attention
from scratchllm.models.config import ModelConfig
from scratchllm.models.ops import Floats, gelu_erf, layer_norm, linear
from scratchllm.models.protocol import Ints
from scratchllm.models.weights import WeightTaker

F32 = npt.NDArray[np.float32]


def encoder_layer(x: Floats, mask: Ints, p: dict[str, Any], cfg: ModelConfig) -> Floats:
    # [B, T, C], [B, T] -> [B, T, C]
    B, T, C = x.shape
    H, D = cfg.num_heads, cfg.head_dim
    flat = x.reshape(B * T, C)
    q, k, v = (linear(flat, p[f"attention.self.{n}.weight"], p[f"attention.self.{n}.bias"]).reshape(B, T, H, D)
               for n in ("query", "key", "value"))
    ctx = bidirectional_attention(q, k, v, mask).reshape(B * T, C)
    attn = linear(ctx, p["attention.output.dense.weight"], p["attention.output.dense.bias"])
    flat = layer_norm(flat + attn, p["attention.output.LayerNorm.weight"], p["attention.output.LayerNorm.bias"],
                      cfg.norm_eps)
    h = gelu_erf(linear(flat, p["intermediate.dense.weight"], p["intermediate.dense.bias"]))
    out = linear(h, p["output.dense.weight"], p["output.dense.bias"])
    flat = layer_norm(flat + out, p["output.LayerNorm.weight"], p["output.LayerNorm.bias"], cfg.norm_eps)
    return flat.reshape(B, T, C)


def bert(input_ids: Ints, attention_mask: Ints, w: dict[str, Any], cfg: ModelConfig,
         token_type_ids: Ints | None = None) -> Floats:  # [B, T] x2 -> [B, T, C]
    B, T = input_ids.shape
    e = w["embeddings"]
    types = e["token_type_embeddings.weight"][0 if token_type_ids is None else token_type_ids]
    x: Floats = e["word_embeddings.weight"][input_ids] + e["position_embeddings.weight"][:T][None] + types
    x = layer_norm(x, e["LayerNorm.weight"], e["LayerNorm.bias"], cfg.norm_eps)
    for p in w["layers"]:
        x = encoder_layer(x, attention_mask, p, cfg)
    return x


def mean_pool_normalize(h: F32, attention_mask: Ints) -> F32:  # [B, T, C], [B, T] -> [B, C]
    xp = array_module(h)
    m = attention_mask[:, :, None].astype(h.dtype)
    pooled = (h * m).sum(axis=1) / xp.maximum(m.sum(axis=1), 1e-9)
    unit: F32 = pooled / xp.maximum(xp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return unit


def _layer_shapes(C: int, I: int) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {f"attention.self.{n}.{k}": (C, C) if k == "weight" else (C,)
         for n in ("query", "key", "value") for k in ("weight", "bias")}
    s.update({"attention.output.dense.weight": (C, C), "attention.output.dense.bias": (C,),
              "attention.output.LayerNorm.weight": (C,), "attention.output.LayerNorm.bias": (C,),
              "intermediate.dense.weight": (I, C), "intermediate.dense.bias": (I,),
              "output.dense.weight": (C, I), "output.dense.bias": (C,),
              "output.LayerNorm.weight": (C,), "output.LayerNorm.bias": (C,)})
    return s


class BertModel:
    # set by models.loader.load_model:
    path: str  # the file or folder it was loaded from
    format: str  # the checkpoint's format, "gguf", "safetensors", ...
    dtype: str  # what dtype "auto" resolved to: "float32", the one this family runs in
    panels_from_cache: bool  # always False: panels are the quantized Llama's

    def __init__(self, config: ModelConfig, weights: Mapping[str, npt.NDArray[Any]]) -> None:
        """`weights`: HF names, with or without the "bert." prefix of the task heads' checkpoints."""
        self.config = config
        C, I = config.hidden_size, config.intermediate_size
        taker = WeightTaker(weights, ("", "bert."))
        self.weights = taker.taken
        get = taker.take

        emb_shapes = {"word_embeddings.weight": (config.vocab_size, C),
                      "position_embeddings.weight": (config.max_position_embeddings, C),
                      "token_type_embeddings.weight": (config.type_vocab_size, C),
                      "LayerNorm.weight": (C,), "LayerNorm.bias": (C,)}
        self.params: dict[str, Any] = {
            "embeddings": {k: get("embeddings." + k, s) for k, s in emb_shapes.items()},
            "layers": [{k: get(f"encoder.layer.{i}.{k}", s) for k, s in _layer_shapes(C, I).items()}
                       for i in range(config.num_layers)],
        }

    def encode(self, input_ids: npt.ArrayLike, attention_mask: npt.ArrayLike,
               token_type_ids: Ints | None = None) -> F32:  # [B, T] -> [B, T, C]
        ids = np.asarray(input_ids)
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"{ids.shape[1]} tokens exceed BERT's {self.config.max_position_embeddings}")
        h: F32 = bert(ids, np.asarray(attention_mask), self.params, self.config, token_type_ids)  # float32 weights
        return h

    def embed(self, input_ids: npt.ArrayLike, attention_mask: npt.ArrayLike) -> F32:
        # [B, T], [B, T] -> [B, C], unit length
        mask = np.asarray(attention_mask)
        return mean_pool_normalize(self.encode(input_ids, mask), mask)
