"""The Cython paged-attention kernel against the NumPy reference (gather + 3-D mask), and the
reference itself against plain per-sequence causal attention."""

import math

import numpy as np
import pytest

from scratchllm.engine.masks import (
    left_padded_causal_mask,
    left_padded_causal_mask_loop,
    left_padded_causal_mask_python,
    varlen_causal_mask,
    varlen_causal_mask_loop,
    varlen_causal_mask_python,
)
from scratchllm.engine.paged_attention import PagedAttention, reference_attention


def layout(rng, seqs, BS, num_blocks):
    """seqs: list of (context_len_before, new_tokens). Random, non-contiguous block tables."""
    MB = max(-(-(c + n) // BS) for c, n in seqs)
    ids = rng.permutation(num_blocks)
    tables = np.zeros((len(seqs), MB), np.int32)
    used = 0
    token_seq, token_pos = [], []
    for s, (c, n) in enumerate(seqs):
        nb = -(-(c + n) // BS)
        tables[s, :nb] = ids[used : used + nb]
        used += nb
        token_seq += [s] * n
        token_pos += list(range(c, c + n))
    return tables, np.array(token_seq, np.int32), np.array(token_pos, np.int32)


@pytest.mark.parametrize("H,KVH,D", [(6, 2, 16), (4, 4, 24), (9, 3, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_reference(H, KVH, D, threads):
    rng = np.random.default_rng(H * 100 + D)
    BS, NB = 4, 64
    seqs = [(0, 7), (5, 1), (9, 6), (0, 1), (13, 1), (3, 9)]  # prefills, chunks over a prefix, decodes
    tables, tseq, tpos = layout(rng, seqs, BS, NB)
    N = len(tseq)
    q = rng.standard_normal((N, H, D)).astype(np.float32)
    k = rng.standard_normal((N, KVH, D)).astype(np.float32)
    v = rng.standard_normal((N, KVH, D)).astype(np.float32)
    attn = PagedAttention(1, NB, BS, KVH, D, num_threads=threads)
    attn.k_cache[:] = rng.standard_normal(attn.k_cache.shape)  # the cached prefixes
    attn.v_cache[:] = rng.standard_normal(attn.v_cache.shape)
    kc, vc = attn.k_cache[0].copy(), attn.v_cache[0].copy()
    want = reference_attention(q, k, v, kc, vc, tables, tseq, tpos)
    attn.set_layout(tables, tseq, tpos)
    got = attn(0, q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(attn.k_cache[0], kc)  # both wrote the same slots
    np.testing.assert_array_equal(attn.v_cache[0], vc)


def test_kernel_reads_strided_query_views():
    """The model hands q, k, v as views into its fused qkv output: rows are strided."""
    rng = np.random.default_rng(0)
    H, KVH, D, BS = 4, 2, 8, 4
    tables, tseq, tpos = layout(rng, [(0, 5), (0, 3)], BS, 8)
    qkv = rng.standard_normal((8, H + 2 * KVH, D)).astype(np.float32)
    q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]
    attn = PagedAttention(1, 8, BS, KVH, D)
    attn.set_layout(tables, tseq, tpos)
    got = attn(0, q, k, v)
    want = reference_attention(q, k, v, np.zeros_like(attn.k_cache[0]), np.zeros_like(attn.v_cache[0]),
                               tables, tseq, tpos)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_out_buffer_is_written_and_returned():
    """The model's workspace passes the output buffer: the same values as a new array, in it."""
    rng = np.random.default_rng(2)
    H, KVH, D, BS = 4, 2, 8, 4
    tables, tseq, tpos = layout(rng, [(0, 5), (0, 3)], BS, 8)
    q, k, v = (rng.standard_normal((8, h, D)).astype(np.float32) for h in (H, KVH, KVH))
    runs = []
    for out in (None, np.full((8, H, D), np.nan, np.float32)):
        attn = PagedAttention(1, 8, BS, KVH, D)
        attn.set_layout(tables, tseq, tpos)
        got = attn(0, q, k, v, out=out)
        assert out is None or got is out
        runs.append(got)
    np.testing.assert_array_equal(runs[0], runs[1])


def test_reference_is_per_sequence_causal_attention():
    rng = np.random.default_rng(1)
    H, KVH, D, BS = 4, 2, 8, 4
    tables, tseq, tpos = layout(rng, [(0, 6), (0, 3)], BS, 8)
    q = rng.standard_normal((9, H, D)).astype(np.float32)
    k = rng.standard_normal((9, KVH, D)).astype(np.float32)
    v = rng.standard_normal((9, KVH, D)).astype(np.float32)
    out = reference_attention(q, k, v, np.zeros((8, KVH, D, BS), np.float32), np.zeros((8, BS, KVH, D), np.float32),
                              tables, tseq, tpos)
    for rows in (np.arange(6), np.arange(6, 9)):
        for i, r in enumerate(rows):
            for h in range(H):
                s = k[rows[: i + 1], h // 2] @ q[r, h] / math.sqrt(D)
                p = np.exp(s - s.max())
                p /= p.sum()
                np.testing.assert_allclose(out[r, h], p @ v[rows[: i + 1], h // 2], rtol=1e-5, atol=1e-6)


def test_copy_blocks():
    attn = PagedAttention(2, 4, 2, 1, 4)
    attn.k_cache[:, 1] = 3.0
    attn.v_cache[:, 1] = 5.0
    attn.copy_blocks([(1, 2)])
    assert np.all(attn.k_cache[:, 2] == 3.0) and np.all(attn.v_cache[:, 2] == 5.0)
    assert np.all(attn.k_cache[:, 3] == 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_masks_vectorized_equals_loop(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 9))
    k_lens = rng.integers(1, 40, B)
    q_lens = np.minimum(rng.integers(1, 40, B), k_lens)
    want = varlen_causal_mask_python(q_lens.tolist(), k_lens.tolist())
    np.testing.assert_array_equal(varlen_causal_mask(q_lens, k_lens), want)
    np.testing.assert_array_equal(varlen_causal_mask_loop(q_lens, k_lens), want)
    pad = rng.integers(0, 30, B)
    want = left_padded_causal_mask_python(pad.tolist(), 5, 35)
    np.testing.assert_array_equal(left_padded_causal_mask(pad, 5, 35), want)
    np.testing.assert_array_equal(left_padded_causal_mask_loop(pad, 5, 35), want)


def test_mask_semantics():
    m = varlen_causal_mask([2, 1], [3, 2])  # seq 0: positions 1, 2 of 3; seq 1: position 1 of 2
    assert m.shape == (2, 2, 3)
    assert m[0].tolist() == [[True, True, False], [True, True, True]]
    assert m[1].tolist() == [[True, True, False], [False, False, False]]
    lp = left_padded_causal_mask([2, 0], 4, 4)  # a prefill: seq 0 has 2 pads, seq 1 none
    assert lp[0].tolist() == [[True, False, False, False], [False, True, False, False],
                              [False, False, True, False], [False, False, True, True]]
    assert lp[1].tolist() == np.tril(np.ones((4, 4), bool)).tolist()


def test_kernel_with_peaked_scores():
    """Scores hundreds apart: the kernel's own exp must flush far-below-max weights to 0, not NaN."""
    rng = np.random.default_rng(9)
    H, KVH, D, BS = 4, 2, 16, 16
    tables, tseq, tpos = layout(rng, [(0, 40), (37, 1)], BS, 16)
    q = (rng.standard_normal((41, H, D)) * 40).astype(np.float32)
    k = rng.standard_normal((41, KVH, D)).astype(np.float32)
    v = rng.standard_normal((41, KVH, D)).astype(np.float32)
    attn = PagedAttention(1, 16, BS, KVH, D)
    attn.set_layout(tables, tseq, tpos)
    got = attn(0, q, k, v)
    want = reference_attention(q, k, v, np.zeros_like(attn.k_cache[0]), np.zeros_like(attn.v_cache[0]),
                               tables, tseq, tpos)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def decode_inputs(rng, H, KVH, D, BS, NB, seqs):
    tables, tseq, tpos = layout(rng, seqs, BS, NB)
    N = len(tseq)
    q = rng.standard_normal((N, H, D)).astype(np.float32)
    k = rng.standard_normal((N, KVH, D)).astype(np.float32)
    v = rng.standard_normal((N, KVH, D)).astype(np.float32)
    return tables, tseq, tpos, q, k, v


@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (10, 2, 80), (4, 1, 16)])  # G = 3, 5 (4 + 1), 4; D = 64 + 16
@pytest.mark.parametrize("threads", [1, 2])
def test_vector_kernel_matches_reference(H, KVH, D, threads):
    """Block size 16 and D % 16 == 0: the SIMD paths, G query heads per kv head in groups of <= 4."""
    rng = np.random.default_rng(H + D)
    BS, NB = 16, 64
    seqs = [(37, 1), (0, 1), (15, 1), (100, 1), (0, 21), (16, 17)]  # decodes, then prefill chunks
    tables, tseq, tpos, q, k, v = decode_inputs(rng, H, KVH, D, BS, NB, seqs)
    attn = PagedAttention(1, NB, BS, KVH, D, num_threads=threads)
    attn.k_cache[:] = rng.standard_normal(attn.k_cache.shape)
    attn.v_cache[:] = rng.standard_normal(attn.v_cache.shape)
    want = reference_attention(q, k, v, attn.k_cache[0].copy(), attn.v_cache[0].copy(), tables, tseq, tpos)
    attn.set_layout(tables, tseq, tpos)
    np.testing.assert_allclose(attn(0, q, k, v), want, rtol=1e-5, atol=1e-5)


def test_thread_count_does_not_change_a_bit():
    """On a busy machine the pool's caller may do every item itself; batch invariance needs the
    same bits either way: one work item is always computed whole by one thread."""
    rng = np.random.default_rng(3)
    H, KVH, D, BS, NB = 9, 3, 64, 16, 128
    seqs = [(int(c), 1) for c in rng.integers(30, 200, 16)]
    tables, tseq, tpos, q, k, v = decode_inputs(rng, H, KVH, D, BS, NB, seqs)
    outs = []
    for threads in (1, 2):
        attn = PagedAttention(1, NB, BS, KVH, D, num_threads=threads)
        attn.k_cache[:] = np.random.default_rng(4).standard_normal(attn.k_cache.shape)
        attn.v_cache[:] = np.random.default_rng(5).standard_normal(attn.v_cache.shape)
        attn.set_layout(tables, tseq, tpos)
        outs.append(attn(0, q, k, v))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_the_kv_pool_is_resident_only_where_written():
    """Writing one block of one layer makes about that block resident, not a 2 MiB huge page
    around it (NumPy asks for huge pages on large arrays; the pool must not)."""
    from scratchllm.engine.paged_attention import lazy_zeros

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    pool = lazy_zeros((4, 2048, 3, 64, 16))  # 4 layers x 2048 blocks x 12 KiB = 96 MiB of address space
    assert pool.dtype == np.float32 and not pool.any()
    before = rss_kib()
    for layer in range(4):
        pool[layer, 1000] = 1.0  # one 12 KiB block per layer
    grown = rss_kib() - before
    assert grown < 4 * 64, f"writing 48 KiB made {grown} KiB resident"


def windowed_attention(q, keys, values, positions, window, scale, softcap=0.0):
    """Plain windowed causal attention of one sequence, written from the definition: the query at
    position p sees the keys at p - window + 1..p (all of 0..p without a window)."""
    H, KVH = q.shape[1], keys.shape[1]
    out = np.zeros(q.shape, np.float64)
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            g = h // (H // KVH)
            s = keys[lo : p + 1, g].astype(np.float64) @ q[i, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ values[lo : p + 1, g]
    return out


@pytest.mark.parametrize("window", [1, 3, 4, 6, 16, 40])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("H,KVH,D", [(4, 2, 16), (9, 3, 64)])
def test_windowed_kernel_matches_the_definition(window, softcap, H, KVH, D):
    """Windows that start inside a block, on a block edge, wider than the context; soft-capping
    and a scale that is not 1/sqrt(D); prefill chunks and decodes in one step."""
    rng = np.random.default_rng(window * 7 + D)
    BS, NB, scale = 4, 64, 0.3
    seqs = [(0, 9), (5, 1), (11, 6), (0, 1), (13, 1)]
    tables, tseq, tpos = layout(rng, seqs, BS, NB)
    N = len(tseq)
    q = rng.standard_normal((N, H, D)).astype(np.float32)
    k = rng.standard_normal((N, KVH, D)).astype(np.float32)
    v = rng.standard_normal((N, KVH, D)).astype(np.float32)
    attn = PagedAttention(1, NB, BS, KVH, D, windows=[window], scale=scale, softcap=softcap)
    attn.k_cache[:] = rng.standard_normal(attn.k_cache.shape)  # the cached prefixes
    attn.v_cache[:] = rng.standard_normal(attn.v_cache.shape)
    kc, vc = attn.k_cache[0].copy(), attn.v_cache[0].copy()
    ref = reference_attention(q, k, v, kc, vc, tables, tseq, tpos, window, scale, softcap)
    attn.set_layout(tables, tseq, tpos)
    got = attn(0, q, k, v)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    for s, (c, n) in enumerate(seqs):  # and against attention written from its definition
        t = np.arange(c + n)
        keys = kc[tables[s, t // BS], :, :, t % BS]  # [T, KVH, D] after this step's writes
        values = vc[tables[s, t // BS], t % BS]
        rows = np.flatnonzero(tseq == s)
        want = windowed_attention(q[rows], keys, values, tpos[rows], window, scale, softcap)
        np.testing.assert_allclose(got[rows], want, rtol=1e-4, atol=1e-5)


def test_windowed_kernel_reads_no_block_before_the_window():
    """The entries before a windowed query's window may be dropped: poisoned blocks there change nothing."""
    rng = np.random.default_rng(3)
    H, KVH, D, BS, window = 4, 2, 16, 4, 6
    tables, tseq, tpos = layout(rng, [(20, 1), (9, 3)], BS, 32)
    N = len(tseq)
    q, k, v = (rng.standard_normal((N, h, D)).astype(np.float32) for h in (H, KVH, KVH))
    attn = PagedAttention(1, 32, BS, KVH, D, windows=[window])
    attn.set_layout(tables, tseq, tpos)
    clean = attn(0, q, k, v).copy()
    for s, first in ((0, 20), (1, 9)):  # blocks wholly before the first query's window
        for b in range(max(0, first - window + 1) // BS):
            attn.k_cache[0, tables[s, b]] = np.nan
            attn.v_cache[0, tables[s, b]] = np.nan
    np.testing.assert_array_equal(attn(0, q, k, v), clean)


def test_windowless_layers_are_bit_identical_to_the_plain_kernel():
    rng = np.random.default_rng(4)
    H, KVH, D, BS = 9, 3, 64, 16
    tables, tseq, tpos = layout(rng, [(40, 1), (0, 20), (100, 1)], BS, 32)
    N = len(tseq)
    q, k, v = (rng.standard_normal((N, h, D)).astype(np.float32) for h in (H, KVH, KVH))
    plain, windowed = PagedAttention(1, 32, BS, KVH, D), PagedAttention(1, 32, BS, KVH, D, windows=[200])
    for attn in (plain, windowed):
        attn.set_layout(tables, tseq, tpos)
    np.testing.assert_array_equal(plain(0, q, k, v), windowed(0, q, k, v))  # a window wider than every context


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("window", [1, 2, 5, 13])
def test_windowed_masks_equal_brute_force(seed, window):
    rng = np.random.default_rng(seed)
    k_lens = rng.integers(1, 30, size=6)
    q_lens = np.minimum(rng.integers(1, 8, size=6), k_lens)
    Q, K = q_lens.max(), k_lens.max()
    want = np.zeros((6, Q, K), bool)  # by the definition: query i of b is at position k - q + i
    for b in range(6):
        for i in range(q_lens[b]):
            p = k_lens[b] - q_lens[b] + i
            for j in range(K):
                want[b, i, j] = p - window < j <= p
    for fn in (varlen_causal_mask, varlen_causal_mask_loop, varlen_causal_mask_python):
        np.testing.assert_array_equal(fn(q_lens.tolist(), k_lens.tolist(), window), want)
    pad = rng.integers(0, 30, size=4)
    lp = np.zeros((4, 5, 35), bool)
    for b in range(4):
        for i in range(5):
            c = 30 + i
            for j in range(35):
                lp[b, i, j] = j == c or (pad[b] <= j <= c and c - window < j)
    for fn in (left_padded_causal_mask, left_padded_causal_mask_loop, left_padded_causal_mask_python):
        np.testing.assert_array_equal(fn(pad.tolist(), 5, 35, window), lp)


def test_window_matches_the_transformers_sliding_window_convention():
    """transformers' sliding-window mask (Mistral, Gemma 2/3): key j is visible from query p when
    p - sliding_window < j <= p; a window of 3 at position 5 sees 3, 4, 5."""
    torch = pytest.importorskip("torch")
    masking = pytest.importorskip("transformers.masking_utils")
    fn = masking.and_masks(masking.sliding_window_overlay(3), masking.causal_mask_function)
    got = np.array([[bool(fn(0, 0, torch.tensor(p), torch.tensor(j))) for j in range(8)] for p in range(8)])
    np.testing.assert_array_equal(got, varlen_causal_mask([8], [8], window=3)[0])
    assert varlen_causal_mask([1], [6], window=3)[0, 0].tolist() == [False, False, False, True, True, True]
