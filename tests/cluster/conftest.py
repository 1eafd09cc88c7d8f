"""One local Ray cluster for every test here (2 CPUs, no dashboard, no usage stats), and one
Serve application on it: two replicas of the fake engine behind the ingress."""

import os
import socket
import time
from pathlib import Path

import pytest

import scratchllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # the workers import the scratchllm under test, wherever this checkout is
    root = str(Path(scratchllm.__file__).resolve().parents[1])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root, "RAY_USAGE_STATS_ENABLED": "0"}})
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def fake_cluster(ray_cluster):
    """Two fake-engine replicas (20 ms a token, 4 running at once) behind the ingress."""
    from ray import serve

    from scratchllm.cluster.app import APP_NAME, ClusterSpec, build_app
    from scratchllm.cluster.replica import ReplicaSpec

    spec = ClusterSpec(replicas=2, replica=ReplicaSpec(engine_options={"step_ms": 20.0, "max_running": 4}),
                       replica_cpus=0, report_interval_s=0.3)
    start = time.monotonic()
    serve.run(build_app(spec), name=APP_NAME, route_prefix="/")
    print(f"cluster up in {time.monotonic() - start:.1f} s")
    yield ray_cluster
    serve.delete(APP_NAME)
