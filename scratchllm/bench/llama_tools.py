"""llama.cpp's own programs as peers: where `make peers` installs them, and running them.

`make peers` (scripts/build_peers.py) builds `llama-bench`, `llama-batched-bench`,
`llama-server`, `llama-cli`, `llama-speculative-simple` and `llama-lookup` with CMake from the
llama.cpp sources that the pinned llama-cpp-python sdist vendors, and installs them into
`<virtualenv>/peers/llama.cpp/bin`, next to a `build.json` that says what was built with which
options. Every checkout that runs with that virtualenv finds them
there; SCRATCHLLM_LLAMA_CPP names another folder.

Peak RSS of a program we did not write: its /proc/<pid>/status VmHWM (the kernel's high-water
mark of its resident set), sampled every 20 ms while it runs; the last sample before it exits is
the peak unless memory grew in those final milliseconds. Not getrusage's ru_maxrss: on Linux a
child's starts at its parent's resident set (copied at fork, kept across exec).
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchllm.bench.common import status_mb

TOOLS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-cli", "llama-speculative-simple", "llama-lookup")
ENV = "SCRATCHLLM_LLAMA_CPP"


def tools_dir() -> Path:
    """The folder holding bin/<tool> and build.json: $SCRATCHLLM_LLAMA_CPP, or the virtualenv's."""
    return Path(os.environ.get(ENV) or Path(sys.prefix) / "peers" / "llama.cpp")


def tool(name: str, folder: Path | None = None) -> Path | None:
    """The installed program `name` (one of TOOLS), or None when `make peers` has not built it."""
    path = (folder or tools_dir()) / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build_info(folder: Path | None = None) -> dict[str, Any]:
    """What build.json says (version, CMake options, instruction sets); {} when there is none."""
    path = (folder or tools_dir()) / "build.json"
    if not path.is_file():
        return {}
    info: dict[str, Any] = json.loads(path.read_text())
    return info


class PeakSampler:
    """Samples a running process's VmHWM every `period` seconds from a thread of its own."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        self.pid, self.period, self.peak_mb = pid, period, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            mb = status_mb(self.pid, "VmHWM")
            if mb is not None:
                self.peak_mb = max(self.peak_mb, mb)
            self._stop.wait(self.period)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


@dataclass
class ToolRun:
    """A finished run of a program: its standard output, wall seconds and peak RSS (and its
    standard error, where llama.cpp's examples print their figures)."""

    stdout: str
    seconds: float
    peak_rss_mb: float
    stderr: str = ""


def run_tool(argv: list[str], timeout: float = 1800) -> ToolRun:
    """Runs argv to its end with its peak RSS sampled; a failure raises with the end of its stderr."""
    from scratchllm.errors import ConfigError

    t = time.perf_counter()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        sampler = PeakSampler(proc.pid)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise ConfigError(f"{Path(argv[0]).name} ran past {timeout:.0f} s") from None
        finally:
            peak = sampler.stop()
    if proc.returncode:
        raise ConfigError(f"{' '.join(argv)} failed (exit {proc.returncode}): {err.strip()[-800:]}")
    return ToolRun(out, time.perf_counter() - t, peak, err)


def bench_args(model: str, threads: int, prompt: int, new: int, reps: int) -> list[str]:
    """llama-bench's command line for one pp<prompt> and one tg<new> test (JSON on stdout)."""
    return ["-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(new), "-r", str(reps), "-o", "json"]


def parse_bench(stdout: str) -> dict[str, float]:
    """llama-bench's JSON tests -> {"prefill_tok_s", "decode_tok_s"} (its mean tokens/s of each)."""
    out = {}
    for test in json.loads(stdout):
        key = "prefill_tok_s" if test["n_gen"] == 0 else "decode_tok_s"
        out[key] = float(test["avg_ts"])
    return out


def batched_args(model: str, threads: int, prompt: int, new: int, sequences: list[int], ctx: int) -> list[str]:
    """llama-batched-bench's command line: each of `sequences` parallel sequences of prompt + new tokens."""
    return ["-m", model, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512",
            "-npp", str(prompt), "-ntg", str(new), "-npl", ",".join(map(str, sequences)), "--output-format", "jsonl"]


def parse_batched(stdout: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's JSON lines -> {sequences: {"aggregate_tok_s", "prefill_tok_s", "decode_tok_s"}}:
    aggregate is all tokens (prompts and generated) over the whole time, as its `S t/s` column."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[int(row["pl"])] = {"aggregate_tok_s": float(row["speed"]), "prefill_tok_s": float(row["speed_pp"]),
                                   "decode_tok_s": float(row["speed_tg"]),
                                   "generated_tok_s": int(row["pl"]) * int(row["tg"]) / float(row["t"])}
    return out


# --- speculative decoding: llama-speculative-simple (a draft model, or its n-gram types) and llama-lookup ---
# The n-gram types of llama-speculative-simple's --spec-type that draft without a model (its --help)
NGRAM_SPEC_TYPES = ("ngram-simple", "ngram-mod")


def speculative_args(model: str, prompt_file: str, threads: int, new_tokens: int, ctx: int, draft_max: int,
                     spec_type: str = "draft-simple", draft_model: str | None = None) -> list[str]:
    """llama-speculative-simple's command line: greedy, `new_tokens` after the prompt in `prompt_file`,
    drafting with `draft_model` (spec_type draft-simple, at most draft_max tokens) or one of
    NGRAM_SPEC_TYPES (at their own defaults: their lookup and draft lengths are their own knobs)."""
    argv = ["-m", model, "-f", prompt_file, "-n", str(new_tokens), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx), "--temp", "0", "--spec-type", spec_type]
    if draft_model is not None:
        argv += ["-md", draft_model, "--spec-draft-n-max", str(draft_max), "-td", str(threads),
                 "-tbd", str(threads)]
    return argv


def lookup_args(model: str, prompt_file: str, threads: int, new_tokens: int, ctx: int, draft_max: int) -> list[str]:
    """llama-lookup's command line: n-gram lookup decoding, greedy, at most draft_max tokens drafted."""
    return ["-m", model, "-f", prompt_file, "-n", str(new_tokens), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx), "--temp", "0", "--spec-draft-n-max", str(draft_max)]


_FIGURE = re.compile(r"\b(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_COUNT = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")


def parse_speculative(log: str) -> dict[str, float]:
    """The figures llama-speculative-simple and llama-lookup print at their end (on stderr):
    {"prefill_tok_s", "decode_tok_s", "decoded", "drafted", "accepted", "accept_rate"}; decode
    speed is theirs: the tokens decoded over the time from the first to the last, drafting included."""
    out: dict[str, float] = {}
    for kind, tokens, _seconds, speed in _FIGURE.findall(log):
        out["prefill_tok_s" if kind == "encoded" else "decode_tok_s"] = float(speed)
        if kind == "decoded":
            out["decoded"] = int(tokens)
    counts = dict(_COUNT.findall(log))
    if "decode_tok_s" not in out or "n_drafted" not in counts:
        from scratchllm.errors import ConfigError

        raise ConfigError(f"no speculative figures in the program's output: {log.strip()[-400:]}")
    out["drafted"], out["accepted"] = int(counts["n_drafted"]), int(counts.get("n_accept", 0))
    out["accept_rate"] = out["accepted"] / out["drafted"] if out["drafted"] else 0.0
    return out
