"""`scratchllm serve`: the OpenAI-compatible HTTP server on a model (or on the fake engine).

Process/thread layout: one process. uvicorn's event loop (main thread) owns the sockets, JSON and
tokenization; the engine steps in its own thread and wakes the loop once per token (no thread
per request). SIGTERM stops accepting connections, lets every in-flight request finish (up to
--drain-timeout seconds), shuts the engine down with drain=True, then exits 0.
"""

import argparse
import signal
import socket
import sys

from scratchllm.dtypes import DTYPE_HELP, DTYPES
from scratchllm.errors import ConfigError


def add_parser(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
                       description=__doc__)
    p.add_argument("--model", default="default", help="'default', or a .gguf file / Hugging Face model folder")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--embedding-model", default="minilm", help="model for /v1/embeddings, or 'none'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on stderr)")
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="engine batching mode: continuous (default) or the static, padded baseline")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per engine step")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks (default: memory plan)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help=DTYPE_HELP)
    p.add_argument("--max-in-flight", type=int, default=64,
                   help="requests held at once (running + waiting); more get 429 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds SIGTERM waits for in-flight requests")
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
    p.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas on Ray Serve behind a KV-block-aware router (needs the "
                        "cluster extra: pip install scratchllm[cluster]); see docs/cluster.md")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: join this Ray cluster (e.g. ray://head:10001 or auto); default: "
                        "start a local one")
    p.set_defaults(func=run)


def build(args):
    """(ServedModel, ServedEmbedder | None) for the arguments."""
    if args.max_in_flight < 1 or args.max_body_bytes < 1:
        raise ConfigError("--max-in-flight and --max-body-bytes must be >= 1")
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
    model = load_model(args.model, args.served_model_name or args.model, options)
    embedder = None if args.embedding_model == "none" else load_embedder(args.embedding_model)
    return model, embedder


def run(args) -> int:
    if args.replicas is not None:
        from scratchllm.cluster.cli import serve_replicas

        return serve_replicas(args)
    import uvicorn

    from scratchllm.server.app import ServerConfig, create_app

    model, embedder = build(args)
    config = ServerConfig(max_in_flight=args.max_in_flight, max_body_bytes=args.max_body_bytes,
                          drain_timeout_s=args.drain_timeout)
    app = create_app(model, embedder, config)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as err:
        model.engine.shutdown(False)
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
    host, port = sock.getsockname()[:2]
    print(f"scratchllm serve: {model.name} on http://{host}:{port}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout,
                                           timeout_keep_alive=5))
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler that was there
    # before it started; this one turns that into a clean exit 0 (drained, nothing lost).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.run(sockets=[sock])
    return 0
