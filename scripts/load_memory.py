"""What one load of a model costs in memory: RSS after load, the load's peak, and the weight figures.

Each model loads in a fresh process (`LLM(model, threads=2)`, as `scratchllm bench peers` loads
it), which prints, after the load: VmRSS, VmHWM (the peak, the load's own: the process did
nothing before it but import), RssAnon and RssFile, the model file's size, the weight bytes the
memory plan counted before the load (engine/shared_memory_plan.estimated_weights_bytes, from the
header), the bytes the loaded model holds (engine/memory_plan.weights_bytes), and whether the
panels came from the panel cache.

A first load (the panels packed, the panel cache written) and a warm one (the panels mapped from
the cache) are told apart by `--cache-dir`: give a fresh folder and each model's first round
packs, the second maps.

Usage: python scripts/load_memory.py [--cache-dir DIR] [--rounds 2] MODEL [MODEL ...]
"""

import argparse
import json
import os
import subprocess
import sys

MB = 1 << 20


def measure(model: str) -> dict[str, object]:
    """One load in this process; the figures above, MB."""
    from scratchllm.engine.memory_plan import weights_bytes
    from scratchllm.engine.shared_memory_plan import estimated_weights_bytes
    from scratchllm.formats import load_header
    from scratchllm.formats.refs import resolve_model
    from scratchllm.llm import LLM
    from scratchllm.models.loader import auto_dtype, read_config

    path = resolve_model(model)
    header = load_header(model)
    planned = estimated_weights_bytes(header, auto_dtype(header, read_config(path, header)))
    llm = LLM(model, threads=2)
    with open("/proc/self/status") as f:
        status = {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f)
                  if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    loaded = llm.model
    return {"model": model, "file_mb": os.path.getsize(path) / MB, "rss_mb": status["VmRSS"],
            "peak_mb": status["VmHWM"], "anon_mb": status["RssAnon"], "file_backed_mb": status["RssFile"],
            "planned_weights_mb": planned / MB, "held_weights_mb": weights_bytes(loaded) / MB,
            "from_cache": bool(getattr(loaded, "panels_from_cache", False))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--cache-dir", help="SCRATCHLLM_CACHE_DIR for the loads (a fresh one: the first round packs)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.models[0])))
        return
    env = dict(os.environ, **({"SCRATCHLLM_CACHE_DIR": args.cache_dir} if args.cache_dir else {}))
    print(f"{'model':<20} {'round':>5} {'file':>8} {'rss':>8} {'peak':>8} {'anon':>8} {'filemap':>8} "
          f"{'planned':>8} {'held':>8}  panels")
    for model in args.models:
        for r in range(args.rounds):
            out = subprocess.run([sys.executable, __file__, "--child", model], env=env, check=True,
                                 capture_output=True, text=True).stdout
            m = json.loads(out.strip().splitlines()[-1])
            print(f"{model:<20} {r + 1:>5} {m['file_mb']:>8.1f} {m['rss_mb']:>8.1f} {m['peak_mb']:>8.1f} "
                  f"{m['anon_mb']:>8.1f} {m['file_backed_mb']:>8.1f} {m['planned_weights_mb']:>8.1f} "
                  f"{m['held_weights_mb']:>8.1f}  {'cache' if m['from_cache'] else 'packed'}", flush=True)


if __name__ == "__main__":
    main()
