"""Tokenizer encode speed: our pure-Python tokenizer beside Hugging Face `tokenizers` (Rust),
same vocabulary, same corpus, one thread, printed as MB/s and a ratio.

Corpus (offline): the Python reference manual's topics (English prose), standard-library source
(code) and a block of Chinese, emoji, numbers and whitespace runs, encoded one document at a time
by both. "Cold" is one pass with empty word caches (fresh tokenizers); "warm" is the median of
repeated passes, timed interleaved (ours, theirs, ours, ...) so both see the same noise from
other jobs; "no cache" is ours with its word cache off (the BPE merge loop on every word).
The ids are compared too: a speed figure for different output would mean nothing. Not equal work
in one respect: tokenizers' encode also tracks offsets (character alignments) on every call; ours
returns ids only. "Cold" is the fairer figure: "warm" lets our unbounded word cache answer every
word of a corpus it has seen (tokenizers keeps at most 10,000 words).

The reference for a GGUF is tokenizers built from the file's vocabulary and merges with the
pre-tokenizer the file declares; for a folder, tokenizers reading the same tokenizer.json.
`tokenizers` is a test dependency: without it, only our figures are printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pydoc_data.topics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scratchllm.bench.common import machine_facts, median
from scratchllm.errors import ConfigError
from scratchllm.formats.refs import resolve_model

if TYPE_CHECKING:
    import tokenizers

    from scratchllm.tokenizer import Tokenizer

MULTILINGUAL = [
    "人工智能正在改变我们的生活方式，从语音助手到自动驾驶汽车，无处不在。",
    "他说：“今天天气很好！”我们一起去公园散步吧？《三体》获得了雨果奖（2015年）。",
    "Great job! 🎉🎉 Family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵, I ❤️ Python 🐍",
    "Prices: $1,234.56, €99.99; date 2026-11-29T23:59:59Z; x=10**9; pi=3.14159265",
    "a   b\t\tc\n\n\n    12345 leading spaces\r\nПривет, мир! 日本語のテキスト。한국어.",
]
CODE_MODULES = ["difflib", "textwrap", "json.decoder", "argparse", "typing", "inspect"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="default (SmolLM2 GGUF), minilm, or a path")
    parser.add_argument("--repeat", type=int, default=5, help="warm passes per tokenizer (median)")
    parser.add_argument("--mb", type=float, default=1.0, help="corpus size in MB (about)")


def corpus(megabytes: float = 1.0) -> dict[str, list[str]]:
    """Category -> documents, about `megabytes` of UTF-8 in all (prose 45%, code 45%, rest 10%)."""
    budget = int(megabytes * 1_000_000)
    prose = _take([pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)], budget * 45 // 100)
    sources = [_source(m).read_text(encoding="utf-8") for m in CODE_MODULES]
    code = _take(sources, budget * 45 // 100)
    block = "\n".join(MULTILINGUAL)
    multilingual = _take([block] * (budget // len(block.encode()) + 1), budget // 10)
    return {"prose": prose, "code": code, "multilingual": multilingual}


def _source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} is a standard-library module with a file"
    return Path(spec.origin)


def _take(docs: list[str], nbytes: int) -> list[str]:
    out: list[str] = []
    total = 0
    for d in docs:
        if total >= nbytes:
            break
        out.append(d)
        total += len(d.encode())
    return out


def _reference(path: Path) -> tokenizers.Tokenizer | None:
    """Hugging Face tokenizers for the same vocabulary, or None when it is not installed."""
    if importlib.util.find_spec("tokenizers") is None:
        return None
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    import tokenizers as tk

    if path.is_dir():
        ref = tk.Tokenizer.from_file(str(path / "tokenizer.json"))
        ref.no_padding()
        ref.no_truncation()
        return ref
    if path.suffix != ".gguf":
        raise ConfigError(f"{path}: the tokenizer benchmark compares GGUF files and tokenizer.json folders")
    from scratchllm.formats.gguf import GGUFFile

    meta = GGUFFile(path).metadata
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    merges = [_merge(str(m)) for m in meta["tokenizer.ggml.merges"]]
    ref = tk.Tokenizer(tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = tk.pre_tokenizers
    # The declaration spelled as tokenizers' components (SmolLM2's own tokenizer.json does this).
    known: dict[str | None, list[tokenizers.pre_tokenizers.PreTokenizer]] = {
        "smollm": [pre.Digits(individual_digits=True)], "gpt2": []}
    steps = known.get(meta.get("tokenizer.ggml.pre"))
    if steps is None:
        raise ConfigError(f"{path}: no tokenizers baseline for tokenizer.ggml.pre={meta.get('tokenizer.ggml.pre')!r}")
    ref.pre_tokenizer = pre.Sequence([*steps, pre.ByteLevel(add_prefix_space=False, use_regex=True)])
    ref.decoder = tk.decoders.ByteLevel()
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    ref.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == 3])
    return ref


def _merge(line: str) -> tuple[str, str]:
    """A GGUF merge, "a b", as the pair tokenizers takes."""
    a, b = line.split(" ", 1)
    return a, b


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scratchllm.tokenizer import Tokenizer

    path = resolve_model(args.model)
    docs = corpus(args.mb)
    flat = [d for ds in docs.values() for d in ds]
    nbytes = sum(len(d.encode()) for d in flat)

    def ours_pass(tok: Tokenizer) -> list[list[int]]:
        return [tok.encode(d, add_special_tokens=False) for d in flat]

    def ref_pass(ref: tokenizers.Tokenizer) -> list[list[int]]:
        return [e.ids for e in (ref.encode(d, add_special_tokens=False) for d in flat)]

    start = time.perf_counter()
    ours = Tokenizer.from_pretrained(path)
    load_s = time.perf_counter() - start
    ref = _reference(path)

    cache_limit = ours.cache_limit
    start = time.perf_counter()
    our_ids = ours_pass(ours)
    cold: dict[str, float] = {"ours": time.perf_counter() - start}
    if ref is not None:
        start = time.perf_counter()
        ref_ids = ref_pass(ref)
        cold["tokenizers"] = time.perf_counter() - start

    # The BPE core alone: our word cache off, every pre-token merged from bytes each time.
    ours.cache_limit = 0
    ours.clear_cache()
    start = time.perf_counter()
    uncached_ids = ours_pass(ours)
    uncached_s = time.perf_counter() - start
    assert uncached_ids == our_ids
    ours.cache_limit = cache_limit
    ours_pass(ours)  # refill

    warm: dict[str, list[float]] = {"ours": [], "tokenizers": []}
    for _ in range(args.repeat):
        start = time.perf_counter()
        ours_pass(ours)
        warm["ours"].append(time.perf_counter() - start)
        if ref is not None:
            start = time.perf_counter()
            ref_pass(ref)
            warm["tokenizers"].append(time.perf_counter() - start)

    def mbps(seconds: float) -> float:
        return nbytes / seconds / 1e6

    figures: dict[str, Any] = {"cold_mb_s": {k: mbps(v) for k, v in cold.items()},
               "warm_mb_s": {k: mbps(median(v)) for k, v in warm.items() if v},
               "uncached_mb_s": mbps(uncached_s), "load_s": load_s}
    result: dict[str, Any] = {
        "inputs": {"model": str(path), "corpus_bytes": nbytes, "documents": len(flat), "repeat": args.repeat,
                   "categories": {k: sum(len(d.encode()) for d in v) for k, v in docs.items()},
                   "tokens": sum(map(len, our_ids)), "threads": 1},
        "figures": figures,
        "ratios": {},
        "machine": machine_facts(),
    }
    if ref is not None:
        import tokenizers

        result["inputs"]["reference"] = f"tokenizers {tokenizers.__version__}"
        result["figures"]["ids_equal"] = our_ids == ref_ids
        for phase in ("cold_mb_s", "warm_mb_s"):
            result["ratios"][f"{phase[:-5]}_ours_over_tokenizers"] = (
                figures[phase]["ours"] / figures[phase]["tokenizers"])
    return result


def render(result: dict[str, Any]) -> str:
    inp, fig, ratios = result["inputs"], result["figures"], result["ratios"]
    cats = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in inp["categories"].items())
    lines = [
        f"tokenizer encode speed: {inp['model']}",
        f"corpus {inp['corpus_bytes'] / 1e6:.2f} MB ({cats}), {inp['documents']} documents, "
        f"{inp['tokens']:,} tokens, one thread, one document per call",
        "",
        f"{'':24}{'cold MB/s':>12}{'warm MB/s':>12}",
        f"{'scratchllm (Python)':24}{fig['cold_mb_s']['ours']:>12.2f}{fig['warm_mb_s']['ours']:>12.2f}",
    ]
    lines.append(f"{'scratchllm, no cache':24}{fig['uncached_mb_s']:>12.2f}{'':>12}")
    if "tokenizers" in fig["cold_mb_s"]:
        lines += [
            f"{inp['reference'] + ' (Rust)':24}{fig['cold_mb_s']['tokenizers']:>12.2f}"
            f"{fig['warm_mb_s']['tokenizers']:>12.2f}",
            f"{'ratio ours / tokenizers':24}{ratios['cold_ours_over_tokenizers']:>12.2f}"
            f"{ratios['warm_ours_over_tokenizers']:>12.2f}",
            "",
            f"ids identical to tokenizers: {'yes' if fig['ids_equal'] else 'NO'}",
        ]
    else:
        lines += ["", "(Hugging Face tokenizers is not installed: no baseline)"]
    lines += [f"load {fig['load_s']:.2f} s; warm = median of {inp['repeat']} passes, cold = first pass, "
              "empty caches (noisy on a shared machine: medians)"]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    print(json.dumps(run(p.parse_args()), default=str))
