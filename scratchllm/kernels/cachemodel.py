"""A cache model for matrix multiply: which tile to use, and why, from the sizes of the caches.

Two rules, for the two loop orders this lab runs:

- Square tiles (the design article's advice; `cachesim.blocked_trace`): the classic rule keeps one T x T
  tile each of A, B and C in L1, so 3 T^2 elements should fit in the share of L1 we may count on
  (`tile`). Looking at the loop order inside the tiles (i, j, k) shows that only the B tile is
  reused across i; A contributes one row of T and C one element at a time, so T^2 + 2T elements
  suffice (`tile_reuse`, the looser rule; the simulator decides between them). T is a multiple
  of the elements per line, so no tile row drags in half a line of its neighbour. The share is
  1/2 by default: a set-associative LRU cache loses lines to conflicts long before it is full
  (Lam, Rothberg, Wolf 1991), and the loop's other data lives there too.
- Packed GEMM (our Cython kernel, `_matmul.gemm`): a kc x NR micro-panel of packed B is reused by
  every MR-row step while the MR x kc micro-panels of A stream past it, so kc x (NR + 2 MR) should
  fit in that share of L1; the mc x kc block of packed A should fit in that share of L2.

The cache sizes come from this machine (sysfs, else `lscpu`, else Zen 4 defaults, saying which).
"""

import glob
import os
import re
import subprocess
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheSizes:
    line_bytes: int
    l1_bytes: int
    l2_bytes: int
    l3_bytes: int
    source: str  # "sysfs", "lscpu" or "default (...)": where the numbers came from


# Zen 4 (the machine this project is measured on): 32 KiB L1d, 1 MiB L2 per core, 32 MiB L3.
_DEFAULT = CacheSizes(64, 32 * 1024, 1024 * 1024, 32 * 1024 * 1024, "default (Zen 4: sysfs and lscpu unreadable)")


def _parse_size(text: str) -> int:
    # "32K", "1024K", "32 MiB", "2 MiB (2 instances)" -> bytes
    m = re.match(r"\s*([\d.]+)\s*([KMG]?)", text)
    if not m:
        raise ValueError(f"not a cache size: {text!r}")
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)]
    return int(float(m.group(1)) * scale)


