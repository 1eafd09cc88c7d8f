"""The kernels' levels: each is recorded with the features its compile flags enable, as the
compiler reports them; the import runs the highest level this CPU has (or the one
SCRATCHLLM_CPU_LEVEL forces), and a level it cannot run is refused by name before any compiled
module is loaded."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scratchllm.errors import ScratchLLMError, UnsupportedCPUError
from scratchllm.kernels import cpu_features as cf

GCC_AVX512_MACROS = ("#define __AVX__ 1\n#define __AVX2__ 1\n#define __AVX512F__ 1\n#define __AVX512BF16__ 1\n"
                     "#define __x86_64 1\n")
V2 = ("pni", "popcnt", "sse4_1", "sse4_2", "ssse3")
BUILT = (cf.Built("x86-64-v2", V2), cf.Built("x86-64-v3", (*V2, "avx", "avx2", "fma", "f16c")),
         cf.Built("avx512-vnni", (*V2, "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni")))
SANDY_BRIDGE = {"sse2", *V2, "avx"}  # AVX but no AVX2, no FMA
ZEN3 = {"sse2", *V2, "avx", "avx2", "fma", "f16c", "bmi2"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}


def test_macros_map_to_cpuinfo_names():
    assert cf.features_from_macros(GCC_AVX512_MACROS) == ["avx", "avx2", "avx512_bf16", "avx512f"]


def test_the_highest_level_this_cpu_has_runs():
    assert cf.choose(BUILT, ZEN4).level == BUILT[2]
    zen3 = cf.choose(BUILT, ZEN3)
    assert zen3.level == BUILT[1]
    assert "not avx512-vnni: no avx512_vnni, avx512bw, avx512f" in zen3.reason  # why not higher, by name
    sandy = cf.choose(BUILT, SANDY_BRIDGE)
    assert sandy.level == BUILT[0] and "not x86-64-v3: no avx2, f16c, fma" in sandy.reason
    assert "avx512-vnni (the highest level built" in cf.choose(BUILT, ZEN4).describe()


def test_a_forced_level_runs_if_this_cpu_has_it():
    choice = cf.choose(BUILT, ZEN4, forced="x86-64-v2")
    assert choice.level == BUILT[0] and choice.reason == "forced by SCRATCHLLM_CPU_LEVEL"
    with pytest.raises(UnsupportedCPUError, match=r"SCRATCHLLM_CPU_LEVEL=avx512-vnni: this CPU lacks avx512_vnni, "
                                                  r"avx512bw, avx512f.*illegal instruction"):
        cf.choose(BUILT, ZEN3, forced="avx512-vnni")
    with pytest.raises(UnsupportedCPUError, match=r"SCRATCHLLM_CPU_LEVEL=avx2: not a level of this build.*"
                                                  r"built: x86-64-v2, x86-64-v3, avx512-vnni"):
        cf.choose(BUILT, ZEN4, forced="avx2")


def test_a_cpu_below_every_level_is_refused_by_name():
    err = UnsupportedCPUError("x")
    assert isinstance(err, ImportError) and isinstance(err, ScratchLLMError)  # an import error; one CLI line
    with pytest.raises(UnsupportedCPUError, match=r"lacks popcnt, sse4_1, sse4_2, ssse3.*SCRATCHLLM_NATIVE=1"):
        cf.choose(BUILT, {"sse2", "pni"})


def test_unknown_features_run_the_lowest_and_nothing_built_is_said():
    assert cf.choose(BUILT, None).level == BUILT[0]  # no /proc/cpuinfo: the one level that runs most widely
    none = cf.choose((), ZEN4)
    assert none.level is None and "make build" in none.describe()


def test_the_record_round_trips(tmp_path):
    path = tmp_path / "levels.txt"
    cf.write_built(BUILT, path)
    assert cf.read_built(path) == BUILT
    assert cf.read_built(tmp_path / "absent.txt") == ()


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cf.cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cf.cpu_flags(tmp_path / "none") is None


def compiler_features(level: cf.Level) -> set[str]:
    out = subprocess.run(["gcc", *level.compile_args, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                         text=True)
    if out.returncode:
        pytest.skip("no gcc")
    return set(cf.features_from_macros(out.stdout))


def test_each_level_enables_what_it_says():
    v2, v3, v4 = (compiler_features(level) for level in cf.LEVELS)
    assert set(V2) <= v2 and not v2 & {"avx", "avx2", "fma"}
    assert {"avx", "avx2", "fma", "f16c", "bmi2"} <= v3 and "avx512f" not in v3
    assert {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_vnni"} <= v4
    assert "avx512_bf16" not in v4  # Cascade Lake and Ice Lake have VNNI without BF16: they run this level
    assert v2 < v3 < v4


def test_this_process_runs_its_level_s_modules():
    from scratchllm.kernels import CHOICE, packed_gemm, pointwise, pool

    level = CHOICE.level
    assert level is not None, "the kernels are built"
    assert level.name in {b.name for b in cf.read_built()}
    for module in (packed_gemm, pointwise):  # per level, from the level's folder, under the one name
        assert Path(module.__file__).parent == level.folder and module.__name__.startswith("scratchllm.kernels.")
    assert Path(pool.__file__).parent == cf.HERE  # the thread pool: one build for every level
    assert set(packed_gemm.COMPILED_FEATURES) <= set(level.features)  # the modules' own macros agree
    have = cf.cpu_flags()
    if have is not None:
        assert set(level.features) <= have
        if not os.environ.get(cf.ENV_LEVEL):  # chosen, not forced: no higher level built runs here
            higher = [b for b in CHOICE.built[CHOICE.built.index(level) + 1:] if set(b.features) <= have]
            assert not higher, higher
    floats = 16 if "avx512f" in level.features else 8 if "avx" in level.features else 4
    assert packed_gemm.NR == 2 * floats  # panels are two vectors wide


def test_a_level_this_cpu_lacks_is_one_line_from_the_cli():
    have = cf.cpu_flags() or set()
    lacking = next((b.name for b in cf.read_built() if not set(b.features) <= have), "no-such-level")
    env = {**os.environ, cf.ENV_LEVEL: lacking}
    out = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "version"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and f"SCRATCHLLM_CPU_LEVEL={lacking}" in out.stderr, out.stderr


def test_version_says_which_kernels_run_and_why(capsys):
    import json

    from scratchllm.cli.main import main
    from scratchllm.kernels import CHOICE, packed_gemm

    assert main(["version", "--json"]) == 0
    k = json.loads(capsys.readouterr().out)["kernels"]
    assert k["level"] == CHOICE.level.name and k["reason"] == CHOICE.reason
    assert [b["level"] for b in k["built"]] == [b.name for b in cf.read_built()]
    assert any(b["level"] == k["level"] and b["runs_here"] for b in k["built"])
    assert k["panel_width"] == packed_gemm.NR and k["integer_products"] == packed_gemm.INT8_DOT
    assert main(["version"]) == 0
    text = capsys.readouterr().out
    assert f"kernels: {CHOICE.level.name} ({CHOICE.reason})" in text and "levels built" in text
