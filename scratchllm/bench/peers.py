"""Ours against llama.cpp on the same GGUF file, measured here, now: through its Python API
(llama-cpp-python), and through llama.cpp's own programs (llama-bench, llama-batched-bench).

Both run on the same file, with the same token ids, the same thread count, each in a child
process of its own (so RSS is its own), in interleaved rounds: ours then the peer, the peer then
ours, ... The first table is against llama-cpp-python's high-level API, which serves one sequence
at a time (so its aggregate row runs the batch's prompts in turn). A round of either measures, in
this order:
  load, s                     constructing the runnable model from the file (ours: `LLM`, the
                              default dtype; the peer: `llama_cpp.Llama`)
  RSS after load, MB          the child's resident memory right after
  prefill tok/s               one prompt of --prompt-tokens ids, after one warm-up run
  decode tok/s                --new-tokens greedy steps after a prompt of --decode-context ids
                              (default 16; a longer one measures decode deep in a context, where
                              attention reads more of the KV cache per step), one stream
  aggregate tok/s             --batch prompts of 32 ids x --new-tokens each, prefill included
                              (ours: one batched `LLM.generate`; llama-cpp-python's high-level
                              API serves one sequence at a time, so the peer runs them in turn)
  peak RSS, MB                the child's peak resident memory over the whole round
The bandwidth bound (memory read bandwidth, measured here between rounds, over the bytes of
weights a decode step reads) is printed for each side, and whether the two sides' greedy ids
agree over the decode run. Rows are medians of the rounds; `advantage` > 1 means ours is ahead
(throughputs: ours / peer; times and memory: peer / ours).

The second table (scratchllm/bench/peers_llama_cpp.py, when `make peers` has built the programs)
is against llama.cpp's own batching: llama-bench's prefill and decode, llama-batched-bench at
each of --sequences sequences at once, and each side's peak RSS at that concurrency. Ours runs at
--kv-cache-dtype (default auto), llama.cpp at its default (f16).

More sections (a comparison of closeness to the float32 model, say) join SECTIONS: each measures
in its own rounds after the tables above and renders its own lines.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict

import numpy as np
import numpy.typing as npt

from scratchllm.bench import peers_llama_cpp
from scratchllm.bench import spec as spec_bench
from scratchllm.bench.common import (
    LoadedModel,
    add_kv_cache_dtype_argument,
    machine_facts,
    measure_bandwidth,
    median,
    require_at_least_one,
    status_mb,
    weight_bytes_per_token,
)
from scratchllm.dtypes import DEFAULT_DTYPE, DTYPES

if TYPE_CHECKING:  # for the annotation only: a child process imports it where it loads the model
    from scratchllm.llm import LLM

ROWS = [  # (key, label, higher is better)
    ("load_s", "load, s", False),
    ("rss_after_load_mb", "RSS after load, MB", False),
    ("prefill_tok_s", "prefill tok/s", True),
    ("decode_tok_s", "decode 1 stream tok/s", True),
    ("aggregate_tok_s", "aggregate tok/s, prefill included", True),
    ("peak_rss_mb", "peak RSS, MB", False),
]
PEER = "llama.cpp"  # the key of llama-cpp-python's side (its Python API), kept for the JSON's readers
PEER_LABEL = "llama-cpp-python"
DECODE_CONTEXT = 16  # the decode row's prompt ids unless --decode-context says otherwise


class Section(Protocol):
    """A further comparison of `bench peers`: measure(spec, args) -> its figures (or None: it could
    not run here, and says nothing), render(figures, inputs) -> its lines of the report."""

    name: str

    def measure(self, spec: "Spec", args: argparse.Namespace) -> dict[str, Any] | None: ...

    def render(self, figures: dict[str, Any], inputs: dict[str, Any]) -> list[str]: ...


class Spec(TypedDict):
    """One side's round, as its child process gets it (JSON on its command line)."""

    side: NotRequired[str]  # "ours" or PEER
    path: str  # the GGUF file
    threads: int
    new_tokens: int
    prompt_tokens: NotRequired[int]
    decode_context: NotRequired[int]
    batch: NotRequired[int]
    batch_ids: NotRequired[list[list[int]]]  # the peer's batch alone, on these prompts (peer_batch)
    sequences: NotRequired[int]  # ours: only the n-sequence row (load, then n prompts of 32 ids at once)
    kv_cache_dtype: NotRequired[str]  # ours: the engine's KV-cache dtype (default auto)
    dtype: NotRequired[str]  # ours: the weights' dtype (load_model's; default auto)