def read_sysfs(root: str = "/sys/devices/system/cpu/cpu0/cache") -> CacheSizes | None:
    """One core's data caches from sysfs (sizes there are per instance, which is what a core sees)."""
    sizes, line = {}, None
    for index in sorted(glob.glob(os.path.join(root, "index*"))):
        try:
            with open(os.path.join(index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                size = _parse_size(f.read())
            with open(os.path.join(index, "coherency_line_size")) as f:
                line = int(f.read())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified"):
            sizes[level] = size
    if 1 not in sizes or 2 not in sizes or line is None:
        return None
    return CacheSizes(line, sizes[1], sizes[2], sizes.get(3, 0), "sysfs")


def read_lscpu() -> CacheSizes | None:
    """`lscpu -C` prints one row per cache with ONE-SIZE (per instance) and the line size."""
    try:
        out = subprocess.run(["lscpu", "-C=NAME,ONE-SIZE,COHERENCY-SIZE", "-B"], capture_output=True,
                             text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes, line = {}, None
    for row in out.splitlines()[1:]:
        parts = row.split()
        if len(parts) == 3 and parts[0] in ("L1d", "L2", "L3"):
            sizes[parts[0]] = int(parts[1])
            line = int(parts[2])
    if "L1d" not in sizes or "L2" not in sizes or line is None:
        return None
    return CacheSizes(line, sizes["L1d"], sizes["L2"], sizes.get("L3", 0), "lscpu")


def machine_caches() -> CacheSizes:
    return read_sysfs() or read_lscpu() or _DEFAULT


@dataclass(frozen=True)
class TilePrediction:
    n: int
    elem_bytes: int
    line_bytes: int
    l1_bytes: int
    l2_bytes: int
    share: float
    tile: int  # square tile T for the blocked loop order, classic rule: 3 T^2 in L1
    tile_reuse: int  # the same loop, only what is reused across i in L1: T^2 + 2T
    kc: int  # packed GEMM: depth of a block (L1 rule)
    mc: int  # packed GEMM: rows of a block of A (L2 rule)
    working_set: dict[str, float] = field(default_factory=dict)  # level -> bytes the chosen tiles keep there
    reasoning: list[str] = field(default_factory=list)  # one line per step, for people


def _largest_multiple(limit: float, step: int) -> int:
    # Whole lines when at least one fits; else the largest size that fits at all (tiny caches).
    return int(limit // step) * step if limit >= step else max(1, int(limit))


def predict_tile(n: int, elem_bytes: int = 4, line_bytes: int | None = None, l1_bytes: int | None = None,
                 l2_bytes: int | None = None, share: float = 0.5, mr: int = 6, nr: int = 32) -> TilePrediction:
    """The tile the model predicts for an n x n matmul, and the working set per level behind it.

    Cache sizes not given are read from this machine. `share`: the part of a cache the tiles may
    fill (the rest is left to conflicts and other data). mr, nr: the packed kernel's register tile.
    """
    if n < 1 or elem_bytes < 1 or not 0 < share <= 1:
        raise ValueError(f"need n >= 1, elem_bytes >= 1, 0 < share <= 1; got {n}, {elem_bytes}, {share}")
    if line_bytes is None or l1_bytes is None or l2_bytes is None:
        found = machine_caches()
        line_bytes = line_bytes or found.line_bytes
        l1_bytes = l1_bytes or found.l1_bytes
        l2_bytes = l2_bytes or found.l2_bytes
    per_line = max(1, line_bytes // elem_bytes)
    why = [f"L1 {l1_bytes // 1024} KiB, L2 {l2_bytes // 1024} KiB, line {line_bytes} B = {per_line} elements "
           f"of {elem_bytes} B; tiles may fill {share:.0%} of a cache"]

    # Square tile: 3 T^2 elements in share * L1, T a multiple of a line's elements, T <= n.
    t_max = (share * l1_bytes / (3 * elem_bytes)) ** 0.5
    tile = _largest_multiple(t_max, per_line)
    why.append(f"square: 3 T^2 x {elem_bytes} B <= {share * l1_bytes:.0f} B gives T <= {t_max:.1f}; "
               f"the largest multiple of {per_line} that fits is {tile}")
    if tile >= n:
        tile = n
        why.append(f"square: the whole {n} x {n} matrix fits, so T = n = {n}")
    next_tile = tile + per_line
    if tile < n:
        why.append(f"square: T = {next_tile} would need {3 * next_tile**2 * elem_bytes} B, "
                   f"over {share * l1_bytes:.0f} B")
    t_reuse_max = ((share * l1_bytes / elem_bytes) + 1) ** 0.5 - 1  # T^2 + 2T <= S  <=>  T <= sqrt(S+1) - 1
    tile_reuse = min(_largest_multiple(t_reuse_max, per_line), n)
    why.append(f"square, reuse rule: only the B tile is reused across i, T^2 + 2T elements <= "
               f"{share * l1_bytes:.0f} B gives T <= {t_reuse_max:.1f} -> {tile_reuse}")
    ws_l1 = 3 * tile * tile * elem_bytes
    # For the i0-j0-k0 order, a strip of A (T x n) is reused across j0 and all of B across i0.
    ws_l2 = (tile * n + n * n + tile * n) * elem_bytes
    why.append(f"square: per i0 the loop reuses a {tile} x {n} strip of A and all of B: {ws_l2} B, "
               f"{'fits' if ws_l2 <= l2_bytes else 'does not fit'} in L2 ({l2_bytes} B)")

    # Packed GEMM: kc x (nr + 2 mr) in share * L1; mc x kc in share * L2.
    kc_max = share * l1_bytes / ((nr + 2 * mr) * elem_bytes)
    kc = min(_largest_multiple(kc_max, per_line), n)
    mc_max = share * l2_bytes / (kc * elem_bytes)
    mc = min(_largest_multiple(mc_max, mr), -(-n // mr) * mr)
    why.append(f"packed: B micro-panel kc x {nr} plus two A micro-panels {mr} x kc in L1: kc <= {kc_max:.0f} -> {kc}")
    why.append(f"packed: A block mc x {kc} in L2: mc <= {mc_max:.0f} -> {mc} (multiple of {mr}, at most n)")
    # Invariant: what the model chose fits where it said it would.
    assert tile == n or ws_l1 <= share * l1_bytes
    assert kc * (nr + 2 * mr) * elem_bytes <= share * l1_bytes or kc == 1
    assert tile_reuse == n or (tile_reuse**2 + 2 * tile_reuse) * elem_bytes <= share * l1_bytes
    return TilePrediction(n, elem_bytes, line_bytes, l1_bytes, l2_bytes, share, tile, tile_reuse, kc, mc,
                          {"L1": ws_l1, "L2": ws_l2, "L1 packed": kc * (nr + 2 * mr) * elem_bytes,
                           "L2 packed": mc * kc * elem_bytes}, why)
