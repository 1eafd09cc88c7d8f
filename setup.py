"""Builds the Cython kernels: every scratchllm/kernels/*.pyx becomes scratchllm.kernels.<name>
(and the loaders' helpers: scratchllm/formats/*.pyx and scratchllm/tokenizer/*.pyx likewise).

Flags: -O3 lets GCC vectorize the inner loops. -march defaults to `native` because the
extension is built on the machine that runs it (make test / make demo build in place): the
kernels then use AVX-512 (and AVX512-BF16) where the CPU has them, and AVX2 + FMA otherwise.
Set SCRATCHLLM_MARCH=x86-64-v3 (any x86-64 with AVX2, FMA, F16C) or another to build for other
machines. The features the compiler enabled are written to scratchllm/kernels/_build_features.txt;
importing scratchllm.kernels compares them with this CPU's and refuses a build it cannot run
(scratchllm/kernels/cpu_features.py).
"""

import glob
import importlib.util
import os
import shlex
import subprocess
import sysconfig

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

march = os.environ.get("SCRATCHLLM_MARCH", "native")
# The build prints no warning at -Wall -Wextra: not from our C (scratchllm/kernels/*.h, which
# tests/kernels/test_headers.py compiles at -Werror), the .pyx sources, nor Cython's generated C.
warning_args = ["-Wall", "-Wextra"]
compile_args = ["-O3", f"-march={march}", "-fno-math-errno", "-fopenmp", *warning_args]
link_args = ["-fopenmp"]


def record_build_features():
    """Ask the compiler which extensions -march enables (its predefined macros) and record them."""
    spec = importlib.util.spec_from_file_location("cpu_features", "scratchllm/kernels/cpu_features.py")
    cpu_features = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_features)  # by path: the package itself may not import before the build
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    macros = subprocess.run([*cc, f"-march={march}", "-dM", "-E", "-x", "c", os.devnull],
                            capture_output=True, text=True, check=True).stdout
    features = cpu_features.features_from_macros(macros)
    with open(cpu_features.BUILD_FEATURES_FILE, "w", encoding="ascii") as f:
        f.write(" ".join(features) + "\n")


record_build_features()

extensions = [
    Extension(
        f"scratchllm.kernels.{os.path.splitext(os.path.basename(path))[0]}",
        [path],
        include_dirs=[np.get_include(), "scratchllm/kernels"],  # the kernels' headers: simd.h, <module>.h
        depends=sorted(glob.glob("scratchllm/kernels/*.h")),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for path in sorted(glob.glob("scratchllm/kernels/*.pyx"))
]
# The loaders' helpers (scratchllm/formats/*.pyx, scratchllm/tokenizer/*.pyx) walk bytes and build
# tables: built for any x86-64, so that opening a model never depends on the build machine's CPU.
extensions += [
    Extension(
        f"scratchllm.{package}.{os.path.splitext(os.path.basename(path))[0]}",
        [path],
        extra_compile_args=["-O2", *warning_args],
    )
    for package in ("formats", "tokenizer")
    for path in sorted(glob.glob(f"scratchllm/{package}/*.pyx"))
]

# `make` installs the package (metadata, the `scratchllm` command) with SCRATCHLLM_NO_EXTENSIONS=1
# and builds the extensions in place itself, in parallel (`build_ext --inplace -j`): an editable
# pip install would otherwise compile every one a second time, serially, into a directory of its
# own that the source tree's in-place modules shadow anyway.
if os.environ.get("SCRATCHLLM_NO_EXTENSIONS") == "1":
    extensions = []

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False, "cdivision": True},
        nthreads=os.cpu_count() or 1,  # the .pyx -> .c translations in parallel (the C compiles: build_ext -j)
    )
)
