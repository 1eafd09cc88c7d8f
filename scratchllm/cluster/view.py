"""The router's view of the cluster: each replica's last report, what has been routed there
since, and how often the predicted cache hits were real ones.

`ClusterView.route(token_ids)` turns the view into `router.ReplicaState`s and calls the pure
decision (router.py) for the configured strategy. Reports are periodic, so between two of them
the view is kept current from what the router itself did:
  - load is max(reported running + waiting, requests this router routed there and has not seen
    end): with one ingress the second is exact, with several the report covers the others';
  - a routed prompt's blocks are *assumed* resident on the chosen replica (it will compute and
    cache them) until a report made after a grace period confirms or drops them. Without this,
    a burst of requests with a new shared prefix would scatter before the first report.
A dead replica is forgotten (`forget`): its entry goes, blocks and load with it; Serve starts a
fresh replica under a new id, which enters the view empty.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scratchllm.cluster.router import (
    BLOCK_SIZE,
    DEFAULT_POLICY,
    STRATEGIES,
    Decision,
    ReplicaState,
    RoutingPolicy,
    choose,
    power_of_two,
    prefix_hashes,
    round_robin,
)

ASSUME_GRACE_S = 2.0  # a report this much newer than the routing confirms or drops its blocks


@dataclass
class _Replica:
    replica_id: str
    resident: frozenset[int] = frozenset()
    assumed: dict[int, float] = field(default_factory=dict)  # hash -> when it was routed here
    reported_load: int = 0
    capacity: int | None = None  # requests its engine runs at once, as reported
    facts: dict[str, Any] = field(default_factory=dict)  # the report's other numbers (KV blocks used, RSS)
    in_flight: int = 0

    def holds(self, h: int) -> bool:
        return h in self.resident or h in self.assumed


class _Holds:
    """`in` over a replica's reported and assumed blocks, without copying either."""

    def __init__(self, replica: _Replica):
        self.replica = replica

    def __contains__(self, h: object) -> bool:
        return isinstance(h, int) and self.replica.holds(h)


@dataclass
class Accuracy:
    """Predicted vs actual prompt tokens served from cache, per finished request."""

    requests: int = 0
    predicted_hits: int = 0  # requests predicted to hit (> 0 cached tokens)
    actual_hits: int = 0  # requests whose engine reported > 0 cached tokens
    hit_agreement: int = 0  # requests where both agree on hit / miss
    exact: int = 0  # requests where the predicted cached token count was exactly right
    predicted_tokens: int = 0
    actual_tokens: int = 0
    prompt_tokens: int = 0

    def add(self, predicted: int, actual: int, prompt_tokens: int) -> None:
        self.requests += 1
        self.predicted_hits += predicted > 0
        self.actual_hits += actual > 0
        self.hit_agreement += (predicted > 0) == (actual > 0)
        self.exact += predicted == actual
        self.predicted_tokens += predicted
        self.actual_tokens += actual
        self.prompt_tokens += prompt_tokens

    def summary(self) -> dict[str, Any]:
        n = max(self.requests, 1)
        return {**self.__dict__, "hit_agreement_rate": self.hit_agreement / n, "exact_rate": self.exact / n,
                "actual_hit_rate": self.actual_hits / n,
                "cached_token_fraction": self.actual_tokens / max(self.prompt_tokens, 1)}


