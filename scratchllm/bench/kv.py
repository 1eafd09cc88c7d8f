"""KV memory with sliding windows: one long request on a model shaped like Gemma 3 270M's
attention (18 layers, 1 KV head, head_dim 256, a 512-token window on 5 layers of 6), random
weights, run through the engine. Prints the most KV it held between steps and within a step
beside what full attention would hold and the bound (engine/kv_sizing.sequence_kv_bytes: each
full-attention layer its context, each windowed layer its window plus the block being filled).
"""

import argparse
import time
from dataclasses import replace
from typing import Any

import numpy as np

from scratchllm.bench.common import add_kv_cache_dtype_argument, machine_facts
from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.kv_sizing import block_bytes, layer_groups, sequence_kv_bytes
from scratchllm.engine.memory_plan import MiB
from scratchllm.models.config import ModelConfig
from scratchllm.models.llama import LlamaModel
from scratchllm.sampling import SamplingParams


def gemma3_270m_attention(context: int, window: int = 512, hidden: int = 64) -> ModelConfig:
    """Gemma 3 270M's attention shape (every sixth layer full attention), on a narrow random model."""
    return ModelConfig(family="llama", model_type="llama", vocab_size=256, hidden_size=hidden, num_layers=18,
                       num_heads=4, num_kv_heads=1, head_dim=256, intermediate_size=2 * hidden, norm_eps=1e-6,
                       max_position_embeddings=context, layer_windows=tuple(0 if (i + 1) % 6 == 0 else window
                                                                            for i in range(18)),
                       attn_scale=256 ** -0.5)


def random_model(cfg: ModelConfig, seed: int = 0) -> LlamaModel:
    rng = np.random.default_rng(seed)
    C, H, KVH, D, inter = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size

    def w(*shape: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        out: np.ndarray[Any, np.dtype[np.float32]] = (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)
        return out

    weights = {"model.embed_tokens.weight": w(cfg.vocab_size, C), "model.norm.weight": np.ones(C, np.float32),
               "lm_head.weight": w(cfg.vocab_size, C)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": np.ones(C, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(C, np.float32),
                    p + "self_attn.q_proj.weight": w(H * D, C), p + "self_attn.k_proj.weight": w(KVH * D, C),
                    p + "self_attn.v_proj.weight": w(KVH * D, C), p + "self_attn.o_proj.weight": w(C, H * D),
                    p + "mlp.gate_proj.weight": w(inter, C), p + "mlp.up_proj.weight": w(inter, C),
                    p + "mlp.down_proj.weight": w(C, inter)}
    return LlamaModel(cfg, weights)


def kv_held(engine: LLMEngine) -> int:
    """Bytes of KV the engine's sequences hold now, every pool (at the engine's KV-cache dtype)."""
    mc, bs = engine.model.config, engine.config.block_size
    return sum(pool.num_used * block_bytes(mc, bs, len(group.layers), engine.plan.kv_dtype)
               for pool, group in zip(engine.block_manager.groups, layer_groups(mc), strict=True))


def measure(cfg: ModelConfig, prompt_len: int, max_tokens: int, block_size: int = 16,
            max_num_batched_tokens: int = 512, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """One request of prompt_len + max_tokens tokens, alone; the KV it held, against the bounds."""
    model = random_model(cfg)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, block_size=block_size, enable_prefix_caching=False,
                                           max_num_batched_tokens=max_num_batched_tokens,
                                           kv_cache_dtype=kv_cache_dtype))
    dtype = engine.plan.kv_dtype
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, prompt_len).tolist()
    engine.add_request("long", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    between, steps, start = 0, 0, time.perf_counter()
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
        if engine.scheduler.num_running():  # still running: what it keeps between steps
            between = max(between, kv_held(engine))
    context = prompt_len + max_tokens
    peaks = [pool.peak_used * block_bytes(cfg, block_size, len(g.layers), dtype)
             for pool, g in zip(engine.block_manager.groups, layer_groups(cfg), strict=True)]
    return {
        "context_tokens": context, "block_size": block_size, "steps": steps,
        "seconds": time.perf_counter() - start,
        "kv_held_between_steps_bytes": between,
        "kv_peak_in_step_bytes": sum(peaks),  # + the prefill chunk in the windowed pool
        "bound_bytes": sequence_kv_bytes(cfg, context, block_size, kv_dtype=dtype),
        "full_attention_bytes": sequence_kv_bytes(cfg, context, block_size, windows=False, kv_dtype=dtype),
        "pool_bytes": engine.plan.kv_bytes, "kv_cache_dtype": dtype,
        "kv_bytes_per_token": engine.plan.kv_bytes_per_token,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-len", type=int, default=4000, help="prompt tokens (default 4000)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated after it (default 16)")
    parser.add_argument("--window", type=int, default=512, help="the windowed layers' window (default 512)")
    add_kv_cache_dtype_argument(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    context = args.prompt_len + args.max_tokens
    cfg = gemma3_270m_attention(context, args.window)
    result = measure(replace(cfg, max_position_embeddings=context), args.prompt_len, args.max_tokens,
                     kv_cache_dtype=args.kv_cache_dtype)
    return {"model": "Gemma 3 270M attention shape (18 layers, 1 KV head, head_dim 256, windows "
                     f"{args.window} on 15 layers), random weights", **result, "machine": machine_facts()}


def render(result: dict[str, Any]) -> str:
    r = result
    return "\n".join([
        f"{r['model']}: one request of {r['context_tokens']} tokens, {r['steps']} steps, {r['seconds']:.1f} s",
        f"  KV-cache dtype {r['kv_cache_dtype']}: {r['kv_bytes_per_token'] / 1024:.1f} KiB per token of context "
        "(every layer)",
        f"  KV held between steps  {r['kv_held_between_steps_bytes'] / MiB:8.2f} MiB",
        f"  bound (window + block) {r['bound_bytes'] / MiB:8.2f} MiB",
        f"  full attention         {r['full_attention_bytes'] / MiB:8.2f} MiB "
        f"({r['full_attention_bytes'] / max(r['kv_held_between_steps_bytes'], 1):.1f}x)",
        f"  peak within a step     {r['kv_peak_in_step_bytes'] / MiB:8.2f} MiB (the prefill chunk besides)",
        f"  pool                   {r['pool_bytes'] / MiB:8.2f} MiB",
    ])
