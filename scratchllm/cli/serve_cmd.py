"""`scratchllm serve`: the OpenAI-compatible HTTP server on a model (or on the fake engine).

Process/thread layout: one process. uvicorn's event loop (main thread) owns the sockets, JSON and
tokenization; the engine steps in its own thread and wakes the loop once per token (no thread
per request).

SIGTERM (or Ctrl-C) drains: the listening socket stays open and every new request, on a new or a
kept-alive connection, gets 503 + Retry-After + Connection: close (/health too; /metrics is still
served), while the requests in flight, streams included, run to their end; once none is left the
server closes its sockets, shuts the engine down and exits 0. Past --drain-timeout seconds, or on
a second SIGTERM, what is still in flight is cut (a stream ends with an SSE error event, a reply
not yet begun gets a 503) and the exit status is 1. (uvicorn alone would close the listening
socket at once, so that new clients meet a refused connection, and would take a second SIGTERM
for the first.)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

from scratchllm.cli import Subparsers
from scratchllm.cli.listen import listen, url
from scratchllm.cli.options import add_kv_cache_dtype_argument, add_threads_argument
from scratchllm.dtypes import DTYPE_HELP, DTYPES
from scratchllm.errors import ConfigError
from scratchllm.evaluate.capture import add_capture_arguments, capture_writer_from_args, check_capture_args

if TYPE_CHECKING:
    import uvicorn

    from scratchllm.evaluate.feedback import RequestClasses
    from scratchllm.server.app import Drain, ServedEmbedder, ServedModel
    from scratchllm.tokenizer import Tokenizer
    from scratchllm.tokenizer.protocol import TokenizerLike
    from scratchllm.trace.writer import TraceWriter

ENV_PREFIX = "SCRATCHLLM_"
logger = logging.getLogger("scratchllm.serve")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
                       description=__doc__ + "\nEvery option also reads a default from the environment: "
                       "--max-num-seqs from SCRATCHLLM_MAX_NUM_SEQS, --api-key from SCRATCHLLM_API_KEY, and so on "
                       "(a flag given on the command line wins).")
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="the model to serve, as `scratchllm serve MODEL` (same as --model)")
    p.add_argument("-m", "--model", default=None,
                   help="'default' (SmolLM2-135M-Instruct), or a .gguf file / Hugging Face model folder")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--embedding-model", default="minilm", help="model for /v1/embeddings, or 'none'")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 serves other machines too (set --api-key then)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on stderr)")
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="engine batching mode: continuous (default) or the static, padded baseline")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences in one engine step (default: 64 for the continuous engine, 8 for the fake one)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks (default: memory plan)")
    p.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory of the KV-cache pool, e.g. 256MiB, 1GiB or a number of bytes (default: what "
                        "--max-num-seqs sequences of --max-model-len tokens need, within the machine's memory); "
                        "the pool is touched only as it fills")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    add_kv_cache_dtype_argument(p)
    p.add_argument("--prefix-cache-memory", type=cache_size, default=None, metavar="SIZE",
                   help="memory the prefix cache may keep beyond the KV blocks the work holds, e.g. 64MiB, 0 "
                        "(cached prefixes only in memory the work made resident) or 'unlimited' (default 32MiB)")
    p.add_argument("--target-tpot-ms", type=float, default=None, metavar="MS",
                   help="time per output token to hold: each step takes only the tokens whose predicted time "
                        "fits, so admission stops adding sequences past it (default: none, --max-num-seqs only)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    p.add_argument("--max-in-flight", type=int, default=64,
                   help="requests held at once (running + waiting); more get 429 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds SIGTERM waits for in-flight requests (new ones get 503 meanwhile); then they are cut")
    p.add_argument("--fake-engine", action="store_true",
                   help="serve the in-process fake engine (no model): for tests and trying clients")
    p.add_argument("--fake-step-ms", type=float, default=2.0, help="fake engine: milliseconds per decode step")
    p.add_argument("--log-level", default=argparse.SUPPRESS, type=str.lower,
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="logging of the engine, the server and uvicorn's access log (default warning; info "
                        "logs each request)")
    p.add_argument("--policy", choices=["priority", "fcfs"], default=None,
                   help="admission policy of the continuous engine: priority (default: short requests "
                        "first, a 10 ms tick, aging) or fcfs (arrival order)")
    add_threads_argument(p)
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template text) instead of the model's own")
    p.add_argument("--trace", default=None, metavar="RING",
                   help="the token trace ring file the engine writes every token into, read by `scratchllm trace "
                        "watch|heatmap|export` (default: on, at $SCRATCHLLM_TRACE or scratchllm-trace-UID.ring in "
                        "the temporary directory; 'none' turns it off)")
    p.add_argument("--trace-ring-mb", type=int, default=128, help="size of the trace ring in MiB (default 128)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="also export one OpenTelemetry span per request (OTLP over HTTP, e.g. "
                        "http://localhost:4318/v1/traces); needs opentelemetry-sdk")
    add_capture_arguments(p)
    p.add_argument("--priority-feedback", default=None, metavar="FILE.json",
                   help="the evaluation loop's priorities.json (`scratchllm eval feedback`): request classes that "
                        "scored below 0.5 wait longer, within the aging bound (continuous engine only)")
    p.add_argument("--metrics-prefix", default="scratchllm:",
                   help="prefix of the /metrics names, which follow vLLM's (default scratchllm:; vllm: for "
                        "dashboards and gateways set up for vLLM)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: none; or SCRATCHLLM_API_KEY)")
    p.add_argument("--allowed-origins", default="",
                   help="CORS: comma list of browser origins allowed to call the API, e.g. "
                        "http://localhost:3000, or * for any (default: none)")
    p.add_argument("--lenient-fields", action="store_true",
                   help="log and ignore request fields the server does not know, instead of a 400 naming them "
                        "(or SCRATCHLLM_LENIENT_FIELDS=1); see docs/openai-api.md")
    p.add_argument("--sse-ping-interval", type=float, default=15.0, metavar="SECONDS",
                   help="send a ': ping' SSE comment on a stream after this many seconds without a chunk "
                        "(default 15; 0 = never)")
    p.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas on Ray Serve behind a KV-block-aware router (needs the "
                        "cluster extra: pip install scratchllm[cluster]); see docs/cluster.md")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: join this Ray cluster (e.g. ray://head:10001 or auto); default: "
                        "start a local one")
    p.set_defaults(func=run, env_errors=_environment_defaults(p))


SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def memory_size(text: str) -> int:
    """'256MiB', '1.5GiB', '300MB', '1048576' -> bytes (> 0); argparse reports a ValueError as a usage error."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: a number with B, KB, MB, GB, KiB, MiB or GiB")
    size = int(float(m.group(1)) * SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be more than 0 bytes")
    return size


def cache_size(text: str) -> int | str:
    """--prefix-cache-memory: a size (0 allowed) or 'unlimited'."""
    if text.strip().lower() == "unlimited":
        return "unlimited"
    return 0 if text.strip() in ("0", "0B", "0b") else memory_size(text)


def _environment_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """SCRATCHLLM_<OPTION> in the environment sets the option's default (a flag still wins).
    Returns the problems found, reported when the command runs (not while --help is built)."""
    errors: list[str] = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.default is argparse.SUPPRESS or action.dest == "help":
            continue
        var = ENV_PREFIX + longs[0][2:].upper().replace("-", "_")
        if var not in os.environ:
            continue
        raw = os.environ[var]
        if action.nargs == 0:  # a switch such as --fake-engine
            if raw.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
                errors.append(f"{var}={raw!r}: expected 1/true/yes or 0/false/no")
                continue
            action.default = raw.lower() in ("1", "true", "yes")
            continue
        try:
            value = action.type(raw) if callable(action.type) else raw
        except ValueError:
            errors.append(f"{var}={raw!r} is not a valid value for {longs[0]}")
            continue
        if action.choices is not None and value not in action.choices:
            errors.append(f"{var}={raw!r}: {longs[0]} takes one of {', '.join(map(str, action.choices))}")
            continue
        action.default = value
    return errors


def model_from_args(args: argparse.Namespace) -> str:
    """The model to serve: MODEL or --model (not two different ones), else 'default'."""
    if args.model_arg and args.model and args.model_arg != args.model:
        raise ConfigError(f"two models given: '{args.model_arg}' and --model '{args.model}'")
    return str(args.model_arg or args.model or "default")


def build(args: argparse.Namespace) -> tuple[ServedModel, ServedEmbedder | None]:
    """(ServedModel, ServedEmbedder | None) for the arguments."""
    if args.env_errors:
        raise ConfigError("; ".join(args.env_errors))
    if args.max_in_flight < 1 or args.max_body_bytes < 1:
        raise ConfigError("--max-in-flight and --max-body-bytes must be >= 1")
    args.model = model_from_args(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        from scratchllm.models.threads import set_blas_threads

        set_blas_threads(args.threads)
    if args.fake_engine:
        from scratchllm.server.backend import fake_backend

        options = {"max_running": args.max_num_seqs or 8, "step_ms": args.fake_step_ms, "batching": args.batching}
        if args.num_kv_blocks:
            options["num_blocks"] = args.num_kv_blocks
        model, embedder = fake_backend(max_model_len=args.max_model_len or 2048, **options)
        model.name = args.served_model_name or model.name
        return model, (None if args.embedding_model == "none" else embedder)
    from scratchllm.server.backend import load_embedder, load_model

    options = {"batching": args.batching, "dtype": args.dtype}
    for key in ("max_num_seqs", "num_kv_blocks", "max_model_len", "policy"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.kv_cache_memory is not None:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.prefix_cache_memory is not None:
        options["prefix_cache_memory_bytes"] = None if args.prefix_cache_memory == "unlimited" \
            else args.prefix_cache_memory
    if args.target_tpot_ms is not None:
        options["target_tpot_s"] = args.target_tpot_ms / 1000
    if args.threads is not None and args.batching == "continuous":
        options["num_threads"] = args.threads
    model = load_model(args.model, args.served_model_name or args.model, options, trace=trace_writer(args))
    if args.chat_template:
        model.tokenizer = _with_chat_template(model.tokenizer, args.chat_template)
    return model, (None if args.embedding_model == "none" else load_embedder(args.embedding_model))


def _priority_feedback(args: argparse.Namespace, model: ServedModel) -> RequestClasses | None:
    """--priority-feedback: the engine's hook reads each queued request's class from the map the
    server keeps (request id -> class); returns that map, or None."""
    if not args.priority_feedback:
        return None
    from scratchllm.engine.async_engine import AsyncEngine
    from scratchllm.evaluate.feedback import RequestClasses, engine_priority_hook, load_priority_hook

    if not isinstance(model.engine, AsyncEngine):
        raise ConfigError("--priority-feedback needs the continuous engine (not --batching static or --fake-engine)")
    classes = RequestClasses()
    # set before the first request: the engine thread reads the hook when a request is queued
    model.engine.engine.set_priority_hook(engine_priority_hook(load_priority_hook(args.priority_feedback), classes))
    return classes


def trace_writer(args: argparse.Namespace) -> TraceWriter | None:
    """The ring the server's engine and its streams write, or None (--trace none). Made once."""
    if getattr(args, "_trace_writer", False) is not False:
        made: TraceWriter | None = args._trace_writer
        return made
    from scratchllm.trace.format import default_ring_path
    from scratchllm.trace.writer import TraceWriter

    writer: TraceWriter | None = None
    if (args.trace or "").lower() != "none":
        if args.trace_ring_mb < 1:
            raise ConfigError(f"--trace-ring-mb must be >= 1, got {args.trace_ring_mb}")
        path = args.trace or default_ring_path()
        try:
            writer = TraceWriter(path, ring_bytes=args.trace_ring_mb << 20)
        except OSError as err:  # a full disk, a read-only folder: serving matters more than the trace
            print(f"scratchllm serve: no token trace: could not make the {args.trace_ring_mb} MiB ring {path} "
                  f"({err.strerror or err}); serving without one", file=sys.stderr, flush=True)
    args._trace_writer = writer
    return writer


def _with_chat_template(tokenizer: TokenizerLike, template: str) -> Tokenizer:
    """The tokenizer with another chat template: a file's text, or the argument itself."""
    from scratchllm.tokenizer import Tokenizer
    from scratchllm.tokenizer.chat import render_chat

    if not isinstance(tokenizer, Tokenizer):
        raise ConfigError("--chat-template needs a model with its own tokenizer (not --fake-engine)")
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    try:
        render_chat(template, [{"role": "user", "content": "hi"}])
    except Exception as err:  # noqa: BLE001 - any template error is the user's input
        raise ConfigError(f"--chat-template does not render: {err}") from None
    return Tokenizer(dataclasses.replace(tokenizer.spec, chat_template=template))


def run(args: argparse.Namespace) -> int:
    args.model = model_from_args(args)
    if args.replicas is not None:
        from scratchllm.cluster.cli import serve_replicas

        return serve_replicas(args)
    import uvicorn

    from scratchllm.server.app import ServerConfig, create_app
    from scratchllm.server.metrics import check_prefix

    # Everything the command line alone decides is checked, and the port bound, before the model
    # loads or the trace ring, the capture folder or any other file is touched.
    try:
        check_prefix(args.metrics_prefix)
    except ValueError as err:
        raise ConfigError(f"--metrics-prefix: {err}") from None
    check_capture_args(args)
    if args.sse_ping_interval < 0:
        raise ConfigError(f"--sse-ping-interval must be >= 0 seconds (0 = off), got {args.sse_ping_interval}")
    sock = listen(args.host, args.port, "scratchllm serve")
    try:
        model, embedder = build(args)
    except BaseException:
        sock.close()
        raise
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    config = ServerConfig(max_in_flight=args.max_in_flight, max_body_bytes=args.max_body_bytes,
                          drain_timeout_s=args.drain_timeout, api_key=args.api_key or None, allowed_origins=origins,
                          metrics_prefix=args.metrics_prefix, trusted_proxies=args.trusted_proxies,
                          lenient_fields=args.lenient_fields, sse_ping_interval_s=args.sse_ping_interval)
    otlp = None
    if args.otlp_traces_endpoint:
        from scratchllm.trace.otlp import make_tracer

        otlp = make_tracer(args.otlp_traces_endpoint)
    writer = None if args.fake_engine else trace_writer(args)
    classes = _priority_feedback(args, model)
    app = create_app(model, embedder, config, trace=writer, otlp=otlp, capture=capture_writer_from_args(args),
                     classes=classes)
    print(f"scratchllm serve: {model.name} on {url(sock)}", file=sys.stderr, flush=True)
    if args.lenient_fields:
        print("scratchllm serve: --lenient-fields: unknown request fields are logged and ignored, not refused",
              file=sys.stderr, flush=True)
    if args.capture:
        print(f"scratchllm serve: capturing {args.capture_rate:.2%} of requests into {args.capture} "
              "(--capture-rate; 1 captures all)", file=sys.stderr, flush=True)
    if args.drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    server = draining_server(uvicorn.Config(app, log_level=getattr(args, "log_level", "warning"),
                                            timeout_graceful_shutdown=5, timeout_keep_alive=5),
                             app.state.drain, args.drain_timeout)
    if writer is not None:
        print(f"scratchllm serve: token trace in {writer.path} (scratchllm trace watch {writer.path})",
              file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        if writer is not None:
            writer.close()
    return 1 if app.state.drain.was_cut else 0


def draining_server(config: uvicorn.Config, drain: Drain, timeout_s: float) -> uvicorn.Server:
    """A uvicorn server whose SIGTERM/SIGINT drains through `drain` (the module doc) instead of
    closing the listening socket at once; a second one cuts what is left."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        deadline: float | None = None  # monotonic time the drain is cut at
        forced = False  # a second signal came

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # a signal handler: set flags only; on_tick (on the event loop, every 0.1 s) acts on them
            if sig not in (signal.SIGTERM, signal.SIGINT) or not self.started:
                self.should_exit = True
            elif self.deadline is None:
                self.deadline = time.monotonic() + timeout_s
            else:
                self.forced = True

        async def on_tick(self, counter: int) -> bool:
            if self.deadline is not None and not self.should_exit:
                if not drain.draining:
                    drain.start()
                    logger.warning("drain: refusing new requests (503), waiting up to %.0f s for %d in flight",
                                   timeout_s, drain.active)
                cutting = self.forced or time.monotonic() >= self.deadline
                if cutting and not drain.was_cut:
                    logger.warning("drain: %s; cutting the %d requests still in flight",
                                   "second signal" if self.forced else "deadline reached", drain.active)
                    drain.cut()
                if drain.idle:
                    logger.warning("drain: done (%d refused, %d cut); shutting down", drain.refused,
                                   drain.cut_requests)
                    self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer(config)
