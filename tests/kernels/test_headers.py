"""The kernels' C lives in header files and compiles without a warning.

Each scratchllm/kernels/*.h is compiled on its own (a translation unit that includes Python.h, as
every Cython module does first, then the header) at -Wall -Wextra -Werror, with the flags of every
level the build makes (cpu_features.LEVELS: x86-64-v2, x86-64-v3, AVX-512 with VNNI), of
-march=native, and of AVX-512 without VNNI (x86-64-v4) and with BF16, the other branches the
headers have. And no .pyx or .pxd holds C in a `cdef extern from *:` string any more, where no
compiler test of the header kind can see it.
"""

import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from scratchllm.kernels import cpu_features

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "scratchllm" / "kernels"
HEADERS = sorted(KERNELS.glob("*.h"))
FLAGS = {level.name: level.compile_args for level in (*cpu_features.LEVELS, cpu_features.NATIVE)} | {
    "x86-64-v4": ("-march=x86-64-v4",), "avx512-bf16": ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16")}
CC = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")  # as setup.py finds it

# C in a Cython string: `cdef extern from *:` (or `* nogil:`) followed by a string literal.
VERBATIM_C = re.compile(r'^[ \t]*cdef\s+extern\s+from\s+\*[^\n]*:[ \t]*\n\s*[rRuU]?("""|\'\'\'|"|\')', re.M)


def compile_header(header: Path, flags: tuple[str, ...], extra: tuple[str, ...] = ()) -> list[str]:
    """Compile a translation unit of just `header`; returns the compiler's diagnostics (lines)."""
    source = f'#include <Python.h>\n#include "{header.name}"\n'
    # -Wno-unused-function: a header's static functions are there for its module, not for this unit.
    cmd = [*CC, *flags, "-O3", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function", "-fsyntax-only",
           "-I", str(header.parent), "-I", sysconfig.get_paths()["include"], *extra, "-x", "c", "-"]
    result = subprocess.run(cmd, input=source, capture_output=True, text=True, cwd=header.parent)
    return [line for line in result.stderr.splitlines() if line.strip()] if result.returncode else []


def test_the_kernels_have_headers():
    assert {h.name for h in HEADERS} >= {"simd.h", "packed_gemm.h", "paged_attention.h", "pool.h", "pointwise.h"}


@pytest.mark.skipif(shutil.which(CC[0]) is None, reason=f"no C compiler ({CC[0]})")
@pytest.mark.parametrize("level", FLAGS)
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: h.name)
def test_header_compiles_without_warnings(header, level):
    diagnostics = compile_header(header, FLAGS[level])
    if diagnostics:
        pytest.fail(f"{header.name} at {' '.join(FLAGS[level])}:\n" + "\n".join(diagnostics), pytrace=False)


@pytest.mark.skipif(shutil.which(CC[0]) is None, reason=f"no C compiler ({CC[0]})")
def test_a_warning_fails_the_check(tmp_path):
    """The check itself: a header with an unused variable is refused, the warning named."""
    planted = tmp_path / "planted.h"
    planted.write_text("static inline int planted(int x) { int unused = x; return 0; }\n")
    diagnostics = compile_header(planted, cpu_features.NATIVE.compile_args)
    assert any("unused" in line for line in diagnostics), diagnostics


def test_no_c_in_cython_strings():
    sources = sorted((ROOT / "scratchllm").rglob("*.pyx")) + sorted((ROOT / "scratchllm").rglob("*.pxd"))
    assert sources
    found = []
    for path in sources:
        text = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                  for m in VERBATIM_C.finditer(text)]
    assert not found, f"C in a `cdef extern from *` string (move it to a header next to the .pyx): {', '.join(found)}"


def test_the_verbatim_pattern_is_recognized():
    """The pattern above finds what it must (and leaves a declaration-only block alone)."""
    assert VERBATIM_C.search('cdef extern from *:\n    """\n    static int f(void) { return 0; }\n    """\n')
    assert VERBATIM_C.search("cdef extern from * nogil:\n    '''#define X 1'''\n")
    assert not VERBATIM_C.search('cdef extern from *:\n    int X\n')
    assert not VERBATIM_C.search('cdef extern from "pool.h":\n    """doc"""\n')
