"""The forward over the step's workspace (llama.blocks_into) against the expressions of
llama.block, which it must equal bit for bit: the same float operations in the same order.

Both sides share embed, the attention kernel and the LM head; what differs is every buffer, the
matmul call, and the residual adds fused into the norms. The references for the numbers
themselves are elsewhere (test_smollm2.py: transformers on the same file, through the model's
forward, which is this path).
"""

import dataclasses

import numpy as np
import pytest

from scratchllm.engine.paged_attention import PagedSequence
from scratchllm.models import ContiguousKVCache
from scratchllm.models.llama import LlamaModel, llama
from scratchllm.models.workspace import CACHED_ROWS, StepBuffers
from tests.engine.tiny import tiny_llama


def with_biases(model: LlamaModel, o_bias: bool) -> LlamaModel:
    """The same random model with q/k/v biases (Qwen2) and optionally an o bias (Llama attention_bias)."""
    cfg = dataclasses.replace(model.config, qkv_bias=True, o_bias=o_bias)
    rng = np.random.default_rng(1)
    weights = dict(model.weights.items())
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        for name, n in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            weights[a + name + ".bias"] = rng.standard_normal(n).astype(np.float32)
        if o_bias:
            weights[a + "o_proj.bias"] = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    return LlamaModel(cfg, weights)


def assert_paths_equal(model: LlamaModel, make_cache, prompt_len: int, steps: int, logits_rows=None):
    """Prefill then greedy decode, each step through both paths on caches of their own."""
    fused, ref = make_cache(model.config), make_cache(model.config)
    ids, pos = np.arange(prompt_len) * 7 % model.config.vocab_size, np.arange(prompt_len)
    a = model.forward(ids, pos, fused, logits_rows=logits_rows)
    b = llama(ids, pos, ref, model.params, model.config, logits_rows)  # no workspace: block by block
    assert np.array_equal(a, b)
    for step in range(steps):
        token = np.array([int(np.argmax(a[-1]))])
        a = model.forward(token, np.array([prompt_len + step]), fused)
        b = llama(token, np.array([prompt_len + step]), ref, model.params, model.config)
        assert np.array_equal(a, b), f"decode step {step}: max difference {np.abs(a - b).max()}"


def paged(cfg):
    return PagedSequence(cfg, 160)


def contiguous(cfg):
    return ContiguousKVCache.for_model(cfg, 160)


@pytest.mark.parametrize("prompt_len", [1, 5, CACHED_ROWS + 36])  # the cached buffers, and a prefill too big for them
@pytest.mark.parametrize("make_cache", [paged, contiguous])
def test_tiny_model_bit_for_bit(prompt_len, make_cache):
    assert_paths_equal(tiny_llama(seed=3, layers=3), make_cache, prompt_len, steps=6)


@pytest.mark.parametrize("o_bias", [False, True])
def test_biases_bit_for_bit(o_bias):
    assert_paths_equal(with_biases(tiny_llama(seed=4), o_bias), paged, 9, steps=4, logits_rows=[3, 8])


def test_batched_rows_of_many_sequences():
    """An engine-shaped step: several sequences' tokens packed into one forward."""
    from scratchllm.engine.paged_attention import PagedAttention

    model = tiny_llama(seed=5)
    cfg = model.config
    lens = [3, 1, 6]
    seq = np.repeat(np.arange(3), lens)
    pos = np.concatenate([np.arange(n) for n in lens])
    ids = np.arange(len(seq)) * 11 % cfg.vocab_size
    tables = np.arange(3 * 2, dtype=np.int32).reshape(3, 2)
    out = []
    for use_workspace in (True, False):
        att = PagedAttention.for_model(cfg, num_blocks=6, block_size=16)
        att.set_layout(tables, seq, pos)
        out.append(llama(ids, pos, att, model.params, cfg, workspace=model.workspace if use_workspace else None))
    assert np.array_equal(out[0], out[1])


@pytest.mark.slow
def test_default_model_bit_for_bit(default_gguf):
    from scratchllm.models import load_model

    model = load_model("default")  # its default dtype: the file's 4-bit blocks
    assert_paths_equal(model, lambda cfg: PagedSequence(cfg, 64), 12, steps=8)


def test_workspace_reuses_its_buffers():
    model = tiny_llama(seed=6)
    ws = model.workspace
    with ws.rows(3) as first:
        pass
    with ws.rows(3) as again:
        assert again is first  # the same views, step after step
    with ws.rows(2) as fewer:
        assert fewer.h.ctypes.data == first.h.ctypes.data and fewer.rows == 2
    with ws.rows(3) as held, ws.rows(3) as other:  # a second forward at once (another thread): its own buffers
        assert other.h.ctypes.data != held.h.ctypes.data
    with ws.rows(CACHED_ROWS + 1) as big:
        assert big.rows == CACHED_ROWS + 1
    with ws.rows(3) as after:
        assert after is first  # the big step did not replace the cached buffers


def test_step_buffers_views_share_memory():
    cfg = tiny_llama(seed=7).config
    buf = StepBuffers.allocate(cfg, 4).head(3)
    buf.qkv_rows[:] = np.arange(buf.qkv_rows.size, dtype=np.float32).reshape(buf.qkv_rows.shape)
    H, KVH = cfg.num_heads, cfg.num_kv_heads
    assert np.array_equal(buf.q, buf.qkv[:, :H]) and np.array_equal(buf.v, buf.qkv[:, H + KVH :])
    buf.attn[:] = 1.0
    assert np.array_equal(buf.attn_rows, np.ones((3, cfg.num_heads * cfg.head_dim), np.float32))
    for a in (buf.h, buf.qkv_rows, buf.qkv, buf.attn, buf.attn_rows, buf.delta, buf.gate_up, buf.act):
        assert a.flags.c_contiguous and a.shape[0] == 3


def test_ab_script_runs_and_compares(tmp_path):
    """scripts/decode_workspace_ab.py on a tiny model: both variants timed, logits compared."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.models.test_loader import tiny_llama_tensors, write

    root = Path(__file__).resolve().parents[2]
    model = write(tmp_path / "tiny", tiny_llama_tensors())
    run = subprocess.run([sys.executable, str(root / "scripts" / "decode_workspace_ab.py"), "--model", str(model),
                          "--chunks", "4", "--chunk-steps", "3", "--json"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert r["steps_each"] == 12 and r["workspace"]["best_chunk_ms"] > 0 and r["block_by_block"]["mean_ms"] > 0
    assert r["python_loop"]["mean_ms"] > 0 and "c_blocks_saved_ms_median_of_pairs" in r
