"""The soak's short version (`make soak` runs it for minutes): saturation, disconnects, aborts,
bursts past the admission bound and a replica kill; then every request answered or refused,
0 KV blocks held in any replica, RSS growth bounded."""

import asyncio

import pytest

from scratchllm.cluster import soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def soak_cluster(ray_cluster):
    from ray import serve

    from scratchllm.cluster.app import ClusterSpec, build_app
    from scratchllm.cluster.replica import ReplicaSpec
    from scratchllm.server.app import ServerConfig

    spec = ClusterSpec(replicas=2, replica=ReplicaSpec(engine_options={"step_ms": 10.0, "max_running": 4}),
                       replica_cpus=0, report_interval_s=0.3, server=ServerConfig(max_in_flight=12))
    serve.run(build_app(spec), name="soak", route_prefix="/soak")
    yield f"{ray_cluster}/soak"
    serve.delete("soak")


def test_a_short_soak_keeps_every_promise(soak_cluster):
    result = asyncio.run(soak.soak(soak_cluster, seconds=15, clients=20, seed=1,
                                   kill=lambda: soak.kill_one_replica("soak")))
    c = result["counts"]
    print(f"soak: {c['requests']} requests, {c.get('completed', 0)} completed, {c.get('http_429', 0)} refused "
          f"(429), {c.get('disconnected', 0)} disconnects, {c.get('aborted_by_client', 0)} aborts, "
          f"{c.get('stream_error_event', 0)} stream error events, leaked blocks {result['leaked_blocks']}, "
          f"RSS growth {result['rss_growth_bytes']}")
    assert soak.check(result) == []
    # the soak did what it says: past the bound, clients leaving, a replica killed
    assert c.get("http_429", 0) > 0 and c.get("disconnected", 0) > 0 and c["replica_kills"] == 1
    assert c.get("completed", 0) >= 50  # and real work got done meanwhile
