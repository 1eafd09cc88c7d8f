"""The planned memory layout of a checkpoint's weights: every tensor packed into one arena.

The arena is one page-aligned allocation holding every tensor as it comes out of a lookup
(dequantized float32 for quantized GGUF tensors). Packing tensors back to back, each starting on
a cache-line boundary, wastes at most 63 bytes per tensor; starting each on its own page
(`tensor_align=4096`) wastes up to a page per tensor but lets the OS map or release one
tensor's pages without touching its neighbours. The plan says which pages each tensor spans and
which pages two tensors share, which is what the design article's diagram draws.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from scratchllm.formats.checkpoint import TensorInfo

PAGE = 4096
CACHE_LINE = 64


@dataclass(frozen=True)
class Placement:
    name: str
    offset: int  # bytes from the arena start
    nbytes: int  # bytes of the loaded array (out_dtype x numel)
    first_page: int
    last_page: int  # inclusive; == first_page - 1 for an empty tensor

    @property
    def pages(self) -> int:
        return self.last_page - self.first_page + 1


@dataclass(frozen=True)
class ArenaPlan:
    placements: tuple[Placement, ...]
    nbytes: int  # arena size, rounded up to whole pages
    page: int
    tensor_align: int
    padding: int  # bytes lost to alignment between tensors and at the end

    @property
    def pages(self) -> int:
        return self.nbytes // self.page


def loaded_nbytes(info: TensorInfo) -> int:
    """Bytes of the array a lookup returns (float32 for dequantized types, else the stored dtype)."""
    return info.numel * np.dtype(info.out_dtype).itemsize


def plan_arena(infos: Iterable[TensorInfo], page: int = PAGE, tensor_align: int = CACHE_LINE) -> ArenaPlan:
    """Tensors in file order, each at the next multiple of `tensor_align`, in a page-aligned arena."""
    assert page > 0 and page & (page - 1) == 0, "page size must be a power of two"
    assert 0 < tensor_align <= page and page % tensor_align == 0, "alignment must divide the page"
    placements, cursor, used = [], 0, 0
    for info in infos:
        offset = -(-cursor // tensor_align) * tensor_align
        n = loaded_nbytes(info)
        first = offset // page
        last = (offset + n - 1) // page if n else first - 1
        placements.append(Placement(info.name, offset, n, first, last))
        cursor, used = offset + n, used + n
    total = -(-cursor // page) * page
    # Invariant: placements are in order and never overlap; the arena holds them all.
    for a, b in zip(placements, placements[1:], strict=False):
        assert a.offset + a.nbytes <= b.offset
    assert total >= cursor
    return ArenaPlan(tuple(placements), total, page, tensor_align, total - used)


def shared_pages(plan: ArenaPlan) -> set[int]:
    """Pages that hold bytes of more than one tensor."""
    owners: dict[int, int] = {}
    for p in plan.placements:
        for page in {p.first_page, p.last_page} if p.nbytes else ():
            owners[page] = owners.get(page, 0) + 1
    return {page for page, count in owners.items() if count > 1}
