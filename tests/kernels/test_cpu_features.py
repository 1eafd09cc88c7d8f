"""The CPU-feature check: a build for instructions this CPU lacks is refused by name, before any
compiled kernel is loaded; the record setup.py writes agrees with what the kernels were compiled for."""

import subprocess

import pytest

from scratchllm.kernels import cpu_features as cf

GCC_AVX512_MACROS = ("#define __AVX__ 1\n#define __AVX2__ 1\n#define __AVX512F__ 1\n#define __AVX512BF16__ 1\n"
                     "#define __x86_64 1\n")


def test_macros_map_to_cpuinfo_names():
    assert cf.features_from_macros(GCC_AVX512_MACROS) == ["avx", "avx2", "avx512_bf16", "avx512f"]


def test_a_build_for_missing_features_is_refused_by_name(tmp_path):
    record = tmp_path / "features.txt"
    record.write_text("avx avx2 fma avx512f avx512bw\n")
    zen3 = {"sse2", "avx", "avx2", "fma", "f16c", "bmi2"}
    with pytest.raises(cf.UnsupportedCPUError, match=r"lacks: avx512bw, avx512f.*SCRATCHLLM_MARCH=x86-64-v3"):
        cf.check(record, have=zen3)
    assert isinstance(cf.UnsupportedCPUError("x"), ImportError)  # `import scratchllm.kernels` fails cleanly
    assert cf.check(record, have=zen3 | {"avx512f", "avx512bw"}) == ["avx", "avx2", "fma", "avx512f", "avx512bw"]
    assert cf.check(tmp_path / "absent.txt", have=zen3) == []  # no record: nothing to compare


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cf.cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cf.cpu_flags(tmp_path / "none") is None


def test_this_build_is_recorded_and_runs_here():
    from scratchllm.kernels import BUILD_FEATURES, packed_gemm

    assert BUILD_FEATURES, "setup.py records the features it compiled for"
    # the compiled modules' own macros are a subset of the record, and this CPU has them all
    assert set(packed_gemm.COMPILED_FEATURES) <= set(BUILD_FEATURES)
    have = cf.cpu_flags()
    if have is not None:
        assert set(BUILD_FEATURES) <= have
    # and the vector width follows the build: two vectors per panel, 16 or 8 floats each
    assert packed_gemm.NR == (32 if "avx512f" in packed_gemm.COMPILED_FEATURES else 16)


def test_the_record_matches_the_compiler(tmp_path):
    # what setup.py writes is what GCC enables for that -march (here a fixed one, x86-64-v3)
    out = subprocess.run(["gcc", "-march=x86-64-v3", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                         text=True)
    if out.returncode:
        pytest.skip("no gcc")
    assert {"avx", "avx2", "fma", "f16c", "bmi2"} <= set(cf.features_from_macros(out.stdout))
    assert "avx512f" not in cf.features_from_macros(out.stdout)
