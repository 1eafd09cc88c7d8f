"""The KV-block-aware router as a Ray Serve custom request router (ray.serve.request_router).

Serve makes one router per deployment handle, in the caller's process (the ingress). It hands
`choose_replicas` the replicas that can take a request now and the pending request (our
`generate(prompt_token_ids, params, request_id, avoid)` call); each replica's last
`record_routing_stats` report is on `replica.routing_stats`. The decision itself is
router.choose over the view (view.py); this module only translates between Serve and the view:
  - reports are ingested when their sequence number changes (not on every request);
  - load is the freshest of the report, this router's own in-flight count and Serve's
    queue-length cache (probed replies of ongoing requests);
  - a replica Serve drops (dead, or replaced) leaves the view, blocks and all;
  - the prediction (cached tokens on the replica the request really went to) is kept in
    ledger.PREDICTIONS under the request id, where the caller in the same process collects it.
Serve pickles this module by value (its globals with it), so what must be one per process lives
in ledger.py, reached as `ledger.X` (a module is pickled by reference).
Strategies (request_router_kwargs={"strategy": ...}): "prefix" (ours), "round_robin",
"power_of_two": the baselines run through the same code, so a bench compares only the decision.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from scratchllm.cluster import ledger
from scratchllm.cluster.router import Decision
from scratchllm.cluster.view import ClusterView

logger = logging.getLogger(__name__)
MAX_PENDING = 100_000


def _request_fields(pending: PendingRequest | None) -> tuple[list[int], str | None, tuple[str, ...]]:
    if pending is None:
        return [], None, ()
    args, kwargs = list(pending.args), dict(pending.kwargs)
    names = ("prompt_token_ids", "params", "request_id", "avoid")
    fields = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    return list(fields.get("prompt_token_ids") or []), fields.get("request_id"), tuple(fields.get("avoid") or ())


class KVBlockRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, strategy: str = "prefix", seed: int = 0, **kwargs: Any) -> None:
        self.view = ClusterView(strategy=strategy, seed=seed)
        self._seen: dict[str, int] = {}  # replica id -> sequence number of the last report ingested
        self._pending: dict[str, tuple[list[int], str]] = {}  # internal request id -> (prompt, reason)
        self._ids: dict[str, str] = {}  # internal request id -> our request id
        ledger.VIEWS.append(self.view)

    def _ingest(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            rid, stats = r.replica_id.unique_id, r.routing_stats or {}
            seq = stats.get("seq")
            if seq is not None and self._seen.get(rid) != seq:
                self._seen[rid] = seq
                facts = {k: v for k, v in stats.items() if k not in ("hashes", "load", "capacity")}
                capacity = stats.get("capacity")
                self.view.report(rid, stats.get("hashes", ()), int(stats.get("load", 0)), facts=facts,
                                 capacity=None if capacity is None else int(capacity))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        self.view.retain(live)
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        self._ingest(replicas)  # new reports arrive this way too, with or without traffic

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        logger.warning("replica %s died: the router forgets its blocks", replica_id.unique_id)
        self.view.forget(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._ingest(list(self.curr_replicas.values()))
        prompt, request_id, avoid = _request_fields(pending_request)
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas
        if not candidates:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidates}
        loads = {}
        for r in candidates:
            q = self.replica_queue_len_cache.get(r.replica_id)
            if q is not None:
                loads[r.replica_id.unique_id] = q
        decision: Decision = self.view.decide(prompt, list(by_id), loads)
        if pending_request is not None:
            internal = pending_request.metadata.internal_request_id
            self._pending[internal] = (prompt, decision.reason)
            if request_id is not None:
                self._ids[internal] = request_id
            while len(self._pending) > MAX_PENDING:  # requests cancelled before they were routed
                stale = next(iter(self._pending))
                self._pending.pop(stale)
                self._ids.pop(stale, None)
        first = by_id[decision.replica_id]
        rest = [r for r in candidates if r is not first]
        return [[first], rest] if rest else [[first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        internal = pending_request.metadata.internal_request_id
        pending = self._pending.pop(internal, None)
        request_id = self._ids.pop(internal, None)
        if pending is None:
            return
        predicted = self.view.commit(pending[0], replica_id.unique_id, pending[1])
        if request_id is not None:
            ledger.PREDICTIONS.put(request_id, (self.view, replica_id.unique_id, predicted))
