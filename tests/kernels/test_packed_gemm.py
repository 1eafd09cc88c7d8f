"""The packed GEMM (scratchllm/kernels/packed_gemm.pyx) against float64 NumPy, and its bfloat16
rounding against torch's."""

import threading

import numpy as np
import pytest
import torch

from scratchllm.kernels import packed_gemm as pg

# (M, K, N): one row, ragged edges (K odd, N not a multiple of 32), several row tiles (M > 12),
# and products big enough to be shared with the pool's helper threads.
SHAPES = [(1, 5, 7), (3, 33, 65), (13, 64, 32), (16, 576, 960), (40, 7, 31), (64, 301, 257), (1, 1536, 576)]


def operands(M, K, N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)


def bf16(a):  # torch's float32 -> bfloat16 rounding, widened back to float32
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_float32_matmul_equals_numpy(M, K, N):
    x, w = operands(M, K, N)
    y = pg.matmul(x, pg.pack(w), N)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_bfloat16_matmul_is_the_exact_product_of_rounded_operands(M, K, N):
    x, w = operands(M, K, N)
    y = pg.matmul(x, pg.pack(w, "bfloat16"), N)
    ref = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64)  # only the fp32 summation may differ
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    # and it is a bfloat16 approximation of the float32 product, not something else
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(y - exact).max() < 2 ** -7 * np.abs(x).max() * np.abs(w).max() * K


def test_bfloat16_rounding_equals_torch():
    rng = np.random.default_rng(1)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-42, 3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
                        1.0 + 2**-8 + 2**-20], dtype=np.float32)  # ties to even, both ways; subnormals
    x = np.concatenate([special, rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000)])
    ours = pg.to_bfloat16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(pg.from_bfloat16(ours[nan])).all()


@pytest.mark.parametrize("dtype", pg.DTYPES)
def test_pack_unpack_and_columns(dtype):
    _, w = operands(1, 37, 70)
    packed = pg.pack(w, dtype)
    expect = w if dtype == "float32" else bf16(w)
    np.testing.assert_array_equal(pg.unpack(packed, 37, 70), expect)
    ids = [0, 31, 32, 69, 5, 5]
    np.testing.assert_array_equal(pg.columns(packed, 37, ids), expect[:, ids].T)


@pytest.mark.parametrize("dtype", pg.DTYPES)
def test_result_does_not_depend_on_the_thread_count(dtype):
    # every panel is computed whole by one thread in one order, so threads change nothing, bit for bit
    x, w = operands(24, 576, 3072)
    packed = pg.pack(w, dtype)
    previous = pg.set_num_threads(1)
    try:
        one = pg.matmul(x, packed, 3072)
        pg.set_num_threads(4)
        four = pg.matmul(x, packed, 3072)
    finally:
        pg.set_num_threads(previous)
    np.testing.assert_array_equal(one, four)


