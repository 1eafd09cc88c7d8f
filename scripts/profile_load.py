"""Where `LLM(model, threads=2)` spends its time: fresh processes, medians, stage by stage.

Each run is a new Python process that imports `scratchllm.llm` first (as `scratchllm bench peers`
does) and then times `LLM(model, threads=2)` three ways, each in its own process:
  - plain: stages timed by wrappers (no profiler), so the figures are what a user waits for;
    the weight packing (`pack` of scratchllm.models.llama_pack, as models.llama calls it) is one
    stage, everything else the rest;
  - profiled: the same under cProfile, for the breakdown by function (cumulative seconds);
  - tokenizer alone: `Tokenizer.from_pretrained(model)`, and the GGUF header parse alone.

    python scripts/profile_load.py [--model default] [--runs 5] [--top 25]
"""

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import cProfile, json, pstats, resource, sys, time
t = time.perf_counter()
from scratchllm.llm import LLM
import_s = time.perf_counter() - t
from scratchllm.tokenizer import Tokenizer

model, which, top = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
if which == "plain":
    import scratchllm.llm as llm_module
    import scratchllm.models.llama as llama_module

    def faults():  # minor page faults of every thread so far: first touches of new memory
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def timed(key, fn):
        def wrapper(*a, **kw):
            t0, f0 = time.perf_counter(), faults()
            try:
                return fn(*a, **kw)
            finally:
                out[key] = out.get(key, 0.0) + time.perf_counter() - t0
                out[key + "_faults"] = out.get(key + "_faults", 0) + faults() - f0
        return wrapper

    llama_module.pack = timed("pack_s", llama_module.pack)
    llm_module.load_model = timed("load_model_s", llm_module.load_model)
    llm_module.LLMEngine = timed("engine_s", llm_module.LLMEngine)
    if hasattr(llm_module, "load_checkpoint"):  # LLM opens the file itself (one header parse)
        llm_module.load_checkpoint = timed("open_s", llm_module.load_checkpoint)
    Tokenizer.from_pretrained = classmethod(timed("tokenizer_s", Tokenizer.from_pretrained.__func__))
    t, f0 = time.perf_counter(), faults()
    llm = LLM(model, threads=2)  # kept: dropping it here would time its teardown too
    out["llm_s"] = time.perf_counter() - t
    out["llm_s_faults"] = faults() - f0
    out["import_s"] = import_s
    out["package"] = sys.modules["scratchllm"].__file__
elif which == "profiled":
    prof = cProfile.Profile()
    prof.enable()
    llm = LLM(model, threads=2)  # kept: dropping it here would time its teardown too
    prof.disable()
    stats = pstats.Stats(prof).stats
    out["top"] = sorted(((v[3], f"{k[0].split('scratchllm/')[-1]}:{k[1]}({k[2]})") for k, v in stats.items()),
                        reverse=True)[:top]
else:
    from scratchllm.formats.gguf import GGUFFile
    from scratchllm.formats.refs import resolve_model

    t = time.perf_counter()
    tok = Tokenizer.from_pretrained(model)
    out["tokenizer_s"] = time.perf_counter() - t
    path = resolve_model(model)
    t = time.perf_counter()
    gguf = GGUFFile(path)
    out["gguf_s"] = time.perf_counter() - t
print(json.dumps(out))
"""


def child(model: str, which: str, top: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, model, which, str(top)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"plain": [], "tokenizer": [], "profiled": []}
    for _ in range(args.runs):  # interleaved, so drift in the machine's load hits every row alike
        for which, rows in runs.items():
            rows.append(child(args.model, which, args.top))
    plain = runs["plain"]

    def med(rows, value) -> float:
        return statistics.median(value(r) for r in rows)

    each = ", ".join(f"{r['llm_s']:.3f}" for r in plain)
    print(f"LLM({args.model!r}, threads=2), median of {args.runs} fresh processes "
          f"(bytecode cache {'off' if sys.flags.dont_write_bytecode else 'on'}); runs: {each}")
    print(f"  scratchllm from {sorted({r['package'] for r in plain})}")
    print(f"  {'stage':28s} {'seconds':>8s} {'page faults':>12s}")

    def row(label, key, less=()):
        seconds = med(plain, lambda r: r.get(key, 0.0) - sum(r.get(k, 0.0) for k in less))
        count = med(plain, lambda r: r.get(key + "_faults", 0) - sum(r.get(k + "_faults", 0) for k in less))
        print(f"  {label:28s} {seconds:8.3f} {count:12.0f}")

    row("load (LLM())", "llm_s")
    row("  packing (pack)", "pack_s")
    row("  everything but packing", "llm_s", ["pack_s"])
    row("    opening the file", "open_s")
    row("    load_model less packing", "load_model_s", ["pack_s"])
    row("    tokenizer", "tokenizer_s")
    row("    engine", "engine_s")
    row("    the rest of LLM()", "llm_s", ["open_s", "load_model_s", "tokenizer_s", "engine_s"])
    print(f"  import scratchllm.llm (before the timer) {med(plain, lambda r: r['import_s']):.3f}")
    print(f"  import + load                           {med(plain, lambda r: r['import_s'] + r['llm_s']):.3f}")
    alone = runs["tokenizer"]
    print(f"  Tokenizer.from_pretrained alone {med(alone, lambda r: r['tokenizer_s']):.3f}")
    print(f"  GGUFFile (header parse) alone   {med(alone, lambda r: r['gguf_s']):.3f}")
    print("cumulative seconds under cProfile (the last run; the profiler slows Python-heavy code):")
    for seconds, where in runs["profiled"][-1]["top"]:
        print(f"  {seconds:7.3f}  {where}")


if __name__ == "__main__":
    main()
