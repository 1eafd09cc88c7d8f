"""Builds the Cython kernels: every scratchllm/kernels/*.pyx becomes scratchllm.kernels.<name>
(and the loaders' helpers: scratchllm/formats/*.pyx and scratchllm/tokenizer/*.pyx likewise).

Portable by default: the kernels whose speed depends on the instruction set (all of
scratchllm/kernels/*.pyx but the thread pool) are compiled once per x86-64 level
(scratchllm/kernels/cpu_features.py: x86-64-v2, x86-64-v3, AVX-512 with VNNI) into
scratchllm/kernels/_levels/<level>/, and `import scratchllm.kernels` runs the highest level this
CPU has. So a wheel, the container image of deploy/ or a copied folder runs on any x86-64 node.
SCRATCHLLM_NATIVE=1 builds one level instead, `native` (-march=native: every feature of the
building machine, for that machine only; one compile instead of three).

Each level is Cython's one translation of the .pyx (cythonize, once) compiled with that level's
flags: a wrapper source per level (build/levels/<level>/<name>.c, which #includes the
translation) gives each its own object file, and the module inside keeps its one name
(scratchllm.kernels.<name>), whichever folder it is loaded from. The features each level's flags
enable (the compiler's predefined macros) are recorded in scratchllm/kernels/_build_levels.txt,
which the import compares with /proc/cpuinfo. The C compiles run in parallel (`build_ext -j`;
default: every core), the longest first.

Flags: -O3 lets GCC vectorize the inner loops; the build prints no warning at -Wall -Wextra: not
from our C (scratchllm/kernels/*.h, which tests/kernels/test_headers.py compiles at -Werror for
every level), the .pyx sources, nor Cython's generated C.
"""

import glob
import importlib.util
import os
import platform
import shlex
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

spec = importlib.util.spec_from_file_location("cpu_features", "scratchllm/kernels/cpu_features.py")
cpu_features = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_features)  # by path: the package itself may not import before the build

native = os.environ.get("SCRATCHLLM_NATIVE") == "1" or platform.machine().lower() not in ("x86_64", "amd64")
levels = [cpu_features.NATIVE] if native else list(cpu_features.LEVELS)
warning_args = ["-Wall", "-Wextra"]
kernel_args = ["-O3", "-fno-math-errno", "-fopenmp", *warning_args]
link_args = ["-fopenmp"]
cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def level_features(level):
    """The /proc/cpuinfo flags that `level`'s compile flags let the compiler use (its predefined macros)."""
    macros = subprocess.run([*cc, *level.compile_args, "-dM", "-E", "-x", "c", os.devnull],
                            capture_output=True, text=True, check=True).stdout
    return tuple(cpu_features.features_from_macros(macros))


def kernel_extension(name, sources, level=None):
    where = f"_levels.{level.folder}." if level else ""
    return Extension(
        f"scratchllm.kernels.{where}{name}",
        sources,
        include_dirs=[np.get_include(), "scratchllm/kernels"],  # the kernels' headers: simd.h, <module>.h
        depends=sorted(glob.glob("scratchllm/kernels/*.h")) + [f"scratchllm/kernels/{name}.c"],
        extra_compile_args=[*kernel_args, *(level.compile_args if level else ())],
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )


def level_source(name, level):
    """build/levels/<level>/<name>.c: Cython's translation of <name>.pyx, #included (written only
    when it changes, so that an unchanged build stays up to date)."""
    path = os.path.join("build", "levels", level.folder, f"{name}.c")
    text = f'#include "{os.path.relpath(f"scratchllm/kernels/{name}.c", os.path.dirname(path))}"\n'
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.isfile(path) or Path(path).read_text() != text:
        with open(path, "w") as f:
            f.write(text)
    return path


kernel_names = [os.path.splitext(os.path.basename(p))[0] for p in sorted(glob.glob("scratchllm/kernels/*.pyx"))]
per_level = [n for n in kernel_names if n not in cpu_features.BASELINE_MODULES]
# The loaders' helpers (scratchllm/formats/*.pyx, scratchllm/tokenizer/*.pyx) walk bytes and build
# tables: built for any x86-64, so that opening a model never depends on the build machine's CPU.
helpers = [
    Extension(f"scratchllm.{package}.{os.path.splitext(os.path.basename(path))[0]}", [path],
              extra_compile_args=["-O2", *warning_args])
    for package in ("formats", "tokenizer")
    for path in sorted(glob.glob(f"scratchllm/{package}/*.pyx"))
]


class BuildExt(build_ext):
    """build_ext that compiles in parallel on every core unless told (-j), records the levels it
    built next to the modules, and removes modules of a build before levels that would shadow
    nothing but mislead."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self):
        if self.inplace:  # setuptools copies each module into the source tree, into folders that must exist
            for ext in self.extensions:
                os.makedirs(os.path.dirname(self.get_ext_fullpath(ext.name)), exist_ok=True)
        super().run()
        if not self.extensions or not any(".kernels." in e.name for e in self.extensions):
            return
        built = [cpu_features.Built(level.name, level_features(level)) for level in levels]
        root = "." if self.inplace else self.build_lib
        cpu_features.write_built(built, Path(root, "scratchllm", "kernels", "_build_levels.txt"))
        if self.inplace:  # a kernel compiled with -march=native before the levels, beside them
            for name in per_level:
                for stale in glob.glob(f"scratchllm/kernels/{name}.*.so"):
                    os.remove(stale)


# `make` installs the package (metadata, the `scratchllm` command) with SCRATCHLLM_NO_EXTENSIONS=1
# and builds the extensions in place itself, in parallel (`build_ext --inplace -j`): an editable
# pip install would otherwise compile every one a second time, serially, into a directory of its
# own that the source tree's in-place modules shadow anyway.
if os.environ.get("SCRATCHLLM_NO_EXTENSIONS") == "1":
    ext_modules = []
else:
    translated = cythonize(  # .pyx -> .c once, in parallel; the C compiles are build_ext's
        [kernel_extension(n, [f"scratchllm/kernels/{n}.pyx"]) for n in kernel_names] + helpers,
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False, "cdivision": True},
        nthreads=os.cpu_count() or 1,
    )
    by_name = {e.name: e for e in translated}
    # the longest compiles first (the packed GEMM, once per level), so that the parallel build ends together
    variants = [kernel_extension(n, [level_source(n, level)], level)
                for n in sorted(per_level, key=lambda n: -os.path.getsize(f"scratchllm/kernels/{n}.c"))
                for level in levels]
    ext_modules = variants + [by_name[f"scratchllm.kernels.{n}"] for n in cpu_features.BASELINE_MODULES] + [
        by_name[e.name] for e in helpers]

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
