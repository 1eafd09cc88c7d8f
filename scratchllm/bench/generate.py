"""Prefill and single-stream decode speed of a model, beside the physical bound measured in the same run.

Decode at batch 1 reads every weight once per token, so it can go no faster than
    memory read bandwidth / bytes of weights read per token.
Bandwidth is measured here, now, two ways: np.sum over a large array (one thread) and a BLAS
matrix-vector product over the same bytes (BLAS's threads, the way decode reads weights); the
bound uses the faster. `--peer llama.cpp` also runs llama.cpp (llama-cpp-python, built for this
CPU by `make peers`) on the same GGUF file, prompt length and thread count, in child processes
before and after ours: its figures are measured here, now (`scratchllm bench peers` compares
more rows, in interleaved rounds). No figure from another machine is printed. Where the time
goes: a decode step split into weight matmuls, attention, the other array kernels and Python
(scratchllm/bench/step_profile.py).

Each figure is measured at every BLAS thread count in --threads (default: 1 and one per core),
because on a machine shared with other jobs a second BLAS thread can make decode several times
slower, not faster (see scratchllm/models/threads.py); the headline is the best count.
"""

import argparse
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from scratchllm.bench import peers
from scratchllm.bench.common import (
    LoadedModel,
    machine_facts,
    measure_bandwidth,
    median,
    status_mb,
    weight_bytes_per_token,
)
from scratchllm.dtypes import DTYPE_HELP, DTYPES

if TYPE_CHECKING:
    from scratchllm.models.loader import FamilyModel

