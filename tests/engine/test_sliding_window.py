"""Sliding-window attention through the engine: a tiny random Llama with windowed layers (and a
softmax scale and soft-cap of its own) against windowed causal attention computed directly in
NumPy, alone and batched, with prefix caching and preemption; and the KV bound of windowed layers."""

from dataclasses import replace

import numpy as np
import pytest

from scratchllm.bench.kv import gemma3_270m_attention, kv_held, measure
from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.kv_sizing import block_bytes, layer_groups, sequence_kv_bytes, window_blocks
from scratchllm.sampling import SamplingParams
from tests.engine.tiny import tiny_llama

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


class WindowedNumpyAttention:
    """One sequence's attention written from the definition: every key and value kept, the query
    at position p of a layer with window w sees positions p - w + 1..p; scores scaled by the
    model's scale, then soft-capped (cap * tanh(s / cap)), then the softmax."""

    def __init__(self, config):
        self.config = config
        self.keys = [np.zeros((0, config.num_kv_heads, config.head_dim))] * config.num_layers
        self.values = list(self.keys)

    def __call__(self, layer, q, k, v):
        cfg = self.config
        start = len(self.keys[layer])
        self.keys[layer] = np.concatenate([self.keys[layer], k])
        self.values[layer] = np.concatenate([self.values[layer], v])
        G = cfg.num_heads // cfg.num_kv_heads
        out = np.zeros(q.shape, np.float32)
        window = cfg.window(layer) or 0
        for i in range(q.shape[0]):
            p = start + i
            lo = max(0, p - window + 1) if window else 0
            for h in range(cfg.num_heads):
                s = self.keys[layer][lo : p + 1, h // G] @ q[i, h] * cfg.softmax_scale
                if cfg.attn_softcap:
                    s = cfg.attn_softcap * np.tanh(s / cfg.attn_softcap)
                w = np.exp(s - s.max())
                out[i, h] = (w / w.sum()) @ self.values[layer][lo : p + 1, h // G]
        return out


def windowed_tiny(windows, scale=None, softcap=None, seed=0):
    model = tiny_llama(seed=seed, layers=len(windows))
    model.config = replace(model.config, layer_windows=tuple(windows), attn_scale=scale, attn_softcap=softcap)
    return model


def greedy_reference(model, prompt, max_tokens):
    attention = WindowedNumpyAttention(model.config)
    logits = model.forward(np.array(prompt), np.arange(len(prompt)), attention)
    out = []
    for _ in range(max_tokens):
        out.append(int(np.argmax(logits[-1])))
        p = len(prompt) + len(out) - 1
        logits = model.forward(np.array([out[-1]]), np.array([p]), attention)
    return out


PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 71)), list(range(3, 30)) + [9, 9]]


@pytest.mark.parametrize("windows,scale,softcap", [
    ((5, 0, 7), None, None),  # windows that start inside a block, and a full-attention layer
    ((6, 6), 0.5, 3.0),  # every layer windowed (one pool), Gemma-style scale and soft-cap
])
def test_engine_matches_windowed_attention_alone_and_batched(windows, scale, softcap):
    model = windowed_tiny(windows, scale, softcap)
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in PROMPTS]
    # the reference is not full attention: the windows change the continuation
    full = replace(model.config, layer_windows=())
    assert any(greedy_reference(replace_config(model, full), p, GREEDY.max_tokens) != w
               for p, w in zip(PROMPTS, want, strict=True))
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=64)
    engine = LLMEngine(model, cfg)
    assert len(engine.block_manager.groups) == len(layer_groups(model.config))
    for prompt, w in zip(PROMPTS, want, strict=True):
        (alone,) = engine.generate([prompt], GREEDY)
        assert alone.token_ids == w
    # batched, chunked prefills, prefix hits (prompt 0 and 3 share 27 tokens; prompt 0 ran above)
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == want
    assert engine.block_manager.stats.prefix_hits > 0
    assert engine.block_manager.num_used == 0
    engine.block_manager.check([])


def replace_config(model, config):
    other = windowed_tiny((0,) * config.num_layers)
    other.config = config
    return other


def test_preemption_and_a_small_windowed_pool_keep_outputs():
    """A pool so small that requests preempt each other: recomputed windowed tables, same tokens."""
    model = windowed_tiny((4, 0, 4), seed=1)
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in PROMPTS]
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=8, num_kv_blocks=20,
                                           max_num_seqs=4))
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used == 0


