"""Replica processes killed for real: SIGKILL of an engine replica's process (its pid from its own
report in /cluster/stats), while clients stream: 12 times in the suite (Serve takes 4-5 s to
bring a replica back on two cores, and the suite has a time budget), 50 with SIGKILL_KILLS=50
(docs/cluster.md has that run's figures). Requests that had no token yet are
retried on another replica and complete; streams that had started end with an SSE error event
then [DONE] (no hang, no silent cut); Serve restarts each replica killed and the router uses it
again. Three fake replicas at 5 ms a token, two requests running at once in each (more clients
than that, so some wait in the replica killed), keep it short: a kill whenever two replicas are
in service, without waiting for the third to be back."""

import os
import signal
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KILLS = int(os.environ.get("SIGKILL_KILLS", 12))
APP = "sigkill"
REPLICAS = 3


@pytest.fixture(scope="module")
def kill_cluster(ray_cluster):
    from ray import serve

    from scratchllm.cluster.app import ClusterSpec, build_app
    from scratchllm.cluster.replica import ReplicaSpec

    spec = ClusterSpec(replicas=REPLICAS, replica=ReplicaSpec(engine_options={"step_ms": 5.0, "max_running": 2}),
                       replica_cpus=0, report_interval_s=0.2)
    serve.run(build_app(spec), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_cluster}/{APP}"
    serve.delete(APP)


def _replicas(url):
    stats = httpx.get(f"{url}/cluster/stats", timeout=30).json()
    return {rid: r for view in stats["routers"] for rid, r in view["replicas"].items()}, stats["requests"]


def _client(url, stop, outcomes, lock):
    """Streams one request after another; each ends as: completed, error_after_tokens (an error
    event after content, then [DONE]), lost_before_token (an error before any content), or a
    broken stream (no [DONE], or a transport error)."""
    with httpx.Client(base_url=url, timeout=30) as http:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": "fake", "prompt": f"kill test {threading.get_ident()} {i} " * 3, "max_tokens": 40,
                    "stream": True}
            tokens, error, done = 0, False, False
            try:
                with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        kind = f"http_{r.status_code}"
                    else:
                        for line in r.iter_lines():
                            if line == "data: [DONE]":
                                done = True
                            elif line.startswith('data: {"error"'):
                                error = True
                            elif line.startswith("data: ") and '"text":""' not in line:
                                tokens += 1
                        if not done:
                            kind = "cut"
                        elif error:
                            kind = "error_after_tokens" if tokens else "lost_before_token"
                        else:
                            kind = "completed"
            except httpx.HTTPError as err:
                kind = f"transport_{type(err).__name__}"
            with lock:
                outcomes[kind] = outcomes.get(kind, 0) + 1


def test_sigkill_of_replica_processes_under_load(kill_cluster):
    url = kill_cluster
    stop, lock, outcomes = threading.Event(), threading.Lock(), {}
    clients = [threading.Thread(target=_client, args=(url, stop, outcomes, lock)) for _ in range(10)]
    for t in clients:
        t.start()
    started, killed, original = time.monotonic(), [], None
    try:
        for k in range(KILLS + 1):
            deadline = time.monotonic() + 60
            while True:  # at least two replicas in service (used since they started), one of them streaming
                replicas, _ = _replicas(url)
                live = {rid: r for rid, r in replicas.items() if r.get("served", 0) > 0 and rid not in killed}
                original = original or set(live)
                enough = len(live) == REPLICAS if k == KILLS else len(live) >= 2
                if enough and any(r["in_flight"] > 0 for r in live.values()):
                    break
                assert time.monotonic() < deadline, f"after {k} kills, too few replicas in service: {replicas}"
                time.sleep(0.05)
            if k == KILLS:
                break
            victim = max(live, key=lambda rid: live[rid]["in_flight"])
            print(f"{time.monotonic() - started:6.1f} s: kill {k + 1}, {outcomes}", flush=True)
            os.kill(live[victim]["pid"], signal.SIGKILL)
            killed.append(victim)
        back = len(set(live) - original) + len(set(killed) - original)  # replacements that served requests
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=60)
    elapsed = time.monotonic() - started
    assert not any(t.is_alive() for t in clients), "a request hung"
    _, counts = _replicas(url)
    print(f"SIGKILL x {KILLS} in {elapsed:.0f} s: {outcomes}; ingress counts {counts}; "
          f"replacement replicas that served requests {back}/{KILLS}")
    assert outcomes.get("lost_before_token", 0) == 0  # every request without a token yet was retried
    assert set(outcomes) <= {"completed", "error_after_tokens"}, outcomes  # no cut, no hang, nothing else
    assert outcomes.get("error_after_tokens", 0) > 0 and counts["retried"] > 0  # both kinds were met
    # every error a client saw is one the ingress counted; the ingress has been seen to count up to
    # 2 more than its clients saw in a run (12 kills: 25 against 23), not yet explained
    assert outcomes["error_after_tokens"] <= counts["failed_mid_stream"]
    assert back >= KILLS  # every replica killed was replaced by one that served again (restarts of others count too)
    r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "after", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
