"""The report of `scratchllm bench engine` (bench/engine.py runs it): the result's tables as text.
Everything printed is read from the result itself, the published figures and the goals included."""

from collections.abc import Callable
from typing import Any


def render(r: dict[str, Any]) -> str:
    f, inp = r["figures"], r["inputs"]
    threads = inp.get("threads") or "default"
    out = [f"model {inp['model']} (loaded in {r['load_s']:.1f} s), threads {threads}; single runs, "
           "on a possibly shared machine"]
    if "continuous" in f:
        out += _mixed(r)
    if "latency" in f:
        out += _latency(r)
    if "decode" in f:
        out += _decode(r)
    if "policies" in f:
        out += _policies(f["policies"])
    if "chat" in f:
        out += _chat(r)
    return "\n".join(out)


Runs = tuple[dict[str, Any] | None, ...]  # the mixed workload's: static, same seqs, same KV, small KV
WIDTHS = (11, 12, 12, 12)


def _cells(runs: Runs, key: str, show: Callable[[Any], str]) -> str:
    """One figure of every run, aligned under the header ("-" for a run that did not happen)."""
    return "".join(f"{show(run[key]) if run else '-':>{w}}" for run, w in zip(runs, WIDTHS, strict=True))


def _mixed(r: dict[str, Any]) -> list[str]:
    f, inp, ra, pub = r["figures"], r["inputs"], r["ratios"], r["published"]
    s, a, c, small = f.get("static"), f.get("continuous_same_seqs"), f["continuous"], f.get("continuous_small_kv")
    runs = (s, a, c, small)

    def row(name: str, key: str, fmt: str, ratio: str | None = None, goal: str = "", published: str = "") -> str:
        rv = f"{ra[ratio]:.2f}x" if ratio and ratio in ra else ""
        return f"{name:<16}{_cells(runs, key, lambda v: format(v, fmt))}{rv:>8}   {goal:<9}{published}"

    when = f"Poisson arrivals at {inp['rate']:g}/s" if inp.get("rate") else "all at t=0"
    frac, cap = f"{inp.get('kv_fraction', 0):g} x KV", f"<= {inp['max_seqs']} seq"
    kv = _saving(ra["kv_saving"]) if "kv_saving" in ra else ""
    pool = ({"kv_pool_bytes": s["peak_kv_bytes"]} if s else None, a, c, small)  # static's pool: its reservation
    return [
        f"\n1. mixed workload: {inp['requests']} requests, prompt {inp['prompt_len']}, output "
        f"{inp['output_len']} tokens, seed {inp['seed']}, {when}, weights {inp.get('dtype', 'float32')}",
        f"{'':<16}{'static':>11}{'continuous':>12}{'continuous':>12}{'continuous':>12}{'ratio':>8}"
        f"   goal     published (A10G)",
        f"{'':<16}{inp['batch_size']:>7} seq{inp['batch_size']:>8} seq{'same KV':>12}{frac:>12}",
        f"{'':<16}{'':>11}{'':>12}{cap:>12}{cap:>12}",
        row("output tok/s", "output_tok_s", ".1f", "throughput_continuous_over_static", ">= 2x",
            _published_qps(pub)),
        row("requests/s", "requests_per_s", ".2f"),
        row("p50 latency ms", "p50_ms", ".0f", "p50_static_over_continuous"),
        row("p99 latency ms", "p99_ms", ".0f", "p99_static_over_continuous",
            ">= 3x" if inp.get("rate") else "(below)", _published_p99(pub)),
        f"{'peak KV':<16}{_cells(runs, 'peak_kv_bytes', _bytes)}{kv:>8}   {'>= 50%':<9}-37%  (ratio: same "
        "concurrency)",
        f"{'KV pool':<16}{_cells(pool, 'kv_pool_bytes', _bytes)}",
        f"{'preemptions':<16}{_cells((None, a, c, small), 'preemptions', str)}",  # static never preempts
        f"{'wall s':<16}{_cells(runs, 'wall_s', lambda v: f'{v:.1f}')}",
        *_mixed_notes(runs, ra, kv, f.get("identical_outputs", "-")),
    ]


def _mixed_notes(runs: Runs, ra: dict[str, float], kv: str, identical: str) -> list[str]:
    s, a, c, small = runs
    assert c is not None
    out = []
    if a and s:
        out.append(f"same concurrency: {ra['throughput_same_seqs_over_static']:.2f}x throughput, p99 "
                   f"{ra['p99_static_over_same_seqs']:.2f}x lower, peak KV {kv}; ratios in the table: same KV "
                   f"memory")
    if small and s:
        out.append(f"in {ra['kv_pool_small_over_static'] * 100:.0f}% of static's KV memory: "
                   f"{ra['throughput_small_kv_over_static']:.2f}x static's throughput, p99 "
                   f"{ra['p99_static_over_small_kv']:.2f}x lower (the KV goal, read as the memory a server "
                   f"must set aside: met if >= 1x at <= 50%)")
    extra = f"; static computed {s['padded_tokens']} padding tokens" if s else ""
    out.append(f"continuous (same KV): {c['steps']} steps{extra}; identical greedy outputs in every run: {identical}")
    return out


