"""The fan-out seam for replay at scale: slices, order, worker processes, and a shard's failure."""

import functools
import os

import pytest

from scratchllm.cluster.fanout import Collected, fan_out, shard_bounds


def test_shards_cover_the_items_once_in_order():
    for n in range(0, 30):
        for shards in range(1, 8):
            bounds = shard_bounds(n, shards)
            covered = [i for a, b in bounds for i in range(a, b)]
            assert covered == list(range(n))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


def square_with_pid(offset, shard):
    return [(x * x + offset, os.getpid()) for x in shard]


def replay_like(shard):
    """What a replay shard does: 'replays' each item, writes through a store, returns the rows."""
    store = Collected()
    for rid in shard:
        for role in ("primary", "secondary", "candidate"):
            store.put_output(rid, role, f"out-{rid}-{role}")
    return [store.rows[i * 3 : i * 3 + 3] for i in range(len(shard))]


def short(shard):
    return shard[:-1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fan_out_on_the_ray_cluster(ray_cluster):
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module
    out = fan_out(list(range(20)), functools.partial(square_with_pid, 1), shards=4, num_cpus=0.5)
    assert [v for v, _ in out] == [x * x + 1 for x in range(20)]
    assert os.getpid() not in {pid for _, pid in out}  # computed in Ray's worker processes
    rows = [row for item in fan_out(list(range(7)), replay_like, shards=3, num_cpus=0.5) for row in item]
    assert [(r[0], r[1]) for r in rows] == [(i, role) for i in range(7) for role in ("primary", "secondary",
                                                                                       "candidate")]
    with pytest.raises(Exception, match="returned 2 results for 3 items"):
        fan_out(list(range(9)), short, shards=3, num_cpus=0.5)
