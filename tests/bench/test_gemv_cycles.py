"""scripts/gemv_cycles.py: every matrix of the first block and the LM head timed, with cycles that
follow from the time and the clock given."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args):
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(root / "scripts" / "gemv_cycles.py"), *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)


def test_every_matrix_is_timed_in_cycles_at_the_clock_given(default_gguf):
    done = run("--rounds", "1", "--ghz", "2.0", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["matrix"] for r in rows] == ["qkv", "o", "gate_up", "down", "lm_head"]
    for r in rows:
        assert r["us"] > 0
        assert r["cycles_per_32_weights"] == pytest.approx(r["us"] * 1e-6 * 2.0e9 / (r["k"] * r["n"] / 32))
    assert {r["panels"] for r in rows} == {"Q4Panels", "Q8Panels"}  # the default model's Q4_1 layers, Q8_0 head


def test_bad_flags_are_refused():
    done = run("--rounds", "0")
    assert done.returncode == 2 and "--rounds" in done.stderr
