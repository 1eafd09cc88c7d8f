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
