"""Every block in one C call (kernels/llama_blocks.pyx) against the Python loop over the same
kernels (models/llama.blocks_into), which it must equal bit for bit; when the model takes it; and
what it refuses. test_fused_forward.py compares both against the expressions of llama.block.

The llama family's variations run in the C blocks too: each architecture below is a tiny random
model of that shape (QK-norm, Gemma's output norms and GeGLU, Gemma 3's second rope base, sliding
windows in one pool or two, the scores' soft-cap), checked against the Python loop and against the
block-by-block definition, bit for bit, on an engine step of several sequences and on decode steps
that go past the windows."""

import dataclasses
import logging

import numpy as np
import pytest

from scratchllm.engine.paged_attention import PagedAttention, PagedSequence
from scratchllm.kernels.llama_blocks import LlamaBlocks
from scratchllm.models import ContiguousKVCache, ModelConfig, llama_pack
from scratchllm.models import llama as llama_module
from scratchllm.models.architectures import GEMMA2, GEMMA3, MISTRAL, PHI3, QWEN3
from scratchllm.models.llama import LlamaModel, llama
from scratchllm.models.llama_pack import FusedPathNotCovered, check_fused_coverage
from scratchllm.models.workspace import StepBuffers
from tests.engine.tiny import tiny_llama
from tests.models.test_fused_forward import assert_paths_equal, with_biases


def forward_both(model, ids, pos, make_attention):
    """model.forward's logits with the C blocks and with the Python loop, each on its own attention."""
    blocks = model.params.blocks
    assert isinstance(blocks, LlamaBlocks)
    fused = model.forward(ids, pos, make_attention())
    model.params.blocks = None
    try:
        loop = model.forward(ids, pos, make_attention())
    finally:
        model.params.blocks = blocks
    return fused, loop


def test_engine_step_of_many_sequences_bit_for_bit():
    engine_step_bit_for_bit(tiny_llama(seed=11, layers=3))


def engine_step_bit_for_bit(model):
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
    blocks = model.params.blocks
    ids = np.arange(7) * 5 % model.config.vocab_size
    for step in range(6):
        pos = np.arange(caches[0].length, caches[0].length + len(ids))
        out = []
        for cache, use_c in zip(caches, (True, False), strict=True):
            model.params.blocks = blocks if use_c else None
            out.append(model.forward(ids, pos, cache))
        model.params.blocks = blocks
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
    blocks = model.params.blocks
    assert blocks.matmul_ns > 0 and blocks.attention_ns > 0 and blocks.other_ns > 0
    assert cache.attention.elapsed_ns == blocks.attention_ns  # the engine trace's attention share


@pytest.mark.parametrize("o_bias", [False, True])
def test_models_with_biases_run_in_the_c_blocks_bit_for_bit(o_bias):
    """q|k|v biases (Qwen2) and an o bias (Llama's attention_bias): added in the C blocks as
    linear_into adds them, on an engine step of several sequences and on decode steps."""
    model = with_biases(tiny_llama(seed=15, layers=3), o_bias=o_bias)
    assert isinstance(model.params.blocks, LlamaBlocks)
    engine_step_bit_for_bit(model)
    assert_paths_equal(model, lambda cfg: PagedSequence(cfg, 48), prompt_len=7, steps=5)


def test_a_bias_of_the_wrong_size_is_refused():
    model = with_biases(tiny_llama(seed=15), o_bias=True)
    layers = list(model.params.layers)
    layers[1] = dataclasses.replace(layers[1], o_bias=layers[1].o_bias[:-1])
    with pytest.raises(ValueError, match="o_bias"):
        LlamaBlocks(layers, model.config)


def test_bfloat16_models_keep_the_python_loop(caplog):
    """Coverage is decided from the description before the blocks are bound, and said once in the
    log; the kernel, handed layers it does not cover, raises ValueError (the caller's bug), not a
    TypeError a fallback could swallow."""
    tiny = tiny_llama(seed=16)
    with caplog.at_level(logging.INFO, logger="scratchllm.models.llama_pack"):
        model = LlamaModel(tiny.config, dict(tiny.weights.items()), dtype="bfloat16")
        LlamaModel(tiny.config, dict(tiny.weights.items()), dtype="bfloat16")
    assert model.params.blocks is None
    said = [r.getMessage() for r in caplog.records if "blocks_into" in r.getMessage()]
    assert len(said) <= 1 and all("bfloat16" in m for m in said)  # once per process
    with pytest.raises(FusedPathNotCovered, match="bfloat16"):
        check_fused_coverage(tiny.config, "bfloat16")
    check_fused_coverage(tiny.config, "quantized")  # covered: no exception
    check_fused_coverage(with_biases(tiny, o_bias=True).config, "float32")  # biases too
    with pytest.raises(ValueError, match="bfloat16"):
        LlamaBlocks(model.params.layers, model.config)


