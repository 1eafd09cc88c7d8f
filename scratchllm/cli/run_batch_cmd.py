"""`scratchllm run-batch -i in.jsonl -o out.jsonl [MODEL ...] [serve's options]`: a Batch API input
file run offline, as vLLM's run-batch does: the models load in this process, every line runs
through the server's own routes in-process (no socket: server/batch_runner.py, the code a
served batch runs through), and the output file gets one line per input line, in the input's
order, successes and errors alike, in OpenAI's output shape:

    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}

Each input line is `{"custom_id", "method": "POST", "url", "body"}`, the url one of
/v1/chat/completions, /v1/completions, /v1/embeddings (lines may mix them). The models and
their options are `scratchllm serve`'s (`run-batch -i in.jsonl -o out.jsonl default
--max-model-len 1024`); without one, the default model (and the embedder only when a line
embeds). A line at fault (not JSON, no
custom_id, another url) stops the run before anything loads, naming its line.
"""

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from scratchllm.cli import Subparsers
from scratchllm.errors import ConfigError
from scratchllm.server.batch_store import Line


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("run-batch", help="run a Batch API input file (JSONL) offline, through the server's routes",
                       usage="scratchllm run-batch -i IN.jsonl -o OUT.jsonl [MODEL ...] [serve's options]",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, metavar="IN.jsonl", help="the requests, one JSON a line")
    p.add_argument("-o", "--output-file", required=True, metavar="OUT.jsonl", help="where the results go")
    # every other word (the models, serve's options) goes to serve's own parser
    p.set_defaults(func=run, serve_args=[], unknown_args_to="serve_args")


def _lines(path: Path) -> list[Line]:
    """The input's lines, checked by the Batch API's own rules (any of its urls), or the first
    line at fault."""
    from scratchllm.server.batch_api import read_lines
    from scratchllm.server.routes import BATCHABLE

    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror}") from None
    lines, errors = read_lines(data, BATCHABLE)
    if errors:
        where = f"{path}:{errors[0]['line']}" if errors[0]["line"] else str(path)
        raise ConfigError(f"{where}: {errors[0]['message'].split(': ', 1)[-1]}")
    return lines


def run(args: argparse.Namespace) -> int:
    from scratchllm.cli.main import build_parser, parse
    from scratchllm.cli.serve_cmd import build, server_config
    from scratchllm.cli.serve_config import apply_config

    lines = _lines(Path(args.input_file))
    given = list(args.serve_args)
    if all(ln.url != "/v1/embeddings" for ln in lines) and not any(a.startswith("--embedding-model") for a in given):
        given += ["--embedding-model", "none"]  # no line embeds: the embedder is not loaded
    serve = parse(build_parser(only="serve"), ["serve", *given])
    apply_config(serve, serve.serve_parser, serve.env_set)
    config = dataclasses.replace(server_config(serve), batch_dir=None)  # nothing persists: the run is the job
    registry = build(serve)
    registry.load_all()
    start = time.monotonic()
    results = asyncio.run(_run(registry, config, lines))
    with open(args.output_file, "w", encoding="utf-8") as out:
        for line in results:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    failed = sum(line["error"] is not None or line["response"]["status_code"] >= 300 for line in results)
    print(f"scratchllm run-batch: {len(results)} requests, {failed} failed, in {time.monotonic() - start:.1f} s "
          f"-> {args.output_file}", file=sys.stderr)
    return 0


async def _run(registry: Any, config: Any, lines: list[Line]) -> list[dict[str, Any]]:
    """The lines as a batch per url, of an app made here, run by its worker; the results in the
    input's order."""
    from scratchllm.server.app import create_app

    app = create_app(registry, config=config)
    store = app.state.batches
    out: dict[int, dict[str, Any]] = {}
    async with app.router.lifespan_context(app):  # the worker runs the batches; the engines stop at its end
        batches: dict[str, list[Line]] = {}
        for url in dict.fromkeys(ln.url for ln in lines):
            mine = [ln for ln in lines if ln.url == url]
            batch_id = store.add_batch(url, "", "24h", [Line(k, ln.custom_id, ln.body) for k, ln in enumerate(mine)],
                                       None)
            batches[batch_id] = mine
        app.state.batch_runner.wake.set()
        while any(store.status(b) not in ("completed", "cancelled", "failed", "expired") for b in batches):
            await asyncio.sleep(0.05)
        for batch_id, mine in batches.items():
            for r in store.results(batch_id):
                out[mine[r["idx"]].idx] = {"id": f"batch_req_{batch_id[6:]}_{r['idx']}", "custom_id": r["custom_id"],
                                           "response": {"status_code": r["status_code"],
                                                        "request_id": r["request_id"], "body": r["body"]},
                                           "error": r["error"]}
    return [out[k] for k in sorted(out)]
