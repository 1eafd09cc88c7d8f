"""`bench peers` against llama.cpp's own programs (built by `make peers`, llama_tools.py), not its
Python API: the rows where llama.cpp batches like we do.

  prefill tok/s    llama-bench pp<--prompt-tokens> | ours: the prefill row of our child (one prompt)
  decode tok/s     llama-bench tg<--new-tokens>    | ours: the decode row (one stream)
  n sequences      llama-batched-bench -npl n, n prompts of 32 random ids + --new-tokens each, all
  at once, for n   decoding together | ours: LLM.generate of n prompts of 32 ids x --new-tokens,
  in --sequences   greedy, in a child process of its own. tok/s = generated tokens / wall time,
                   prefill included, on both sides (batched-bench's own `S t/s` also counts the
                   prompt tokens: it is reported beside, as "llama.cpp's S").
  peak RSS at n    each side's process, run for that row alone: the same concurrency, the same
                   tokens, each at its default KV-cache dtype (printed).
Each round runs every program once, in interleaved order (ours first in even rounds); rows are
medians. llama-bench and llama-batched-bench run with the same thread count and the context their
rows need (batched-bench: n x (32 + --new-tokens)), everything else at their defaults.
"""

import os
from typing import Any

from scratchllm.bench import llama_tools
from scratchllm.bench.common import median

SEQ_PROMPT = 32  # prompt ids of each sequence in the n-sequence rows (as batched-bench's -npp)


def available() -> bool:
    return all(llama_tools.tool(name) is not None for name in ("llama-bench", "llama-batched-bench"))