def test_concurrent_callers_get_their_own_results():
    # the pool serves one job at a time; a second caller meanwhile computes alone, correctly
    x, w = operands(16, 576, 1536)
    packed = pg.pack(w)
    expect = pg.matmul(x, packed, 1536)
    errors = []

    def worker(seed):
        xs = x * (seed + 1)
        for _ in range(20):
            y = pg.matmul(xs, packed, 1536)
            if not np.allclose(y, expect * (seed + 1), rtol=1e-5, atol=1e-3):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_out_and_shape_errors():
    x, w = operands(4, 10, 40)
    packed = pg.pack(w)
    out = np.empty((4, 40), np.float32)
    assert pg.matmul(x, packed, 40, out=out) is out
    with pytest.raises(ValueError, match="do not fit"):
        pg.matmul(x[:, :9], packed, 40)
    with pytest.raises(ValueError, match="out must be"):
        pg.matmul(x, packed, 40, out=np.empty((4, 41), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        pg.pack(w, "float16")
    assert pg.matmul(x[:0], packed, 40).shape == (0, 40)


def test_packed_weight_is_used_as_x_at_w():
    from scratchllm.models.packed import PackedWeight

    x, w = operands(5, 48, 40)
    pw = PackedWeight.from_rows([w.T[:8], w.T[8:]])  # two checkpoint tensors [out_i, in], fused along out
    assert pw.shape == (48, 40)
    np.testing.assert_allclose(x @ pw, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(pw.numpy(), w)
    with pytest.raises(ValueError, match="weight"):
        x[:, :47] @ pw


def test_a_forked_child_computes_without_the_parents_helpers():
    # after fork() the child has no helper threads; the pool's caller must then do every task itself
    import multiprocessing

    x, w = operands(16, 576, 1536)
    packed = pg.pack(w)
    expect = pg.matmul(x, packed, 1536)  # the parent's helpers exist now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as child:
        got = child.apply_async(pg.matmul, (x, packed, 1536)).get(timeout=60)
    np.testing.assert_array_equal(got, expect)


def quantized_operands(K, N, kind, seed=0):
    """q, d, m as formats.ggml_quants.as_q8 returns them for a GGUF type, and the float32 matrix
    they stand for, made with the loader's operations (d * q, then + m)."""
    rng = np.random.default_rng(seed)
    q = {"Q8_0": rng.integers(-127, 128, (K, N)), "Q4_0": rng.integers(-8, 8, (K, N)),
         "Q4_1": rng.integers(0, 16, (K, N))}[kind].astype(np.int8)
    d = (rng.standard_normal((K // 32, N)) * 0.02).astype(np.float16).astype(np.float32)
    m = (rng.standard_normal((K // 32, N)) * 0.02).astype(np.float16).astype(np.float32)
    if kind != "Q4_1":
        m[:] = 0
    w = q.astype(np.float32).reshape(K // 32, 32, N)
    w *= d[:, None]
    w += m[:, None]
    return q, d, m, w.reshape(K, N)


def assert_quantized_panels_compute_w(panels, w, M):
    K, N = w.shape
    np.testing.assert_array_equal(pg.unpack(panels, K, N), w)
    ids = [0, N - 1, N // 2, 0]
    np.testing.assert_array_equal(pg.columns(panels, K, ids), w[:, ids].T)
    x = np.random.default_rng(1).standard_normal((M, K), dtype=np.float32)
    y = pg.matmul(x, panels, N)
    np.testing.assert_array_equal(y, pg.matmul(x, pg.pack(w), N))  # same values, same order of sums
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-5 * np.sqrt(K))


# M = 1 with several panels: the two-at-a-time path (and an odd last panel); M > 12: buffered
QUANTIZED_SHAPES = [(1, 32, 7), (1, 96, 65), (1, 576, 960), (3, 64, 65), (13, 576, 960), (16, 1536, 576),
                    (40, 288, 31)]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("M,K,N", QUANTIZED_SHAPES)
def test_quantized_matmul_is_the_float32_kernel_on_the_dequantized_matrix_bit_for_bit(kind, M, K, N):
    q, d, m, w = quantized_operands(K, N, kind)
    panels = pg.pack_q8(q, d, m)
    assert panels.q.dtype == np.uint8 and panels.nbytes < pg.pack(w).nbytes / 3
    np.testing.assert_array_equal(pg.unpack(panels, K, N), w)  # the words of biased bytes hold q, d and m
    assert_quantized_panels_compute_w(panels, w, M)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("M,K,N", QUANTIZED_SHAPES[:5])
def test_eight_bit_panels_with_any_float32_scale_round_the_product_first(M, K, N, kind):
    """Scales that are not float16 values: d * q is rounded before + m (no fused multiply-add), as the
    dequantized matrix was made."""
    q, _, m, _ = quantized_operands(K, N, kind)
    m = (np.random.default_rng(6).standard_normal((K // 32, N)) * 0.02).astype(np.float32)
    d = (np.random.default_rng(5).standard_normal((K // 32, N)) * 0.02).astype(np.float32)  # 24-bit mantissas
    w = (q.astype(np.float32).reshape(K // 32, 32, N) * d[:, None] + m[:, None]).reshape(K, N)
    panels = pg.pack_q8(q, d, m)
    assert not panels.exact
    assert_quantized_panels_compute_w(panels, w, M)


def test_quantized_packing_refuses_bad_shapes():
    q, d, m, _ = quantized_operands(64, 8, "Q8_0")
    with pytest.raises(ValueError, match="K % 32"):
        pg.pack_q8(q[:40], d, m)
    with pytest.raises(ValueError, match="do not fit"):
        pg.matmul(np.ones((1, 32), np.float32), pg.pack_q8(q, d, m), 8)


def four_bit_operands(K, N, kind, seed=0):
    """Q4_0 / Q4_1 as pack_q4 takes them (nibbles 0..15, float16 d and m; Q4_0's m = -8 d) and the
    float32 matrix the loader makes from the same blocks (Q4_0: d * (q - 8); Q4_1: d * q + m)."""
    q, d, m, w = quantized_operands(K, N, kind, seed)
    nibbles = (q + 8 if kind == "Q4_0" else q).astype(np.uint8)
    m16 = (-8 * d if kind == "Q4_0" else m).astype(np.float16)
    assert (m16.astype(np.float32) == (-8 * d if kind == "Q4_0" else m)).all()  # exact in float16
    return nibbles, d.astype(np.float16), m16, w


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("M,K,N", QUANTIZED_SHAPES)
def test_four_bit_matmul_is_the_float32_kernel_on_the_dequantized_matrix_bit_for_bit(kind, M, K, N):
    q, d, m, w = four_bit_operands(K, N, kind)
    panels = pg.pack_q4(q, d, m)
    P = -(-N // pg.NR)  # half a byte per weight, 2 + 2 bytes of float16 d and m per 32: Q4_1's bytes
    assert panels.q4.shape == (P, K // 2, pg.NR) and panels.nbytes == P * pg.NR * (K // 2 + 4 * K // 32)
    assert_quantized_panels_compute_w(panels, w, M)


def test_four_bit_packing_refuses_bad_input():
    q, d, m, _ = four_bit_operands(64, 8, "Q4_1")
    with pytest.raises(ValueError, match="K % 32"):
        pg.pack_q4(q[:40], d, m)
    with pytest.raises(ValueError, match="do not fit"):
        pg.matmul(np.ones((1, 32), np.float32), pg.pack_q4(q, d, m), 8)


def raw_blocks(kind, rows, K, seed=0, big_scale=False):
    """Random GGUF blocks of a [rows, K] tensor as the file stores them: uint8 [rows, row bytes]."""
    from scratchllm.formats import ggml_quants as gq

    rng = np.random.default_rng(seed)
    blocks = np.zeros((rows, K // 32), dtype=gq.BLOCK_DTYPES[kind])
    scale = 1e4 if big_scale else 0.02
    blocks["d"] = (rng.standard_normal(blocks.shape) * scale).astype(np.float16).view(np.uint16).view("<f2")
    if kind == "Q4_1":
        blocks["m"] = (rng.standard_normal(blocks.shape) * 0.05).astype(np.float16)
    blocks["qs"] = rng.integers(0, 256, blocks["qs"].shape).astype(blocks["qs"].dtype)
    return blocks.view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("kinds", [("Q4_1",), ("Q4_0",), ("Q4_1", "Q4_0", "Q4_1"), ("Q8_0",), ("Q8_0", "Q8_0")])
def test_panels_straight_from_blocks_equal_the_panels_of_the_decoded_blocks(kinds):
    """pack_blocks moves a file's bytes; the result must be what decoding the blocks (as_q4 / as_q8,
    tested against the gguf package) and packing them gives, byte for byte, with fused parts and
    a row order (the q/k unpermutation) applied."""
    from scratchllm.formats import ggml_quants as gq

    K, rows = 96, [40, 24, 8][: len(kinds)]
    parts, decoded = [], []
    for i, (kind, n) in enumerate(zip(kinds, rows, strict=True)):
        raw = raw_blocks(kind, n, K, seed=i)
        order = np.random.default_rng(10 + i).permutation(n) if i != 1 else None
        parts.append((kind, raw, order))
        four = kind != "Q8_0"
        q, d, m = (gq.as_q4 if four else gq.as_q8)(kind, raw.reshape(-1), (n, K))
        sel = np.arange(n) if order is None else order
        decoded.append((q[sel], d[sel], m[sel]))
    got = pg.pack_blocks(parts, K)
    cat = [np.concatenate([p[j] for p in decoded]).T for j in range(3)]
    want = (pg.pack_q8 if kinds[0] == "Q8_0" else pg.pack_q4)(*cat)
    assert type(got) is type(want)
    if kinds[0] == "Q8_0":  # the file's bytes: int8 q and its float16 d, no offset (the decoded m is 0)
        assert got.m is None and not want.m.any() and got.d.dtype == np.float16
        assert np.array_equal(got.d.astype(np.float32), want.d) and np.array_equal(got.q, want.q)
        assert got.exact and want.exact  # a file's float16 scales: the kernel fuses d * q + m, with the same floats
        assert got.nbytes == want.q.nbytes + want.d.nbytes // 2
        assert np.array_equal(got.dequantize(), want.dequantize())
        P = got.q.shape[0]
        cols = np.arange(P * pg.NR) % pg.NR
        assert np.array_equal(got.columns(np.arange(P * pg.NR) // pg.NR, cols),
                              want.columns(np.arange(P * pg.NR) // pg.NR, cols))
    else:  # Q4_0 alone stores no offsets (the kernel makes -8 d); beside Q4_1 its m is stored like theirs
        assert (got.m is None) == (set(kinds) == {"Q4_0"})
        for a, b in zip(got[:3], want[:3], strict=True):
            if a is None:
                assert np.array_equal(b.astype(np.float32), -8 * want.d.astype(np.float32))
                continue
            assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        assert np.array_equal(got.dequantize(), want.dequantize())
        P = got.q4.shape[0]
        cols = np.arange(P * pg.NR)
        assert np.array_equal(got.columns(cols // pg.NR, cols % pg.NR), want.columns(cols // pg.NR, cols % pg.NR))
    N = sum(rows)
    for M in (1, 2, 16):  # one row (panels in pairs), fused tiles, the dequantized-block path
        x = np.random.default_rng(3).standard_normal((M, K)).astype(np.float32)
        assert np.array_equal(pg.matmul(x, got, N), pg.matmul(x, want, N))


def test_pack_blocks_refuses_what_it_cannot_keep():
    K = 64
    big = raw_blocks("Q4_0", 16, K, big_scale=True)  # -8 d overflows float16
    assert pg.pack_blocks([("Q4_0", big, None), ("Q4_1", raw_blocks("Q4_1", 16, K), None)], K) is None  # m stored
    alone = pg.pack_blocks([("Q4_0", big, None)], K)  # no m stored: the kernel's -8 d is a float32
    x = np.random.default_rng(0).standard_normal((1, K)).astype(np.float32)
    w = alone.dequantize().transpose(1, 0, 2).reshape(K, -1)
    assert np.isfinite(w).all() and np.array_equal(pg.matmul(x, alone, 16), pg.matmul(x, pg.pack(w), 16))
    with pytest.raises(ValueError, match="Q4_0/Q4_1 parts, Q8_0 parts, or parts of one type of"):
        pg.pack_blocks([("Q8_0", raw_blocks("Q8_0", 16, K), None), ("Q4_1", raw_blocks("Q4_1", 16, K), None)], K)
    with pytest.raises(ValueError, match="rows must be"):
        pg.pack_blocks([("Q4_1", raw_blocks("Q4_1", 16, K)[:, :-1], None)], K)
    with pytest.raises(ValueError, match="permutation"):
        pg.pack_blocks([("Q4_1", raw_blocks("Q4_1", 16, K), np.arange(16) + 1)], K)
    with pytest.raises(ValueError, match="32-weight blocks"):
        pg.pack_blocks([("Q4_1", raw_blocks("Q4_1", 16, K), None)], 40)


def test_q4_0_offsets_are_minus_eight_scales_for_every_float16_scale():
    """Q4_0's m = -8 d is made from the scale's float16 bits at load: checked against NumPy for every
    finite float16 d whose -8 d fits (subnormals, which become normal, included)."""
    from scratchllm.formats import ggml_quants as gq

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    d = bits.view(np.float16)
    d = d[np.isfinite(d)]
    d = d[np.abs(d.astype(np.float32)) * 8 <= np.finfo(np.float16).max]
    d = np.concatenate([d, np.zeros((-len(d)) % 512, np.float16)])  # whole rows of 32 groups, whole panels
    rows, groups = len(d) // 32, 32
    blocks = np.zeros((rows, groups), dtype=gq.BLOCK_DTYPES["Q4_0"])
    blocks["d"] = d.reshape(rows, groups)
    raw = blocks.view(np.uint8).reshape(rows, -1)
    q4_1 = raw_blocks("Q4_1", pg.NR, 32 * groups)  # beside Q4_1 parts, Q4_0's m is stored
    panels = pg.pack_blocks([("Q4_0", raw, None), ("Q4_1", q4_1, None)], 32 * groups)
    first = rows // pg.NR  # the Q4_0 rows' panels
    want = (-8 * panels.d[:first].astype(np.float32)).astype(np.float16)
    assert np.array_equal(panels.m[:first].view(np.uint16), want.view(np.uint16))
    alone = pg.pack_blocks([("Q4_0", raw, None)], 32 * groups)  # no m: the kernel's -8 d, the same floats
    assert alone.m is None
    x = np.random.default_rng(1).standard_normal((2, 32 * groups)).astype(np.float32)
    assert np.array_equal(pg.matmul(x, alone, rows), pg.matmul(x, panels, rows + pg.NR)[:, :rows])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q8 inexact"])
@pytest.mark.parametrize("M,K,N", [(1, 96, 65), (1, 576, 960), (3, 64, 40), (16, 288, 31)])
def test_prepared_quantized_gemm_equals_matmul(kind, M, K, N):
    """QuantizedGemm (checks and buffers bound once) computes exactly what matmul does."""
    if kind == "Q4_1":
        panels = pg.pack_q4(*four_bit_operands(K, N, "Q4_1")[:3])
    else:
        q, d, m, _ = quantized_operands(K, N, "Q8_0")
        if kind == "Q8 inexact":
            d = d + np.float32(1e-9)  # not float16 values: the unfused path
        panels = pg.pack_q8(q, d, m)
        assert panels.exact == (kind == "Q8_0")
    gemm = pg.QuantizedGemm(panels, N)
    x = np.random.default_rng(2).standard_normal((M, K), dtype=np.float32)
    out = np.full((M, N), np.nan, np.float32)
    gemm(x, out)
    np.testing.assert_array_equal(out, pg.matmul(x, panels, N))
    with pytest.raises(ValueError, match="do not fit"):
        gemm(np.ones((M, K + 32), np.float32), out)
    with pytest.raises(ValueError, match="do not fit"):
        gemm(x, np.empty((M, N + 1), np.float32))
    with pytest.raises(TypeError):
        pg.QuantizedGemm(pg.pack(np.ones((K, N), np.float32)), N)


@pytest.mark.parametrize("N", [64, 69, 115, 144, 16 * 13 + 1])  # whole fours of panels, and fours + pairs + one
@pytest.mark.parametrize("threads", [1, 2])
def test_one_row_of_q8_0_blocks_takes_four_panels_at_a_time_with_the_same_sums(N, threads):
    """A single row over Q8_0 panels (float16 d, no m: pg_gemm_q8h_quad) against the same values as
    float32-scale panels with m = 0 (the two-panel path), bit for bit, with a ragged right edge."""
    from scratchllm.formats import ggml_quants as gq
    from scratchllm.kernels import pool

    K = 288  # a block of 256 and a block of 32
    raw = raw_blocks("Q8_0", N, K, seed=N)
    got = pg.pack_blocks([("Q8_0", raw, None)], K)
    q, d, m = gq.as_q8("Q8_0", raw.reshape(-1), (N, K))
    want = pg.pack_q8(q.T, d.T, m.T)
    assert got.m is None and want.exact
    x = np.random.default_rng(N).standard_normal((1, K)).astype(np.float32)
    previous = pool.set_num_threads(threads)
    try:
        assert np.array_equal(pg.matmul(x, got, N), pg.matmul(x, want, N))
        f32 = pg.pack(want.dequantize().transpose(1, 0, 2).reshape(K, -1)[:, :N])  # the float32 kernel's panels
        assert np.array_equal(pg.matmul(x, got, N), pg.matmul(x, f32, N))
    finally:
        pool.set_num_threads(previous)


def test_panels_of_another_panel_width_are_refused_everywhere_they_are_bound():
    """bind_weight (matmul, QuantizedGemm, the C blocks) checks the panels' width against this build's NR:
    panels made by a build of another width would otherwise be read with the wrong stride."""
    q, d, m, _ = four_bit_operands(64, 2 * pg.NR, "Q4_1")
    good = pg.pack_q4(q, d, m)
    other = pg.Q4Panels(*(np.ascontiguousarray(a.reshape(a.shape[0] // 2 or 1, a.shape[1], -1)) for a in good))
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError, match="wide panels"):
        pg.matmul(x, other, 2 * pg.NR)
    with pytest.raises(ValueError, match="wide panels"):
        pg.QuantizedGemm(other, 2 * pg.NR)
