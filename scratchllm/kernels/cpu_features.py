"""Which build of the kernels this process runs: one of several x86-64 levels, chosen from the CPU.

A kernel compiled for an instruction set the CPU lacks does not fail at import: it dies with
SIGILL (illegal instruction) at the first vector instruction, killing the process with no Python
traceback. So one install holds the kernels compiled for several x86-64 levels (setup.py), and
the package picks one when it is imported, as llama.cpp's GGML_CPU_ALL_VARIANTS does:

- `x86-64-v2` (-march=x86-64-v2): any x86-64 of the last 15 years (SSE4.2, POPCNT); 4-float
  vectors, no FMA, integer products in plain C;
- `x86-64-v3` (-march=x86-64-v3): AVX2 + FMA + F16C (Intel Haswell, AMD Zen and later); 8-float
  vectors, a 6 x 16 register tile;
- `avx512-vnni` (-march=x86-64-v4 -mavx512vnni): AVX-512 F/BW/DQ/VL/CD with VNNI (Intel Cascade
  Lake, Ice Lake, Sapphire Rapids; AMD Zen 4); 16-float vectors, 12 x 32, vpdpbusd.

Each level's modules are in `scratchllm/kernels/_levels/<level>/`; setup.py asks the compiler
which extensions each level's flags enable (its predefined macros) and records them, as
/proc/cpuinfo names them, in LEVELS_FILE. `import scratchllm.kernels` (`current()`) takes the
highest level whose features are all in this CPU's flags (Linux clears a flag the OS does not
enable) and puts its folder first on the package's path, so that `scratchllm.kernels.packed_gemm`
is that level's module. SCRATCHLLM_CPU_LEVEL=<level> forces one (the tests run every level this
way); a level this CPU cannot run is refused by name (scratchllm.errors.UnsupportedCPUError)
instead of a SIGILL.
A build with SCRATCHLLM_NATIVE=1 has one level, `native` (-march=native: the building machine's
own features, for that machine only).

Only the kernels whose speed depends on the instruction set are built per level: every
scratchllm/kernels/*.pyx but the thread pool (BASELINE_MODULES). The thread pool and the loaders'
helpers (scratchllm/formats, scratchllm/tokenizer) are built once, for any x86-64.

This module imports only the standard library (the error class, from scratchllm.errors, when it
is raised): setup.py loads it by path, before the package (or NumPy) can be imported.
"""

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
LEVELS_FILE = HERE / "_build_levels.txt"  # one line per level built, lowest first: name, then its features
LEVELS_DIR = HERE / "_levels"  # a folder per level, named Level.folder
ENV_LEVEL = "SCRATCHLLM_CPU_LEVEL"
BASELINE_MODULES = ("pool",)  # built once, for any x86-64: its speed is the threads', not the vectors'


def folder_name(level: str) -> str:
    """A level's folder under LEVELS_DIR: a valid module name (setup.py names the extensions by it)."""
    return level.replace("-", "_")


@dataclass(frozen=True)
class Level:
    """One way of compiling the kernels."""

    name: str
    compile_args: tuple[str, ...]
    cpus: str  # which CPUs run it, in words

    @property
    def folder(self) -> str:
        return folder_name(self.name)


LEVELS = (
    Level("x86-64-v2", ("-march=x86-64-v2",), "any x86-64 with SSE4.2 and POPCNT (2009 on)"),
    Level("x86-64-v3", ("-march=x86-64-v3",), "AVX2, FMA and F16C (Intel Haswell, AMD Zen and later)"),
    Level("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"),
          "AVX-512 F/BW/DQ/VL/CD with VNNI (Intel Cascade Lake, Ice Lake, Sapphire Rapids; AMD Zen 4)"),
)
NATIVE = Level("native", ("-march=native",), "the machine that built it (SCRATCHLLM_NATIVE=1)")

# GCC's predefined macro for an extension -> the name Linux gives the same extension in /proc/cpuinfo
MACRO_TO_FLAG = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2", "__SSE4A__": "sse4a",
    "__POPCNT__": "popcnt", "__LZCNT__": "abm", "__MOVBE__": "movbe", "__XSAVE__": "xsave",
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__BMI__": "bmi1",
    "__BMI2__": "bmi2", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl", "__AVX512CD__": "avx512cd", "__AVX512BF16__": "avx512_bf16",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512IFMA__": "avx512ifma", "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVX512FP16__": "avx512_fp16", "__AVXVNNI__": "avx_vnni", "__GFNI__": "gfni", "__VAES__": "vaes",
    "__VPCLMULQDQ__": "vpclmulqdq",
}


