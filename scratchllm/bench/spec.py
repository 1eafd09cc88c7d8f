"""`scratchllm bench spec`: speculative decoding, ours against llama.cpp's, on the same files and
the same prompts (scratchllm/bench/spec_workloads.py: code edits, code questions), greedy.

Ours, each configuration in a child process of its own per round (so its peak RSS is its own):
  off      the target decoding one token per step
  ngram    --speculative-config {"method": "ngram", "num_speculative_tokens": --draft-max, ...}
  draft    {"model": --draft, "num_speculative_tokens": --draft-max}
llama.cpp (scratchllm/bench/spec_peers.py): llama-speculative-simple's n-gram types and its draft
model, llama-lookup, and llama-bench's tg128 on the target as the plain-decode baseline.
Each round runs every side once, in an order reversed every other round; figures are medians of
the rounds. Decode tok/s of a side on a workload: its decoded tokens (all but the first, which
the prefill makes) over its decode seconds, summed over the workload's cases. Acceptance:
accepted drafts / drafted. `identical`: how many cases' greedy tokens equal `off`'s exactly.
Ratios: each side's decode over llama-bench's tg128 and over our `off`; ours over the best of
llama.cpp's n-gram modes. Peak RSS: each process's (the draft model's weights and KV included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from scratchllm.bench import spec_batch, spec_peers, spec_rows, spec_serving
from scratchllm.bench.common import machine_facts, median, require_at_least_one, status_mb
from scratchllm.bench.spec_workloads import WORKLOADS, load_cases

OURS = ("off", "ngram", "draft")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target (default qwen2.5-coder-1.5b)")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model (default qwen2.5-coder-0.5b)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"prompt sets (default {','.join(WORKLOADS)})")
    parser.add_argument("--cases", type=int, default=None, help="at most this many cases of each (default all)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per case (default the set's)")
    parser.add_argument("--draft-max", type=int, default=5, help="most tokens drafted per step, both sides (default 5)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="ours: shortest n-gram looked up (default 2)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="ours: longest n-gram looked up (default 4)")
    parser.add_argument("--sides", default=",".join(OURS + spec_peers.MODES),
                        help="which to run (default all: " + ",".join(OURS + spec_peers.MODES) + "; none: only "
                             "--serving)")
    parser.add_argument("--serving", action="store_true",
                        help="also a serving workload through our server, without and with n-gram speculation "
                             "(scratchllm/bench/spec_serving.py)")
    parser.add_argument("--serving-workload", default="mixed", help="--serving's workload (default mixed)")
    parser.add_argument("--concurrency", type=int, default=16, help="--serving's requests in flight (default 16)")
    parser.add_argument("--row-cost", action="store_true",
                        help="also a forward's time by rows (1-8) of the target and the draft "
                             "(scratchllm/bench/spec_rows.py)")
    parser.add_argument("--row-context", type=int, default=300, help="--row-cost's context tokens (default 300)")
    parser.add_argument("--row-repeats", type=int, default=6, help="--row-cost's rounds (default 6)")
    parser.add_argument("--batch-sizes", default=None, metavar="B,B,...",
                        help="also code edits B at once, without, with forced and with default n-gram speculation "
                             "(scratchllm/bench/spec_batch.py: the measurement behind disable_by_batch_size)")
    parser.add_argument("--in-turns", action="store_true",
                        help="run our sides in one process, taking turns case by case (on a machine whose speed "
                             "drifts between processes, their ratios are then paired in time; peak RSS is the "
                             "process's, all sides together)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every side (default 2)")


def speculative_config(side: str, spec: dict[str, Any]) -> dict[str, Any] | None:
    if side == "ngram":
        return {"method": "ngram", "num_speculative_tokens": spec["draft_max"],
                "prompt_lookup_min": spec["prompt_lookup_min"], "prompt_lookup_max": spec["prompt_lookup_max"]}
    if side == "draft":
        return {"model": spec["draft"], "num_speculative_tokens": spec["draft_max"]}
    return None


def _load(side: str, spec: dict[str, Any]) -> Any:
    from scratchllm.llm import LLM
    from scratchllm.sampling import SamplingParams

    llm = LLM(spec["model"], threads=spec["threads"], speculative_config=speculative_config(side, spec))
    cases = load_cases(spec["workloads"], spec["cases"])
    llm.chat(cases[0].messages, SamplingParams(max_tokens=8, temperature=0.0))  # warm: page tables, caches
    return llm


def _case(llm: Any, case: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from scratchllm.sampling import SamplingParams

    params = SamplingParams(max_tokens=spec["max_tokens"] or case.max_tokens, temperature=0.0)
    result = llm.chat(case.messages, params)
    m = result.metrics
    assert m is not None
    return {"workload": case.workload, "id": case.case_id, "decoded": len(result.token_ids) - 1,
            "decode_s": m.decode_ms / 1e3, "drafted": m.spec_drafted, "accepted": m.spec_accepted,
            "token_ids": result.token_ids}


def _ours(spec: dict[str, Any]) -> dict[str, Any]:
    """One of our configurations on every case (a child process's work)."""
    llm = _load(spec["side"], spec)
    out = [_case(llm, case, spec) for case in load_cases(spec["workloads"], spec["cases"])]
    return {"cases": out, "peak_rss_mb": status_mb("self", "VmHWM"), "memory_plan": llm.engine.plan.describe()}


def _ours_in_turns(spec: dict[str, Any]) -> dict[str, Any]:
    """Our configurations spec["sides"] in one process, taking turns on each case (the order
    reversed every other case): {side: its figures}, as _ours gives them."""
    sides: list[str] = spec["sides"]
    llms = {side: _load(side, spec) for side in sides}
    out: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for i, case in enumerate(load_cases(spec["workloads"], spec["cases"])):
        for side in sides if i % 2 == 0 else sides[::-1]:
            out[side].append(_case(llms[side], case, spec))
    peak = status_mb("self", "VmHWM")
    return {side: {"cases": out[side], "peak_rss_mb": peak, "memory_plan": llms[side].engine.plan.describe()}
            for side in sides}


def child_main() -> None:
    spec = json.loads(sys.argv[1])
    print(json.dumps(_ours_in_turns(spec) if "sides" in spec else _ours(spec)))


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    code = "from scratchllm.bench.spec import child_main; child_main()"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                          timeout=3600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        from scratchllm.errors import ConfigError

        who = spec.get("side") or ",".join(spec["sides"])
        raise ConfigError(f"our {who} side failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def run_peer(mode: str, spec: dict[str, Any], prompts: list[tuple[str, str, str, int]]) -> dict[str, Any]:
    """llama.cpp's `mode` on every prompt: (workload, id, text, max tokens) each."""
    out, peak = [], 0.0
    for workload, case_id, text, max_tokens in prompts:
        r = spec_peers.run_case(mode, spec["target_path"], spec["draft_path"], text, spec["threads"],
                                spec["max_tokens"] or max_tokens, spec["draft_max"])
        out.append({"workload": workload, "id": case_id, "decoded": r["decoded"],
                    "decode_s": r["decoded"] / r["decode_tok_s"], "drafted": r["drafted"], "accepted": r["accepted"]})
        peak = max(peak, r["peak_rss_mb"])
    return {"cases": out, "peak_rss_mb": peak}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scratchllm.errors import ConfigError
    from scratchllm.formats.refs import resolve_model
    from scratchllm.tokenizer import Tokenizer

    require_at_least_one(args, "rounds", "threads", "draft_max")
    require_at_least_one(args, *(name for name in ("cases", "max_tokens") if getattr(args, name) is not None))
    sides = list(dict.fromkeys(s.strip() for s in args.sides.split(",") if s.strip() and s.strip() != "none"))
    unknown = sorted(set(sides) - set(OURS + spec_peers.MODES))
    batches = [int(b) for b in (args.batch_sizes or "").split(",") if b.strip().isdigit() and int(b) >= 1]
    if args.batch_sizes is not None and not batches:
        raise ConfigError(f"--batch-sizes takes counts >= 1 separated by commas (1,4,16), got {args.batch_sizes!r}")
    if unknown or not (sides or args.serving or args.row_cost or batches):
        raise ConfigError(f"--sides takes some of {','.join(OURS + spec_peers.MODES)}, got {args.sides!r}")
    peers = [s for s in sides if s in spec_peers.MODES]
    if peers and not spec_peers.available():
        raise ConfigError("llama.cpp's programs are not built (`make peers`); run with --sides off,ngram,draft")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    cases = load_cases(workloads, args.cases)
    spec = {"model": args.model, "draft": args.draft, "workloads": workloads, "cases": args.cases,
            "max_tokens": args.max_tokens, "draft_max": args.draft_max, "threads": args.threads,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
            "target_path": str(resolve_model(args.model)), "draft_path": str(resolve_model(args.draft))}
    tok = Tokenizer.from_pretrained(args.model)
    prompts = [(c.workload, c.case_id, tok.apply_chat_template(c.messages, add_generation_prompt=True), c.max_tokens)
               for c in cases]
    ours = [s for s in sides if s in OURS]
    in_turns = bool(args.in_turns and ours)
    jobs = (["ours"] if in_turns else ours) + peers + (["tg128"] if peers else [])
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        done: dict[str, Any] = {"loadavg_1min": []}
        for side in jobs if r % 2 == 0 else jobs[::-1]:
            if side == "ours":
                done |= run_ours({**spec, "sides": ours if r % 2 == 0 else ours[::-1]})
            elif side in OURS:
                done[side] = run_ours({**spec, "side": side})
            elif side == "tg128":
                done[side] = spec_peers.tg128(spec["target_path"], args.threads)
            else:
                done[side] = run_peer(side, spec, prompts)
            done["loadavg_1min"].append(os.getloadavg()[0])
        rounds.append(done)
    result: dict[str, Any] = {"bench": "spec", "inputs": {**spec, "in_turns": in_turns}, "sides": sides,
                              "rows": summarize(rounds, sides, workloads) if sides else {}, "rounds": rounds,
                              "machine": machine_facts(), "command": "scratchllm " + " ".join(sys.argv[1:])}
    if batches:
        result["batch"] = spec_batch.measure(args.model, args.threads, batches, args.rounds,
                                             args.max_tokens or 128, args.draft_max, args.prompt_lookup_min,
                                             args.prompt_lookup_max)
    if args.row_cost:
        result["row_cost"] = spec_rows.measure([args.model, args.draft], args.threads, args.row_context,
                                               args.row_repeats)
    if args.serving:
        ngram = speculative_config("ngram", spec)
        assert ngram is not None
        result["serving"] = spec_serving.measure(args.model, args.threads, args.serving_workload, args.concurrency,
                                                 args.rounds, ngram)
    return result


def _rate(side_round: dict[str, Any], workload: str) -> dict[str, float]:
    cases = [c for c in side_round["cases"] if c["workload"] == workload]
    decoded, seconds = sum(c["decoded"] for c in cases), sum(c["decode_s"] for c in cases)
    drafted, accepted = sum(c["drafted"] for c in cases), sum(c["accepted"] for c in cases)
    return {"decode_tok_s": decoded / seconds if seconds else 0.0,
            "accept_rate": accepted / drafted if drafted else 0.0, "drafted": drafted, "accepted": accepted}


def summarize(rounds: list[dict[str, Any]], sides: list[str], workloads: list[str]) -> dict[str, Any]:
    """Per workload and side: median decode tok/s, acceptance, ratios; peak RSS per side."""
    rows: dict[str, Any] = {}
    tg = median([r["tg128"]["decode_tok_s"] for r in rounds]) if "tg128" in rounds[0] else None
    for w in workloads:
        row: dict[str, Any] = {}
        for side in sides:
            rates = [_rate(r[side], w) for r in rounds]
            row[side] = {"decode_tok_s": median([x["decode_tok_s"] for x in rates]),
                         "accept_rate": median([x["accept_rate"] for x in rates])}
            if tg:
                row[side]["vs_tg128"] = row[side]["decode_tok_s"] / tg
        if "off" in sides:
            off = rounds[0]["off"]["cases"]
            for side in (s for s in sides if s in OURS):
                row[side]["vs_off"] = row[side]["decode_tok_s"] / row["off"]["decode_tok_s"]
                same = [a["token_ids"] == b["token_ids"] for r in rounds
                        for a, b in zip(r[side]["cases"], off, strict=True) if a["workload"] == w]
                row[side]["identical"] = f"{sum(same)}/{len(same)}"
        best = max((row[m]["decode_tok_s"] for m in spec_peers.NGRAM_MODES if m in row), default=None)
        if best and "ngram" in row:
            row["ngram"]["vs_best_llama_ngram"] = row["ngram"]["decode_tok_s"] / best
        rows[w] = row
    rows["peak_rss_mb"] = {side: median([r[side]["peak_rss_mb"] for r in rounds]) for side in sides}
    rows["tg128_tok_s"] = tg
    return rows


def render(r: dict[str, Any]) -> str:
    i, rows = r["inputs"], r["rows"]
    lines = [f"target {i['target_path']}, draft {i['draft_path']}; {i['threads']} threads, greedy, at most "
             f"{i['draft_max']} drafted per step; medians of {len(r['rounds'])} interleaved rounds",
             f"command: {r['command']}"]
    extra = (spec_batch.render(r["batch"]) if "batch" in r else []) + \
        (spec_rows.render(r["row_cost"]) if "row_cost" in r else []) + \
        (spec_serving.render(r["serving"]) if "serving" in r else [])
    if not r["sides"]:
        return "\n".join(lines + extra)
    if rows.get("tg128_tok_s"):
        lines.append(f"llama-bench tg128 on the target: {rows['tg128_tok_s']:.1f} tok/s")
    for w in i["workloads"]:
        lines += ["", f"{w}:", f"{'side':<16}{'decode tok/s':>13}{'accepted':>10}{'x tg128':>9}{'x off':>8}"
                  f"{'identical':>11}"]
        for side in r["sides"]:
            c = rows[w][side]
            name = ("ours " if side in OURS else "llama.cpp ") + side
            lines.append(f"{name:<16}{c['decode_tok_s']:>13.1f}{c['accept_rate']:>10.0%}"
                         + (f"{c['vs_tg128']:>8.2f}x" if "vs_tg128" in c else f"{'':>9}")
                         + (f"{c['vs_off']:>7.2f}x" if "vs_off" in c else f"{'':>8}")
                         + f"{c.get('identical', ''):>11}")
        if "vs_best_llama_ngram" in rows[w].get("ngram", {}):
            best = rows[w]["ngram"]["vs_best_llama_ngram"]
            lines.append(f"ours ngram / the best of llama.cpp's n-gram modes: {best:.2f}x")
    lines += ["", "peak RSS, MB: " + ", ".join(f"{s} {mb:.0f}" for s, mb in rows["peak_rss_mb"].items())]
    if r["inputs"].get("in_turns"):
        lines.append("ours: every side in one process, taking turns case by case (its peak RSS is theirs together)")
    if "draft" in r["sides"]:
        lines.append("ours draft, its memory plan: " + r["rounds"][0]["draft"]["memory_plan"])
    lines += extra
    loads = [x for rnd in r["rounds"] for x in rnd["loadavg_1min"]]
    lines.append(f"machine: {r['machine']['cpu']}, load average {min(loads):.1f}-{max(loads):.1f} during the rounds")
    return "\n".join(lines)


class PeersSection:
    """`bench peers`' rows of speculative decoding: the first --spec-cases code edits on the peers'
    model, --new-tokens each, ours without and with n-gram speculation beside llama.cpp's n-gram
    modes, and with `--spec-draft MODEL` both sides' draft-model decoding (medians of the peers'
    rounds)."""

    name = "spec"

    def measure(self, spec: Any, args: argparse.Namespace) -> dict[str, Any] | None:
        from scratchllm.bench import peers_llama_cpp

        if not (spec_peers.available() and peers_llama_cpp.available()) or not getattr(args, "spec_cases", 0):
            return None
        draft = getattr(args, "spec_draft", None)
        sides = ["off", "ngram", *spec_peers.NGRAM_MODES] + (["draft", "draft-simple"] if draft else [])
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        ns = parser.parse_args(["--model", args.model, "--draft", draft or args.model, "--workloads", "code-edits",
                                "--cases", str(args.spec_cases), "--max-tokens", str(args.new_tokens),
                                "--rounds", str(args.rounds),
                                "--threads", str(args.threads), "--sides", ",".join(sides)])
        return run(ns)

    def render(self, figures: dict[str, Any], inputs: dict[str, Any]) -> list[str]:
        rows = figures["rows"]["code-edits"]
        tg = figures["rows"]["tg128_tok_s"]
        lines = ["", f"speculative decoding, code edits ({figures['inputs']['cases']} cases, greedy, at most "
                     f"{figures['inputs']['draft_max']} drafted; `scratchllm bench spec` has the rest): decode tok/s, "
                     f"accepted, x llama-bench tg128 ({tg:.1f})"]
        for side in figures["sides"]:
            c = rows[side]
            who = "ours" if side in OURS else "llama.cpp"
            lines.append(f"  {who} {side:<14}{c['decode_tok_s']:>8.1f}{c['accept_rate']:>8.0%}{c['vs_tg128']:>8.2f}x")
        return lines


PEERS_SECTION = PeersSection()
