"""Engine replicas on Ray Serve behind a KV-block-aware router (docs/cluster.md).

router.py is the pure routing decision (no Ray); view.py the router's state; the modules that
import Ray (replica, request_router, remote, app) are imported only when a cluster is used, so
scratchllm works without the `cluster` extra.
"""