class Ids(TypedDict):
    """The token ids of a round's rows (workload)."""

    prefill: list[int]
    decode: list[int]
    batch: list[list[int]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="a GGUF model reference (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each side (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    parser.add_argument("--prompt-tokens", type=int, default=500, help="prefill length (default 500)")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode length (default 128)")
    parser.add_argument("--decode-context", type=int, default=DECODE_CONTEXT,
                        help=f"prompt ids before the decode row's steps (default {DECODE_CONTEXT})")
    parser.add_argument("--batch", type=int, default=16, help="prompts of the aggregate row (default 16)")
    parser.add_argument("--bandwidth-mb", type=int, default=512, help="array size for the bandwidth probe")
    parser.add_argument("--sequences", default="1,4,16",
                        help="sequences at once of the rows against llama-batched-bench (default 1,4,16)")
    parser.add_argument("--spec-cases", type=int, default=2,
                        help="code edits of the speculative-decoding rows (bench spec's; 0: none; default 2)")
    parser.add_argument("--spec-draft", default=None, metavar="MODEL",
                        help="a draft model for those rows, both sides (default: n-gram rows only)")
    add_kv_cache_dtype_argument(parser)
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                        help="our side's weight dtype (default auto; int8 rounds x to 8 bits as llama.cpp does)")


