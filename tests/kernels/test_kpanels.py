"""K-quant panels (scratchllm/kernels/kpanels.py): a file's K-quant (and Q5_0, Q5_1) blocks kept
at about their own bits per weight, their weights gguf-py's dequantization bit for bit, the exact products
the float32 kernel's on those weights bit for bit, and the integer products within the rounding
of x."""

import numpy as np
import pytest

from scratchllm.formats import ggml_quants as gq
from scratchllm.kernels import packed_gemm as pg
from scratchllm.kernels.kpanels import KPanels
from scratchllm.models.packed import panel_bytes_per_weight

gguf = pytest.importorskip("gguf")

KINDS = ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "Q5_0", "Q5_1"]


def random_raw(kind, rows, K, seed=0, tame=False):
    """uint8 [rows, row bytes] of random blocks. Every float16 scale any finite value (zeros,
    subnormals, negatives, 65504), or with `tame` small ones (|D| <= 1/16, so products stay finite)."""
    rng = np.random.default_rng(seed)
    block = gq.BLOCK_DTYPES[kind]
    raw = rng.integers(0, 256, rows * K // gq.BLOCK_SIZE[kind] * block.itemsize, dtype=np.uint8)
    for field in ("d", "dmin", "m"):
        if field in block.names:
            h = raw.view(block)[field].view(np.uint16)
            h[(h & 0x7C00) == 0x7C00] &= 0x83FF  # no inf / NaN
            if tame:
                h[:] = (h & 0x8000) | np.minimum(h & 0x7FFF, 0x2C00)
    return raw.reshape(rows, -1)


def dequantized(kind, raw):
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_gguf_dequantization_bit_for_bit_at_the_files_size(kind):
    N, K = 2 * pg.NR + 5, 512  # a ragged last panel
    raw = random_raw(kind, N, K, seed=1)
    panels = pg.pack_blocks([(kind, raw, None)], K)
    assert isinstance(panels, KPanels) and panels.kind == kind
    want = dequantized(kind, raw)  # [N, K]
    np.testing.assert_array_equal(pg.unpack(panels, K, N).T.view(np.uint32), want.view(np.uint32))
    ids = [0, N - 1, 7, 0]
    np.testing.assert_array_equal(pg.columns(panels, K, ids).view(np.uint32), want[ids].view(np.uint32))
    full = pg.pack_blocks([(kind, random_raw(kind, pg.NR, K), None)], K)  # whole panels: no padding
    assert full.nbytes * 8 / (pg.NR * K) == {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625, "Q3_K": 4.5625,
                                             "Q2_K": 5.125, "Q5_0": 5.5, "Q5_1": 6.0}[kind]
    assert full.nbytes / (pg.NR * K) == panel_bytes_per_weight(kind)  # what memory plans count


@pytest.mark.parametrize("kind", KINDS)
def test_fused_parts_in_their_row_order(kind):
    K = 256
    a, b = random_raw(kind, 40, K, seed=2), random_raw(kind, 24, K, seed=3)
    order = np.random.default_rng(4).permutation(24)
    panels = pg.pack_blocks([(kind, a, None), (kind, b, order)], K)
    want = np.concatenate([dequantized(kind, a), dequantized(kind, b)[order]])
    np.testing.assert_array_equal(pg.unpack(panels, K, 64).T.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
def test_packed_a_few_panels_at_a_time_the_panels_are_the_same(kind, monkeypatch):
    """pack_blocks packs K-quant parts in chunks of whole panels (kpanels.CHUNK_WEIGHTS), so its
    temporaries stay small whatever the matrix: the panels equal those of the whole at once, with
    chunks that cross from one part to the next and a ragged last panel."""
    from scratchllm.kernels import kpanels

    K = 256
    a, b = random_raw(kind, 3 * pg.NR + 3, K, seed=5), random_raw(kind, 2 * pg.NR + 7, K, seed=6)
    order = np.random.default_rng(7).permutation(b.shape[0])
    parts = [(kind, a, None), (kind, b, order)]
    whole = kpanels.pack(kind, np.concatenate([a, b[order]]), K, pg.NR)
    monkeypatch.setattr(kpanels, "CHUNK_WEIGHTS", 2 * pg.NR * K)  # two panels a chunk
    chunked = pg.pack_blocks(parts, K)
    assert isinstance(chunked, KPanels) and chunked.kind == kind
    for got, want in zip(chunked[:6], whole[:6], strict=True):
        assert (got is None and want is None) or np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [1, 2, 3, 16, 40])
def test_exact_products_are_the_float32_kernels_on_the_weights(kind, M):
    N, K = 70, 768
    panels = pg.pack_blocks([(kind, random_raw(kind, N, K, seed=M, tame=True), None)], K)
    x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
    w = pg.unpack(panels, K, N)
    np.testing.assert_array_equal(pg.matmul(x, panels, N), pg.matmul(x, pg.pack(w), N))


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("kind", KINDS)
def test_integer_products_are_the_products_within_the_rounding_of_x(kind, activations):
    M, N, K = 7, 70, 768
    panels = pg.pack_blocks([(kind, random_raw(kind, N, K, seed=5, tame=True), None)], K)
    x = np.random.default_rng(6).standard_normal((M, K), dtype=np.float32)
    w = pg.unpack(panels, K, N).astype(np.float64)
    q1, q2, d, _, _ = pg.quantize_x8(x, "natural", activations == "int16")
    big = q1.astype(np.float64) if q2 is None else 256.0 * q1 + q2
    xr = (big.reshape(M, -1, 32) * d[..., None]).reshape(M, K)  # the rounded x, as the kernel has it
    y = pg.matmul(x, panels, N, activations=activations)
    assert (np.abs(y - xr @ w) <= 1e-6 * (np.abs(xr) @ np.abs(w))).all()  # integer sums exact
    for rows in ([0], [2, 3, 4]):  # a row's result does not depend on the rows beside it
        np.testing.assert_array_equal(pg.matmul(x[rows], panels, N, activations=activations), y[rows])


def test_pack_blocks_refuses_mixed_k_quants():
    with pytest.raises(ValueError, match="parts of one type of"):
        pg.pack_blocks([("Q4_K", random_raw("Q4_K", 32, 256), None), ("Q6_K", random_raw("Q6_K", 32, 256), None)],
                       256)
    with pytest.raises(ValueError, match="rows must be"):
        pg.pack_blocks([("Q6_K", random_raw("Q6_K", 32, 256)[:, :-1].copy(), None)], 256)


@pytest.mark.parametrize("M", [1, 5])
def test_a_fused_matrix_of_k_quants_beside_other_types_keeps_each_run_in_its_panels(M):
    """q|k in Q4_K beside v in Q6_K (a Q4_K_M file's layer): each run of one type in panels of its
    own (SegmentedPanels), writing its columns of y; the same bits as the float32 kernel."""
    from scratchllm.models.packed import PackedWeight

    K = 512
    kinds, rows = ("Q4_K", "Q4_K", "Q6_K", "Q4_0"), (2 * pg.NR, pg.NR, pg.NR, 24)
    raws = [random_raw(k, n, K, seed=i, tame=True) if k != "Q4_0" else
            np.random.default_rng(i).integers(0, 256, (n, K // 32 * 18), dtype=np.uint8) for i, (k, n) in
            enumerate(zip(kinds, rows, strict=True))]
    for raw, k in zip(raws, kinds, strict=True):  # Q4_0: tame scales too
        if k == "Q4_0":
            raw.reshape(-1, 18)[:, :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    packed = PackedWeight.from_blocks(list(zip(kinds, raws, [None] * 4, strict=True)), (K, sum(rows)))
    panels = packed.panels
    assert isinstance(panels, pg.SegmentedPanels) and panels.cols == (3 * pg.NR, pg.NR, 24)
    assert [getattr(p, "kind", "Q4") for p in panels.parts] == ["Q4_K", "Q6_K", "Q4"]
    want = np.concatenate([dequantized(k, r) for k, r in zip(kinds, raws, strict=True)]).T  # [K, N]
    np.testing.assert_array_equal(packed.numpy(), want)
    np.testing.assert_array_equal(packed.columns([0, 3 * pg.NR, sum(rows) - 1]), want[:, [0, 3 * pg.NR, -1]].T)
    x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
    np.testing.assert_array_equal(x @ packed, pg.matmul(x, pg.pack(want), sum(rows)))
    packed.activations = "int16"
    y = np.empty((M, sum(rows)), dtype=np.float32)
    packed.matmul_into(x, y)
    assert np.abs(y - x @ want).max() < 1e-4 * np.abs(x @ want).max()
    # a run before the last that is not whole panels wide cannot write its columns straight
    # (half a panel more: 8 more rows would be a whole panel at x86-64-v2, whose panels are 8 wide)
    ragged = [("Q4_K", raws[0][:pg.NR + pg.NR // 2], None), ("Q6_K", raws[2], None)]
    assert PackedWeight.from_blocks(ragged, (K, 2 * pg.NR + pg.NR // 2)) is None
