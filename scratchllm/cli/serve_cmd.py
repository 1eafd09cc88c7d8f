"""`scratchllm serve`: the OpenAI- and Ollama-compatible HTTP server on one model or several
(or on the fake engine).

Several models (`scratchllm serve default minilm gemma3-270m`, or --model repeated): each
generation model gets its own engine and KV pool, each embedding model sits beside them, and all
of them are planned in one memory plan at start (what does not fit is refused before the socket
serves). Requests go to the model their `model` field names. --load first-use loads each on
its first request; --keep-alive unloads a model idle that long (never one in use).

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
import functools
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from scratchllm.cli import Subparsers
from scratchllm.cli.listen import listen, ready_url
from scratchllm.cli.options import (
    add_kv_cache_dtype_argument,
    add_speculative_arguments,
    add_threads_argument,
    speculative_config,
)
from scratchllm.cli.serve_config import apply_config, environment_defaults, render_config, track_given
from scratchllm.dtypes import DTYPE_HELP, DTYPES
from scratchllm.engine.config import POLICY_NAMES
from scratchllm.errors import ConfigError
from scratchllm.evaluate.capture import add_capture_arguments, capture_writer_from_args, check_capture_args
from scratchllm.server.tool_parsers import FORMATS as TOOL_CALL_FORMATS

if TYPE_CHECKING:
    import uvicorn

    from scratchllm.server.app import Drain, ServedModel, ServerConfig
    from scratchllm.server.registry import ModelRegistry, ModelSpec
    from scratchllm.tokenizer import Tokenizer
    from scratchllm.tokenizer.protocol import TokenizerLike
    from scratchllm.trace.writer import TraceWriter

logger = logging.getLogger("scratchllm.serve")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
                       description=__doc__ + "\nEvery option can also come from a TOML file (--config) and from the "
                       "environment (--max-num-seqs from SCRATCHLLM_MAX_NUM_SEQS, --api-key from SCRATCHLLM_API_KEY, "
                       "and so on). Lowest first: the default, the file, the environment, the command line; "
                       "--print-config shows the result.")
    p.add_argument("model_arg", nargs="*", metavar="MODEL", default=[],
                   help="the models to serve, as `scratchllm serve MODEL [MODEL ...]` (same as --model)")
    p.add_argument("-m", "--model", action=ModelOption, default=None,
                   help="'default' (SmolLM2-135M-Instruct), 'minilm', 'gemma3-270m', 'qwen2.5-coder-0.5b', "
                        "'qwen2.5-coder-1.5b', or a .gguf file / Hugging Face model folder; repeat it to serve several")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send, with one model (default: the model as given)")
    p.add_argument("--embedding-model", default="minilm",
                   help="model for /v1/embeddings, served beside the others, or 'none'")
    p.add_argument("--load", choices=["start", "first-use"], default="start",
                   help="when each model loads: all at start, before the socket serves, or each on its first request")
    p.add_argument("--keep-alive", type=keep_alive_arg, default=None, metavar="DURATION",
                   help="unload a model idle this long (seconds, or e.g. 30s, 5m, 1h; never one in use) and load it "
                        "again on its next request (default: forever, never unloaded)")
    p.add_argument("--memory-budget", type=memory_size, default=None, metavar="SIZE",
                   help="memory all the models may plan together, e.g. 4GiB (default: the memory available at start)")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read serve's options from a TOML file, under SCRATCHLLM_* variables and flags (default: "
                        "none, or $SCRATCHLLM_CONFIG); see docs/workbench.md")
    p.add_argument("--print-config", action="store_true",
                   help="print the options in effect, each with where it came from, as a TOML file, and exit")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 serves other machines too (set --api-key then)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on stderr)")
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="engine batching mode: continuous (default) or the static, padded baseline")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences in one engine step (default: 16 for the continuous engine: fewer give each "
                        "token sooner, more start each request sooner; 8 for the fake one)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks (default: memory plan)")
    p.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory of the KV-cache pool, e.g. 256MiB, 1GiB or a number of bytes (default: what "
                        "--max-num-seqs sequences of --max-model-len tokens need, within the machine's memory); "
                        "the pool is touched only as it fills")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, or what the memory plan's KV pool holds when that "
                        "is less, at least 4096 tokens; said at start)")
    add_kv_cache_dtype_argument(p)
    add_speculative_arguments(p)
    p.add_argument("--prefix-cache-memory", type=cache_size, default=None, metavar="SIZE",
                   help="memory the prefix cache may keep beyond the KV blocks the work holds, e.g. 64MiB or 0 "
                        "(cached prefixes only in memory the work made resident); default: as much as the most "
                        "KV the work has held at once")
    p.add_argument("--target-tpot-ms", type=float, default=None, metavar="MS",
                   help="time per output token to hold: each step takes only the tokens whose predicted time "
                        "fits, so admission stops adding sequences past it (default: none, --max-num-seqs only)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    p.add_argument("--max-in-flight", type=int, default=64,
                   help="requests each model holds at once (running + waiting); more get 429 + Retry-After")
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
    p.add_argument("--policy", choices=POLICY_NAMES, default=None,
                   help="admission policy of the continuous engine: priority (default: short requests "
                        "first, a 10 ms tick, aging) or fcfs (arrival order)")
    add_threads_argument(p)
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template text) instead of the model's own")
    p.add_argument("--trace", default=None, metavar="RING",
                   help="the token trace ring file the engine writes every token into, read by `scratchllm trace "
                        "watch|heatmap|export` (default: on, at $SCRATCHLLM_TRACE or scratchllm-trace-UID-PORT.ring "
                        "in the temporary directory, one per server; a ring another live server writes is never "
                        "taken: this one then writes RING.pid-PID; of the default rings whose servers have ended, "
                        "the newest 4 are kept and older ones removed at start; 'none' turns it off)")
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
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "strict", "none", *TOOL_CALL_FORMATS],
                   help="the format of the model's tool calls with tool_choice auto: hermes (<tool_call> blocks), "
                        "llama3_json, mistral ([TOOL_CALLS]) or gemma (```tool_code blocks); auto (the default) "
                        "takes the one the chat template writes, and also reads a reply that is a declared "
                        "tool's call as bare JSON (or in a ```json fence) as a call; strict: the template's "
                        "format only; see docs/openai-replies.md")
    p.add_argument("--batch-dir", default=None, metavar="FOLDER",
                   help="where Batch API files and jobs persist, resumed after a restart (default: "
                        "$SCRATCHLLM_CACHE_DIR/batches, i.e. ~/.cache/scratchllm/batches)")
    p.add_argument("--batch-concurrency", type=int, default=4, metavar="N",
                   help="a batch's requests in the server at once, each in the engine's low-priority queue")
    p.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas on Ray Serve behind a KV-block-aware router (needs the "
                        "cluster extra: pip install scratchllm[cluster]); see docs/cluster.md")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: join this Ray cluster (e.g. ray://head:10001 or auto); default: "
                        "start a local one")
    track_given(p)
    env_errors, env_set = environment_defaults(p)
    p.set_defaults(func=run, env_errors=env_errors, env_set=env_set, serve_parser=p)


class ServeLog:
    """serve's own lines on stderr ("scratchllm serve: ..."). The first line a server prints is
    its address (scripts read it as "ready"), so what is said before it (a ring taken, a flag
    adjusted, the loads at start) is held and printed right after it."""

    def __init__(self) -> None:
        self.held: list[str] | None = []

    def say(self, line: str) -> None:
        if self.held is None:
            print(f"scratchllm serve: {line}", file=sys.stderr, flush=True)
        else:
            self.held.append(line)

    def ready(self, address_line: str) -> None:
        """Print the address line, then what was held; from now on lines go out at once."""
        held, self.held = self.held or [], None
        print(f"scratchllm serve: {address_line}", file=sys.stderr, flush=True)
        for line in held:
            self.say(line)


def serve_log(args: argparse.Namespace) -> ServeLog:
    """The one ServeLog of this serve run."""
    if getattr(args, "_log", None) is None:
        args._log = ServeLog()
    log: ServeLog = args._log
    return log


class ModelOption(argparse.Action):
    """-m/--model, repeatable: each one is added to the models served (`model_options`);
    `model` keeps the first, the one model a one-model reader (the cluster's spec) takes."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given = [*(getattr(namespace, "model_options", None) or []), str(values)]
        namespace.model_options = given
        namespace.model = given[0]


def keep_alive_arg(text: str) -> float | None:
    """--keep-alive: seconds, or a duration such as 5m; None (forever) for a negative one."""
    from scratchllm.server.registry import parse_keep_alive

    try:
        return parse_keep_alive(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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


def cache_size(text: str) -> int:
    """--prefix-cache-memory: a size, 0 allowed."""
    return 0 if text.strip() in ("0", "0B", "0b") else memory_size(text)


NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}


def given_models(args: argparse.Namespace) -> list[str]:
    """The models named by MODEL..., --model (repeated), SCRATCHLLM_MODEL or the config file, in
    that order, each once; empty when none is named."""
    named = [*(args.model_arg or []), *(getattr(args, "model_options", None) or [])]
    if not named and args.model:  # SCRATCHLLM_MODEL sets --model's default
        named = [args.model]
    return list(dict.fromkeys(named))


def models_from_args(args: argparse.Namespace) -> list[str]:
    """The models to serve: those named, else 'default'."""
    return given_models(args) or ["default"]


def model_from_args(args: argparse.Namespace) -> str:
    """The one model of a one-model path (--replicas): refused when several are named."""
    refs = models_from_args(args)
    if len(refs) > 1:
        count = NUMBER_WORDS.get(len(refs), str(len(refs)))
        raise ConfigError(f"--replicas serves one model; {count} models given: " + ", ".join(f"'{r}'" for r in refs))
    return refs[0]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options every generation model gets from the command line."""
    options: dict[str, Any] = {"batching": args.batching, "dtype": args.dtype}
    for key in ("max_num_seqs", "num_kv_blocks", "max_model_len", "policy"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.kv_cache_memory is not None:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.prefix_cache_memory is not None:
        options["prefix_cache_memory_bytes"] = args.prefix_cache_memory
    if args.target_tpot_ms is not None:
        options["target_tpot_s"] = args.target_tpot_ms / 1000
    if args.threads is not None and args.batching == "continuous":
        options["num_threads"] = args.threads
    spec = speculative_config(args)
    if spec is not None:
        if args.batching != "continuous":
            raise ConfigError("speculative decoding runs in the continuous engine, not --batching static")
        options["speculative_config"] = spec
    return options


def build(args: argparse.Namespace) -> ModelRegistry:
    """The registry of the models the arguments name, planned (nothing is loaded yet)."""
    from scratchllm.server.registry import ModelRegistry

    if args.env_errors:
        raise ConfigError("; ".join(args.env_errors))
    if args.max_in_flight < 1 or args.max_body_bytes < 1:
        raise ConfigError("--max-in-flight and --max-body-bytes must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        from scratchllm.models.threads import set_blas_threads

        set_blas_threads(args.threads)
    embedding = None if args.embedding_model == "none" else args.embedding_model
    if args.fake_engine:
        from scratchllm.server.backend import fake_specs

        for flag, given in (("--chat-template", args.chat_template), ("--priority-feedback", args.priority_feedback),
                            ("--speculative-config", args.speculative_config), ("--model-draft", args.model_draft)):
            if given:
                raise ConfigError(f"{flag} needs a model (not --fake-engine)")

        options = {"max_running": args.max_num_seqs or 8, "step_ms": args.fake_step_ms, "batching": args.batching}
        if args.num_kv_blocks:
            options["num_blocks"] = args.num_kv_blocks
        names = given_models(args) or [args.served_model_name or "fake"]
        specs = fake_specs(names, embedding is not None, max_model_len=args.max_model_len or 2048, **options)
    else:
        specs = _model_specs(args, models_from_args(args), embedding)
    for spec in specs:
        _show_progress(spec, lambda: getattr(args, "_serving", False))
    for line in adjustments(args, specs):
        serve_log(args).say(line)
    try:
        registry = ModelRegistry(specs, keep_alive_s=args.keep_alive, report=serve_log(args).say)
    except ValueError as err:  # two models under one name
        raise ConfigError(str(err)) from None
    registry.new_spec = functools.partial(_added_spec, args)
    return registry


def _added_spec(args: argparse.Namespace, name: str, ref: str) -> ModelSpec:
    """A spec for a model named while serving (Ollama's /api/pull, /api/create): loaded on its
    first request, planned alone against the memory there is then (the models served already
    hold theirs)."""
    if args.fake_engine:
        from scratchllm.server.backend import fake_specs

        options = {"max_running": args.max_num_seqs or 8, "step_ms": args.fake_step_ms, "batching": args.batching}
        return fake_specs([name], False, max_model_len=args.max_model_len or 2048, **options)[0]
    from scratchllm.server.backend import model_specs

    try:
        (spec,), _ = model_specs([ref], engine_options(args), trace=trace_writer(args))
    except ConfigError as err:
        from scratchllm.server.errors import APIError

        raise APIError(400, f"cannot serve '{name}' ({ref}): {err}", param="model") from None
    spec.name = name
    _show_progress(spec, lambda: True)
    return spec


def adjustments(args: argparse.Namespace, specs: list[ModelSpec]) -> list[str]:
    """What serve says at start about the options in effect: each generation model's context
    (the model's, the one asked for, or what its memory plan holds, and why), and each option
    asked for that is clamped or adjusted (the value asked, the value used, why)."""
    lines = []
    plan = getattr(args, "_memory_plan", None)
    for spec, need in zip(specs, plan.needs if plan is not None else (), strict=False):  # specs in the plan's order
        if spec.task == "generate" and need.context is not None:
            lines.append(f"'{spec.name}': {need.context.describe()}")
    if args.max_num_seqs is not None and args.max_num_seqs > args.max_in_flight:
        lines.append(f"--max-num-seqs {args.max_num_seqs} asked, at most {args.max_in_flight} run at once: "
                     f"--max-in-flight {args.max_in_flight} is what each model holds at once, running and waiting")
    return lines


def _model_specs(args: argparse.Namespace, refs: list[str], embedding: str | None) -> list[ModelSpec]:
    from scratchllm.server.backend import model_specs

    if embedding is not None and embedding not in refs:
        refs = [*refs, embedding]
    specs, plan = model_specs(refs, engine_options(args), trace=trace_writer(args), budget_bytes=args.memory_budget)
    args._memory_plan = plan
    generators = [s for s in specs if s.task == "generate"]
    if embedding is not None and next(s for s in specs if s.name == embedding).task != "embed":
        raise ConfigError(f"--embedding-model '{embedding}' is not an encoder model (it has no embeddings)")
    if args.served_model_name:
        if len(generators) != 1:
            raise ConfigError("--served-model-name names the one model served; with several, each is served by "
                              "the name it was given")
        generators[0].name = args.served_model_name
    if args.chat_template:
        if len(generators) != 1:
            raise ConfigError("--chat-template replaces one model's chat template; serve that model alone")
        template = args.chat_template
        _after_load(generators[0], lambda m: setattr(m, "tokenizer", _with_chat_template(m.tokenizer, template)))
    if args.priority_feedback:
        hook = _priority_feedback(args)
        for spec in generators:
            _after_load(spec, hook)
    return specs


def _show_progress(spec: ModelSpec, serving: Callable[[], bool]) -> None:
    """Each load of the spec's model shows its long steps (packing, the panel cache) on the
    console; before the server serves (`serving()` false), on a terminal only."""
    from scratchllm.models.progress import console_sink, reporting

    load = spec.load
    assert load is not None

    def load_with_progress() -> Any:
        with reporting(console_sink(spec.name, terminal_only=not serving())):
            return load()

    spec.load = load_with_progress


def _after_load(spec: ModelSpec, hook: Callable[[ServedModel], None]) -> None:
    """Run `hook` on the model each time the spec loads it."""
    from scratchllm.server.state import ServedModel

    load = spec.load
    assert load is not None

    def load_then_hook() -> ServedModel:
        served = load()
        assert isinstance(served, ServedModel), "a generation spec loads a ServedModel"
        hook(served)
        return served

    spec.load = load_then_hook


def _priority_feedback(args: argparse.Namespace) -> Callable[[ServedModel], None]:
    """--priority-feedback: the hook that sets each loaded engine's priority hook, which reads a
    queued request's class from the map the server keeps (request id -> class, args._classes)."""
    from scratchllm.engine.async_engine import AsyncEngine
    from scratchllm.evaluate.feedback import RequestClasses, engine_priority_hook, load_priority_hook

    if args.batching != "continuous":
        raise ConfigError("--priority-feedback needs the continuous engine (not --batching static or --fake-engine)")
    classes = args._classes = RequestClasses()
    priorities = load_priority_hook(args.priority_feedback)

    def set_hook(model: ServedModel) -> None:
        assert isinstance(model.engine, AsyncEngine)
        # set before the first request: the engine thread reads the hook when a request is queued
        model.engine.engine.set_priority_hook(engine_priority_hook(priorities, classes))

    return set_hook


def trace_writer(args: argparse.Namespace) -> TraceWriter | None:
    """The ring the server's engines and its streams write, or None (--trace none). Made once,
    named after the server's port (format.default_ring_path); a ring that another live server
    writes is left alone: this server takes a name of its own and says so."""
    if getattr(args, "_trace_writer", False) is not False:
        made: TraceWriter | None = args._trace_writer
        return made
    from scratchllm.trace.format import default_ring_path, own_ring_path, ring_folder
    from scratchllm.trace.rings import KEEP_FINISHED, prune_rings
    from scratchllm.trace.writer import RingInUse, TraceWriter

    writer: TraceWriter | None = None
    if (args.trace or "").lower() != "none":
        if args.trace_ring_mb < 1:
            raise ConfigError(f"--trace-ring-mb must be >= 1, got {args.trace_ring_mb}")
        if not args.trace:  # a default name: the default folder's finished rings are ours to keep bounded
            removed = prune_rings()  # before this one reserves its space: a disk they filled gets it back
            if removed:
                serve_log(args).say(f"removed {len(removed)} trace ring(s) of earlier runs from {ring_folder()} "
                                    f"(the newest {KEEP_FINISHED} of finished runs are kept)")
        port = getattr(args, "_port", 0)
        path = args.trace or default_ring_path(port=port)
        try:
            try:
                writer = TraceWriter(path, ring_bytes=args.trace_ring_mb << 20, port=port)
            except RingInUse as err:
                own = own_ring_path(path)
                writer = TraceWriter(own, ring_bytes=args.trace_ring_mb << 20, port=port)
                serve_log(args).say(f"the trace ring {path} is in use by another live writer (pid {err.pid}); "
                                    f"this server writes {own}")
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


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The HTTP server's options (one process or the replicas' ingress alike), checked."""
    from scratchllm.server.app import ServerConfig
    from scratchllm.server.metrics import check_prefix

    try:
        check_prefix(args.metrics_prefix)
    except ValueError as err:
        raise ConfigError(f"--metrics-prefix: {err}") from None
    if args.sse_ping_interval < 0:
        raise ConfigError(f"--sse-ping-interval must be >= 0 seconds (0 = off), got {args.sse_ping_interval}")
    if args.drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    if args.batch_concurrency < 1:
        raise ConfigError(f"--batch-concurrency must be >= 1, got {args.batch_concurrency}")
    from scratchllm.formats.refs import cache_dir

    return ServerConfig(batch_dir=args.batch_dir or str(cache_dir().parent / "batches"),
                        batch_concurrency=args.batch_concurrency, max_in_flight=args.max_in_flight,
                        max_body_bytes=args.max_body_bytes,
                        drain_timeout_s=args.drain_timeout, api_key=args.api_key or None,
                        allowed_origins=origins, metrics_prefix=args.metrics_prefix,
                        trusted_proxies=args.trusted_proxies, lenient_fields=args.lenient_fields,
                        sse_ping_interval_s=args.sse_ping_interval, tool_call_parser=args.tool_call_parser)


def run(args: argparse.Namespace) -> int:
    sources = apply_config(args, args.serve_parser, args.env_set)  # the file, under the environment and flags
    if sources.get("log_level") in ("file", "environment"):
        logging.getLogger().setLevel(args.log_level.upper())
    if args.print_config:
        print(render_config(args, args.serve_parser, sources, models_from_args(args)), end="")
        return 0
    if args.replicas is not None:
        from scratchllm.cluster.cli import serve_replicas

        args.model = model_from_args(args)
        return serve_replicas(args, server_config(args))
    import uvicorn

    from scratchllm.server.app import create_app

    # Everything the command line alone decides is checked, and the port bound, before the model
    # loads or the trace ring, the capture folder or any other file is touched.
    config = server_config(args)
    check_capture_args(args)
    sock = listen(args.host, args.port, "scratchllm serve")
    args._port = sock.getsockname()[1]  # the port it really got (--port 0): the trace ring is named after it
    try:
        registry = build(args)
        otlp = None
        if args.otlp_traces_endpoint:
            from scratchllm.trace.otlp import make_tracer

            otlp = make_tracer(args.otlp_traces_endpoint)
        writer = None if args.fake_engine else trace_writer(args)
        app = create_app(registry, config=config, trace=writer, otlp=otlp, capture=capture_writer_from_args(args),
                         classes=getattr(args, "_classes", None))
        if args.load == "start":
            registry.load_all()
    except BaseException:
        sock.close()
        raise
    # the address line comes once the models are loaded: scripts read it as "ready" (so the loads
    # at start show their progress on a terminal only, never as lines before it)
    names = registry.names("generate") or registry.names("embed")
    serve_log(args).ready(f"{', '.join(names)} on {ready_url(sock)}")
    args._serving = True  # loads from now on (first use, after an unload) show progress as lines too
    plan = getattr(args, "_memory_plan", None)
    if plan is not None and len(plan.needs) > 1:
        print(f"scratchllm serve: memory plan: {plan.describe()}", file=sys.stderr, flush=True)
    if args.load == "first-use" or args.keep_alive is not None:
        keep = "forever" if args.keep_alive is None else f"{args.keep_alive:g} s idle"
        print(f"scratchllm serve: models load on {'first use' if args.load == 'first-use' else 'start'} and stay "
              f"loaded {keep}", file=sys.stderr, flush=True)
    if args.lenient_fields:
        print("scratchllm serve: --lenient-fields: unknown request fields are logged and ignored, not refused",
              file=sys.stderr, flush=True)
    if args.capture:
        print(f"scratchllm serve: capturing {args.capture_rate:.2%} of requests into {args.capture} "
              "(--capture-rate; 1 captures all)", file=sys.stderr, flush=True)
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
