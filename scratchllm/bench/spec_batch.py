"""`bench spec --batch-sizes 1,2,4,8,16`: where verifying drafts stops paying as the batch grows,
the measurement behind `disable_by_batch_size`. B code-edit requests at once (the prompt set's
cases in turn), greedy, through `LLM.generate` in a child process per run:

  off       no speculation
  forced    n-gram drafts of --draft-max tokens verified in every step that has them (the
            draft-length rule and the batch-size switch off)
  ngram     the defaults: the draft-length rule and the switch at disable_by_batch_size

Output tokens per second of the whole batch, each side's over off's; rounds interleaved.
Where `forced` falls below off, a verified row costs more than the tokens it brings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from scratchllm.bench.common import median

SIDES = ("off", "forced", "ngram")


def _config(side: str, draft_max: int, lo: int, hi: int) -> dict[str, Any] | None:
    if side == "off":
        return None
    config: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": draft_max, "prompt_lookup_min": lo,
                              "prompt_lookup_max": hi}
    if side == "forced":
        config |= {"adaptive": False, "disable_by_batch_size": None}
    return config


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    from scratchllm.bench.spec_workloads import load_cases
    from scratchllm.llm import LLM
    from scratchllm.sampling import SamplingParams

    llm = LLM(spec["model"], threads=spec["threads"], speculative_config=spec["config"])
    cases = load_cases(["code-edits"])
    prompts = [llm.tokenizer.encode(llm.apply_chat_template(cases[i % len(cases)].messages),
                                    add_special_tokens=False) for i in range(spec["batch"])]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm
    t = time.perf_counter()
    done = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    stats = llm.stats()
    return {"tok_s": sum(len(r.token_ids) for r in done) / seconds, "token_ids": [r.token_ids for r in done],
            "drafted": stats.spec_decode_num_draft_tokens or 0, "accepted": stats.spec_decode_num_accepted_tokens or 0}


def child_main() -> None:
    print(json.dumps(_child(json.loads(sys.argv[1]))))


def measure(model: str, threads: int, batches: list[int], rounds: int, max_tokens: int, draft_max: int,
            lo: int, hi: int) -> dict[str, Any]:
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {b: {s: [] for s in SIDES} for b in batches}
    loads: list[float] = []
    for r in range(rounds):
        for b in batches:
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                spec = {"model": model, "threads": threads, "batch": b, "max_tokens": max_tokens,
                        "config": _config(side, draft_max, lo, hi)}
                code = "from scratchllm.bench.spec_batch import child_main; child_main()"
                done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                                      timeout=3600, check=True)
                runs[b][side].append(json.loads(done.stdout.strip().splitlines()[-1]))
                loads.append(os.getloadavg()[0])
    rows = {}
    for b in batches:
        tok_s = {s: median([x["tok_s"] for x in runs[b][s]]) for s in SIDES}
        rows[b] = {"tok_s": tok_s, "over_off": {s: tok_s[s] / tok_s["off"] for s in SIDES},
                   "identical": all(x["token_ids"] == y["token_ids"] for s in SIDES
                                    for x, y in zip(runs[b][s], runs[b]["off"], strict=True)),
                   "accepted": {s: f"{sum(x['accepted'] for x in runs[b][s])}/{sum(x['drafted'] for x in runs[b][s])}"
                                for s in SIDES[1:]}}
    return {"batches": batches, "rows": rows, "max_tokens": max_tokens, "loadavg_1min": loads}


def render(s: dict[str, Any]) -> list[str]:
    lines = ["", f"code edits at once, {s['max_tokens']} tokens each, output tok/s of the batch (x off):",
             f"{'batch':>6}{'off':>10}{'forced':>16}{'ngram':>16}  accepted/drafted (forced, ngram)  identical"]
    for b in s["batches"]:
        row = s["rows"][str(b)] if str(b) in s["rows"] else s["rows"][b]
        t, x = row["tok_s"], row["over_off"]
        lines.append(f"{b:>6}{t['off']:>10.1f}{t['forced']:>9.1f} {x['forced']:>5.2f}x{t['ngram']:>9.1f} "
                     f"{x['ngram']:>5.2f}x  {row['accepted']['forced']:>12} {row['accepted']['ngram']:>12}"
                     f"  {row['identical']}")
    return lines
