"""Where the resident memory of our side of `bench peers` goes, phase by phase.

Runs our side's round of `scratchllm bench peers` (scratchllm/bench/peers.py: load, a prefill of
--prompt-tokens ids twice, --new-tokens decode steps, then --batch prompts of 32 ids x
--new-tokens batched through `LLM.generate`) in this process, and at the end of each phase prints
  rss        VmRSS now, MB
  peak       the phase's own peak (VmHWM, reset at the phase's start through /proc/self/clear_refs)
  anon/file  RssAnon and RssFile now (the weights' panels are anonymous or file-backed, whether
             they came from the panel cache or were packed)
  kv pool    resident MB of the engine's KV pool (mincore over its arrays)
and, within `LLM.generate`, RSS after its first step (the batched prefill of the first prompts),
after the step with the most KV blocks in use, and after the step where RSS was highest.
`--tracemalloc` adds the Python allocator's peak per phase (NumPy's buffers included), at the
cost of a slower run.

Usage: python scripts/rss_phases.py [--model default] [--threads 2] [--tracemalloc] [--json]
"""

import argparse
import json
import tracemalloc

from scratchllm.bench import peers
from scratchllm.models.arena import resident_bytes

MB = 1 << 20


def status() -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, MB."""
    want = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k in want}


def reset_peak() -> None:
    """Start a new VmHWM from the current RSS (Linux: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Probe:
    def __init__(self, use_tracemalloc: bool):
        self.rows: list[dict] = []
        self.steps: list[dict] = []
        self.tracemalloc = use_tracemalloc
        self.engine = None
        reset_peak()
        if use_tracemalloc:
            tracemalloc.start()

    def kv_mb(self) -> float:
        if self.engine is None:
            return 0.0
        return sum(resident_bytes(a) for a in self.engine.runner.attention.arrays()) / MB

    def row(self, phase: str) -> None:
        s = status()
        r = {"phase": phase, "rss": s["VmRSS"], "peak": s["VmHWM"], "anon": s["RssAnon"], "file": s["RssFile"],
             "kv_pool": self.kv_mb()}
        if self.tracemalloc:
            r["py_now"], r["py_peak"] = (x / MB for x in tracemalloc.get_traced_memory())
            tracemalloc.reset_peak()
        self.rows.append(r)
        reset_peak()

    def __call__(self, phase: str, llm) -> None:
        if self.engine is None:  # after load: watch every step of the engine from now on
            self.engine = llm.engine
            self._watch_steps(llm.engine)
        self.row(phase)

    def _watch_steps(self, engine) -> None:
        step = engine.step

        def watched():
            events = step()
            s = status()
            self.steps.append({"step": engine.num_steps, "tokens": engine.last_step_tokens, "rss": s["VmRSS"],
                               "anon": s["RssAnon"], "blocks": engine.block_manager.num_used})
            return events

        engine.step = watched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV-cache dtype (default auto)")
    parser.add_argument("--tracemalloc", action="store_true", help="also the Python allocator's peak per phase")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from scratchllm.formats.refs import resolve_model

    spec = {"path": str(resolve_model(args.model)), "threads": args.threads, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "batch": args.batch, "kv_cache_dtype": args.kv_cache_dtype}
    probe = Probe(args.tracemalloc)
    probe.row("start (imports)")
    out = peers._ours(spec, probe)
    final = status()
    steps = probe.steps
    inside = {"first step (batched prefill)": steps[0], "most KV blocks in use": max(steps, key=lambda s: s["blocks"]),
              "highest RSS": max(steps, key=lambda s: s["rss"])}
    block_mb = probe.engine.plan.kv_block_bytes / MB
    if args.json:
        print(json.dumps({"phases": probe.rows, "generate_steps": steps, "peak_rss_mb": final["VmHWM"],
                          "bench_peak_rss_mb": max(r["peak"] for r in probe.rows), "kv_block_mb": block_mb,
                          "aggregate_tok_s": out["aggregate_tok_s"]}))
        return
    cols = "rss", "peak", "anon", "file", "kv_pool", *(("py_now", "py_peak") if args.tracemalloc else ())
    print(f"{'phase (MB)':<34}" + "".join(f"{c:>9}" for c in cols))
    for r in probe.rows:
        print(f"{r['phase']:<34}" + "".join(f"{r[c]:>9.1f}" for c in cols))
    print(f"\ninside LLM.generate ({len(steps)} steps; a KV block is {block_mb * 1024:.0f} KiB):")
    for name, s in inside.items():
        print(f"  {name:<30} step {s['step']:>4} ({s['tokens']:>3} tokens): rss {s['rss']:.1f}, "
              f"anon {s['anon']:.1f}, {s['blocks']} KV blocks in use = {s['blocks'] * block_mb:.1f} MB")
    print(f"\npeak RSS over the run (the bench's row): {max(r['peak'] for r in probe.rows):.1f} MB")


if __name__ == "__main__":
    main()