class ClusterView:
    """Thread-safe: reports, routing and completions may come from different threads.

    Replicas come and go (Serve replaces a dead one with a fresh one under a new id): `retain`
    drops those no longer listed, `report` adds a new one. `decide` is free of side effects
    (Serve may ask again for the same request when the chosen replica refuses it); `commit`
    records where a request really went.
    """

    def __init__(self, strategy: str = "prefix", seed: int = 0, policy: RoutingPolicy = DEFAULT_POLICY,
                 block_size: int = BLOCK_SIZE, clock: Callable[[], float] = time.monotonic):
        assert strategy in STRATEGIES, strategy
        self.strategy, self.policy, self.block_size, self.clock = strategy, policy, block_size, clock
        self.replicas: dict[str, _Replica] = {}
        self.rng = random.Random(seed)
        self.counter = 0
        self.decisions = {"prefix": 0, "balance": 0, "round_robin": 0, "power_of_two": 0}
        self.forgotten = 0
        self._lock = threading.Lock()

    def report(self, replica_id: str, hashes: Iterable[int], load: int, made_at: float | None = None,
               facts: dict[str, Any] | None = None, capacity: int | None = None) -> None:
        """A replica's resident blocks, load and capacity as of `made_at` (the router's clock)."""
        made_at = self.clock() if made_at is None else made_at
        with self._lock:
            r = self.replicas.setdefault(replica_id, _Replica(replica_id))
            r.resident, r.reported_load, r.facts = frozenset(hashes), load, dict(facts or {})
            r.capacity = capacity
            r.assumed = {h: t for h, t in r.assumed.items() if t > made_at - ASSUME_GRACE_S}

    def forget(self, replica_id: str) -> None:
        """The replica died: nothing it held survives it."""
        with self._lock:
            if self.replicas.pop(replica_id, None) is not None:
                self.forgotten += 1

    def retain(self, replica_ids: Iterable[str]) -> None:
        keep = set(replica_ids)
        for rid in [r for r in self.replicas if r not in keep]:
            self.forget(rid)

    def _states(self, ids: Sequence[str], loads: dict[str, int]) -> list[ReplicaState]:
        out = []
        for rid in ids:
            r = self.replicas.setdefault(rid, _Replica(rid))
            load = max(r.reported_load, r.in_flight, loads.get(rid, 0))
            out.append(ReplicaState(rid, _Holds(r), load, r.capacity))  # type: ignore[arg-type]
        return out

    def decide(self, token_ids: Sequence[int], candidates: Sequence[str],
               loads: dict[str, int] | None = None) -> Decision:
        """Where the strategy sends this prompt among `candidates` (fresher `loads` may be given)."""
        if not candidates:
            raise LookupError("no replica to route to")
        hashes = prefix_hashes(token_ids, self.block_size)
        with self._lock:
            states = self._states(candidates, loads or {})
            if self.strategy == "prefix":
                return choose(states, hashes, self.rng, self.policy, self.block_size)
            if self.strategy == "round_robin":
                return round_robin(states, hashes, self.counter, self.block_size)
            return power_of_two(states, hashes, self.rng, self.block_size)

    def commit(self, token_ids: Sequence[int], replica_id: str, reason: str) -> int:
        """The request went to `replica_id`: count it in that replica's load, assume its prompt's
        blocks resident there, and return the predicted cached tokens on that replica."""
        hashes = prefix_hashes(token_ids, self.block_size)
        with self._lock:
            self.counter += 1
            self.decisions[reason] += 1
            r = self.replicas.setdefault(replica_id, _Replica(replica_id))
            run = ReplicaState(replica_id, _Holds(r), 0).leading_run(hashes)  # type: ignore[arg-type]
            r.in_flight += 1
            now = self.clock()
            for h in hashes:
                r.assumed.setdefault(h, now)
            return run * self.block_size

    def route(self, token_ids: Sequence[int], candidates: Sequence[str]) -> Decision:
        """decide + commit, for callers that route on their own (tests, the bench's simulator)."""
        decision = self.decide(token_ids, candidates)
        predicted = self.commit(token_ids, decision.replica_id, decision.reason)
        assert predicted == decision.predicted_cached_tokens
        return decision

    def completed(self, replica_id: str) -> None:
        with self._lock:
            r = self.replicas.get(replica_id)
            if r is not None:
                r.in_flight = max(r.in_flight - 1, 0)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"strategy": self.strategy, "decisions": dict(self.decisions), "forgotten": self.forgotten,
                    "replicas": {r.replica_id: {"resident_blocks": len(r.resident), "assumed_blocks": len(r.assumed),
                                                "reported_load": r.reported_load, "in_flight": r.in_flight,
                                                **r.facts}
                                 for r in self.replicas.values()}}
