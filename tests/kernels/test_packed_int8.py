"""The int8-activation GEMM (scratchllm/kernels/packed_int8.h): x's rounding against a NumPy
statement of its definition, the products against float64 sums of the rounded x times the
dequantized weights, and a row's result independent of the rows beside it and of the threads."""

import numpy as np
import pytest

from scratchllm.kernels import packed_gemm as pg

KINDS = ["Q4_0", "Q4_1", "Q8_0", "Q8_f32"]
SHAPES = [(1, 32, 7), (3, 256, 65), (13, 576, 96), (16, 1536, 40), (1, 2048, 257)]  # (M, K, N)


def rounded(x, two=False):
    """The definition the kernel implements: per row and run of 32 values, d = amax / 127 and
    q1 = rint(x * (127 / amax)) in float32, ties to even; two levels: r = x - q1 d rounded once and
    q2 = rint(r * (256 * 127 / amax)) within +-127. -> (q1, q2 or None int32 [M, K], d [M, K/32])."""
    M, K = x.shape
    runs = x.reshape(M, K // 32, 32)
    amax = np.abs(runs).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    q1 = np.rint(runs * inv[..., None]).astype(np.float32)
    q2 = None
    if two:  # x - q1 d is exact in float64 (a 32-bit product beside x): one rounding to float32, as an FMA
        r = (runs.astype(np.float64) - q1.astype(np.float64) * d[..., None]).astype(np.float32)
        q2 = np.clip(np.rint(r * (inv * np.float32(256))[..., None]), -127, 127).astype(np.int32).reshape(M, K)
    return q1.astype(np.int32).reshape(M, K), q2, d


def test_rounding_follows_the_definition_in_both_orders():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 256), dtype=np.float32) * np.float32(3)
    x[1, :32] = 0  # a run of zeros: scale 0, every q 0
    x[2, 32:64] = np.arange(32, dtype=np.float32) - 15.5  # amax 16.5: q = rint(x * 127 / 16.5)
    x[3, 64:96] = np.float32(127) / 8 * (np.arange(32) % 9 - 4)  # amax 63.5: q = 2 x exactly ...
    x[3, 64] = np.float32(63.5)
    x[3, 65:96] = np.float32(0.25) * (2 * np.arange(31) - 31)  # ... and ties (x * 2 = k + 0.5) go to even
    want, want2, d = rounded(x, two=True)
    assert np.abs(want).max() == 127 and (want[3, 65:96] % 2 == 0).all()
    assert np.abs(want2).max() == 127 and (want2 != 0).mean() > 0.9  # x - q1 d, 256 times finer
    for order in ("natural", "even-odd"):
        for two in (False, True):
            q, q2, dk, s, total = pg.quantize_x8(x, order, two)
            if order == "even-odd":  # rows 0 2 4 6 1 3 5 7 of every 8 -> back to 0..7
                q = q.reshape(5, 32, 2, 4).transpose(0, 1, 3, 2).reshape(5, 256)
                q2 = None if q2 is None else q2.reshape(5, 32, 2, 4).transpose(0, 1, 3, 2).reshape(5, 256)
            np.testing.assert_array_equal(q, want)
            big = want if not two else 256 * want + q2
            if two:
                np.testing.assert_array_equal(q2, want2)
            np.testing.assert_array_equal(dk, d / 256 if two else d)
            np.testing.assert_array_equal(total, big.reshape(5, 8, 32).sum(-1))
            np.testing.assert_array_equal(s, dk * total.astype(np.float32))
    with pytest.raises(ValueError, match="32"):
        pg.quantize_x8(x[:, :40])


