"""The static padded baseline is exact: greedy outputs equal each request run alone."""

import numpy as np

from scratchllm.engine.static import run_static

from .tiny import greedy_alone, tiny_llama


def test_static_padded_batches_equal_alone():
    model = tiny_llama(seed=11)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 97, int(rng.integers(1, 30))).tolist() for _ in range(10)]
    max_tokens = [int(rng.integers(1, 12)) for _ in range(10)]
    res = run_static(model, prompts, max_tokens, batch_size=4)
    assert res.token_ids == [greedy_alone(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    assert res.padded_tokens > 0
    # each batch reserved [B, longest prompt + longest output] per layer, K and V
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    want = max(len(prompts[i : i + 4]) * (max(map(len, prompts[i : i + 4])) + max(max_tokens[i : i + 4]))
               for i in range(0, 10, 4)) * per_token
    assert res.peak_kv_bytes == want


def test_a_row_ends_at_the_context_and_its_padding_stays_inside_it():
    """A long prompt whose max_tokens runs past the context ends there ("length"), in a batch
    whose other row runs on longer: its padding steps are fed no position past the context."""
    model = tiny_llama(seed=11)
    ctx = model.config.max_position_embeddings
    long_prompt, short_prompt = [7] * (ctx - 12), [3, 5, 8]
    res = run_static(model, [long_prompt, short_prompt], [100, 40], batch_size=2)
    assert res.token_ids == [greedy_alone(model, long_prompt, 12), greedy_alone(model, short_prompt, 40)]


def test_static_honours_sliding_windows_scale_and_soft_cap():
    """Gemma-style attention in the padded baseline: per-layer windows (in a batch whose rows are
    padded differently), the model's softmax scale and the soft-cap, as the definition computes them."""
    from .test_sliding_window import PROMPTS, greedy_reference, windowed_tiny

    model = windowed_tiny((5, 0, 7), scale=0.5, softcap=3.0, seed=3)
    want = [greedy_reference(model, p, 10) for p in PROMPTS]
    res = run_static(model, PROMPTS, [10] * len(PROMPTS), batch_size=4)
    assert res.token_ids == want
