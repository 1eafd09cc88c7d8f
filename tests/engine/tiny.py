"""Tiny random Llama models built with scratchllm.models (HF names, random weights), and the
plain one-sequence greedy loop (ContiguousKVCache) that engine outputs are checked against."""

import numpy as np

from scratchllm.models import ContiguousKVCache, ModelConfig
from scratchllm.models.llama import LlamaModel


def tiny_llama(seed=0, vocab=97, hidden=32, layers=2, heads=4, kv_heads=2, inter=48, ctx=512) -> LlamaModel:
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=inter,
                      norm_eps=1e-5, max_position_embeddings=ctx, eos_token_id=None)
    rng = np.random.default_rng(seed)
    D = hidden // heads

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0), "model.norm.weight": 1 + w(hidden, scale=0.1),
               "lm_head.weight": w(vocab, hidden, scale=0.5)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + w(hidden, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + w(hidden, scale=0.1),
            p + "self_attn.q_proj.weight": w(heads * D, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * D, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * D, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * D),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    return LlamaModel(cfg, weights)


def greedy_alone(model, prompt, max_tokens, eos=None) -> list[int]:
    """The simplest correct generation: one sequence, contiguous cache, prefill then decode."""
    cache = ContiguousKVCache.for_model(model.config, len(prompt) + max_tokens)
    logits = model.forward(np.array(prompt), np.arange(len(prompt)), cache, logits_rows=np.array([len(prompt) - 1]))
    out = []
    for _ in range(max_tokens):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        if tok == eos:
            break
        p = len(prompt) + len(out) - 1
        logits = model.forward(np.array([tok]), np.array([p]), cache)
    return out
