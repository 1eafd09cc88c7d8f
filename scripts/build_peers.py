"""Build the peers of `scratchllm bench peers` and `bench serving --peer` from source for this CPU.

Two builds from one source: the pinned llama-cpp-python sdist of requirements/peers.txt (downloaded
once from the package index with `pip download --no-binary`):
  1. llama-cpp-python itself, installed into this virtualenv (the Python-API peer);
  2. llama.cpp's own programs `llama-bench`, `llama-batched-bench` and `llama-server`, built with
     CMake from the llama.cpp sources that sdist vendors (vendor/llama.cpp), linked statically and
     installed into <virtualenv>/peers/llama.cpp/bin with a build.json saying how they were built;
     every checkout running with this virtualenv finds them there (scratchllm/bench/llama_tools.py).

Why not their default builds: those compile with -march=native, and a virtual machine may report
CPU features (AVX-512 above all) that its host does not let it run; the result dies with SIGILL
(illegal instruction) at the first model load. So the instruction sets are named explicitly, from
what /proc/cpuinfo reports, and each build is proven by running the default model in a child
process; a build killed by SIGILL is rebuilt without its widest instruction set (AVX-512 first,
then AVX2's companions), until one runs or nothing is left to drop.

Usage: `make peers` (or python scripts/build_peers.py [--only python|tools] [--dry-run]).
Both builds compile llama.cpp: on 2 cores about 12 minutes each.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scratchllm.bench.llama_tools import TOOLS, tools_dir  # noqa: E402

# ggml's CMake options for x86 instruction sets, and the /proc/cpuinfo flag each needs; widest first,
# so dropping from the front removes what is least likely to be really there
OPTIONS = [("GGML_AMX_INT8", "amx_int8"), ("GGML_AMX_BF16", "amx_bf16"), ("GGML_AMX_TILE", "amx_tile"),
           ("GGML_AVX512_BF16", "avx512_bf16"), ("GGML_AVX512_VNNI", "avx512_vnni"), ("GGML_AVX512_VBMI", "avx512vbmi"),
           ("GGML_AVX512", "avx512f"), ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_BMI2", "bmi2"), ("GGML_F16C", "f16c"),
           ("GGML_FMA", "fma"), ("GGML_AVX2", "avx2"), ("GGML_AVX", "avx")]
SMOKE = ("import sys, llama_cpp; m = llama_cpp.Llama(model_path=sys.argv[1], n_threads=1, n_ctx=64, verbose=False); "
         "m.eval([1, 2, 3]); print('ok')")
# the programs' own options: no network (no curl, no OpenSSL, no web UI fetched at build time), no tests
TOOL_OPTIONS = ["-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
                "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release"]


def pinned() -> str:
    for line in (ROOT / "requirements" / "peers.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            return line.strip()
    raise SystemExit("requirements/peers.txt names no package")


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def isa_args(enabled: list[str]) -> list[str]:
    return ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if opt in enabled else 'OFF'}" for opt, _ in OPTIONS]


def python_cmake_args(enabled: list[str]) -> str:
    return " ".join(isa_args(enabled) + ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                                         "-DLLAMA_BUILD_TOOLS=OFF"])


def fetch_sdist(requirement: str, cache: Path) -> Path:
    """The requirement's source distribution, from the package index once, then from cache."""
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_')}-{version}"
    sdist = cache / f"{stem}.tar.gz"
    if not sdist.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading the {requirement} sdist into {cache}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        requirement, "-d", str(cache)], check=True)
    return sdist


def unpack(sdist: Path, into: Path) -> Path:
    """The sdist's vendored llama.cpp source folder (unpacked once)."""
    top = into / sdist.name.removesuffix(".tar.gz")
    if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(into, filter="data")
    return top / "vendor" / "llama.cpp"


def build_python(sdist: Path, requirement: str, enabled: list[str], jobs: int) -> None:
    env = {**os.environ, "CMAKE_ARGS": python_cmake_args(enabled), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    print(f"building {requirement} with CMAKE_ARGS={env['CMAKE_ARGS']}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", "--no-cache-dir",
                    str(sdist)], env=env, check=True)
    # its Python dependencies (the package itself is now there and satisfies the requirement), from wheels
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], check=True)


