"""llama.cpp's speculative decoding on `bench spec`'s prompts, through its own programs (`make
peers` builds them; llama_tools.py runs them):

  ngram-simple, ngram-mod   llama-speculative-simple --spec-type TYPE: its n-gram drafters, each at
                            its own defaults (their lookup and draft lengths are their own knobs)
  lookup                    llama-lookup: n-gram lookup with at most --draft-max drafted tokens
  draft-simple              llama-speculative-simple --spec-type draft-simple -md DRAFT: the draft
                            model, at most --draft-max tokens a step
  tg128                     llama-bench's plain decode of 128 tokens on the target (the baseline)

Each run is greedy, with the bench's threads, one prompt (the chat template's text, in a file),
its decode speed and acceptance as the program prints them, its peak RSS sampled.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from scratchllm.bench import llama_tools

MODES = ("ngram-simple", "ngram-mod", "lookup", "draft-simple")
NGRAM_MODES = ("ngram-simple", "ngram-mod", "lookup")


def available() -> bool:
    return all(llama_tools.tool(t) is not None for t in ("llama-bench", "llama-speculative-simple", "llama-lookup"))


def run_case(mode: str, target: str, draft: str, prompt_text: str, threads: int, new_tokens: int,
             draft_max: int) -> dict[str, Any]:
    """One llama.cpp run of `mode` on one prompt: {"decode_tok_s", "decoded", "drafted", "accepted",
    "accept_rate", "peak_rss_mb"}."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt_text)
    try:
        ctx = 4096
        if mode == "lookup":
            exe = llama_tools.tool("llama-lookup")
            assert exe is not None
            argv = [str(exe), *llama_tools.lookup_args(target, f.name, threads, new_tokens, ctx, draft_max)]
        else:
            exe = llama_tools.tool("llama-speculative-simple")
            assert exe is not None
            argv = [str(exe), *llama_tools.speculative_args(target, f.name, threads, new_tokens, ctx, draft_max,
                                                            mode, draft if mode == "draft-simple" else None)]
        run = llama_tools.run_tool(argv)
    finally:
        Path(f.name).unlink()
    return {**llama_tools.parse_speculative(run.stderr), "peak_rss_mb": run.peak_rss_mb}


def tg128(target: str, threads: int) -> dict[str, Any]:
    """llama-bench's tg128 on the target: {"decode_tok_s", "peak_rss_mb"}."""
    exe = llama_tools.tool("llama-bench")
    assert exe is not None
    run = llama_tools.run_tool([str(exe), *llama_tools.bench_args(target, threads, 0, 128, 1)])
    tests = llama_tools.parse_bench(run.stdout)
    return {"decode_tok_s": tests["decode_tok_s"], "peak_rss_mb": run.peak_rss_mb}
