"""Load every tensor into one page-aligned arena, following the plan `scratchllm inspect` draws.

Why one arena instead of one array per tensor: a fresh allocation costs a page fault per 4 KiB
page on first touch, and for the default model (538 MB of float32) those faults cost more than
the dequantization itself. One large allocation is backed by transparent huge pages where the
kernel offers them (NumPy asks with madvise), so it faults 2 MiB at a time. The arena also makes
the weights' memory one known block: its size is the plan's, decided before anything is read.
"""

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.formats.checkpoint import Checkpoint
from scratchllm.formats.layout import CACHE_LINE, PAGE, ArenaPlan, plan_arena


def load_arena(ckpt: Checkpoint, names: Iterable[str] | None = None,
               tensor_align: int = CACHE_LINE) -> tuple[dict[str, npt.NDArray[Any]], ArenaPlan]:
    """({name: array view into the arena}, the plan). Every array is dense, writable and owned by
    the arena (no view of the mapped file survives), in its lookup dtype (float32 when dequantized)."""
    infos = [ckpt.infos[name] for name in (ckpt if names is None else names)]
    plan = plan_arena(infos, tensor_align=tensor_align)
    backing = np.empty(plan.nbytes + PAGE, dtype=np.uint8)
    start = -backing.ctypes.data % PAGE  # first page boundary inside the allocation
    arena = backing[start:start + plan.nbytes]
    # Invariant: the arena starts on a page boundary, so the plan's page numbers are real pages.
    assert arena.ctypes.data % PAGE == 0
    arrays: dict[str, npt.NDArray[Any]] = {}
    for info, place in zip(infos, plan.placements, strict=True):
        slot = arena[place.offset:place.offset + place.nbytes].view(info.out_dtype).reshape(info.shape)
        arrays[info.name] = ckpt.read_into(info.name, slot)
    return arrays, plan