def build_tools(source: Path, build: Path, enabled: list[str], jobs: int) -> list[str]:
    """Configures and builds TOOLS in `build` (from scratch when the options changed); returns the CMake options."""
    options = isa_args(enabled) + TOOL_OPTIONS
    stamp = build / "scratchllm-options.json"
    if stamp.is_file() and json.loads(stamp.read_text()) != options:
        shutil.rmtree(build)
    build.mkdir(parents=True, exist_ok=True)
    print(f"building {', '.join(TOOLS)} with {' '.join(options)}", flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *options], check=True,
                   stdout=subprocess.DEVNULL)
    stamp.write_text(json.dumps(options))
    subprocess.run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *TOOLS], check=True)
    return options


def smoke_python(model: str) -> int:
    """0 when the build loads and runs the model; the child's exit status otherwise (-SIGILL: bad flags)."""
    done = subprocess.run([sys.executable, "-c", SMOKE, model], capture_output=True, text=True, timeout=600)
    if done.returncode:
        print(done.stderr[-600:], file=sys.stderr)
    return done.returncode


def smoke_tools(bin_dir: Path, model: str) -> int:
    """0 when each program runs the model (the server: its --version); the first failure's exit status otherwise."""
    checks = [[str(bin_dir / "llama-bench"), "-m", model, "-t", "1", "-p", "8", "-n", "4", "-r", "1", "-o", "json"],
              [str(bin_dir / "llama-batched-bench"), "-m", model, "-t", "1", "-c", "256", "-npp", "8", "-ntg", "4",
               "-npl", "1,2", "--output-format", "jsonl"],
              [str(bin_dir / "llama-server"), "--version"]]
    for argv in checks:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if done.returncode:
            print(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-600:]}", file=sys.stderr)
            return done.returncode
    return 0


def install_tools(build: Path, dest: Path, info: dict[str, object]) -> None:
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    for name in TOOLS:
        shutil.copy2(build / "bin" / name, dest / "bin" / name)
    (dest / "build.json").write_text(json.dumps(info, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the CMake options, build nothing")
    parser.add_argument("--only", choices=["python", "tools"], help="build only llama-cpp-python or only the programs")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="compile jobs (default: the cores)")
    args = parser.parse_args()
    flags = cpu_flags()
    enabled = [opt for opt, flag in OPTIONS if flag in flags]
    dest = tools_dir()
    if args.dry_run:
        print(f"llama-cpp-python: {python_cmake_args(enabled)}")
        print(f"{', '.join(TOOLS)} -> {dest / 'bin'}: {' '.join(isa_args(enabled) + TOOL_OPTIONS)}")
        return 0
    from scratchllm.formats.refs import resolve_model

    model, requirement = str(resolve_model("default")), pinned()
    work = Path(sys.prefix) / "peers" / "src"
    sdist = fetch_sdist(requirement, work)
    parts = [args.only] if args.only else ["tools", "python"]
    while True:
        status = 0
        for part in parts:
            if part == "python":
                build_python(sdist, requirement, enabled, args.jobs)
                status = smoke_python(model)
            else:
                build = work / "build"
                options = build_tools(unpack(sdist, work), build, enabled, args.jobs)
                status = smoke_tools(build / "bin", model)
                if status == 0:
                    install_tools(build, dest, {"from": requirement, "source": "vendor/llama.cpp of its sdist",
                                                "cmake": options, "instruction_sets": enabled})
                    print(f"{', '.join(TOOLS)} installed in {dest / 'bin'}")
            if status:
                break
        if status == 0:
            print(f"{', '.join(parts)} built and run here with {', '.join(enabled) or 'no x86 extensions'}")
            return 0
        if status != -signal.SIGILL or not enabled:
            print(f"the build fails to run the default model (exit {status}); see above", file=sys.stderr)
            return 1
        print(f"illegal instruction with {enabled[0]}: this CPU reports it but does not run it; rebuilding without it")
        enabled = enabled[1:]


if __name__ == "__main__":
    sys.exit(main())
