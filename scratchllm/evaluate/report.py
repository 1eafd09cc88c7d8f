"""The report of a run: what changed (triage, net of noise), whether it is better (the
annotators' scores), how far they agree, and what it costs (latency).

Rates are over all scores given (each diff has up to 3): improvement = share of +1, harm =
share of -1, neutral = share of 0, each with a Wilson 95% interval. Agreement: Krippendorff's
alpha (ordinal, -1 < 0 < +1) over every scored diff, and Fleiss' kappa over the diffs that have
their full 3 scores (it needs the same number of raters per item). Latency deltas are per
request, candidate minus primary, beside secondary minus primary (the noise). The worst
regressions are the diffs with the lowest mean score below 0, linked into the annotation page.
"""

import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from scratchllm.evaluate.agreement import fleiss_kappa, ordinal_alpha, wilson
from scratchllm.evaluate.annotate import PER_DIFF
from scratchllm.evaluate.store import Output, RunStore

TEMPLATE = Path(__file__).with_name("report.html")
SCORES = (-1, 0, 1)
# Special tokens as servers spell them in token strings (<|im_end|>, <|eot_id|>, </s>, <eos>,
# <end_of_turn>): markup of the model's format, not part of the answer a reader compares.
SPECIAL = re.compile(r"<\|[^<>|\s]{1,40}\|>|</s>|<eos>|<end_of_turn>")


def shown(text: str | None) -> str:
    """An output's text as the report shows it: special tokens dropped."""
    return SPECIAL.sub("", text or "")


def _rate(k: int, n: int) -> dict[str, Any]:
    lo, hi = wilson(k, n)
    return {"count": k, "of": n, "rate": k / n if n else None, "wilson95": [lo, hi]}


def _summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None}
    a = np.asarray(values, dtype=np.float64)
    return {"n": len(values), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90))}


def agreement(scores: list[dict[str, Any]]) -> dict[str, Any]:
    annotators = sorted({s["annotator"] for s in scores})
    units = sorted({s["request_id"] for s in scores})
    matrix = np.full((len(annotators), len(units)), math.nan)
    for s in scores:
        matrix[annotators.index(s["annotator"]), units.index(s["request_id"])] = s["score"]
    by_unit: defaultdict[int, list[int]] = defaultdict(list)
    for s in scores:
        by_unit[s["request_id"]].append(s["score"])
    full = [[v.count(c) for c in SCORES] for v in by_unit.values() if len(v) == PER_DIFF]
    return {"krippendorff_alpha_ordinal": ordinal_alpha(matrix) if scores else None,
            "fleiss_kappa": fleiss_kappa(full) if full else None, "fleiss_items": len(full),
            "annotators": len(annotators), "scored_diffs": len(units)}


def latency(store: RunStore) -> dict[str, Any]:
    per_role: defaultdict[str, list[float]] = defaultdict(list)
    deltas: list[float] = []
    noise: list[float] = []
    for req in store.requests():
        outs = store.outputs(req["id"])
        ms = {role: o.latency_ms for role, o in outs.items() if o.ok and o.latency_ms is not None}
        for role, v in ms.items():
            per_role[role].append(v)
        if "primary" in ms and "candidate" in ms:
            deltas.append(ms["candidate"] - ms["primary"])
        if "primary" in ms and "secondary" in ms:
            noise.append(ms["secondary"] - ms["primary"])
    return {"per_server_ms": {r: _summary(v) for r, v in sorted(per_role.items())},
            "candidate_minus_primary_ms": _summary(deltas), "secondary_minus_primary_ms": _summary(noise)}


def build_report(store: RunStore, annotate_url: str = "http://127.0.0.1:8765", worst: int = 10) -> dict[str, Any]:
    scores = store.scores()
    n = len(scores)
    by_request: defaultdict[int, list[int]] = defaultdict(list)
    for s in scores:
        by_request[s["request_id"]].append(s["score"])
    diffs = {d["request_id"]: d for d in store.diffs()}
    regressions: list[dict[str, Any]] = []
    for rid, values in by_request.items():
        mean = sum(values) / len(values)
        if mean < 0:
            d, outs = diffs[rid], store.outputs(rid)
            regressions.append({"request_id": rid, "index": d["idx"], "mean_score": mean, "scores": len(values),
                                "klass": d["klass"], "context_primary": shown(d["detail"].get("context_a")),
                                "context_candidate": shown(d["detail"].get("context_b")),
                                "cut_primary": _cut(outs.get("primary")), "cut_candidate": _cut(outs.get("candidate")),
                                "link": f"{annotate_url.rstrip('/')}/#/diff/{rid}"})
    regressions.sort(key=lambda r: (r["mean_score"], r["index"]))
    run = store.run()
    assert run is not None, "a run file has its run row"
    return {
        "run": {k: run[k] for k in ("capture", "primary_url", "secondary_url", "candidate_url")},
        "change": run["options"].get("change"),
        "requests": len(store.requests()),
        "triage": run["options"].get("triage"),
        "scores": {"total": n, "improvement": _rate(sum(s["score"] == 1 for s in scores), n),
                   "neutral": _rate(sum(s["score"] == 0 for s in scores), n),
                   "harm": _rate(sum(s["score"] == -1 for s in scores), n)},
        "agreement": agreement(scores),
        "latency": latency(store),
        "worst_regressions": regressions[:worst],
    }


def _cut(output: Output | None) -> bool:
    """The answer stopped at its max_tokens, not at its own end."""
    return output is not None and output.finish_reason == "length"


def render_html(report: dict[str, Any]) -> str:
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["pct"] = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
    env.filters["num"] = lambda x, d=3: "n/a" if x is None else f"{x:.{d}f}"
    return env.from_string(TEMPLATE.read_text()).render(r=report)


def write_report(store: RunStore, html_path: str | Path, json_path: str | Path,
                 annotate_url: str = "http://127.0.0.1:8765") -> dict[str, Any]:
    report = build_report(store, annotate_url)
    Path(json_path).write_text(json.dumps(report, indent=2))
    Path(html_path).write_text(render_html(report))
    return report