def test_a_bug_in_binding_the_blocks_is_not_swallowed(monkeypatch):
    """Where the description says the blocks cover a model, an error while binding them reaches
    the caller: no fallback to the slow path hides it."""
    def broken(*args, **kwargs):
        raise TypeError("a bug in the binding")

    monkeypatch.setattr(llama_pack, "LlamaBlocks", broken)
    with pytest.raises(TypeError, match="a bug in the binding"):
        tiny_llama(seed=18)


def test_bad_arguments_are_errors_not_crashes():
    model = tiny_llama(seed=16)
    cfg, blocks = model.config, model.params.blocks
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
    for bad in ([1, 1], [2, 0], [3], [-1]):  # the rows that get logits: increasing rows of the step
        with pytest.raises(ValueError, match="out_rows"):
            blocks.run(x, StepBuffers.allocate(cfg, 3), cos, cos, *args, out_rows=np.array(bad, np.int32))
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


# ---- the llama family's variations ---------------------------------------------------------------
BASE = dict(family="llama", vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=48, norm_eps=1e-6, max_position_embeddings=512)
GEMMA = dict(hidden_act="gelu_tanh", embed_scale=32 ** 0.5, norm_weight_offset=1.0, tie_word_embeddings=True,
             attn_scale=0.2)
ARCHITECTURES = {  # windows of 5 and 9 start inside a 16-token block; 37 tokens go past them
    "gemma3": dict(model_type="gemma3", arch=GEMMA3, layer_windows=(5, 5, 0), rope_theta=1e6,
                   rope_local_theta=10000.0, **GEMMA),
    "gemma2": dict(model_type="gemma2", arch=GEMMA2, layer_windows=(9, 0, 9), attn_softcap=2.0, final_softcap=5.0,
                   **GEMMA),
    "qwen3": dict(model_type="qwen3", arch=QWEN3),
    "mistral": dict(model_type="mistral", arch=MISTRAL, layer_windows=(9, 9, 9)),
    "phi3": dict(model_type="phi3", arch=PHI3, layer_windows=(5, 5, 5)),
}


