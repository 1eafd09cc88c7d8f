"""Build llama-cpp-python (the pinned version of requirements/peers.txt) from source for this CPU.

Why not its default build: that compiles llama.cpp with -march=native, and a virtual machine may
report CPU features (AVX-512 above all) that its host does not let it run; the result dies with
SIGILL (illegal instruction) at the first model load. So the instruction sets are named
explicitly, from what /proc/cpuinfo reports, and the build is proven by loading the default
model in a child process; a build killed by SIGILL is rebuilt without its widest instruction
set (AVX-512 first, then AVX2's companions), until one runs or nothing is left to drop.

Usage: `make peers` (or python scripts/build_peers.py [--dry-run]).
"""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# ggml's CMake options for x86 instruction sets, and the /proc/cpuinfo flag each needs; widest first,
# so dropping from the front removes what is least likely to be really there
OPTIONS = [("GGML_AVX512_BF16", "avx512_bf16"), ("GGML_AVX512_VNNI", "avx512_vnni"), ("GGML_AVX512_VBMI", "avx512vbmi"),
           ("GGML_AVX512", "avx512f"), ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_BMI2", "bmi2"), ("GGML_F16C", "f16c"),
           ("GGML_FMA", "fma"), ("GGML_AVX2", "avx2"), ("GGML_AVX", "avx")]
SMOKE = ("import sys, llama_cpp; m = llama_cpp.Llama(model_path=sys.argv[1], n_threads=1, n_ctx=64, verbose=False); "
         "m.eval([1, 2, 3]); print('ok')")


def pinned() -> str:
    for line in (ROOT / "requirements" / "peers.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            return line.strip()
    raise SystemExit("requirements/peers.txt names no package")


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def cmake_args(enabled: list[str]) -> str:
    on = " ".join(f"-D{opt}={'ON' if opt in enabled else 'OFF'}" for opt, _ in OPTIONS)
    return f"-DGGML_NATIVE=OFF {on} -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"


def build(requirement: str, enabled: list[str]) -> None:
    env = {**os.environ, "CMAKE_ARGS": cmake_args(enabled), "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    print(f"building {requirement} with CMAKE_ARGS={env['CMAKE_ARGS']}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", "--no-cache-dir",
                    "--no-binary", "llama-cpp-python", requirement], env=env, check=True)
    # its Python dependencies (the package itself is now there and satisfies the requirement), from wheels
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], check=True)


def smoke(model: str) -> int:
    """0 when the build loads and runs the model; the child's exit status otherwise (-SIGILL: bad flags)."""
    done = subprocess.run([sys.executable, "-c", SMOKE, model], capture_output=True, text=True, timeout=600)
    if done.returncode:
        print(done.stderr[-600:], file=sys.stderr)
    return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the CMake options, build nothing")
    args = parser.parse_args()
    flags = cpu_flags()
    enabled = [opt for opt, flag in OPTIONS if flag in flags]
    if args.dry_run:
        print(cmake_args(enabled))
        return 0
    sys.path.insert(0, str(ROOT))
    from scratchllm.formats.refs import resolve_model

    model, requirement = str(resolve_model("default")), pinned()
    while True:
        build(requirement, enabled)
        status = smoke(model)
        if status == 0:
            print(f"{requirement} built and runs here with {', '.join(enabled) or 'no x86 extensions'}")
            return 0
        if status != -signal.SIGILL or not enabled:
            print(f"the build fails to run the default model (exit {status}); see above", file=sys.stderr)
            return 1
        print(f"illegal instruction with {enabled[0]}: this CPU reports it but does not run it; rebuilding without it")
        enabled = enabled[1:]


if __name__ == "__main__":
    sys.exit(main())
