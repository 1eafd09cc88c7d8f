"""Options that several commands take, defined once so their meaning and help agree."""

import argparse
from typing import TYPE_CHECKING

from scratchllm.bench.common import add_kv_cache_dtype_argument

if TYPE_CHECKING:
    from scratchllm.engine.speculative.config import SpeculativeConfig

__all__ = ["add_kv_cache_dtype_argument", "add_speculative_arguments", "add_threads_argument", "speculative_config"]


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """--threads: the process's compute threads (our matmul and attention pool, and BLAS)."""
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads: our matmul and attention kernels and NumPy's BLAS (default: one per "
                        "core); 1 is often faster when other jobs share the cores")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (docs/speculative-decoding.md), in vLLM's spelling or llama.cpp's."""
    g = p.add_argument_group("speculative decoding (docs/speculative-decoding.md)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2}\' (n-gram lookup in the prompt and output) or \'{"model": '
                        '"qwen2.5-coder-0.5b", "num_speculative_tokens": 5}\' (a draft model of the same vocabulary); '
                        "default: none")
    g.add_argument("--model-draft", "--spec-draft-model", dest="model_draft", default=None, metavar="MODEL",
                   help="llama.cpp's: the draft model (same vocabulary as the model)")
    g.add_argument("--draft-max", "--spec-draft-n-max", dest="draft_max", type=int, default=None, metavar="N",
                   help="llama.cpp's: most tokens drafted per step (default 3, as llama.cpp's)")
    g.add_argument("--draft-min", "--spec-draft-n-min", dest="draft_min", type=int, default=None, metavar="N",
                   help="llama.cpp's: fewer drafted tokens are not verified (default 0)")
    g.add_argument("--draft-p-min", "--spec-draft-p-min", dest="draft_p_min", type=float, default=None, metavar="P",
                   help="llama.cpp's: the draft stops at a token it gives less than this probability (default 0)")


def speculative_config(args: argparse.Namespace) -> "SpeculativeConfig | None":
    """The speculative config the arguments give (ConfigError for bad or conflicting ones)."""
    from scratchllm.engine.speculative.config import SpeculativeConfig
    from scratchllm.errors import ConfigError

    llama = SpeculativeConfig.from_llama_cpp(args.model_draft, args.draft_max, args.draft_min, args.draft_p_min)
    vllm = SpeculativeConfig.parse(args.speculative_config)
    if llama is not None and vllm is not None:
        raise ConfigError("give --speculative-config or --model-draft, not both")
    return llama or vllm