def _latency(r: dict[str, Any]) -> list[str]:
    lat, ra = r["figures"]["latency"], r["ratios"]
    st, co = lat["static"], lat["continuous"]

    def row(name: str, key: str, ratio: str, goal: str = "", published: str = "") -> str:
        return f"{name:<16}{st[key]:>11.0f}{co[key]:>12.0f}{ra[ratio]:>7.2f}x   {goal:<9}{published}"

    return [f"\nlatency under load: the first {lat['requests']} requests, Poisson arrivals at "
            f"{lat['rate']:.3f}/s = {lat['load']:g} x static's offline requests/s; identical outputs: "
            f"{lat['identical_outputs']}",
            f"{'':<16}{'static':>11}{'continuous':>12}{'ratio':>8}   goal     published (A10G)",
            row("p50 latency ms", "p50_ms", "p50_under_load_static_over_continuous"),
            row("p99 latency ms", "p99_ms", "p99_under_load_static_over_continuous", ">= 3x",
                _published_p99(r["published"])),
            f"{'peak KV':<16}{_bytes(st['peak_kv_bytes']):>11}{_bytes(co['peak_kv_bytes']):>12}"
            f"{_saving(ra['kv_saving_under_load']):>8}"]


def _decode(r: dict[str, Any]) -> list[str]:
    d, ra = r["figures"]["decode"], r["ratios"]
    return [f"\n2. batched decode ({d['prompt_tokens']}-token prompts, median of {d['steps']} steps): "
            f"1 stream {d['single_tok_s']:.1f} tok/s, {d['sequences']} streams {d['batched_tok_s']:.1f} "
            f"tok/s = {ra['decode_batched_over_single']:.1f}x (goal >= {r['goals']['decode_scaling']:.0f}x)"]


def _policies(policies: dict[str, dict[str, Any]]) -> list[str]:
    out = ["\nadmission policies (continuous, same KV memory): offline all at t=0, and under load",
           f"{'':<16}" + "".join(f"{name:>14}" for name in policies)]
    for key, name in (("output_tok_s", "output tok/s"), ("p50_ms", "p50 latency ms"), ("p99_ms", "p99 latency ms"),
                      ("short_p99_ms", "p99 short reqs"), ("load_p99_ms", "p99 under load"),
                      ("load_short_p99_ms", "p99 short, load")):
        out.append(f"{name:<16}" + "".join(f"{_fmt(run.get(key)):>14}" for run in policies.values()))
    out.append("short requests: max_tokens < 256 (the priority policy's high queue)")
    return out


def _chat(r: dict[str, Any]) -> list[str]:
    a, peer, ra = r["figures"]["chat"], r.get("peer"), r["ratios"]
    line = (f"\n3. chat batch: 16 chat prompts ({min(a['prompt_tokens'])}-{max(a['prompt_tokens'])} tokens) x "
            f"{a['new_tokens']} new, prefill included: {a['aggregate_tok_s']:.0f} tok/s")
    if peer:
        line += (f"; llama.cpp {peer['chat_aggregate_tok_s']:.0f} tok/s on the same ids (measured here, now: "
                 f"llama-cpp-python {peer['version']}, {peer['threads']} threads, one sequence at a time, median "
                 f"of {peer['child_runs']} child runs) = {ra['chat_over_llama_cpp']:.2f}x "
                 f"(goal >= {r['goals']['chat_over_llama_cpp']:.0f}x)")
    else:
        line += ("; llama.cpp not measured (--peer llama.cpp measures it here, now; `scratchllm bench peers` "
                 "compares more rows)")
    return [line]


def _bytes(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _saving(fraction: float) -> str:
    """A KV saving as a change: 0.59 -> "-59%", -0.16 (more memory) -> "+16%"."""
    return f"{-fraction * 100:+.0f}%"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _published_qps(pub: dict[str, Any]) -> str:
    c, s = pub["continuous"]["qps"], pub["static"]["qps"]
    return f"{c:.0f} vs {s:.0f} QPS = {c / s:.2f}x"


def _published_p99(pub: dict[str, Any]) -> str:
    return (f"{pub['continuous']['p99_ms']:.0f} vs {pub['static']['p99_ms']:.0f} ms = "
            f"{pub['static']['p99_ms'] / pub['continuous']['p99_ms']:.2f}x")
