"""`scratchllm bench NAME`: benchmarks that print ratios against a baseline measured in the same run.

Each benchmark is a module scratchllm.bench.<name> with ``add_arguments(parser)`` and
``run(args) -> dict``; ``render(result) -> str`` prints the human table. With ``--json`` the dict
is printed as one JSON object instead (inputs, figures, ratios, machine facts). A bench whose
result lists broken promises under "problems" (soak) exits 1 when there are any.
"""

import argparse
import importlib
import importlib.util
import json
from collections.abc import Callable
from types import ModuleType

from scratchllm.cli import Subparsers, help_func

BENCHES = {
    "matmul": "the kernel lab: matrix multiply four ways, cache model and tile sweep",
    "load": "load + dequantize the default model: ours vs the gguf package",
    "tokenizer": "tokenizer encode MB/s: ours vs Hugging Face tokenizers",
    "generate": "prefill and single-stream decode tok/s vs the memory-bandwidth bound",
    "engine": "continuous batching vs the static baseline on a mixed workload; admission policies",
    "masks": "3-D attention mask generator: vectorized vs Python loop",
    "kv": "KV memory with sliding windows: a long request on Gemma 3 270M's attention shape vs full attention",
    "kv_dtype": "the KV-cache dtypes side by side: bytes per token, decode and batch speed, logits vs float32",
    "serving": "HTTP load test: Poisson arrivals, TTFT/TPOT/ITL/e2e percentiles; --peer llama-server",
    "trace": "token tracing: writer ns per record, engine throughput with tracing off vs on",
    "peers": "ours vs llama.cpp on one GGUF file: its Python API, llama-bench, llama-batched-bench",
    "accuracy": "logits against the dequantized float32 model: each dtype of ours, and llama.cpp",
    "structured": "structured output: grammar mask cost per token, throughput with and without",
    "cluster": "replicas on Ray Serve: KV-block router vs round robin vs power of two, hit rate and TTFT",
    "structured_http": "structured output through the server: json_schema vs unconstrained chat requests",
    "soak": "a bounded soak of one server: cancellations, bursts, hostile bodies, slow clients; 5xx, leaks, fds",
    "spec": "speculative decoding: n-gram and draft model, ours vs llama-speculative-simple and llama-lookup",
}


def add_parser(sub: Subparsers) -> None:
    parser = sub.add_parser("bench", help="run a benchmark", description=__doc__)
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name, help_text in BENCHES.items():
        module_name = f"scratchllm.bench.{name}"
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        p = benches.add_parser(name, help=help_text, description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)  # the docs are laid out
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        module.add_arguments(p)
        p.set_defaults(func=_run(module))
    parser.set_defaults(func=help_func(parser))


def _run(module: ModuleType) -> Callable[[argparse.Namespace], int]:
    def func(args: argparse.Namespace) -> int:
        result = module.run(args)
        if args.json:
            print(json.dumps(result, indent=None, default=str))
        else:
            print(module.render(result))
        return 1 if result.get("problems") else 0  # a bench that checks promises (soak) fails on a broken one

    return func
