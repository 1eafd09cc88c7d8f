"""The KV-block-aware routing decision, as a pure function of the replicas' reported state.

Each replica reports the chained hashes of the full prefix blocks resident in its KV cache, its
load (running + waiting requests) and its capacity (the requests its engine runs at once). A
prompt's leading blocks hash the same way (block size 16, `prefix_hashes`), so "how much of this
prompt would replica r serve from cache" is the length of the run of leading hashes r holds.
The rule:

  1. the replica with the longest run wins while it can start the request at once (its load is
     below its capacity: a continuous-batching engine adds the request to the running batch), or
     else while its load exceeds the least loaded replica's by no more than the bound
     (`max(min_slack, slack_fraction * least)`): a replica whose request would wait in its
     queue, far behind the least busy, loses its claim, because queueing there costs more than
     a prefill;
  2. otherwise (no replica holds any leading block, or the holder is too busy): power of two
     choices, two replicas drawn at random, the less loaded one taken.

Why a free batch slot keeps the claim: a hit saves the prefill of the cached blocks, and one
more sequence in a decode step costs a replica little (the default model's step of 16 sequences
takes 7.0 ms, one sequence's 5.1 ms: docs/kernels.md), where spilling to an idle replica
recomputes the whole prefix there and makes a second copy of it in a pool that has room for
only its share of the prefixes. Before it (a holder lost its claim 3 requests above the least,
whatever its batch), `bench cluster`'s 2 replicas with 4 clients spilled 5-6 of its 56 repeated
prompts, each a miss and a second copy.

The engine reuses cached blocks only as an unbroken run from the first block, and always leaves
at least one prompt token to compute (its forward makes the first output token), so only the
first (len - 1) // block_size blocks are looked up: the same rule as the engine's prefix lookup.
Deterministic given the `random.Random` passed in.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from scratchllm.engine.block_pool import chain_hash

BLOCK_SIZE = 16
# The chain's root. The engine starts its chain at None, whose hash() is the object's address
# on Python < 3.12: different in every process. Routers and replicas live in different
# processes, so the routing hashes start from a fixed integer instead (the hash of a tuple of
# ints is the same in every process: ints are not salted).
CHAIN_ROOT = 0


def prefix_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """Chained hashes of the prompt's leading full blocks the engine could serve from cache."""
    hashes: list[int] = []
    prev = CHAIN_ROOT
    for i in range((len(token_ids) - 1) // block_size):
        prev = chain_hash(prev, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(prev)
    return hashes


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one replica: its resident prefix blocks and its load."""

    replica_id: str
    resident: Collection[int]  # routing hashes of full blocks in its KV cache (a set: `in` is O(1))
    load: int  # running + waiting requests
    capacity: int | None = None  # requests its engine runs at once (a batch); None: not reported

    def starts_at_once(self) -> bool:
        """One more request would join the running batch rather than wait."""
        return self.capacity is not None and self.load < self.capacity

    def leading_run(self, hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks this replica holds, as an unbroken run."""
        n = 0
        for h in hashes:
            if h not in self.resident:
                break
            n += 1
        return n


@dataclass(frozen=True)
class RoutingPolicy:
    min_slack: int = 2  # a holder may be this many requests busier than the least loaded ...
    slack_fraction: float = 0.5  # ... or this fraction of the least load, whichever is larger

    def __post_init__(self) -> None:
        assert self.min_slack >= 0 and self.slack_fraction >= 0

    def bound(self, least_load: int) -> float:
        return least_load + max(self.min_slack, self.slack_fraction * least_load)


DEFAULT_POLICY = RoutingPolicy()


@dataclass(frozen=True)
class Decision:
    replica_id: str
    matched_blocks: int  # leading blocks the chosen replica holds
    predicted_cached_tokens: int  # matched_blocks * block_size
    reason: str  # "prefix" (longest run), "balance" (power of two choices)


def choose(replicas: Sequence[ReplicaState], hashes: Sequence[int], rng: random.Random,
           policy: RoutingPolicy = DEFAULT_POLICY, block_size: int = BLOCK_SIZE) -> Decision:
    """The replica for a prompt whose leading block hashes are `hashes` (see the module doc)."""
    if not replicas:
        raise ValueError("no replica to route to")
    runs = [r.leading_run(hashes) for r in replicas]
    least = min(r.load for r in replicas)
    # longest run first; among equal runs the less loaded; then the first listed (deterministic)
    best = min(range(len(replicas)), key=lambda i: (-runs[i], replicas[i].load, i))
    holder = replicas[best]
    if runs[best] > 0 and (holder.starts_at_once() or holder.load <= policy.bound(least)):
        return Decision(holder.replica_id, runs[best], runs[best] * block_size, "prefix")
    picks = rng.sample(range(len(replicas)), 2) if len(replicas) >= 2 else [0]
    pick = min(picks, key=lambda i: (replicas[i].load, -runs[i]))
    return Decision(replicas[pick].replica_id, runs[pick], runs[pick] * block_size, "balance")


def round_robin(replicas: Sequence[ReplicaState], hashes: Sequence[int], counter: int,
                block_size: int = BLOCK_SIZE) -> Decision:
    """The first baseline: the counter-th replica in turn, blind to cache and load."""
    i = counter % len(replicas)
    run = replicas[i].leading_run(hashes)
    return Decision(replicas[i].replica_id, run, run * block_size, "round_robin")


def power_of_two(replicas: Sequence[ReplicaState], hashes: Sequence[int], rng: random.Random,
                 block_size: int = BLOCK_SIZE) -> Decision:
    """The second baseline: power of two choices on load alone, blind to the cache."""
    picks = rng.sample(range(len(replicas)), 2) if len(replicas) >= 2 else [0]
    i = min(picks, key=lambda j: replicas[j].load)
    run = replicas[i].leading_run(hashes)
    return Decision(replicas[i].replica_id, run, run * block_size, "power_of_two")


STRATEGIES = ("prefix", "round_robin", "power_of_two")
