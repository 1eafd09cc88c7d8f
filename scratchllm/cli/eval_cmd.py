"""`scratchllm eval`: judge a change on real traffic, diff by diff.

The loop: capture traffic (`serve --capture`, or bring OpenAI Batch API input JSONL), then
  eval replay   send each request to the primary (what serves now), a secondary (a second
                instance of the primary, or a second pass on it: the noise baseline) and the
                candidate (the change); store all outputs in a run file; triage the diffs
  eval annotate serve the page where annotators score the semantic diffs (-1 / 0 / +1)
  eval report   rates with Wilson intervals, agreement, per-class counts net of noise, latency
  eval feedback per-request-class scores as a priorities file for `serve --priority-feedback`
See docs/evaluation.md for the file formats and the rules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from scratchllm.cli import Subparsers, help_func
from scratchllm.cli.listen import listen, ready_url
from scratchllm.errors import ConfigError

if TYPE_CHECKING:
    from scratchllm.evaluate.store import RunStore

CLASSES = ("detokenization", "repetition", "near-tie", "semantic")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("eval",
                       help="diff-based evaluation: replay captured traffic, triage, annotate, report, feedback",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ev = p.add_subparsers(dest="eval_command", metavar="STEP")

    r = ev.add_parser("replay", help="replay a capture on primary, secondary and candidate servers",
                      description="Sends every captured request to the three servers in parallel (greedy, or "
                      "with the captured seed; top-k logprobs requested), writes the run file and triages it.")
    r.add_argument("capture", help="a capture directory or file, or OpenAI Batch API input JSONL")
    r.add_argument("--primary", required=True, help="URL of the server in service now, e.g. http://127.0.0.1:8000")
    r.add_argument("--candidate", required=True, help="URL of the server with the change")
    r.add_argument("--secondary", default=None,
                   help="URL of a second instance of the primary (default: a second pass on the primary)")
    r.add_argument("-o", "--output", required=True, help="the run file to create (SQLite)")
    r.add_argument("--api-key", default=os.environ.get("SCRATCHLLM_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $SCRATCHLLM_API_KEY)")
    r.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    r.add_argument("--retries", type=int, default=3, help="retries of a failed request (connection, 429, 5xx)")
    r.add_argument("--top-logprobs", type=int, default=5, help="alternatives per token, for near-tie triage")
    r.add_argument("--sampling", choices=["auto", "greedy"], default="auto",
                   help="auto: greedy unless the request carried a seed (then kept); greedy: always greedy")
    r.add_argument("--model", default=None, help="model name to request on all servers (default: the captured)")
    r.add_argument("--max-tokens", type=int, default=None, help="cap each request's output length")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--change", default=None, metavar="TEXT",
                   help="what the candidate changes, in a few words (shown at the top of the report)")
    _triage_args(r)
    r.set_defaults(func=_replay)

    t = ev.add_parser("triage", help="classify a run's diffs again (other thresholds, deterministic mode)")
    t.add_argument("run", help="the run file")
    _triage_args(t)
    t.set_defaults(func=_triage)

    a = ev.add_parser("annotate", help="serve the annotation page for a run",
                      description="Annotators sign in by name and score diffs. The page shows the two answers as A "
                      "(left) and B (right), the candidate on a side chosen by a fixed coin per annotator and diff, "
                      "so nobody learns which is the change: 1 = A better, 2 = same, 3 = B better. The score is "
                      "stored from the candidate's side: -1 primary better, 0 same, +1 candidate better. Each "
                      "diff goes to 3 different annotators.")
    a.add_argument("run", help="the run file")
    a.add_argument("--host", default="127.0.0.1", help="address the annotation page listens on")
    a.add_argument("--port", type=int, default=8765, help="port of the annotation page (0 picks a free one)")
    a.add_argument("--classes", default="semantic",
                   help=f"comma-separated triage classes to annotate (of {', '.join(CLASSES)}); default semantic")
    a.set_defaults(func=_annotate)

    rep = ev.add_parser("report", help="the run's report, HTML and JSON")
    rep.add_argument("run", help="the run file")
    rep.add_argument("-o", "--output", default=None, help="HTML file (default: RUN with .html)")
    rep.add_argument("--json", default=None, help="JSON file (default: RUN with .json)")
    rep.add_argument("--annotate-url", default="http://127.0.0.1:8765",
                     help="where `eval annotate` serves, for the links of the worst regressions")
    rep.set_defaults(func=_report)

    f = ev.add_parser("feedback", help="per-request-class scores as a priorities file for the scheduler",
                      description="A class scoring below --threshold (share of +1) is lowered in priority, by up "
                      "to --max-adjust-s seconds; the scheduler's aging still bounds every wait.")
    f.add_argument("run", help="the run file")
    f.add_argument("-o", "--output", required=True, help="priorities.json to write")
    f.add_argument("--threshold", type=float, default=0.5,
                   help="share of +1 scores (candidate better) below which a class is lowered in priority")
    f.add_argument("--max-adjust-s", type=float, default=2.0,
                   help="the most seconds a class's queue priority is moved by, for the lowest score")
    f.set_defaults(func=_feedback)
    p.set_defaults(func=help_func(p))


def _triage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deterministic", action="store_true",
                   help="the servers are deterministic: any primary-vs-secondary difference is a bug (exit 1)")
    p.add_argument("--near-tie-gap", type=float, default=0.5, help="nats between the two tokens of a near-tie")
    p.add_argument("--near-tie-max-edit", type=float, default=0.25,
                   help="a near-tie's answers differ in at most this share of the longer one's tokens; more "
                        "is semantic")
    p.add_argument("--abs-threshold", type=float, default=0.01,
                   help="a class counts when its excess over noise exceeds this share of all requests ...")
    p.add_argument("--rel-threshold", type=float, default=0.2, help="... and this share of its noise count")


def _run_triage(store: RunStore, args: argparse.Namespace) -> int:
    from scratchllm.evaluate.triage import TriageConfig, triage_run

    cfg = TriageConfig(near_tie_gap=args.near_tie_gap, near_tie_max_edit=args.near_tie_max_edit,
                       abs_threshold=args.abs_threshold,
                       rel_threshold=args.rel_threshold)
    summary = triage_run(store, cfg, deterministic=args.deterministic)
    print(f"{summary['total']} requests; class: candidate / noise / net (* beyond noise)")
    for name, c in summary["classes"].items():
        mark = " *" if c["significant"] else ""
        print(f"  {name:15s} {c['candidate']:5d} / {c['noise']:5d} / {c['net']:5d}{mark}")
    if summary["server_bug"]:
        print(f"deterministic mode: {len(summary['noisy_requests'])} requests differ between primary and "
              "secondary: the servers are not deterministic", file=sys.stderr)
        return 1
    return 0


def _replay(args: argparse.Namespace) -> int:
    from scratchllm.evaluate.replay import ReplayOptions, replay
    from scratchllm.evaluate.sources import read_traffic

    opts = ReplayOptions(args.primary, args.candidate, secondary=args.secondary, api_key=args.api_key,
                         concurrency=args.concurrency, retries=args.retries, top_logprobs=args.top_logprobs,
                         sampling=args.sampling, model=args.model, max_tokens=args.max_tokens,
                         progress=not args.no_progress)
    traffic = read_traffic(args.capture)
    if traffic.partial_lines:
        print(f"skipped {traffic.partial_lines} partial last line(s) of the capture", file=sys.stderr)
    store = replay(traffic, args.output, opts, capture=args.capture)
    if args.change:
        store.set_option("change", args.change)
    print(f"replayed {len(traffic.requests)} requests into {args.output}")
    return _run_triage(store, args)


def _triage(args: argparse.Namespace) -> int:
    from scratchllm.evaluate.store import RunStore

    return _run_triage(RunStore(args.run), args)


def _annotate(args: argparse.Namespace) -> int:
    from scratchllm.evaluate.annotate import open_run, serve

    classes = tuple(c.strip() for c in args.classes.split(",") if c.strip())
    if not classes or any(c not in CLASSES for c in classes):
        raise ConfigError(f"--classes takes some of {', '.join(CLASSES)}, got {args.classes!r}")
    app = open_run(args.run, classes)
    sock = listen(args.host, args.port, "scratchllm eval annotate")
    print(f"annotation page: {ready_url(sock)}/ ({len(app.state.annotation.eligible_ids())} diffs to score)",
          file=sys.stderr)
    serve(app, sock)
    return 0


def _report(args: argparse.Namespace) -> int:
    from scratchllm.evaluate.report import write_report
    from scratchllm.evaluate.store import RunStore

    base = os.path.splitext(args.run)[0]
    html, js = args.output or base + ".html", args.json or base + ".json"
    report = write_report(RunStore(args.run), html, js, args.annotate_url)
    imp = report["scores"]["improvement"]
    if imp["rate"] is not None:
        lo, hi = imp["wilson95"]
        print(f"improvement {imp['count']}/{imp['of']} = {imp['rate']:.3f} (Wilson 95% {lo:.3f}-{hi:.3f})")
    print(f"wrote {html} and {js}")
    return 0


def _feedback(args: argparse.Namespace) -> int:
    from scratchllm.evaluate.feedback import compute_feedback
    from scratchllm.evaluate.store import RunStore

    doc = compute_feedback(RunStore(args.run), args.threshold, args.max_adjust_s)
    with open(args.output, "w") as f:
        json.dump(doc, f, indent=2)
    lowered = sum(c["adjust_s"] < 0 for c in doc["classes"].values())
    print(f"{len(doc['classes'])} classes, {lowered} lowered; wrote {args.output}")
    return 0