def test_windowed_layers_hold_the_window_not_the_context():
    """Decoding one long request: between steps the windowed pool holds at most the window's
    blocks (the window plus the block being filled), while the full-attention pool grows."""
    model = windowed_tiny((8, 0, 8), seed=2)
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=64))
    engine.add_request("a", list(range(1, 60)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    full, windowed = engine.block_manager.groups
    while engine.scheduler.has_work():
        engine.step()
        req = engine.requests.get("a")
        if req is not None and engine.scheduler.num_running():
            assert windowed.num_used <= window_blocks(8, 4) and full.num_used == -(-req.num_computed_tokens // 4)
            assert kv_held(engine) <= sequence_kv_bytes(model.config, req.num_computed_tokens + 1, 4)
    assert full.peak_used == -(-99 // 4) and windowed.peak_used <= window_blocks(8, 4) + 16 // 4 + 1


def test_sequence_kv_bound_of_gemma3_270m_attention():
    cfg = gemma3_270m_attention(4096)
    per_layer_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert [g.window for g in layer_groups(cfg)] == [0, 512] and len(layer_groups(cfg)[0].layers) == 3
    bound = sequence_kv_bytes(cfg, 4000, 16)
    assert bound == per_layer_token * (3 * 4000 + 15 * (512 + 16))  # global x context + windowed x (window + a block)
    assert sequence_kv_bytes(cfg, 4000, 16, windows=False) == per_layer_token * 18 * 4000
    assert block_bytes(cfg, 16, 15) == 15 * 16 * per_layer_token


def test_a_long_request_on_gemma3_attention_shape_keeps_to_the_bound():
    """The bench's measurement, shortened (1,200 tokens, window 128 on 15 layers of 18)."""
    cfg = gemma3_270m_attention(1300, window=128, hidden=32)
    r = measure(cfg, 1200, 4, max_num_batched_tokens=256)
    assert r["kv_held_between_steps_bytes"] <= r["bound_bytes"] < r["full_attention_bytes"] / 3
    # within a step the windowed pool holds the window and the prefill chunk
    per_token = 2 * cfg.head_dim * 4
    assert r["kv_peak_in_step_bytes"] <= r["bound_bytes"] + 15 * per_token * (256 + 16)


def test_memory_plan_sizes_the_windowed_pool_by_the_window():
    from scratchllm.engine.memory_plan import plan_memory

    model = windowed_tiny((5, 0, 7))
    cfg = EngineConfig(max_num_seqs=4, block_size=4, max_num_batched_tokens=16, memory_budget_bytes=1 << 32)
    plan = plan_memory(model, cfg, 512)
    assert plan.window == 7 and plan.num_window_blocks == 4 * (window_blocks(7, 4) + 1) + 16 // 4
    assert plan.num_kv_blocks == 4 * 512 // 4  # the full-attention layer: every sequence at full length
    assert plan.kv_block_bytes == block_bytes(model.config, 4, 1, plan.kv_dtype)
    assert plan.window_block_bytes == block_bytes(model.config, 4, 2, plan.kv_dtype)
    assert plan.kv_bytes == plan.num_kv_blocks * plan.kv_block_bytes + plan.num_window_blocks * plan.window_block_bytes
    assert "windowed (7 tokens)" in plan.describe()
    fixed = plan_memory(model, replace(cfg, num_kv_blocks=10), 512)  # never more windowed blocks than full ones
    assert fixed.num_kv_blocks == 10 and fixed.num_window_blocks == 10


def test_stats_count_each_pools_blocks_at_their_own_size():
    """kv_bytes_used / kv_bytes_peak add each pool's blocks at its block size: the windowed pool's
    blocks hold fewer layers than the full-attention pool's."""
    model = windowed_tiny((8, 0, 8), seed=2)
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=64))
    engine.add_request("a", list(range(1, 60)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    full, windowed = engine.block_manager.groups
    plan, peak = engine.plan, 0
    assert plan.window_block_bytes != plan.kv_block_bytes  # 2 windowed layers, 1 full one
    while engine.scheduler.has_work():
        engine.step()
        used = full.num_used * plan.kv_block_bytes + windowed.num_used * plan.window_block_bytes
        peak = max(peak, used)
        assert engine.stats().kv_bytes_used == used
    assert engine.stats().kv_bytes_peak >= peak > 0