def panels_of(K, N, kind, seed=0):
    """Panels of random weights: Q4Panels of Q4_0 (no offsets stored: w = d (u - 8)) or Q4_1;
    Q8Panels of Q8_0 (float16 d, no offsets: a file's, as pack_blocks keeps them) or of int8
    with float32 scales and offsets ("Q8_f32", the other types' 8-bit form)."""
    rng = np.random.default_rng(seed)
    if kind.startswith("Q8"):
        q = rng.integers(-127, 128, (K, N)).astype(np.int8)
        d = (rng.uniform(0.5, 1.5, (K // 32, N)) * 0.01).astype(np.float32)
        m = (rng.standard_normal((K // 32, N)) * 0.05).astype(np.float32)
        if kind == "Q8_0":
            panels = pg.pack_q8(q, d.astype(np.float16).astype(np.float32), np.zeros_like(m))
            return pg.Q8Panels(panels.q, panels.d.astype(np.float16), None, True)
        return pg.pack_q8(q, d, m)
    u = rng.integers(0, 16, (K, N)).astype(np.uint8)
    d = (rng.uniform(0.5, 1.5, (K // 32, N)) * 0.01).astype(np.float16)
    m = -8 * d if kind == "Q4_0" else (rng.standard_normal((K // 32, N)) * 0.05).astype(np.float16)
    panels = pg.pack_q4(u, d, m)
    return panels._replace(m=None) if kind == "Q4_0" else panels


def int8_reference(x, panels, N, two=False):
    """float64 sums of the rounded x times the dequantized matrix, and the sums of |terms|."""
    q, q2, d = rounded(x, two)
    big = q if q2 is None else 256 * q + q2
    xr = (big.reshape(len(q), -1, 32) * (d / (256 if two else 1))[..., None].astype(np.float64)).reshape(q.shape)
    w = pg.unpack(panels, x.shape[1], N).astype(np.float64)
    return xr @ w, np.abs(xr) @ np.abs(w)


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_products_are_the_rounded_x_times_the_weights(kind, M, K, N, activations):
    x = np.random.default_rng(M + K).standard_normal((M, K), dtype=np.float32)
    panels = panels_of(K, N, kind)
    y = pg.matmul(x, panels, N, activations=activations)
    want, terms = int8_reference(x, panels, N, two=activations == "int16")
    # the integer sums are exact: only float32 rounding per group of 32 remains
    assert (np.abs(y - want) <= 1e-6 * terms + 1e-30).all(), np.abs(y - want).max()
    # and it is the product, within the rounding of x: not the exact path's result, but close to it
    exact = pg.matmul(x, panels, N)
    assert not np.array_equal(y, exact)
    assert np.abs(y - exact).max() < (0.02 if activations == "int8" else 1e-4) * np.abs(exact).max()


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(kind, activations):
    M, K, N = 23, 1536, 200  # several row tiles, a ragged last panel, kc blocks of the panel
    x = np.random.default_rng(1).standard_normal((M, K), dtype=np.float32)
    panels = panels_of(K, N, kind, seed=2)
    y = pg.matmul(x, panels, N, activations=activations)
    for rows in ([0], [5, 6, 7], list(range(3, 19))):
        np.testing.assert_array_equal(pg.matmul(x[rows], panels, N, activations=activations), y[rows])
    previous = pg.set_num_threads(1)
    try:
        np.testing.assert_array_equal(pg.matmul(x, panels, N, activations=activations), y)
    finally:
        pg.set_num_threads(previous)
    gemm = pg.QuantizedGemm(panels, N, activations)  # the bound product: the same bits
    out = np.empty((M, N), dtype=np.float32)
    gemm(x, out)
    np.testing.assert_array_equal(out, y)


def test_activations_are_checked():
    panels = panels_of(64, 32, "Q4_1")
    with pytest.raises(ValueError, match="activations"):
        pg.matmul(np.ones((1, 64), np.float32), panels, 32, activations="int4")
    with pytest.raises(ValueError, match="activations"):
        pg.QuantizedGemm(panels, 32, "float16")


def fma32(a, b, c):
    """float32 fma(a, b, c): a * b is exact in float64 (24 + 24 bits), the sum is rounded to the
    long double and then to float32 (two roundings can differ from one only on a tie of the
    second, which these random operands do not hit)."""
    return (a.astype(np.longdouble) * b + c).astype(np.float32)


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_float_operations_are_the_documented_ones_bit_for_bit(kind, activations):
    """packed_int8.h's float arithmetic, emulated: per group an integer sum, less the zero point
    times sum(Q), converted, fma with d dx, then fma(m, s); c = the first block's sum plus each
    later block's (512 k). This sequence is why every instruction set gives the same bits."""
    M, K, N = 3, 1088, 40  # two whole blocks of 512 k and a part of a third
    x = np.random.default_rng(7).standard_normal((M, K), dtype=np.float32)
    panels = panels_of(K, N, kind, seed=8)
    two = activations == "int16"
    q1, q2, d = rounded(x, two)
    big = (q1 if q2 is None else 256 * q1 + q2).astype(np.int64).reshape(M, K // 32, 32)
    dx = (d / np.float32(256)).astype(np.float32) if two else d
    total = big.sum(-1)
    s = (dx * total.astype(np.float32)).astype(np.float32)
    if kind.startswith("Q4"):
        w_int = pg.unpack(panels._replace(d=np.ones_like(panels.d), m=None if panels.m is None else
                                          np.zeros_like(panels.m)), K, N) + (8 if panels.m is None else 0)
        zero, dw = (8 if panels.m is None else 0), panels.d.astype(np.float32)
        mw = None if panels.m is None else panels.m.astype(np.float32)
    else:
        w_int = panels.rows().transpose(1, 0, 2).reshape(K, -1)[:, :N].astype(np.int64)
        zero, dw = 0, panels.d.astype(np.float32)
        mw = None if panels.m is None else panels.m
    dw = dw.transpose(1, 0, 2).reshape(K // 32, -1)[:, :N]
    mw = None if mw is None else mw.transpose(1, 0, 2).reshape(K // 32, -1)[:, :N]
    sums = np.einsum("rgk,gkj->rgj", big, w_int.astype(np.int64).reshape(K // 32, 32, N))  # exact integers
    sums -= zero * total[:, :, None]  # the zero point, for Q4_0 (u - 8) in this accounting
    c = None
    for g0 in range(0, K // 32, 16):
        acc = np.zeros((M, N), dtype=np.float32)
        for g in range(g0, min(g0 + 16, K // 32)):
            acc = fma32(sums[:, g].astype(np.float32), (dw[g][None, :] * dx[:, g, None]).astype(np.float32), acc)
            if mw is not None:
                acc = fma32(np.broadcast_to(mw[g], (M, N)), s[:, g, None], acc)
        c = acc if c is None else (c + acc).astype(np.float32)
    np.testing.assert_array_equal(pg.matmul(x, panels, N, activations=activations), c)


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_a_nan_or_an_infinity_in_x_is_not_rounded_away(activations):
    """The exact path carries a NaN (or an infinity) of x into the outputs; the integer path
    must not round it to a finite value."""
    panels = panels_of(64, 40, "Q4_1")
    x = np.ones((3, 64), dtype=np.float32)
    x[0, 5], x[1, 40] = np.nan, np.inf
    y = pg.matmul(x, panels, 40, activations=activations)
    assert np.isnan(y[0]).all() and not np.isfinite(y[1]).any() and np.isfinite(y[2]).all()
