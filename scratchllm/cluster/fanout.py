"""Fan a list of independent work items out over a Ray cluster: the seam for replaying a large
capture (the evaluation loop's `eval replay`) on many machines at once.

    fan_out(items, work, shards) -> results, in item order

`work(shard: list) -> list` runs in a Ray task (its own process, anywhere in the cluster) on one
contiguous slice of the items and returns one result per item. It must be picklable (a module
level function or a functools.partial of one) and must not write shared local state (a results
file): the caller collects the returned results and writes them itself. For replay, the shard
function runs the replayer over its slice with an in-memory store (`Collected`) and returns the
(request id, role, output) rows, which the caller puts into the run file:

    rows = fan_out(items, functools.partial(replay_shard, opts), shards=16)
    for request_id, role, output in rows: store.put_output(request_id, role, output)

Each server's concurrency limit then applies per shard: shards x concurrency requests reach a
server at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Collected:
    """A stand-in for the run store inside a shard: keeps what would be written, in order."""

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []

    def put_output(self, *row: Any) -> None:
        self.rows.append(row)


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """[start, stop) of `shards` contiguous slices of n items, sizes differing by at most one."""
    assert n >= 0 and shards >= 1
    shards = min(shards, max(n, 1))
    base, extra = divmod(n, shards)
    bounds, start = [], 0
    for i in range(shards):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    assert start == n
    return bounds


def _run_shard(work: Callable[[list[Any]], list[Any]], shard: list[Any]) -> list[Any]:
    results = list(work(shard))
    if len(results) != len(shard):
        raise ValueError(f"the shard function returned {len(results)} results for {len(shard)} items")
    return results


def fan_out(items: Sequence[T], work: Callable[[list[T]], list[R]], shards: int,
            num_cpus: float = 1.0) -> list[R]:
    """Results of `work` over `items`, computed as `shards` Ray tasks (Ray must be initialized)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("fan_out needs a Ray cluster: call ray.init(address=...) first")
    task = ray.remote(num_cpus=num_cpus)(_run_shard)
    refs = [task.remote(work, list(items[a:b])) for a, b in shard_bounds(len(items), shards) if b > a]
    return [r for part in ray.get(refs) for r in part]