def random_model(arch: str, seed: int = 0) -> LlamaModel:
    """A random model of `arch`'s shape, its tensors under the Hugging Face names the loader reads."""
    cfg = ModelConfig(**BASE, **ARCHITECTURES[arch])
    rng = np.random.default_rng(seed)
    C, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    def norm(n):  # Gemma's files store w for a scale of 1 + w
        return w(n, scale=0.3) + (0.0 if cfg.norm_weight_offset else 1.0)

    weights = {"model.embed_tokens.weight": w(cfg.vocab_size, C, scale=1.0), "model.norm.weight": norm(C)}
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = w(cfg.vocab_size, C)
    for i in range(cfg.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if cfg.arch.sandwich_norms else []
        weights |= {p + n + ".weight": norm(C) for n in norms}
        if cfg.arch.fused_projections:
            weights[a + "qkv_proj.weight"] = w(cfg.q_size + 2 * cfg.kv_size, C)
            weights[m + "gate_up_proj.weight"] = w(2 * I, C)
        else:
            weights |= {a + "q_proj.weight": w(cfg.q_size, C), a + "k_proj.weight": w(cfg.kv_size, C),
                        a + "v_proj.weight": w(cfg.kv_size, C), m + "gate_proj.weight": w(I, C),
                        m + "up_proj.weight": w(I, C)}
        if cfg.arch.qk_norm:
            weights |= {a + "q_norm.weight": norm(D), a + "k_norm.weight": norm(D)}
        weights |= {a + "o_proj.weight": w(C, cfg.q_size), m + "down_proj.weight": w(C, I)}
    return LlamaModel(cfg, weights)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_runs_in_the_c_blocks(arch, monkeypatch):
    model = random_model(arch)
    assert isinstance(model.params.blocks, LlamaBlocks)
    assert model.params.blocks.gelu == (model.config.hidden_act == "gelu_tanh")
    calls = []
    original = llama_module.blocks_into
    monkeypatch.setattr(llama_module, "blocks_into", lambda *a, **k: calls.append(1) or original(*a, **k))
    model.forward(np.arange(6), np.arange(6), PagedSequence(model.config, 16))
    assert calls == []


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_engine_step_bit_for_bit(arch):
    """Prefills and decode rows of four sequences in one step, each sequence's windowed layers in
    blocks of their own pool (other block ids than the full-attention layers')."""
    model = random_model(arch, seed=1)
    cfg = model.config
    lens = [5, 1, 37, 2]
    seq = np.repeat(np.arange(4), lens).astype(np.int32)
    pos = np.concatenate([np.arange(n) + (20 if n == 1 else 0) for n in lens])
    ids = np.arange(len(seq)) * 13 % cfg.vocab_size
    tables = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    window_tables = tables[::-1, ::-1].copy()  # the same blocks, other ids

    def attention():
        a = PagedAttention.for_model(cfg, num_blocks=12, block_size=16)
        a.set_layout(tables, seq, pos, window_tables if a.num_groups == 2 else None)
        return a

    assert attention().num_groups == (2 if arch in ("gemma3", "gemma2") else 1)
    fused, loop = forward_both(model, ids, pos, attention)
    assert np.array_equal(fused, loop)
    assert np.array_equal(fused, llama(ids, pos, attention(), model.params, cfg))  # the definition, block by block


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_decode_past_the_windows_bit_for_bit(arch):
    assert_paths_equal(random_model(arch, seed=2), lambda cfg: PagedSequence(cfg, 64), prompt_len=7, steps=12)


@pytest.mark.parametrize("rows", [[-1], [4, 0, 9, 4], [2], []])
def test_the_last_block_finishes_only_the_rows_that_get_logits(rows):
    """logits_rows through the C blocks (the last block past its attention on those rows alone)
    equal the Python loop's logits of the same rows, bit for bit, with repeats, negatives and in
    any order; and the step's K/V are the same for every row (a decode step after it agrees)."""
    model = with_biases(tiny_llama(seed=21, layers=3), o_bias=False)
    ids, pos = np.arange(10) * 3 % model.config.vocab_size, np.arange(10)
    caches = [PagedSequence(model.config, 32), PagedSequence(model.config, 32)]
    blocks = model.params.blocks
    out = []
    for cache, use_c in zip(caches, (True, False), strict=True):
        model.params.blocks = blocks if use_c else None
        try:
            out.append((model.forward(ids, pos, cache, logits_rows=rows),
                        model.forward(np.array([5]), np.array([10]), cache)))
        finally:
            model.params.blocks = blocks
    assert out[0][0].shape == (len(rows), model.config.vocab_size)
    assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1])


def test_run_with_out_rows_puts_those_rows_first():
    model = tiny_llama(seed=23, layers=2)
    cfg, blocks = model.config, model.params.blocks
    N, rows = 6, np.array([1, 3, 5], np.int32)
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((N, cfg.hidden_size)).astype(np.float32)
    angle = rng.standard_normal((N, cfg.head_dim // 2)).astype(np.float32)
    out = []
    for out_rows in (None, rows):
        att = PagedAttention.for_model(cfg, num_blocks=1, block_size=16)
        att.set_layout(np.array([[0]], np.int32), np.zeros(N, np.int32), np.arange(N, dtype=np.int32))
        x = x0.copy()
        blocks.run(x, StepBuffers.allocate(cfg, N), np.cos(angle), np.sin(angle), att.k_cache, att.v_cache,
                   att.block_tables, att.token_seq, att.token_pos, att.max_ctx, att.scale, out_rows=out_rows)
        out.append((x, att.k_cache.copy(), att.v_cache.copy()))
    assert np.array_equal(out[1][0][: len(rows)], out[0][0][rows])
    assert np.array_equal(out[1][1], out[0][1]) and np.array_equal(out[1][2], out[0][2])  # every row's K/V
