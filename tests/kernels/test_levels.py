"""Every level of the kernels that this CPU runs, each forced in a process of its own
(SCRATCHLLM_CPU_LEVEL), computes the default model's logits over a chat prompt and 8 greedy steps.

Where the arithmetic is the same the results are equal bit for bit: the levels with FMA
(x86-64-v3, AVX-512 with VNNI) sum every output in the same order whatever the vector width
(docs/kernels.md), in float32 products (`quantized`, the exact path) and in integer ones
(`int16`, `int8`). x86-64-v2 has no FMA instruction, so each multiply-add there rounds twice:
its exact-path logits are within 1e-5 of the largest logit of the others' (measured: 1.4e-6),
with the same greedy ids. Its integer paths (plain C, a lane at a time) are slow and are
compared by hand (docs/kernels.md gives the figures).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from scratchllm.kernels import cpu_features as cf

pytestmark = pytest.mark.slow

PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # SmolLM2's chat form
STEPS = 8
RUN = """
import sys
import numpy as np
from scratchllm.kernels import LEVEL
from scratchllm.models import ContiguousKVCache, load_model
out = {"level": np.array(LEVEL)}
for dtype in sys.argv[2].split(","):
    model = load_model("default", dtype=dtype)
    ids = [int(t) for t in sys.argv[3].split(",")]
    cache = ContiguousKVCache.for_model(model.config, len(ids) + int(sys.argv[4]))
    logits = model.forward(np.array(ids), np.arange(len(ids)), cache)
    rows = [logits]
    for _ in range(int(sys.argv[4])):
        ids.append(int(np.argmax(logits[-1])))
        logits = model.forward(np.array(ids[-1:]), np.array([len(ids) - 1]), cache)
        rows.append(logits)
    out[dtype + "_logits"], out[dtype + "_ids"] = np.concatenate(rows), np.array(ids)
np.savez(sys.argv[1], **out)
"""


def runnable_levels() -> list[str]:
    have = cf.cpu_flags()
    return [b.name for b in cf.read_built() if have is None or set(b.features) <= have]


def run_level(level: str, dtypes: list[str], path: str) -> dict[str, np.ndarray]:
    env = {**os.environ, cf.ENV_LEVEL: level}
    subprocess.run([sys.executable, "-c", RUN, path, ",".join(dtypes), ",".join(map(str, PROMPT)), str(STEPS)],
                   env=env, check=True, timeout=600)
    with np.load(path) as f:
        assert str(f["level"]) == level
        return dict(f)


def test_levels_agree(tmp_path):
    levels = runnable_levels()
    if len(levels) < 2:
        pytest.skip(f"this CPU runs one level of the build only: {levels}")
    with_fma = [lv for lv in levels if "fma" in dict((b.name, b.features) for b in cf.read_built())[lv]]
    results = {lv: run_level(lv, ["quantized", "int16", "int8"] if lv in with_fma else ["quantized"],
                             str(tmp_path / f"{lv}.npz")) for lv in levels}
    first = with_fma[0] if with_fma else levels[0]
    ref = results[first]
    for lv in levels:
        got = results[lv]
        if lv in with_fma:
            for dtype in ("quantized", "int16", "int8"):
                np.testing.assert_array_equal(got[f"{dtype}_logits"], ref[f"{dtype}_logits"], err_msg=f"{lv} {dtype}")
                np.testing.assert_array_equal(got[f"{dtype}_ids"], ref[f"{dtype}_ids"], err_msg=f"{lv} {dtype}")
        else:  # without FMA: two roundings per multiply-add
            diff = np.abs(got["quantized_logits"] - ref["quantized_logits"]).max()
            assert diff <= 1e-5 * np.abs(ref["quantized_logits"]).max(), (lv, diff)
            np.testing.assert_array_equal(got["quantized_ids"], ref["quantized_ids"], err_msg=lv)
