"""Every block in one C call (kernels/llama_blocks.pyx) against the Python loop over the same
kernels (models/llama.blocks_into), which it must equal bit for bit; when the model takes it; and
what it refuses. test_fused_forward.py compares both against the expressions of llama.block."""

import numpy as np
import pytest

from scratchllm.engine.paged_attention import PagedAttention, PagedSequence
from scratchllm.kernels.llama_blocks import LlamaBlocks
from scratchllm.models import ContiguousKVCache
from scratchllm.models import llama as llama_module
from scratchllm.models.llama import llama
from scratchllm.models.workspace import StepBuffers
from tests.engine.tiny import tiny_llama
from tests.models.test_fused_forward import with_biases


def forward_both(model, ids, pos, make_attention):
    """model.forward's logits with the C blocks and with the Python loop, each on its own attention."""
    blocks = model.params["blocks"]
    assert isinstance(blocks, LlamaBlocks)
    fused = model.forward(ids, pos, make_attention())
    model.params["blocks"] = None
    try:
        loop = model.forward(ids, pos, make_attention())
    finally:
        model.params["blocks"] = blocks
    return fused, loop


def test_engine_step_of_many_sequences_bit_for_bit():
    model = tiny_llama(seed=11, layers=3)
    cfg = model.config
    lens = [5, 1, 17, 2]  # prefills and single decode rows in one step, one sequence over two blocks
    seq = np.repeat(np.arange(4), lens).astype(np.int32)
    pos = np.concatenate([np.arange(n) + (9 if n == 1 else 0) for n in lens])  # the 1-row one decodes at 9
    ids = np.arange(len(seq)) * 13 % cfg.vocab_size
    tables = np.arange(4 * 2, dtype=np.int32).reshape(4, 2)

    def attention():
        a = PagedAttention.for_model(cfg, num_blocks=8, block_size=16)
        a.set_layout(tables, seq, pos)
        return a

    fused, loop = forward_both(model, ids, pos, attention)
    assert np.array_equal(fused, loop)


def test_decode_steps_bit_for_bit_and_lengths():
    model = tiny_llama(seed=12, layers=2)
    caches = [PagedSequence(model.config, 48), PagedSequence(model.config, 48)]
    blocks = model.params["blocks"]
    ids = np.arange(7) * 5 % model.config.vocab_size
    for step in range(6):
        pos = np.arange(caches[0].length, caches[0].length + len(ids))
        out = []
        for cache, use_c in zip(caches, (True, False), strict=True):
            model.params["blocks"] = blocks if use_c else None
            out.append(model.forward(ids, pos, cache))
        model.params["blocks"] = blocks
        assert np.array_equal(out[0], out[1]), f"step {step}"
        assert caches[0].length == caches[1].length == pos[-1] + 1
        ids = np.array([int(np.argmax(out[0][-1]))])


def test_the_model_takes_the_c_blocks_for_paged_attention_only(monkeypatch):
    model = tiny_llama(seed=13)
    calls = []
    original = llama_module.blocks_into
    monkeypatch.setattr(llama_module, "blocks_into", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids, pos = np.arange(4), np.arange(4)
    model.forward(ids, pos, PagedSequence(model.config, 16))
    assert calls == []  # the C blocks ran every layer
    model.forward(ids, pos, ContiguousKVCache.for_model(model.config, 16))
    assert calls == [1]  # any other cache object: the Python loop, which calls it per layer


def test_time_split_is_measured_and_attention_is_traced():
    model = tiny_llama(seed=14, layers=2)
    cache = PagedSequence(model.config, 16)
    model.forward(np.arange(6), np.arange(6), cache)
    blocks = model.params["blocks"]
    assert blocks.matmul_ns > 0 and blocks.attention_ns > 0 and blocks.other_ns > 0
    assert cache.attention.elapsed_ns == blocks.attention_ns  # the engine trace's attention share


def test_models_with_biases_keep_the_python_loop():
    model = with_biases(tiny_llama(seed=15), o_bias=False)
    assert model.params["blocks"] is None
    with pytest.raises(TypeError, match="biases"):
        LlamaBlocks(model.params["layers"], model.config)


def test_bad_arguments_are_errors_not_crashes():
    model = tiny_llama(seed=16)
    cfg, blocks = model.config, model.params["blocks"]
    att = PagedAttention.for_model(cfg, num_blocks=2, block_size=16)
    att.set_layout(np.array([[0, 1]], np.int32), np.zeros(3, np.int32), np.arange(3, dtype=np.int32))
    x = np.zeros((3, cfg.hidden_size), np.float32)
    cos = np.ones((3, cfg.head_dim // 2), np.float32)
    args = (att.k_cache, att.v_cache, att.block_tables, att.token_seq, att.token_pos, att.max_ctx, att.scale)
    with pytest.raises(ValueError, match="buffers"):
        blocks.run(x, StepBuffers.allocate(cfg, 2), cos, cos, *args)  # 2-row buffers for 3 tokens
    with pytest.raises(ValueError, match="rotary"):
        blocks.run(x, StepBuffers.allocate(cfg, 3), cos[:2], cos[:2], *args)
    with pytest.raises(ValueError, match="layout"):
        blocks.run(x[:2], StepBuffers.allocate(cfg, 2), cos[:2], cos[:2], *args)  # the layout has 3 tokens
    other = PagedAttention(cfg.num_layers + 1, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="pools"):
        blocks.run(x, StepBuffers.allocate(cfg, 3), cos, cos, other.k_cache, other.v_cache, *args[2:])
    full = PagedSequence(cfg, 4)
    with pytest.raises(ValueError, match="holds 16 positions"):
        model.forward(np.arange(20) % cfg.vocab_size, np.arange(20), full)
    assert full.length == 0  # nothing was taken


def test_no_workspace_path_is_unchanged():
    """llama() without a workspace is the block-by-block definition, whatever the attention."""
    model = tiny_llama(seed=17)
    ids, pos = np.arange(5), np.arange(5)
    a = llama(ids, pos, PagedSequence(model.config, 16), model.params, model.config)
    b = model.forward(ids, pos, PagedSequence(model.config, 16))
    assert np.array_equal(a, b)


def test_check_bit_equal_script_on_the_default_model():
    """scripts/check_bit_equal.py: the exact path's logits against float32's, through the C blocks."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "scripts" / "check_bit_equal.py"), "default", "--steps", "3",
                          "--json"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)},
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["equal"] and report["dtype"] == "quantized" and report["rows_compared"] == 40 + 3
