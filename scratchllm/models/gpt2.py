"""GPT-2 forward pass, in paper order (Radford et al. 2019; the layout of picoGPT's gpt2.py).

    x = wte[ids] + wpe[positions]
    for each block:  x += c_proj( attention( split(c_attn(ln_1(x))) ) )
                     x += mlp_c_proj( gelu_tanh( c_fc(ln_2(x)) ) )
    logits = ln_f(x) @ wte.T

GPT-2 stores its linear layers as "Conv1D": weights are [in, out] and apply as x @ w + b.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.models.config import ModelConfig
from scratchllm.models.ops import Floats, conv1d, gelu_tanh, layer_norm
from scratchllm.models.protocol import Attention, Ints
from scratchllm.models.weights import WeightTaker


def mha(x: Floats, layer: int, p: dict[str, Any], cfg: ModelConfig, attention: Attention) -> Floats:  # [N, C] -> [N, C]
    N = x.shape[0]
    qkv = conv1d(x, p["attn.c_attn.weight"], p["attn.c_attn.bias"]).reshape(N, 3, cfg.num_heads, cfg.head_dim)
    out = attention(layer, qkv[:, 0], qkv[:, 1], qkv[:, 2])  # [N, H, D]
    return conv1d(out.reshape(N, cfg.hidden_size), p["attn.c_proj.weight"], p["attn.c_proj.bias"])


def ffn(x: Floats, p: dict[str, Any]) -> Floats:  # [N, C] -> [N, C]
    h = gelu_tanh(conv1d(x, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"]))  # [N, 4C]
    return conv1d(h, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])


def transformer_block(x: Floats, layer: int, p: dict[str, Any], cfg: ModelConfig, attention: Attention) -> Floats:
    # [N, C] -> [N, C]
    x = x + mha(layer_norm(x, p["ln_1.weight"], p["ln_1.bias"], cfg.norm_eps), layer, p, cfg, attention)
    return x + ffn(layer_norm(x, p["ln_2.weight"], p["ln_2.bias"], cfg.norm_eps), p)


def gpt2(input_ids: Ints, positions: Ints, attention: Attention, w: dict[str, Any], cfg: ModelConfig,
         logits_rows: Ints | Sequence[int] | None = None) -> npt.NDArray[np.float32]:  # [N] -> [rows, V]
    x: Floats = w["wte.weight"][input_ids] + w["wpe.weight"][positions]  # [N, C]
    for layer, p in enumerate(w["h"]):
        x = transformer_block(x, layer, p, cfg, attention)
    if logits_rows is not None:
        x = x[logits_rows]
    logits: npt.NDArray[np.float32] = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], cfg.norm_eps) @ w["wte.weight"].T
    return logits  # tied head


BLOCK_SHAPES: Callable[[int, int], dict[str, tuple[int, ...]]] = lambda C, I: {  # noqa: E731 - a table
    "ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
    "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
    "mlp.c_fc.weight": (C, I), "mlp.c_fc.bias": (I,), "mlp.c_proj.weight": (I, C), "mlp.c_proj.bias": (C,),
}


class GPT2Model:
    # set by models.loader.load_model:
    path: str  # the file or folder it was loaded from
    format: str  # the checkpoint's format, "gguf", "safetensors", ...
    dtype: str  # what dtype "auto" resolved to: "float32", the one this family runs in
    panels_from_cache: bool  # always False: panels are the quantized Llama's

    def __init__(self, config: ModelConfig, weights: Mapping[str, npt.NDArray[Any]]) -> None:
        """`weights`: HF names, with or without the "transformer." prefix of GPT2LMHeadModel."""
        self.config = config
        C, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
        taker = WeightTaker(weights, ("transformer.", ""))
        self.weights = taker.taken
        get = taker.take

        self.params: dict[str, Any] = {
            "wte.weight": get("wte.weight", (V, C)),
            "wpe.weight": get("wpe.weight", (config.max_position_embeddings, C)),
            "ln_f.weight": get("ln_f.weight", (C,)),
            "ln_f.bias": get("ln_f.bias", (C,)),
            "h": [{k: get(f"h.{i}.{k}", s) for k, s in BLOCK_SHAPES(C, I).items()} for i in range(config.num_layers)],
        }

    def forward(self, input_ids: Ints, positions: Ints, attention: Attention,
                logits_rows: Ints | Sequence[int] | None = None) -> npt.NDArray[np.float32]:  # Model's, lists too
        if positions.max() >= self.config.max_position_embeddings:
            raise ValueError(f"position {positions.max()} exceeds GPT-2's {self.config.max_position_embeddings}")
        return gpt2(input_ids, positions, attention, self.params, self.config, logits_rows)
