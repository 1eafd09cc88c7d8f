"""The per-process state the router and the ingress share: the router's predictions, waiting
for the request's end, and every router's view (for /cluster/stats). Serve builds the router
from a by-value pickle of its module, so this state lives here, imported by reference.
"""

from __future__ import annotations

import threading

from scratchllm.cluster.view import ClusterView


class Predictions:
    """request id -> (its view, the replica it went to, predicted cached tokens), written by the
    router when it routes, taken by the caller when the request ends: the caller then tells the
    view (`ClusterView.completed`), because Serve's own completion hook fires when a streaming
    call is dispatched, not when its stream ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, tuple[ClusterView, str, int]] = {}

    def put(self, request_id: str, routed: tuple[ClusterView, str, int]) -> None:
        with self._lock:
            self._by_id[request_id] = routed
            if len(self._by_id) > 100_000:  # a caller that never collects must not grow this forever
                self._by_id.pop(next(iter(self._by_id)))

    def take(self, request_id: str) -> tuple[ClusterView, str, int] | None:
        with self._lock:
            return self._by_id.pop(request_id, None)




PREDICTIONS = Predictions()
VIEWS: list[ClusterView] = []