def peer_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def workload(vocab_size: int, spec: Spec) -> Ids:
    """The token ids both sides get: fixed, so rounds and sides compute the same thing."""
    rng = np.random.default_rng(0)
    lo = min(100, vocab_size // 2)
    ids: Ids
    ids = {"prefill": rng.integers(lo, vocab_size, spec["prompt_tokens"]).tolist(),
           "decode": rng.integers(lo, vocab_size, DECODE_CONTEXT).tolist(),
           "batch": rng.integers(lo, vocab_size, (spec["batch"], 32)).tolist()}
    n = spec.get("decode_context", DECODE_CONTEXT)  # longer: more ids after these (the other rows' ids stay)
    more = np.random.default_rng(1).integers(lo, vocab_size, max(n - DECODE_CONTEXT, 0)).tolist()
    ids["decode"] = (ids["decode"] + more)[:n]
    return ids


def _positions_needed(spec: Spec) -> int:
    """The longest sequence a round makes: the prefill prompt, the decode prompt and its steps, or a
    32-id batch prompt and its steps."""
    new = spec["new_tokens"]
    return max(spec["prompt_tokens"], spec.get("decode_context", DECODE_CONTEXT) + new, 32 + new)


def _rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS), or its peak (VmHWM), in MB (not ru_maxrss: the
    parent here has just held the bandwidth probe's array, and a child starts with its peak)."""
    mb = status_mb("self", field)
    assert mb is not None, f"/proc/self/status has no {field}"
    return mb


def _no_probe(phase: str, llm: "LLM") -> None:
    """The phase probe of a plain run: nothing."""


def _ours(spec: Spec, probe: Callable[[str, "LLM"], None] = _no_probe) -> dict[str, Any]:
    """Our side's round. `probe(phase, llm)` is called as each phase ends ("load", "prefill",
    "decode", "generate"): scripts/rss_phases.py samples memory there."""
    from scratchllm.engine.paged_attention import PagedSequence
    from scratchllm.llm import LLM
    from scratchllm.sampling import SamplingParams

    t = time.perf_counter()
    llm = LLM(spec["path"], threads=spec["threads"], kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
              dtype=spec.get("dtype", DEFAULT_DTYPE))
    out: dict[str, Any] = {"load_s": time.perf_counter() - t, "rss_after_load_mb": _rss_mb()}
    probe("load", llm)
    model: LoadedModel = llm.model
    kv_dtype = llm.engine.plan.kv_dtype
    out["kv_cache_dtype"] = kv_dtype
    out["dtype"] = llm.model.dtype
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    if "sequences" in spec:  # the n-sequence row alone: n prompts of 32 ids at once
        prompts = np.random.default_rng(2).integers(min(100, model.config.vocab_size // 2), model.config.vocab_size,
                                                    (spec["sequences"], peers_llama_cpp.SEQ_PROMPT)).tolist()
        t = time.perf_counter()
        done = llm.generate(prompts, params)
        out["tok_s"] = sum(len(r.token_ids) for r in done) / (time.perf_counter() - t)
        return out
    ids = workload(model.config.vocab_size, spec)
    prefill = np.array(ids["prefill"])
    for _ in range(2):  # the first warms caches and page tables
        cache = PagedSequence(model.config, len(prefill) + 1, kv_dtype=kv_dtype)
        t = time.perf_counter()
        model.forward(prefill, np.arange(len(prefill)), cache, logits_rows=[len(prefill) - 1])
        out["prefill_tok_s"] = len(prefill) / (time.perf_counter() - t)
    probe("prefill", llm)
    prompt = np.array(ids["decode"])
    cache = PagedSequence(model.config, len(prompt) + spec["new_tokens"] + 1, kv_dtype=kv_dtype)
    logits = model.forward(prompt, np.arange(len(prompt)), cache, logits_rows=[-1])
    greedy, gaps = [], []
    t = time.perf_counter()
    for _ in range(spec["new_tokens"]):
        token, gap = greedy_and_gap(logits[-1])
        greedy.append(token)
        gaps.append(gap)
        logits = model.forward(np.array(greedy[-1:]), np.array([cache.length]), cache)
    out["decode_tok_s"] = spec["new_tokens"] / (time.perf_counter() - t)
    out["top2_gap"] = gaps
    del cache, logits  # the decode run's KV cache is not the batched run's: its peak RSS counts what generating takes
    probe("decode", llm)
    t = time.perf_counter()
    done = llm.generate(ids["batch"], params)
    out["aggregate_tok_s"] = sum(len(r.token_ids) for r in done) / (time.perf_counter() - t)
    probe("generate", llm)
    out["weight_bytes_per_token"] = weight_bytes_per_token(model)
    return {**out, "greedy": greedy, "dtype": model.dtype, "panels_from_cache": model.panels_from_cache}


def _peer_open(spec: Spec, n_ctx: int) -> tuple[Any, float, float]:  # (llama_cpp.Llama, ...)
    """llama.cpp's model and context on spec's file and threads; (llm, load seconds, RSS after load)."""
    import llama_cpp

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["path"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_ctx=n_ctx, n_batch=512, verbose=False)
    return llm, time.perf_counter() - t, _rss_mb()


def _peer_steps(llm: Any, n: int, gaps: list[float] | None = None) -> list[int]:  # llm: llama_cpp.Llama
    """n greedy decode steps from llama.cpp's context as it is (top-2 gaps appended to gaps)."""
    import llama_cpp

    vocab, got = llm.n_vocab(), []
    for _ in range(n):
        # the last evaluated token's logits, read from llama.cpp's context: `Llama.scores` is
        # filled only with logits_all=True (which computes every position's logits) in 0.3.x
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        token, gap = greedy_and_gap(row)
        got.append(token)
        if gaps is not None:
            gaps.append(gap)
        llm.eval(got[-1:])
    return got


def _peer_batch(llm: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Aggregate tok/s of greedy generation over prompts, prefill included. llama-cpp-python's
    high-level API serves one sequence at a time, so they run in turn."""
    t = time.perf_counter()
    made = 0
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        made += len(_peer_steps(llm, new_tokens))
    return made / (time.perf_counter() - t)


def _peer(spec: Spec) -> dict[str, Any]:
    import llama_cpp

    if "batch_ids" in spec:  # the batch alone, on the caller's prompts (bench engine's chat batch)
        prompts = spec["batch_ids"]
        llm, load_s, rss = _peer_open(spec, max(map(len, prompts)) + spec["new_tokens"] + 8)
        return {"load_s": load_s, "rss_after_load_mb": rss, "version": llama_cpp.__version__,
                "aggregate_tok_s": _peer_batch(llm, prompts, spec["new_tokens"])}
    n_ctx = _positions_needed(spec) + 8
    llm, load_s, rss = _peer_open(spec, n_ctx)
    out: dict[str, Any] = {"load_s": load_s, "rss_after_load_mb": rss}
    ids = workload(llm.n_vocab(), spec)
    for _ in range(2):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids["prefill"])
        out["prefill_tok_s"] = len(ids["prefill"]) / (time.perf_counter() - t)
    llm.reset()
    llm.eval(ids["decode"])
    out["top2_gap"] = []
    t = time.perf_counter()
    greedy = _peer_steps(llm, spec["new_tokens"], out["top2_gap"])
    out["decode_tok_s"] = spec["new_tokens"] / (time.perf_counter() - t)
    out["aggregate_tok_s"] = _peer_batch(llm, ids["batch"], spec["new_tokens"])
    return {**out, "greedy": greedy, "version": llama_cpp.__version__}


def peer_batch(path: str, threads: int, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """llama.cpp on `prompts` (token ids) x new_tokens greedy, in a child process of its own:
    {"aggregate_tok_s", "load_s", "rss_after_load_mb", "peak_rss_mb", "version"}."""
    return run_side({"side": PEER, "path": path, "threads": threads, "new_tokens": new_tokens,
                     "batch_ids": [list(map(int, p)) for p in prompts]})


def greedy_and_gap(row: npt.NDArray[np.floating[Any]]) -> tuple[int, float]:
    """A logits row's greedy id and its best logit minus the second best (how close the choice
    was), read in place: the decode run keeps no rows (128 x the vocabulary is 25 MB, which
    would count in the peak RSS of either side)."""
    best = int(np.argmax(row))
    second = max(row[:best].max(initial=-np.inf), row[best + 1 :].max(initial=-np.inf))
    return best, float(row[best] - second)


def child_main() -> None:
    """Entry of a child process: argv[1] is the JSON spec; prints one JSON object."""
    spec = json.loads(sys.argv[1])
    out = (_ours if spec["side"] == "ours" else _peer)(spec)
    out["peak_rss_mb"] = _rss_mb("VmHWM")
    print(json.dumps(out))


def run_side(spec: Spec) -> dict[str, Any]:
    """One side's figures (spec['side'] is 'ours' or the peer), measured in a child process of its own."""
    code = "from scratchllm.bench.peers import child_main; child_main()"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        from scratchllm.errors import ConfigError

        raise ConfigError(f"the {spec['side']} side failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scratchllm.errors import ConfigError
    from scratchllm.formats import load_checkpoint
    from scratchllm.formats.refs import resolve_model

    require_at_least_one(args, "rounds", "threads", "prompt_tokens", "new_tokens", "decode_context", "batch",
                         "bandwidth_mb")
    sequences = _sequences(args.sequences)
    path = resolve_model(args.model)
    ckpt = load_checkpoint(path)
    if ckpt.format != "gguf":
        raise ConfigError(f"bench peers compares both sides on one GGUF file; {path} is {ckpt.format}")
    file_weight_bytes = sum(i.nbytes for i in ckpt.infos.values())
    spec: Spec
    spec = {"path": str(path), "threads": args.threads, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "decode_context": args.decode_context, "batch": args.batch,
            "kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype}
    context = ckpt.metadata.get(f"{ckpt.metadata.get('general.architecture')}.context_length")
    if context is not None and _positions_needed(spec) > context:
        raise ConfigError(f"the rows need {_positions_needed(spec)} positions (--prompt-tokens, --decode-context + "
                          f"--new-tokens, 32 + --new-tokens), more than the model's context of {context}")
    sides = ["ours", PEER] if peer_installed() else ["ours"]
    rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    bandwidth, loads = [], []
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            rounds[side].append(run_side({**spec, "side": side}))
            loads.append(os.getloadavg()[0])
        probe = measure_bandwidth(args.bandwidth_mb, 3)
        bandwidth.append(max(probe["sum_1thread"], probe["gemv_blas"]))
    bw = median(bandwidth)
    bytes_read = {"ours": rounds["ours"][0]["weight_bytes_per_token"], PEER: file_weight_bytes}
    figures = {side: {key: median([x[key] for x in runs]) for key, _, _ in ROWS} for side, runs in rounds.items()}
    for side in sides:
        figures[side]["bound_tok_s"] = bw / bytes_read[side]
        figures[side]["decode_vs_bound"] = figures[side]["decode_tok_s"] / figures[side]["bound_tok_s"]
        figures[side]["weight_mb_per_token"] = bytes_read[side] / 1e6
    result: dict[str, Any]
    result = {"bench": "peers", "peer_installed": PEER in sides,
              "inputs": {"model": args.model, "model_path": str(path), **{k: v for k, v in spec.items() if k != "path"},
                         "rounds": args.rounds, "ours_dtype": rounds["ours"][0]["dtype"]},
              "figures": figures, "bandwidth_gb_s": bw / 1e9,
              "rounds": rounds, "machine": {**machine_facts(), "loadavg_1min": loads}}
    if PEER in sides:
        result["advantage"] = {key: (figures["ours"][key] / figures[PEER][key] if higher
                                     else figures[PEER][key] / figures["ours"][key]) for key, _, higher in ROWS}
        a, b = rounds["ours"][0]["greedy"], rounds[PEER][0]["greedy"]
        agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        result["greedy_ids_agree_for"] = agree
        if agree < len(a):  # where they part: a near-tie if either side's two best logits were close there
            gaps = {side: rounds[side][0]["top2_gap"][agree] for side in sides}
            result["greedy_parting"] = {"step": agree, "ours_token": a[agree], "peer_token": b[agree],
                                        "top2_gap": gaps}
        result["inputs"]["peer_version"] = rounds[PEER][0]["version"]
    result["inputs"]["ours_kv_cache_dtype"] = rounds["ours"][0]["kv_cache_dtype"]
    result["inputs"]["ours_dtype"] = rounds["ours"][0].get("dtype")
    if peers_llama_cpp.available():
        result["llama_cpp_tools"] = measure_tools(spec, sequences, args.rounds, rounds["ours"])
    for section in SECTIONS:
        measured = section.measure(spec, args)
        if measured is not None:
            result.setdefault("sections", {})[section.name] = measured
    return result


def _sequences(text: str) -> list[int]:
    from scratchllm.errors import ConfigError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"--sequences takes counts >= 1 separated by commas (1,4,16), got {text!r}")
    return values


def measure_tools(spec: Spec, sequences: list[int], rounds: int, ours_rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows against llama.cpp's own programs (peers_llama_cpp.py), in interleaved rounds."""
    from scratchllm.bench import llama_tools

    def ours_batch(n: int) -> dict[str, Any]:
        return run_side({**spec, "side": "ours", "sequences": n})

    done = [peers_llama_cpp.measure_round(dict(spec), sequences, r % 2 == 1, ours_batch) for r in range(rounds)]
    return {"rows": peers_llama_cpp.summarize(done, ours_rounds, sequences), "rounds": done, "sequences": sequences,
            "build": llama_tools.build_info(), "tools_dir": str(llama_tools.tools_dir())}


# Further comparisons (see the module doc); each runs after the tables above.
SECTIONS: list[Section] = [spec_bench.PEERS_SECTION]


def render(r: dict[str, Any]) -> str:
    f = r["figures"]
    i = r["inputs"]
    lines = [f"model {i['model_path']}, {i['threads']} threads, medians of {i['rounds']} interleaved rounds; "
             f"ours in dtype {i['ours_dtype']}",
             f"memory read bandwidth {r['bandwidth_gb_s']:.1f} GB/s (median, measured between rounds)"]
    if not r["peer_installed"]:
        lines.append("llama-cpp-python is not installed (`make peers` builds it for this CPU): ours only, no peer "
                     "figures")
    else:
        lines.append(f"against {PEER_LABEL}: llama.cpp through its Python API, which serves one sequence at a time")
    lines += ["", f"{'row':<36}{'ours':>10}" + (f"{PEER_LABEL:>18}{'advantage':>11}" if r["peer_installed"] else "")]
    for key, label, _ in ROWS:
        line = f"{label:<36}{f['ours'][key]:>10.2f}"
        if r["peer_installed"]:
            line += f"{f[PEER][key]:>18.2f}{r['advantage'][key]:>10.2f}x"
        lines.append(line)
    lines.append(f"decode: {i['new_tokens']} steps after a {i.get('decode_context', DECODE_CONTEXT)}-token prompt")
    cached = sum(bool(x.get("panels_from_cache")) for x in r["rounds"]["ours"])
    lines.append(f"ours: panels mapped from the panel cache in {cached} of {len(r['rounds']['ours'])} rounds "
                 "(the others packed them from the file's blocks)")
    for side in f:
        lines.append(f"{side}: {f[side]['weight_mb_per_token']:.0f} MB of weights per decode token -> bound "
                     f"{f[side]['bound_tok_s']:.0f} tok/s; decode reaches {f[side]['decode_vs_bound']:.0%} of it")
    if r["peer_installed"]:
        lines.append(f"greedy ids agree for the first {r['greedy_ids_agree_for']} of {i['new_tokens']} decode steps "
                     f"(llama-cpp-python {i['peer_version']}); advantage > 1: ours ahead")
        if r.get("greedy_parting"):
            g = r["greedy_parting"]
            lines.append(f"  they part at step {g['step']} (ours {g['ours_token']}, {PEER} {g['peer_token']}), "
                         f"where the two best logits were {g['top2_gap']['ours']:.3g} apart for ours and "
                         f"{g['top2_gap'][PEER]:.3g} for {PEER}: a near-tie if small beside the logits' spread")
    lines.append(f"ours: weights {i.get('ours_dtype', '?')}, KV cache {i.get('ours_kv_cache_dtype', '?')}")
    if "llama_cpp_tools" in r:
        lines += peers_llama_cpp.render(r["llama_cpp_tools"], i)
    else:
        lines.append("llama.cpp's own programs are not built (`make peers` builds llama-bench and "
                     "llama-batched-bench): no rows against its batching")
    for section in SECTIONS:
        if section.name in r.get("sections", {}):
            lines += section.render(r["sections"][section.name], i)
    loads = r["machine"]["loadavg_1min"]
    lines.append(f"machine: {r['machine']['cpu']}, load average {min(loads):.1f}-{max(loads):.1f} during the rounds")
    return "\n".join(lines)
