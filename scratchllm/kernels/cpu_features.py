"""Which x86 instruction-set extensions the kernels were compiled for, and whether this CPU has them.

The Cython kernels are compiled with -march (default `native`: the building machine's own
features). An extension built for AVX-512 and imported on a CPU without it does not fail at
import: it dies with SIGILL (illegal instruction) at the first vector instruction, killing the
process with no Python traceback. A wheel or a folder copied to another machine, or a virtual
machine that reports a feature its host does not enable, all end that way. So setup.py records
the features the compiler enabled (its predefined macros for the -march given) in
BUILD_FEATURES_FILE, and `scratchllm.kernels` compares them with the flags the kernel reports in
/proc/cpuinfo before any compiled module is loaded, refusing with a message that says what to do.

This module has no imports beyond the standard library: setup.py loads it by path, before the
package (or NumPy) can be imported.
"""

from collections.abc import Iterable
from pathlib import Path

BUILD_FEATURES_FILE = Path(__file__).with_name("_build_features.txt")

# GCC's predefined macro for an extension -> the name Linux gives the same extension in /proc/cpuinfo
MACRO_TO_FLAG = {
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__BMI__": "bmi1",
    "__BMI2__": "bmi2", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl", "__AVX512CD__": "avx512cd", "__AVX512BF16__": "avx512_bf16",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512VBMI__": "avx512vbmi", "__AVXVNNI__": "avx_vnni",
}


class UnsupportedCPUError(ImportError):
    """The kernels use instructions this CPU does not have."""


def features_from_macros(predefined: str) -> list[str]:
    """The output of `cc -march=... -dM -E -x c /dev/null` -> the /proc/cpuinfo flags it implies."""
    defined = {line.split()[1] for line in predefined.splitlines() if line.startswith("#define ")}
    return sorted(flag for macro, flag in MACRO_TO_FLAG.items() if macro in defined)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The flags of this machine's first CPU, or None where /proc/cpuinfo is not readable (not Linux)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def missing_features(needed: Iterable[str], have: Iterable[str]) -> list[str]:
    return sorted(set(needed) - set(have))


def check(build_file: Path = BUILD_FEATURES_FILE, have: set[str] | None = None) -> list[str]:
    """Raise UnsupportedCPUError if the build needs a feature this CPU lacks; returns the build's features.
    No record (a build by an older setup.py) or no /proc/cpuinfo: nothing to compare, nothing refused."""
    if not build_file.is_file():
        return []
    needed = build_file.read_text(encoding="ascii").split()
    have = cpu_flags() if have is None else have
    if have is None:
        return needed
    missing = missing_features(needed, have)
    if missing:
        raise UnsupportedCPUError(
            f"scratchllm's kernels were compiled for CPU features this CPU lacks: {', '.join(missing)} "
            f"(built for: {' '.join(needed)}). Running them would crash with an illegal instruction. Rebuild them "
            "for this CPU: `python setup.py build_ext --inplace --force` (SCRATCHLLM_MARCH=native, the default), "
            "or portably for any x86-64 with AVX2: `SCRATCHLLM_MARCH=x86-64-v3 python setup.py build_ext --inplace "
            "--force`.")
    return needed
