"""The cache model: its rules hold for any cache, it reads this machine's sizes, and the
simulator agrees with it about which tiles fit."""

import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchllm.kernels import cachemodel, cachesim
from scratchllm.kernels.cachemodel import predict_tile


def test_the_seeds_case():
    # Seed, section 2: 300 x 300, 64-byte lines, "24 x 24, not the intuitive 32 x 32". The classic
    # rule (3 tiles in half of a 32 KiB L1) gives exactly that for float64 (8 per line, T <= 26.1),
    # and 32 for float32 (16 per line, T <= 36.9).
    p64 = predict_tile(300, 8, 64, 32 * 1024, 1024 * 1024)
    p32 = predict_tile(300, 4, 64, 32 * 1024, 1024 * 1024)
    assert (p64.tile, p32.tile) == (24, 32)
    assert p64.working_set["L1"] == 3 * 24 * 24 * 8
    assert any("26.1" in line for line in p64.reasoning)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), elem=st.sampled_from([2, 4, 8]), line=st.sampled_from([32, 64, 128]),
       l1_kib=st.sampled_from([16, 32, 48, 64]), l2_kib=st.sampled_from([256, 512, 1024, 2048]),
       share=st.sampled_from([0.25, 0.5, 1.0]))
def test_rules_hold_for_any_cache(n, elem, line, l1_kib, l2_kib, share):
    p = predict_tile(n, elem, line, l1_kib * 1024, l2_kib * 1024, share=share)
    per_line = line // elem
    budget = share * l1_kib * 1024
    for t, rule in ((p.tile, lambda t: 3 * t * t), (p.tile_reuse, lambda t: t * t + 2 * t)):
        assert 1 <= t <= n
        if t < n:  # not clamped to the matrix: a whole number of lines, fits, and the next would not
            step = per_line if t >= per_line else 1  # whole lines, unless not even one line fits
            assert t % step == 0
            assert rule(t) * elem <= budget or t == 1
            assert rule(t + step) * elem > budget or t + step > n
    assert p.tile <= p.tile_reuse
    assert p.mc % 6 == 0 and (p.mc * p.kc * elem <= share * l2_kib * 1024 or p.mc == 6)


def test_reads_this_machines_caches():
    found = cachemodel.machine_caches()
    assert found.source in ("sysfs", "lscpu") or found.source.startswith("default")
    assert found.line_bytes in (32, 64, 128) and found.l1_bytes < found.l2_bytes
    p = predict_tile(300)
    assert (p.l1_bytes, p.l2_bytes, p.line_bytes) == (found.l1_bytes, found.l2_bytes, found.line_bytes)


def test_sysfs_layout_is_parsed(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                             (2, "Unified", "2048K"), (3, "Unified", "96M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size), ("coherency_line_size", 64)):
            (d / name).write_text(f"{value}\n")
    found = cachemodel.read_sysfs(str(tmp_path))
    assert (found.l1_bytes, found.l2_bytes, found.l3_bytes, found.line_bytes) == (48 << 10, 2 << 20, 96 << 20, 64)
    assert cachemodel.read_sysfs(str(tmp_path / "missing")) is None


def test_lscpu_output_is_parsed(monkeypatch):
    text = "NAME ONE-SIZE COHERENCY-SIZE\nL1d 49152 64\nL1i 32768 64\nL2 1310720 64\nL3 50331648 64\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, text, ""))
    found = cachemodel.read_lscpu()
    assert (found.l1_bytes, found.l2_bytes, found.l3_bytes, found.source) == (49152, 1310720, 50331648, "lscpu")


def test_bad_arguments():
    with pytest.raises(ValueError):
        predict_tile(0)
    with pytest.raises(ValueError):
        predict_tile(10, share=0)


def test_simulator_agrees_that_the_predicted_tile_fits():
    # A scaled-down machine (4 KiB L1, 8 sets) so the full blocked loop simulates in a moment: the
    # tile the model picks misses L1 far less often than tiles too big for it, and than no tiling.
    l1 = cachesim.CacheConfig("L1", 4096, 64, 8)
    elem = 8
    p = predict_tile(60, elem, 64, l1.size_bytes, 64 * 1024)
    assert p.tile == 8 and p.tile_reuse == 8  # 3T^2 and T^2+2T elements in 2 KiB of float64

    def misses_per_fma(n, tile):
        [s] = cachesim.simulate(cachesim.blocked_trace(n, tile, elem), [l1])
        return s.misses / n**3

    predicted = misses_per_fma(60, p.tile)
    assert predicted < 0.5 * misses_per_fma(60, 60)  # one tile of n: the naive order
    assert predicted < 0.5 * misses_per_fma(60, 32)  # a 32 x 32 float64 B tile is 8 KiB, twice L1
    # What the capacity model cannot see: at n = 64 a row is 512 B = 8 lines = the number of sets,
    # so all 8 rows of a tile of B fall into one set, and the same tile thrashes.
    assert misses_per_fma(64, p.tile) > 10 * predicted
