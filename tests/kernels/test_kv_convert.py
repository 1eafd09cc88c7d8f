"""The KV cache's element conversions in paged_attention.h, on the path a build without F16C or
AVX2 takes (-march=x86-64): float -> half and bfloat16 rounded to nearest even, and back exactly,
bit for bit what NumPy (half) and round-to-nearest-even truncation (bfloat16) give; int8 widening
included. The vector paths are tested through the kernel (tests/engine/test_kv_dtype.py)."""

import shutil
import subprocess
import sysconfig

import numpy as np
import pytest

from tests.kernels.test_headers import CC, KERNELS

PROGRAM = r"""
#include <Python.h>
#include "paged_attention.h"
#include <stdio.h>
int main(void) {
    float x;
    while (fread(&x, sizeof x, 1, stdin) == 1) {
        uint16_t h = scratchllm_float_to_half(x), b = scratchllm_float_to_bf16(x);
        float back[2] = {scratchllm_half_to_float(h), scratchllm_bf16_to_float(b)};
        uint16_t hb[2] = {h, b};
        scratchllm_vf v = scratchllm_kv_load(hb, 0, SCRATCHLLM_KV_F16);  /* the loads' scalar fallback */
        fwrite(hb, sizeof hb, 1, stdout);
        fwrite(back, sizeof back, 1, stdout);
        fwrite(&v[0], sizeof v[0], 1, stdout);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    if shutil.which(CC[0]) is None:
        pytest.skip(f"no C compiler ({CC[0]})")
    folder = tmp_path_factory.mktemp("kvconvert")
    (folder / "convert.c").write_text(PROGRAM)
    exe = folder / "convert"
    subprocess.run([*CC, "-march=x86-64", "-O2", "-I", str(KERNELS), "-I", sysconfig.get_paths()["include"],
                    str(folder / "convert.c"), "-o", str(exe), "-lm"], check=True, capture_output=True)
    return exe


def bf16_rne(x):
    bits = x.view(np.uint32).astype(np.uint64)
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = (bits[nan] >> 16).astype(np.uint16) | 0x40
    return out


def test_the_scalar_conversions_round_to_nearest_even(converter):
    rng = np.random.default_rng(0)
    x = np.concatenate([  # all float32: a signalling NaN's bits survive only without a cast
        (rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000)).astype(np.float32),
        np.array([0.0, -0.0, 65504, 65519.99, 65520, 1e6, -1e6, np.inf, -np.inf, 5.96e-8, 2.98e-8, 2.99e-8,
                  6.1035e-5, 6.1e-5, 1e-45, 3.4e38], dtype=np.float32),
        rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bits, NaNs too
    ])
    done = subprocess.run([str(converter)], input=x.tobytes(), capture_output=True, check=True)
    rec = np.frombuffer(done.stdout, dtype=np.dtype([("h", "<u2"), ("b", "<u2"), ("hf", "<f4"), ("bf", "<f4"),
                                                     ("load", "<f4")]))
    assert len(rec) == len(x)
    with np.errstate(over="ignore", invalid="ignore"):
        half = x.astype(np.float16)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(rec["h"][finite], half.view(np.uint16)[finite])
    assert np.all(np.isnan(rec["hf"][~finite]))  # a NaN stays a NaN
    np.testing.assert_array_equal(rec["hf"][finite], half[finite].astype(np.float32))  # back, exactly
    np.testing.assert_array_equal(rec["load"][finite], half[finite].astype(np.float32))
    np.testing.assert_array_equal(rec["b"], bf16_rne(x))
    ok = finite
    np.testing.assert_array_equal(rec["bf"][ok], (rec["b"][ok].astype(np.uint32) << 16).view(np.float32))
