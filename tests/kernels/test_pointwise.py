"""The fused elementwise kernels (scratchllm/kernels/pointwise.pyx) against transformers' and
torch's own Llama pieces."""

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from scratchllm.kernels import pointwise as pw
from scratchllm.models.llama import rope_tables


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1536])  # whole vectors of 16 and a scalar tail
def test_silu_mul_equals_torch(n):
    rng = np.random.default_rng(n)
    gu = (rng.standard_normal((5, 2 * n)) * 8).astype(np.float32)
    gu[0, : min(n, 4)] = [-120.0, 120.0, 0.0, -0.0][:n]  # saturated and zero gates
    t = torch.from_numpy(gu).double()
    expect = (torch.nn.functional.silu(t[:, :n]) * t[:, n:]).numpy()
    np.testing.assert_allclose(pw.silu_mul(gu), expect, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("n", [7, 576])
def test_rms_norm_equals_transformers(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((9, n)) * 3).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    norm = LlamaRMSNorm(n, eps=1e-5)
    norm.weight.data = torch.from_numpy(w)
    with torch.no_grad():
        expect = norm(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(pw.rms_norm(x, w, 1e-5), expect, rtol=1e-5, atol=1e-5)


def test_rope_in_place_equals_transformers():
    rng = np.random.default_rng(0)
    N, H, KVH, D = 6, 4, 2, 16
    qkv = rng.standard_normal((N, H + 2 * KVH, D)).astype(np.float32)
    pos = np.array([0, 1, 5, 63, 7, 2])
    cos, sin = rope_tables(D, 10000.0, 64)
    ours = qkv.copy()
    pw.rope_(ours, H + KVH, cos[pos], sin[pos])
    # transformers: q, k as [batch, heads, seq, D], cos/sin as [batch, seq, D] (halves repeated)
    c = torch.from_numpy(np.concatenate([cos[pos], cos[pos]], -1))[None]
    s = torch.from_numpy(np.concatenate([sin[pos], sin[pos]], -1))[None]
    q = torch.from_numpy(qkv[:, :H]).transpose(0, 1)[None]
    k = torch.from_numpy(qkv[:, H : H + KVH]).transpose(0, 1)[None]
    q_rot, k_rot = apply_rotary_pos_emb(q, k, c, s)
    np.testing.assert_allclose(ours[:, :H], q_rot[0].transpose(0, 1).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours[:, H : H + KVH], k_rot[0].transpose(0, 1).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ours[:, H + KVH :], qkv[:, H + KVH :])  # v is not rotated


def test_shape_errors():
    with pytest.raises(ValueError):
        pw.rms_norm(np.zeros((2, 4), np.float32), np.zeros(5, np.float32), 1e-5)
    with pytest.raises(ValueError):
        pw.rope_(np.zeros((2, 3, 8), np.float32), 4, np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32))


def test_add_rms_norm_equals_add_then_norm_bit_for_bit():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 576)) * 3).astype(np.float32)
    h = rng.standard_normal((5, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    want_x = x + h
    want = pw.rms_norm(want_x, w, 1e-5)
    out = np.empty_like(x)
    pw.add_rms_norm(x, h, w, 1e-5, out)
    assert np.array_equal(x, want_x) and np.array_equal(out, want)
    np.testing.assert_allclose(out, want_x / np.sqrt((want_x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
                               * w, rtol=1e-5, atol=1e-5)  # NumPy's statement of the rule, in float64


def test_out_buffers_hold_the_same_values():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    out = np.full((3, 64), np.nan, np.float32)
    assert pw.rms_norm(x, w, 1e-6, out=out) is out and np.array_equal(out, pw.rms_norm(x, w, 1e-6))
    gu = rng.standard_normal((3, 128)).astype(np.float32)
    assert pw.silu_mul(gu, out=out) is out and np.array_equal(out, pw.silu_mul(gu))


@pytest.mark.parametrize("bad", [np.zeros((3, 63), np.float32), np.zeros((3, 64), np.float64),
                                 np.zeros((64, 3), np.float32).T])
def test_bad_out_buffers_are_refused(bad):
    x, w = np.zeros((3, 64), np.float32), np.ones(64, np.float32)
    with pytest.raises(ValueError, match="out must be"):
        pw.rms_norm(x, w, 1e-6, out=bad)
    with pytest.raises(ValueError, match="out must be"):
        pw.silu_mul(np.zeros((3, 128), np.float32), out=bad)


def test_add_rms_norm_shape_errors():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        pw.add_rms_norm(x, np.zeros((2, 7), np.float32), np.ones(8, np.float32), 1e-5, np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        pw.add_rms_norm(x, x.copy(), np.ones(8, np.float32), 1e-5, np.zeros((1, 8), np.float32))
