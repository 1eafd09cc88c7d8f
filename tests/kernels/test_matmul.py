"""The four matrix multiplies agree with a float64 NumPy reference on random and awkward shapes."""

import numpy as np
import pytest

from scratchllm.errors import ConfigError
from scratchllm.kernels import matmul

SIZES = (1, 3, 17, 300, 1023)
# Every size in every position once, without the full 125-shape cube (the 1023^3 corner alone
# would dominate the test time and adds no new edge case).
SHAPES = sorted({(m, k, n) for m in SIZES for k in SIZES for n in SIZES if sorted((m, k, n))[1] <= 17}
                | {(300, 300, 300), (1023, 300, 17), (17, 1023, 300), (300, 17, 1023)})


def _pair(m, k, n, seed=0):
    rng = np.random.default_rng(seed + 7 * m + 13 * k + 31 * n)
    return rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)


def _check_fp32(c, a, b):
    ref = a.astype(np.float64) @ b.astype(np.float64)
    k = a.shape[1]
    # float32 sums of k products of N(0,1) values: error grows like sqrt(k) * eps * |terms|.
    tol = 8 * np.finfo(np.float32).eps * np.sqrt(k) * (np.abs(a).astype(np.float64) @ np.abs(b))
    assert c.shape == ref.shape and c.dtype == np.float32
    assert np.all(np.abs(c - ref) <= tol + 1e-30), float(np.max(np.abs(c - ref) - tol))


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_tiled_and_numpy_agree_with_reference(m, k, n):
    a, b = _pair(m, k, n)
    _check_fp32(matmul.tiled(a, b), a, b)
    _check_fp32(matmul.numpy(a, b), a, b)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 3, 3), (17, 3, 1), (1, 17, 3), (3, 1, 17), (17, 17, 17),
                                   (1, 300, 3), (3, 17, 300)])
def test_naive_agrees_with_reference(m, k, n):
    a, b = _pair(m, k, n)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    c = np.array(matmul.naive(a64.tolist(), b64.tolist()))
    np.testing.assert_allclose(c.reshape(m, n), a64 @ b64, rtol=1e-12, atol=1e-12)
    _check_fp32(matmul.tiled(a, b), a, b)  # and the Cython kernel with it, on the same inputs


@pytest.mark.parametrize("tiles", [matmul.Tiles(1, 1, 1), matmul.Tiles(7, 5, 33), matmul.Tiles(6, 300, 32),
                                   matmul.Tiles(500, 1000, 5000), matmul.Tiles(13, 64, 40)])
def test_tile_sizes_change_nothing_but_speed(tiles):
    # Ragged blocks and panels everywhere: padding must never leak into C.
    a, b = _pair(101, 77, 131)
    c = matmul.tiled(a, b, tiles)
    _check_fp32(c, a, b)


def test_threads_give_identical_bits():
    # Threads split the rows of C; each element is summed in the same order, so bits are equal.
    # Slices are cut along the longer side of C (columns when n >= m, else rows), ragged or not.
    for m, k, n in [(300, 257, 211), (211, 257, 300), (1, 1023, 17), (1023, 17, 1), (17, 3, 1023), (40, 5, 33)]:
        a, b = _pair(m, k, n)
        for tiles in (matmul.Tiles(mc=24), matmul.Tiles(), matmul.Tiles(mc=6, kc=100, nc=64)):
            one = matmul.tiled(a, b, tiles, threads=1)
            for threads in (2, 3):
                many = matmul.tiled(a, b, tiles, threads=threads)
                np.testing.assert_array_equal(one, many)
            _check_fp32(one, a, b)


def test_any_strides():
    rng = np.random.default_rng(3)
    base_a = rng.standard_normal((90, 120), dtype=np.float32)
    base_b = rng.standard_normal((240, 70), dtype=np.float32)
    cases = [
        (base_a.T, base_b[:90]),  # column-major A
        (base_a[:, ::-1], base_b[::2]),  # negative and doubled strides
        (base_a[5:50:3, 7:], base_b[1:114, ::-2]),  # offsets with both
        (np.asfortranarray(base_a), np.asfortranarray(base_b[:120])),
    ]
    for a, b in cases:
        _check_fp32(matmul.tiled(a, b), a, b)


def test_empty_dimensions_and_other_dtypes():
    a = np.zeros((4, 0), np.float32)
    b = np.zeros((0, 5), np.float32)
    np.testing.assert_array_equal(matmul.tiled(a, b), np.zeros((4, 5), np.float32))
    a64, b64 = _pair(9, 11, 13)
    _check_fp32(matmul.tiled(a64.astype(np.float64), b64.astype(np.float64)), a64, b64)


def test_bad_input_is_a_config_error():
    a, b = _pair(3, 4, 5)
    with pytest.raises(ConfigError, match="do not multiply"):
        matmul.tiled(a, a)
    with pytest.raises(ConfigError, match="threads"):
        matmul.tiled(a, b, threads=0)
    with pytest.raises(ConfigError, match="tile sizes"):
        matmul.Tiles(mc=0)
    with pytest.raises(ConfigError, match="rows"):
        matmul.naive([[1.0, 2.0], [3.0]], [[1.0], [2.0]])


def test_cublas_agrees_or_says_why_not():
    reason = matmul.cublas_unavailable()
    if reason is not None:
        with pytest.raises(ConfigError, match="no GPU"):
            matmul.cublas(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
        pytest.skip(f"cublas: {reason}")
    for m, k, n in [(1, 1, 1), (3, 17, 300), (300, 300, 300), (1023, 17, 3)]:
        a, b = _pair(m, k, n)
        _check_fp32(matmul.cublas(a, b).astype(np.float32), a, b)
