"""`scratchllm version`: the version, and which build of the kernels runs on this CPU and why.

The kernels are built for several x86-64 levels in one install (docs/kernels.md, "One install,
every x86-64"); the import picks the highest level this CPU has, or the one SCRATCHLLM_CPU_LEVEL
names. This prints that choice, the levels built, the CPU, and what the chosen level's kernels
are (vector width, register tile, integer products, what dtype "auto" runs a quantized GGUF on).
"""

import argparse
import json
import os
import platform
from typing import Any

from scratchllm import __version__
from scratchllm.cli import Subparsers


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("version", help="the version, and which kernels run on this CPU and why", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report() -> dict[str, Any]:
    """What `version` prints. Raises UnsupportedCPUError where this CPU runs no level (or not the forced one)."""
    from scratchllm.kernels import CHOICE, cpu_features, packed_gemm

    level = CHOICE.level
    out: dict[str, Any] = {
        "version": __version__, "python": platform.python_version(), "cpu": cpu_model(), "cores": os.cpu_count(),
        "kernels": {
            "level": level.name if level else None, "reason": CHOICE.reason,
            "forced": os.environ.get(cpu_features.ENV_LEVEL) or None,
            "built": [{"level": b.name, "features": list(b.features),
                       "runs_here": CHOICE.cpu_flags is None or not cpu_features.missing_features(b.features,
                                                                                                  CHOICE.cpu_flags)}
                      for b in CHOICE.built],
            "folder": str(level.folder) if level else None,
        },
    }
    if level is not None:
        out["kernels"] |= {
            "compiled_features": list(packed_gemm.COMPILED_FEATURES),
            "floats_per_vector": packed_gemm.NR // 2, "panel_width": packed_gemm.NR, "tile_rows": packed_gemm.MAXR,
            "integer_products": packed_gemm.INT8_DOT, "bfloat16_dot_instruction": packed_gemm.HAVE_AVX512_BF16,
            "auto_dtype_for_quantized_gguf": ("int8 (0.4B parameters or more), int16 (smaller)"
                                             if packed_gemm.INT_DOT_INSTRUCTION else "quantized"),
        }
    return out


def render(r: dict[str, Any]) -> str:
    k = r["kernels"]
    lines = [f"scratchllm {r['version']} (Python {r['python']})", f"CPU: {r['cpu']}, {r['cores']} cores"]
    if k["level"] is None:
        return "\n".join([*lines, f"kernels: none built ({k['reason']})"])
    lines += [f"kernels: {k['level']} ({k['reason']})",
              f"  {k['floats_per_vector']} floats per vector, panels {k['panel_width']} wide, tiles up to "
              f"{k['tile_rows']} rows; integer products: {k['integer_products']}; dtype auto on a quantized GGUF: "
              f"{k['auto_dtype_for_quantized_gguf']}",
              f"  from {k['folder']}",
              "levels built (lowest first):"]
    for b in k["built"]:
        mark = "*" if b["level"] == k["level"] else " "
        lines.append(f" {mark} {b['level']:<12} {'runs here' if b['runs_here'] else 'not on this CPU':<16} "
                     f"{' '.join(b['features'])}")
    lines.append("(SCRATCHLLM_CPU_LEVEL=<level> runs another level this CPU has)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    r = report()
    print(json.dumps(r) if args.json else render(r))
    return 0
