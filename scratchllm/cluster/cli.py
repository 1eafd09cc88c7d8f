"""`scratchllm serve --replicas N [--ray-address ADDR]`: the serve command's options, mapped onto
a ClusterSpec, then the Serve application started (app.start). Only imported with --replicas."""

from __future__ import annotations

import sys
from typing import Any

from scratchllm.errors import ConfigError
from scratchllm.server.state import ServerConfig


def spec_from_args(args: Any, server: ServerConfig) -> Any:
    """`server`: the HTTP options the ingress serves with (API key, CORS, limits, field
    strictness, pings, tool-call format), checked by the serve command as for one process."""
    from scratchllm.cluster.app import ClusterSpec
    from scratchllm.cluster.replica import ReplicaSpec

    if args.batching != "continuous":
        raise ConfigError("--replicas serves the continuous engine only (not --batching static)")
    if args.fake_engine:
        options: dict[str, Any] = {"max_running": args.max_num_seqs or 8, "step_ms": args.fake_step_ms,
                                   "max_model_len": args.max_model_len or 2048}
        if args.num_kv_blocks:
            options["num_blocks"] = args.num_kv_blocks
        replica = ReplicaSpec("fake", options)
    else:
        from scratchllm.engine.load import load_frontend

        options = {k: getattr(args, k) for k in ("max_num_seqs", "num_kv_blocks", "max_model_len", "policy")
                   if getattr(args, k) is not None}
        if args.prefix_cache_memory is not None:  # else the replica's default: the prefix cache may fill the pool
            options["prefix_cache_memory_bytes"] = args.prefix_cache_memory
        # a model that is not there, a broken header or tokenizer, a bad engine option: one clear
        # error here, before Ray starts, not a failed deploy of every replica and the ingress
        load_frontend(args.model, options)
        replica = ReplicaSpec(args.model, options, dtype=args.dtype)
    embedding = None if args.embedding_model == "none" else args.embedding_model
    if embedding is not None and not args.fake_engine:
        from scratchllm.formats.refs import resolve_model

        resolve_model(embedding)  # refused here, not in the ingress
    return ClusterSpec(replicas=args.replicas, replica=replica, served_model_name=args.served_model_name,
                       max_model_len=args.max_model_len, server=server, embedding_model=embedding)


def serve_replicas(args: Any, server: ServerConfig) -> int:
    try:
        import ray  # noqa: F401 - only to say clearly what is missing
    except ImportError as err:
        raise ConfigError(f"--replicas needs the cluster extra (pip install 'scratchllm[cluster]'): {err}") from None
    from scratchllm.cluster.app import start

    spec = spec_from_args(args, server)  # bad options fail here, before Ray starts
    print(f"scratchllm serve: {spec.replicas} replicas of {spec.replica.model} on Ray Serve, "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    start(spec, args.ray_address, args.host, args.port)
    return 0