def llama_bench(path: str, threads: int, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    exe = llama_tools.tool("llama-bench")
    assert exe is not None
    run = llama_tools.run_tool([str(exe), *llama_tools.bench_args(path, threads, prompt_tokens, new_tokens, 1)])
    return {**llama_tools.parse_bench(run.stdout), "peak_rss_mb": run.peak_rss_mb}


def batched_bench(path: str, threads: int, sequences: int, new_tokens: int) -> dict[str, Any]:
    exe = llama_tools.tool("llama-batched-bench")
    assert exe is not None
    ctx = sequences * (SEQ_PROMPT + new_tokens) + 8
    argv = [str(exe), *llama_tools.batched_args(path, threads, SEQ_PROMPT, new_tokens, [sequences], ctx)]
    run = llama_tools.run_tool(argv)
    row = llama_tools.parse_batched(run.stdout)[sequences]
    return {"tok_s": row["generated_tok_s"], "s_tok_s": row["aggregate_tok_s"], "peak_rss_mb": run.peak_rss_mb}


def measure_round(spec: dict[str, Any], sequences: list[int], reverse: bool,
                  ours_batch: Any) -> dict[str, dict[str, Any]]:
    """One round of every llama.cpp program and our matching batch children: {"llama_bench": ...,
    "batched": {n: {"ours": ..., "llama.cpp": ...}}}. `ours_batch(n)` runs our n-sequence child."""
    out: dict[str, Any] = {"batched": {n: {} for n in sequences}, "loadavg_1min": []}
    jobs: list[tuple[str, int, Any]] = [("llama_bench", 0, lambda: llama_bench(spec["path"], spec["threads"],
                                                                              spec["prompt_tokens"],
                                                                              spec["new_tokens"]))]
    for n in sequences:
        sides = [("ours", lambda n=n: ours_batch(n)),
                 ("llama.cpp", lambda n=n: batched_bench(spec["path"], spec["threads"], n, spec["new_tokens"]))]
        jobs += [(side, n, fn) for side, fn in (sides[::-1] if reverse else sides)]
    for name, n, fn in (jobs[::-1] if reverse else jobs):
        result = fn()
        if name == "llama_bench":
            out["llama_bench"] = result
        else:
            out["batched"][n][name] = result
        out["loadavg_1min"].append(os.getloadavg()[0])
    return out


def summarize(rounds: list[dict[str, Any]], ours_rounds: list[dict[str, Any]],
              sequences: list[int]) -> dict[str, Any]:
    """Medians over the rounds, and ours / llama.cpp for each (throughputs; peak RSS: llama.cpp / ours)."""
    lb = {k: median([r["llama_bench"][k] for r in rounds]) for k in ("prefill_tok_s", "decode_tok_s")}
    ours = {k: median([r[k] for r in ours_rounds]) for k in ("prefill_tok_s", "decode_tok_s")}
    rows: dict[str, Any] = {
        "prefill": {"ours": ours["prefill_tok_s"], "llama.cpp": lb["prefill_tok_s"],
                    "advantage": ours["prefill_tok_s"] / lb["prefill_tok_s"]},
        "decode": {"ours": ours["decode_tok_s"], "llama.cpp": lb["decode_tok_s"],
                   "advantage": ours["decode_tok_s"] / lb["decode_tok_s"]}}
    for n in sequences:
        cell: dict[str, Any] = {side: {k: median([r["batched"][n][side][k] for r in rounds])
                                       for k in ("tok_s", "peak_rss_mb")} for side in ("ours", "llama.cpp")}
        cell["llama.cpp"]["s_tok_s"] = median([r["batched"][n]["llama.cpp"]["s_tok_s"] for r in rounds])
        cell["advantage"] = cell["ours"]["tok_s"] / cell["llama.cpp"]["tok_s"]
        cell["rss_advantage"] = cell["llama.cpp"]["peak_rss_mb"] / cell["ours"]["peak_rss_mb"]
        cell["kv_dtype"] = rounds[0]["batched"][n]["ours"].get("kv_cache_dtype")
        rows[f"seq{n}"] = cell
    return rows


def render(t: dict[str, Any], inputs: dict[str, Any]) -> list[str]:
    info = t["build"]
    lines = ["", f"against llama.cpp's own programs ({info.get('from', '?')}'s vendored llama.cpp, built with "
                 f"{' '.join(info.get('instruction_sets', [])) or '?'}; {t['tools_dir']}):",
             f"{'row':<44}{'ours':>10}{'llama.cpp':>11}{'advantage':>11}"]
    r = t["rows"]
    lines.append(f"{'prefill tok/s (llama-bench pp' + str(inputs['prompt_tokens']) + ')':<44}"
                 f"{r['prefill']['ours']:>10.1f}{r['prefill']['llama.cpp']:>11.1f}{r['prefill']['advantage']:>10.2f}x")
    lines.append(f"{'decode tok/s (llama-bench tg' + str(inputs['new_tokens']) + ')':<44}"
                 f"{r['decode']['ours']:>10.1f}{r['decode']['llama.cpp']:>11.1f}{r['decode']['advantage']:>10.2f}x")
    for n in t["sequences"]:
        c = r[f"seq{n}"]
        label = f"{n} at once, {SEQ_PROMPT} + {inputs['new_tokens']} each, tok/s (batched-bench)"
        lines.append(f"{label:<44}{c['ours']['tok_s']:>10.1f}{c['llama.cpp']['tok_s']:>11.1f}{c['advantage']:>10.2f}x")
        lines.append(f"{'  peak RSS of that run, MB':<44}{c['ours']['peak_rss_mb']:>10.0f}"
                     f"{c['llama.cpp']['peak_rss_mb']:>11.0f}{c['rss_advantage']:>10.2f}x")
    last = r[f"seq{t['sequences'][-1]}"]
    lines.append(f"tok/s: generated tokens over the wall time, prefill included (llama.cpp's own S t/s, prompts "
                 f"counted too, at {t['sequences'][-1]}: {last['llama.cpp']['s_tok_s']:.1f}); KV cache: ours "
                 f"{last['kv_dtype']}, llama.cpp f16 (its default); peak RSS: each process, sampled every 20 ms")
    loads = [x for rnd in t["rounds"] for x in rnd["loadavg_1min"]]
    lines.append(f"load average {min(loads):.1f}-{max(loads):.1f} during these rows")
    return lines
