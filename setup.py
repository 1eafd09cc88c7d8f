"""Builds the Cython kernels: every scratchllm/kernels/*.pyx becomes scratchllm.kernels.<name>.

Flags: -O3 lets GCC vectorize the inner loops. -march defaults to `native` because the
extension is built on the machine that runs it (make test / make demo build in place);
set SCRATCHLLM_MARCH=x86-64-v3 (or another) to build a portable wheel.
"""

import glob
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

march = os.environ.get("SCRATCHLLM_MARCH", "native")
compile_args = ["-O3", f"-march={march}", "-fno-math-errno", "-fopenmp"]
link_args = ["-fopenmp"]

extensions = [
    Extension(
        f"scratchllm.kernels.{os.path.splitext(os.path.basename(path))[0]}",
        [path],
        include_dirs=[np.get_include(), "scratchllm/kernels"],  # simd.h
        depends=sorted(glob.glob("scratchllm/kernels/*.h")),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for path in sorted(glob.glob("scratchllm/kernels/*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
