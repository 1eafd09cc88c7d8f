"""`scratchllm bench load`: open the default model and dequantize every tensor to float32.

Ours (scratchllm.formats: header parse, then vectorized NumPy dequantization of the mmap'd blocks
into one page-aligned arena; also shown: plain per-tensor lookups) beside
the gguf package's reader (GGUFReader + gguf.quants.dequantize), measured in the same run, same
file, same page cache. Medians of --repeat runs after one warm-up; the ratio is gguf / ours
(> 1: ours is faster). The gguf package is a test-time reference: it is imported only here,
and the benchmark reports it as missing rather than failing when it is not installed.
"""

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from scratchllm.bench.common import machine_facts, median
from scratchllm.formats import load_checkpoint
from scratchllm.formats.arena import load_arena
from scratchllm.formats.refs import resolve_model


class Timing(TypedDict):
    """One reader's figures: medians of the timed runs."""

    open_s: float  # parsing the header
    dequantize_s: float  # every tensor to float32
    total_s: float
    runs_total_s: list[float]  # each run's total
    elements: int  # elements produced (every run the same)
    float32_GB_per_s: NotRequired[float]  # dequantized output per second (ours, when gguf ran too)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="a GGUF file or 'default' (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per implementation (default: 5)")


def ours(path: Path) -> tuple[float, float, int]:
    """(seconds to parse the header, seconds to dequantize every tensor into one arena, elements)."""
    start = time.perf_counter()
    ckpt = load_checkpoint(path)
    opened = time.perf_counter()
    arrays, _ = load_arena(ckpt)
    done = time.perf_counter()
    return opened - start, done - opened, sum(a.size for a in arrays.values())


def ours_lookups(path: Path) -> tuple[float, float, int]:
    """The same through plain `ckpt[name]` lookups: one fresh array per tensor."""
    start = time.perf_counter()
    ckpt = load_checkpoint(path)
    opened = time.perf_counter()
    arrays = [ckpt[name] for name in ckpt]  # kept alive: the cost of materializing all of them
    done = time.perf_counter()
    return opened - start, done - opened, sum(a.size for a in arrays)


def reference(path: Path) -> tuple[float, float, int]:
    import gguf

    start = time.perf_counter()
    reader = gguf.GGUFReader(path)
    opened = time.perf_counter()
    arrays = [gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors]
    done = time.perf_counter()
    return opened - start, done - opened, sum(a.size for a in arrays)


def timed(fn: Callable[[Path], tuple[float, float, int]], path: Path, repeat: int) -> Timing:
    fn(path)  # warm-up: page cache, imports
    runs = [fn(path) for _ in range(repeat)]
    elements = {r[2] for r in runs}
    assert len(elements) == 1, "the element count must not change between runs"
    return {
        "open_s": median(r[0] for r in runs),
        "dequantize_s": median(r[1] for r in runs),
        "total_s": median(r[0] + r[1] for r in runs),
        "runs_total_s": [round(r[0] + r[1], 4) for r in runs],
        "elements": elements.pop(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    path = resolve_model(args.model)
    ckpt = load_checkpoint(path)
    if ckpt.format != "gguf":
        from scratchllm.errors import ConfigError

        raise ConfigError(f"bench load compares GGUF readers; {path} is {ckpt.format}")
    o, lookups = timed(ours, path, args.repeat), timed(ours_lookups, path, args.repeat)
    figures: dict[str, Timing | None] = {"ours": o, "ours_lookups": lookups}
    ratios: dict[str, float | None] = {}
    result: dict[str, Any] = {
        "bench": "load",
        "inputs": {"model": str(path), "file_bytes": path.stat().st_size, "tensors": len(ckpt),
                   "repeat": args.repeat, "types": sorted({i.dtype for i in ckpt.infos.values()})},
        "figures": figures,
        "ratios": ratios,
        "machine": machine_facts(),
    }
    try:
        import gguf  # noqa: F401
    except ImportError:
        figures["gguf"] = None
        ratios["gguf_over_ours"] = None
        return result
    ref = timed(reference, path, max(1, min(args.repeat, 3)))  # it is slow; 3 runs give a median
    figures["gguf"] = ref
    assert o["elements"] == ref["elements"], "both must produce every element of every tensor"
    result["ratios"] = {
        "gguf_over_ours": ref["total_s"] / o["total_s"],
        "open_gguf_over_ours": ref["open_s"] / o["open_s"],
        "dequantize_gguf_over_ours": ref["dequantize_s"] / o["dequantize_s"],
        "gguf_over_ours_lookups": ref["total_s"] / lookups["total_s"],
    }
    o["float32_GB_per_s"] = o["elements"] * 4 / o["dequantize_s"] / 1e9
    return result


def row(label: str, f: Timing) -> str:
    return f"  {label:<22} {f['open_s']:>10.3f} {f['dequantize_s']:>15.3f} {f['total_s']:>10.3f}"


def render(r: dict[str, Any]) -> str:
    inp, o, g = r["inputs"], r["figures"]["ours"], r["figures"]["gguf"]
    lines = [f"load + dequantize every tensor to float32: {inp['model']}",
             f"  {inp['tensors']} tensors ({', '.join(inp['types'])}), {inp['file_bytes'] / 1e6:.1f} MB file, "
             f"{o['elements'] / 1e6:.1f} M elements; medians of {inp['repeat']} runs (machine shared: noisy)",
             "",
             f"  {'':<22} {'open (s)':>10} {'dequantize (s)':>15} {'total (s)':>10}",
             row("scratchllm (arena)", o), row("scratchllm (lookups)", r["figures"]["ours_lookups"])]
    if g is None:
        lines.append("  gguf package not installed: no reference measured (pip install gguf)")
    else:
        lines.append(row("gguf (GGUFReader)", g))
        ratio = r["ratios"]["gguf_over_ours"]
        lines += ["", f"  ratio gguf / ours: {ratio:.2f}x ({'ours faster' if ratio >= 1 else 'ours SLOWER'}); "
                      f"open {r['ratios']['open_gguf_over_ours']:.1f}x, dequantize "
                      f"{r['ratios']['dequantize_gguf_over_ours']:.2f}x; through lookups "
                      f"{r['ratios']['gguf_over_ours_lookups']:.2f}x"]
    lines.append(f"  goal: under 1 s for the default model -> {'met' if o['total_s'] < 1 else 'NOT met'}")
    return "\n".join(lines)

