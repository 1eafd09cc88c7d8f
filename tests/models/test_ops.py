"""Each operation against a reference with a tolerance (STYLE 6, level 1): torch, or the formula."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from scratchllm.models import ContiguousKVCache  # noqa: E402
from scratchllm.models.attention import bidirectional_attention, causal_attention  # noqa: E402
from scratchllm.models.llama import rms_norm, rope, rope_tables, swiglu  # noqa: E402
from scratchllm.models.loader import unpermute_rotary  # noqa: E402
from scratchllm.models.ops import erf, gelu_erf, gelu_tanh, layer_norm  # noqa: E402

rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_rms_norm():
    x, w = randn(5, 48) * 3, randn(48)
    want = torch.nn.functional.rms_norm(torch.tensor(x), (48,), torch.tensor(w), eps=1e-5).numpy()
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), want, atol=1e-5)


def test_layer_norm_and_gelus():
    x, g, b = randn(4, 32) * 2, randn(32), randn(32)
    want = torch.nn.functional.layer_norm(torch.tensor(x), (32,), torch.tensor(g), torch.tensor(b), 1e-5)
    np.testing.assert_allclose(layer_norm(x, g, b, 1e-5), want.numpy(), atol=1e-5)
    x = np.linspace(-12, 12, 2001, dtype=np.float32)
    gelu = torch.nn.functional.gelu
    np.testing.assert_allclose(gelu_tanh(x), gelu(torch.tensor(x), approximate="tanh").numpy(), atol=1e-5)
    np.testing.assert_allclose(gelu_erf(x), gelu(torch.tensor(x)).numpy(), atol=1e-5)
    xs = np.linspace(-6, 6, 241)
    np.testing.assert_allclose(erf(xs), [math.erf(v) for v in xs], atol=2e-7)


def test_rope_matches_hf_rotate_half():
    T, H, D = 7, 3, 16
    x = randn(T, H, D)
    pos = np.array([0, 1, 2, 5, 100, 1000, 4095])
    cos, sin = rope_tables(D, 10000.0, 4096)
    got = rope(x, cos[pos], sin[pos])
    # transformers' Llama: x * cos + rotate_half(x) * sin, cos/sin repeated over both halves
    inv = 1.0 / (10000.0 ** (np.arange(0, D, 2) / D))
    ang = np.concatenate([pos[:, None] * inv] * 2, axis=1)[:, None, :]
    rot = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], axis=-1)
    np.testing.assert_allclose(got, x * np.cos(ang) + rot * np.sin(ang), atol=1e-5)


def test_swiglu():
    x, gate, up, down = randn(3, 8), randn(12, 8), randn(12, 8), randn(8, 12)
    g, u = torch.tensor(x @ gate.T), torch.tensor(x @ up.T)
    want = (torch.nn.functional.silu(g) * u).numpy() @ down.T
    # swiglu takes the packed layout: [in, out] matrices, gate|up side by side
    np.testing.assert_allclose(swiglu(x, np.concatenate([gate, up]).T.copy(), down.T.copy()), want, atol=1e-4)


@pytest.mark.parametrize("T, offset, block", [(6, 0, 128), (6, 5, 128), (11, 0, 4), (10, 7, 3), (300, 20, 128)])
def test_causal_attention_gqa_matches_sdpa(T, offset, block, monkeypatch):
    from scratchllm.models import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", block)  # long prefills go in query blocks
    H, KVH, D = 6, 2, 8
    S = offset + T
    q, k, v = randn(T, H, D), randn(KVH, S, D), randn(KVH, S, D)
    got = causal_attention(q, k, v, offset)
    # reference: repeat kv heads (query head h uses kv head h // (H/KVH)), explicit mask
    kr = torch.tensor(k).repeat_interleave(H // KVH, dim=0)
    vr = torch.tensor(v).repeat_interleave(H // KVH, dim=0)
    allowed = torch.arange(S)[None, :] <= (offset + torch.arange(T))[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(torch.tensor(q).transpose(0, 1), kr, vr, attn_mask=allowed)
    np.testing.assert_allclose(got, want.transpose(0, 1).numpy(), atol=1e-5)


def test_bidirectional_attention_ignores_padding():
    B, T, H, D = 2, 5, 2, 4
    q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    got = bidirectional_attention(q, k, v, mask)
    k2, v2 = k.copy(), v.copy()
    k2[1, 3:], v2[1, 3:] = 99.0, -99.0  # whatever sits under the padding must not matter
    np.testing.assert_allclose(bidirectional_attention(q, k2, v2, mask), got, atol=1e-6)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a).transpose(1, 2) for a in (q, k, v)), attn_mask=torch.tensor(mask[:, None, None, :] > 0))
    np.testing.assert_allclose(got, want.transpose(1, 2).numpy(), atol=1e-5)


def test_kv_cache_appends_per_layer_and_refuses_overflow():
    cache = ContiguousKVCache(num_layers=2, num_kv_heads=1, head_dim=4, max_len=3)
    q, kv = randn(2, 2, 4), randn(2, 1, 4)
    cache(0, q, kv, kv)
    assert cache.lengths == [2, 0]
    cache(1, q, kv, kv)
    assert cache.length == 2
    np.testing.assert_array_equal(cache.k[1, 0, :2], kv[:, 0])
    with pytest.raises(ValueError, match="holds 3 positions"):
        cache(0, q, kv, kv)


def test_unpermute_undoes_llama_cpp_permute():
    # convert_hf_to_gguf.py's LlamaModel.permute, restated from its definition
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = randn(3 * 8, 5)  # 3 heads of size 8
    np.testing.assert_array_equal(unpermute_rotary(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)
    b = randn(3 * 8)
    np.testing.assert_array_equal(unpermute_rotary(permute(b, 3), 3), b)