PEER_ROWS = ("load_s", "rss_after_load_mb", "prefill_tok_s", "decode_tok_s")  # what both sides measure
GOALS = {"decode_fraction_of_bound": 0.5, "load_s": 1.0, "decode_over_peer": 1.25, "prefill_over_peer": 1.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model reference (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    parser.add_argument("--prompt-tokens", type=int, default=500, help="prefill length (default 500)")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode length (default 128)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each figure; medians are reported")
    parser.add_argument("--bandwidth-mb", type=int, default=1024, help="array size for the bandwidth probe")
    parser.add_argument("--threads", default=None,
                        help="comma-separated BLAS thread counts to measure (default: 1 and one per core)")
    parser.add_argument("--sequences", type=int, default=16,
                        help="also split an engine step of this many sequences decoding at once into its parts "
                             "(default 16; 1 skips it)")
    parser.add_argument("--compare", default="quantized",
                        help="a second dtype measured beside --dtype, interleaved, on the same weights (default "
                             "quantized: the exact path beside the default integer products; `none` skips it; "
                             "only where the two differ)")
    parser.add_argument("--peer", choices=["llama.cpp"], default=None,
                        help="also measure llama.cpp (llama-cpp-python; `make peers` builds it) on the same GGUF "
                             "file, at the most threads measured, in child processes before and after ours")


def _prompt_ids(model: LoadedModel, n: int) -> npt.NDArray[np.int64]:
    # content does not change the arithmetic; fixed ids keep runs comparable
    return np.random.default_rng(0).integers(min(100, model.config.vocab_size // 2), model.config.vocab_size, n)


def time_prefill(model: LoadedModel, n: int, repeat: int, slow_after: float | None = None) -> list[float]:
    from scratchllm.engine.paged_attention import PagedSequence

    ids, pos = _prompt_ids(model, n), np.arange(n)
    times = []
    for _ in range(repeat + 1):  # the first run warms caches and page tables; dropped
        cache = PagedSequence(model.config, n + 1)
        t = time.perf_counter()
        model.forward(ids, pos, cache, logits_rows=[n - 1])
        times.append(time.perf_counter() - t)
        if slow_after and len(times) > 1 and times[-1] > slow_after:
            break  # far slower than another thread count already measured: one run tells enough
    return times[1:]


def time_decode(model: LoadedModel, new_tokens: int, repeat: int, prompt_len: int = 16,
                slow_after: float | None = None) -> tuple[list[float], list[float]]:
    """Wall seconds and this thread's CPU seconds for `new_tokens` greedy decode steps after a
    short prompt (prefill not included). With one BLAS thread all work runs on this thread, so
    its CPU time is what the run would take with a core to itself (memory stalls included)."""
    from scratchllm.engine.paged_attention import PagedSequence

    times, cpu = [], []
    for _ in range(repeat):
        cache = PagedSequence(model.config, prompt_len + new_tokens + 1)
        logits = model.forward(_prompt_ids(model, prompt_len), np.arange(prompt_len), cache, logits_rows=[-1])
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(new_tokens):
            token = int(np.argmax(logits[-1]))
            logits = model.forward(np.array([token]), np.array([cache.length]), cache)
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        if slow_after and times[-1] > slow_after:
            break
    return times, cpu


def time_matmuls_only(model: LoadedModel, repeat: int) -> float:
    """This thread's CPU seconds per decode step spent in the weight matrix products alone (same
    shapes, batch 1), best of many runs. Meaningful with one BLAS thread, where all work is ours."""
    from scratchllm.models.llama_params import LlamaParams
    from scratchllm.models.packed import PackedWeight

    params = model.params
    assert isinstance(params, LlamaParams), "a Llama-family model's matrices"
    mats = [a for layer in params.layers for a in layer.matrices().values() if isinstance(a, PackedWeight)]
    mats += [params.lm_head] if isinstance(params.lm_head, PackedWeight) else []
    x = {n: np.ones((1, n), dtype=np.float32) for n in {m.shape[0] for m in mats}}  # matrices are [in, out]
    cpu = []
    for _ in range(repeat * 5):
        c = time.thread_time()
        for m in mats:
            x[m.shape[0]] @ m
        cpu.append(time.thread_time() - c)
    return min(cpu)


def compare_dtypes(model: LoadedModel, other: LoadedModel, args: argparse.Namespace, threads: int,
                   bound: float) -> dict[str, Any]:
    """model and other (the same file in two dtypes) timed in turns, model first, at `threads`:
    decode and prefill tok/s of each (medians) and the medians of the paired ratios model / other."""
    from scratchllm.models.threads import blas_threads

    runs: dict[str, dict[str, list[float]]] = {"model": {"decode": [], "prefill": []},
                                               "other": {"decode": [], "prefill": []}}
    with blas_threads(threads):
        for _ in range(args.repeat):
            for side, m in (("model", model), ("other", other)):
                runs[side]["decode"].append(args.new_tokens / time_decode(m, args.new_tokens, 1)[0][0])
                runs[side]["prefill"].append(args.prompt_tokens / time_prefill(m, args.prompt_tokens, 1)[0])
    out: dict[str, Any] = {"dtype": other.dtype, "threads": threads, "rounds": args.repeat}
    for row in ("decode", "prefill"):
        for side in ("model", "other"):
            out[f"{side}_{row}_tok_s"] = median(runs[side][row])
        out[f"{row}_ratio"] = median([a / b for a, b in zip(runs["model"][row], runs["other"][row], strict=True)])
    out["model_decode_vs_bound"] = out["model_decode_tok_s"] / bound
    out["other_decode_vs_bound"] = out["other_decode_tok_s"] / bound
    return out


def rss_mb() -> float | None:
    """Resident memory of this process (Linux /proc), MB."""
    return status_mb("self", "VmRSS")


def _model_sha256(path: str | os.PathLike[str]) -> str | None:
    """Every run records the model's hash (of the file, or of a folder's weight files)."""
    import hashlib
    from pathlib import Path

    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.suffix in (".safetensors", ".bin",
                                                                                        ".gguf", ".json"))
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            digest.update(hashlib.file_digest(fh, "sha256").digest())
    return digest.hexdigest()


def _thread_counts(spec: str | None) -> list[int]:
    if spec:
        return sorted({int(t) for t in str(spec).split(",")})
    return sorted({1, os.cpu_count() or 1})


def _peer_runs(args: argparse.Namespace, path: str, threads: int) -> dict[str, Any]:
    """The peer's figures, medians of a child process before ours and one after (see bench.peers)."""
    spec: peers.Spec
    spec = {"side": peers.PEER, "path": path, "threads": threads, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "batch": 1}
    runs = [peers.run_side(spec) for _ in range(2)]
    return {key: median([r[key] for r in runs]) for key in PEER_ROWS} | {"version": runs[0]["version"],
                                                                         "runs": len(runs), "threads": threads}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scratchllm.models import load_model
    from scratchllm.models.bert import BertModel
    from scratchllm.models.threads import blas_threads

    if args.peer:
        from scratchllm.errors import ConfigError

        if not peers.peer_installed():
            raise ConfigError("--peer llama.cpp needs llama-cpp-python, which is not installed: `make peers` builds "
                              "it from source for this CPU")
    load_times = []
    loaded: FamilyModel | None
    for _ in range(args.repeat):
        loaded = None  # the previous copy is freed before the next load, so RSS counts one model
        t = time.perf_counter()
        loaded = load_model(args.model, dtype=args.dtype)
        load_times.append(time.perf_counter() - t)
    assert loaded is not None  # the last load
    rss_after_load = rss_mb()
    if not loaded.config.is_decoder:
        from scratchllm.errors import ConfigError

        raise ConfigError(f"{args.model} is an encoder; bench generate needs a decoder")
    assert not isinstance(loaded, BertModel), "BERT is the one encoder family"
    model: LoadedModel = loaded
    bytes_per_token = weight_bytes_per_token(model)
    if args.peer and model.format != "gguf":
        from scratchllm.errors import ConfigError

        raise ConfigError(f"--peer llama.cpp runs on a GGUF file; {model.path} is {model.format}")
    peer_before = _peer_runs(args, model.path, max(_thread_counts(args.threads))) if args.peer else None
    per_threads: dict[int, dict[str, Any]]
    bandwidth: dict[str, float]
    cpu_view: dict[str, float] | None
    per_threads, bandwidth, cpu_view = {}, {}, None
    for n in _thread_counts(args.threads):
        with blas_threads(n) as actual:
            bw = measure_bandwidth(args.bandwidth_mb, args.repeat)
            bandwidth["sum_1thread"] = max(bandwidth.get("sum_1thread", 0.0), bw["sum_1thread"])
            bandwidth[f"gemv_{n}threads"] = bw["gemv_blas"]
            # a thread count 3x slower than the best so far (other jobs on the cores) gets one run
            limit = {k: 3 * min(r[k] for r in per_threads.values()) if per_threads else None
                     for k in ("prefill_s", "decode_s")}
            prefill = time_prefill(model, args.prompt_tokens, args.repeat, slow_after=limit["prefill_s"])
            decode, decode_cpu = time_decode(model, args.new_tokens, args.repeat, slow_after=limit["decode_s"])
            if actual == 1:
                cpu_view = {"decode_tok_s": args.new_tokens / median(decode_cpu),
                            "bandwidth_gb_s": bw["sum_1thread_cpu"] / 1e9,
                            "bound_tok_s": bw["sum_1thread_cpu"] / bytes_per_token}
                cpu_view["decode_vs_bound"] = cpu_view["decode_tok_s"] / cpu_view["bound_tok_s"]
                # where a step's time goes: weight matmuls alone vs the whole step
                cpu_view["step_ms"] = 1e3 * min(decode_cpu) / args.new_tokens  # best vs best
                cpu_view["matmul_ms"] = 1e3 * time_matmuls_only(model, args.repeat)
                cpu_view["other_ms"] = cpu_view["step_ms"] - cpu_view["matmul_ms"]
            per_threads[n] = {
                "blas_threads": actual,
                "runs": {"prefill": len(prefill), "decode": len(decode)},
                "prefill_s": median(prefill),
                "decode_s": median(decode),
                "prefill_tok_s": args.prompt_tokens / median(prefill),
                "decode_tok_s": args.new_tokens / median(decode),
                "decode_tok_s_best_run": args.new_tokens / min(decode),
                "decode_step_ms_best_run": 1e3 * min(decode) / args.new_tokens,
            }
    from scratchllm.bench.step_profile import batched_breakdown, step_breakdown

    with blas_threads(max(per_threads)):
        breakdown = step_breakdown(model)
        sequences = getattr(args, "sequences", 16)
        batched = batched_breakdown(model, sequences) if sequences > 1 else None
    bound = max(bandwidth.values()) / bytes_per_token
    best_decode = max(per_threads, key=lambda n: per_threads[n]["decode_tok_s"])
    best_prefill = max(per_threads, key=lambda n: per_threads[n]["prefill_tok_s"])
    figures = {
        "load_s": median(load_times),
        "rss_after_load_mb": rss_after_load,
        "prefill_tok_s": per_threads[best_prefill]["prefill_tok_s"],
        "decode_tok_s": per_threads[best_decode]["decode_tok_s"],
        "best_threads": {"prefill": best_prefill, "decode": best_decode},
        "bandwidth_gb_s": {k: v / 1e9 for k, v in bandwidth.items()},
        "weight_mb_per_token": bytes_per_token / 1e6,
        "bound_tok_s": bound,
        "by_threads": per_threads,
        # one BLAS thread, timed by its own CPU time: the figures with a core to ourselves
        "one_thread_cpu_time": cpu_view,
        "decode_step_ms": breakdown,  # matmuls / attention / rest / python, at the most threads measured
        "batched_step_ms": batched,  # the same of an engine step of --sequences sequences decoding
    }
    ratios = {"decode_vs_bound": figures["decode_tok_s"] / bound}
    figures["compare"] = None
    compare, mine = getattr(args, "compare", None), getattr(model, "dtype", args.dtype)
    if compare not in (None, "none", mine) and mine in ("quantized", "int8", "int16"):  # a file's quantized blocks
        other = load_model(args.model, dtype=compare)
        assert not isinstance(other, BertModel), "the same file as the decoder measured above"
        if other.dtype != mine:
            figures["compare"] = compare_dtypes(model, other, args, max(per_threads), bound)
        del other
    peer = None
    if peer_before is not None:
        after = _peer_runs(args, model.path, peer_before["threads"])
        peer = {k: median([peer_before[k], after[k]]) for k in PEER_ROWS}
        peer |= {"name": args.peer, "version": after["version"], "threads": after["threads"], "child_runs": 4}
        for key in PEER_ROWS:  # > 1: ours ahead (throughputs ours / peer, times and memory peer / ours)
            ahead = figures[key] / peer[key] if key.endswith("tok_s") else peer[key] / figures[key]
            ratios[f"{key}_vs_{args.peer}"] = ahead
    goals_met = {  # each judged on figures measured in this run; the peer's only when it was measured
        "decode >= 50% of bound": ratios["decode_vs_bound"] >= GOALS["decode_fraction_of_bound"],
        "load < 1 s": figures["load_s"] < GOALS["load_s"],
    }
    if peer is not None:
        goals_met |= {
            f"decode >= {GOALS['decode_over_peer']}x {args.peer}":
                ratios[f"decode_tok_s_vs_{args.peer}"] >= GOALS["decode_over_peer"],
            f"prefill >= {GOALS['prefill_over_peer']}x {args.peer}":
                ratios[f"prefill_tok_s_vs_{args.peer}"] >= GOALS["prefill_over_peer"],
        }
    return {
        "bench": "generate",
        "inputs": {"model": args.model, "model_path": model.path, "model_sha256": _model_sha256(model.path),
                   "scratchllm": __import__("scratchllm").__version__, "config": model.config.__dict__,
                   "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeat": args.repeat,
                   "bandwidth_mb": args.bandwidth_mb, "threads": list(per_threads), "dtype": args.dtype,
                   "weights_dtype": getattr(model, "dtype", args.dtype)},  # what "auto" resolved to
        "figures": figures,
        "ratios": ratios,
        "goals_met": goals_met,
        "peer": peer,  # measured here, now; None without --peer
        "machine": {**machine_facts(), "loadavg_1min": os.getloadavg()[0]},
    }


def render(r: dict[str, Any]) -> str:
    f, q, peer = r["figures"], r["ratios"], r.get("peer")
    bw = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in f["bandwidth_gb_s"].items())
    lines = [
        f"model {r['inputs']['model']} ({r['inputs']['config']['model_type']}, "
        f"{r['inputs'].get('weights_dtype', r['inputs'].get('dtype', 'float32'))} "
        "weights), "
        f"medians of {r['inputs']['repeat']} runs",
        f"memory read bandwidth, GB/s: {bw}",
        f"weights read per decoded token {f['weight_mb_per_token']:.0f} MB -> bound {f['bound_tok_s']:.1f} tok/s",
        "",
    ]
    labels = {"load_s": "load, s", "rss_after_load_mb": "RSS after load, MB",
              "prefill_tok_s": f"prefill {r['inputs']['prompt_tokens']} tokens, tok/s",
              "decode_tok_s": f"decode {r['inputs']['new_tokens']} tokens, tok/s"}
    if peer:
        lines.append(f"{'figure':<34}{'ours':>10}{peer['name']:>12}{'advantage':>11}   (the peer measured here, "
                     f"now, {peer['threads']} threads, llama-cpp-python {peer['version']})")
    for key, label in labels.items():
        row = f"{label:<34}{f[key] or float('nan'):>10.2f}"
        if peer:
            row += f"{peer[key]:>12.2f}{q[key + '_vs_' + peer['name']]:>10.2f}x"
        lines.append(row)
    lines.append(f"decode vs bound: {q['decode_vs_bound']:.0%}" + (
        "" if peer else "   (llama.cpp not measured: --peer llama.cpp, or `scratchllm bench peers`, "
                        "measures it here, now)"))
    c = f.get("compare")
    if c:
        mine = r["inputs"].get("weights_dtype", r["inputs"]["dtype"])
        lines.append(f"{mine} beside {c['dtype']}, {c['rounds']} rounds in turns at {c['threads']} threads: decode "
                     f"{c['model_decode_tok_s']:.1f} vs {c['other_decode_tok_s']:.1f} tok/s "
                     f"({c['decode_ratio']:.2f}x; "
                     f"{c['model_decode_vs_bound']:.0%} vs {c['other_decode_vs_bound']:.0%} of the bound), prefill "
                     f"{c['model_prefill_tok_s']:.1f} vs {c['other_prefill_tok_s']:.1f} tok/s "
                     f"({c['prefill_ratio']:.2f}x)")
    if f.get("decode_step_ms"):
        from scratchllm.bench.step_profile import render_breakdown

        lines.append(render_breakdown(f["decode_step_ms"]))
    if f.get("batched_step_ms"):
        from scratchllm.bench.step_profile import render_batched

        lines.append(render_batched(f["batched_step_ms"]))
    for n, t in f["by_threads"].items():
        lines.append(f"BLAS threads {n}: prefill {t['prefill_tok_s']:.1f} tok/s, decode {t['decode_tok_s']:.1f} tok/s "
                     f"(best run {t['decode_tok_s_best_run']:.1f})")
    if f.get("one_thread_cpu_time"):
        c = f["one_thread_cpu_time"]
        lines.append(f"1 BLAS thread timed by its own CPU time (as with a core to itself): "
                     f"decode {c['decode_tok_s']:.1f} tok/s vs bound {c['bound_tok_s']:.1f} "
                     f"(np.sum {c['bandwidth_gb_s']:.1f} GB/s) = {c['decode_vs_bound']:.0%}; a step takes "
                     f"{c['step_ms']:.1f} ms = weight matmuls {c['matmul_ms']:.1f} + everything else "
                     f"{c['other_ms']:.1f} (norms, RoPE, attention, NumPy call overhead)")
    lines += [
        "goals: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in r["goals_met"].items()),
        f"machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, "
        f"load average {r['machine']['loadavg_1min']:.1f} (other jobs on the cores make every figure noisy)",
    ]
    return "\n".join(lines)