def unsupported(message: str) -> ImportError:
    """scratchllm.errors.UnsupportedCPUError (an ImportError the CLI prints as one line), imported
    here rather than at the top: setup.py loads this module by path, outside the package."""
    from scratchllm.errors import UnsupportedCPUError

    return UnsupportedCPUError(message)


@dataclass(frozen=True)
class Built:
    """A level as the build recorded it: its name and the CPU features its code may use."""

    name: str
    features: tuple[str, ...]

    @property
    def folder(self) -> Path:
        return LEVELS_DIR / folder_name(self.name)


@dataclass(frozen=True)
class Choice:
    """The level this process runs and why (`scratchllm version` prints it)."""

    level: Built | None  # None: no kernels built (the pure-Python modules still import)
    reason: str
    built: tuple[Built, ...]
    cpu_flags: frozenset[str] | None  # None: not readable here

    def describe(self) -> str:
        if self.level is None:
            return f"kernels: none built ({self.reason})"
        others = ", ".join(b.name for b in self.built if b is not self.level) or "none"
        return f"kernels: {self.level.name} ({self.reason}); also built: {others}"


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


def write_built(levels: Sequence[Built], path: Path = LEVELS_FILE) -> None:
    path.write_text("".join(f"{b.name} {' '.join(b.features)}\n" for b in levels), encoding="ascii")


def read_built(path: Path = LEVELS_FILE) -> tuple[Built, ...]:
    """The levels the build made, lowest first; none if nothing was built."""
    if not path.is_file():
        return ()
    rows = [line.split() for line in path.read_text(encoding="ascii").splitlines() if line.strip()]
    return tuple(Built(row[0], tuple(row[1:])) for row in rows)


def choose(built: Sequence[Built], have: set[str] | frozenset[str] | None, forced: str | None = None) -> Choice:
    """The level to run: `forced` if given (refused if not built or not runnable here), else the
    highest built level whose features are all in `have` (this CPU's flags; None: unknown, so the
    lowest). Raises scratchllm.errors.UnsupportedCPUError where none fits."""
    names = ", ".join(b.name for b in built) or "none"
    flags = None if have is None else frozenset(have)
    if forced:
        level = next((b for b in built if b.name == forced), None)
        if level is None:
            raise unsupported(f"{ENV_LEVEL}={forced}: not a level of this build of scratchllm's kernels "
                                      f"(built: {names})")
        missing = [] if flags is None else missing_features(level.features, flags)
        if missing:
            raise unsupported(f"{ENV_LEVEL}={forced}: this CPU lacks {', '.join(missing)}, which that level's "
                                      "kernels use (running them would crash with an illegal instruction); "
                                      f"built: {names}")
        return Choice(level, f"forced by {ENV_LEVEL}", tuple(built), flags)
    if not built:
        return Choice(None, "run `make build`, or `python setup.py build_ext --inplace`", (), flags)
    if flags is None:
        return Choice(built[0], "the lowest level: this CPU's features are not readable here (no /proc/cpuinfo)",
                      tuple(built), flags)
    skipped: list[str] = []
    for level in reversed(built):
        missing = missing_features(level.features, flags)
        if not missing:
            why = "the highest level built whose features this CPU has"
            if skipped:
                why += "; not " + "; not ".join(skipped)
            return Choice(level, why, tuple(built), flags)
        skipped.append(f"{level.name}: no {', '.join(missing)}")
    lowest = built[0]
    raise unsupported(
        f"this CPU lacks {', '.join(missing_features(lowest.features, flags))}, which every level of scratchllm's "
        f"kernels built here uses (built: {names}). Rebuild them for this machine: SCRATCHLLM_NATIVE=1 python "
        "setup.py build_ext --inplace")


def current() -> Choice:
    """The choice for this process: the build's record, this CPU's flags and SCRATCHLLM_CPU_LEVEL."""
    return choose(read_built(), cpu_flags(), os.environ.get(ENV_LEVEL) or None)
