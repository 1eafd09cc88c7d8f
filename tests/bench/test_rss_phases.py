"""scripts/rss_phases.py on a short round of the default model: every phase sampled, and the KV
pool resident in exactly the pages that the round's batched run wrote (counted from the layout)."""

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path


def test_a_short_round_samples_every_phase(default_gguf):
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "scripts" / "rss_phases.py"), "--prompt-tokens", "24",
                          "--new-tokens", "3", "--batch", "2", "--threads", "1", "--json",
                          "--kv-cache-dtype", "float32"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    phases = [p["phase"] for p in r["phases"]]
    assert phases == ["start (imports)", "load", "prefill", "decode", "generate"]
    for p in r["phases"]:
        assert 0 < p["rss"] <= p["peak"] + 0.01 and p["anon"] + p["file"] <= p["rss"] + 0.01
    assert r["bench_peak_rss_mb"] == max(p["peak"] for p in r["phases"])
    # 2 prompts of 32 ids + 3 new tokens: 34 slots written each (the last token's K/V is never
    # computed): 2 full blocks and 2 slots of a third. Per layer a block's K is [3 heads, 64, 16] float32
    # floats, 3 pages, every one written by each token; its V is 16 slots of 768 bytes, 3 pages
    # filled in slot order, so 2 slots touch one.
    page = mmap.PAGESIZE
    assert page == 4096
    layers, k_pages, v_pages = 30, 3 * 3, 3 + 3 + 1
    expected = 2 * layers * (k_pages + v_pages) * page / 2**20
    assert r["phases"][-1]["kv_pool"] == expected
    assert r["generate_steps"][-1]["blocks"] == 0  # every request finished and returned its blocks
