"""The OpenAI API through the Ray Serve ingress, with the official `openai` client: the same
replies as the one-process server, streaming included, `cached_tokens` in every usage, the
router's predictions checked against what the engines report, and a replica killed mid-load.

Slow (a local Ray cluster takes ~30 s to start on two shared cores): one cluster for the module.
"""

import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from scratchllm.engine.fake import FakeTokenizer
from scratchllm.server.app import create_app
from scratchllm.server.backend import fake_backend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SYSTEMS = [f"You are assistant number {i}. Answer briefly and politely, in plain words. " * 3 for i in range(4)]


def chat(system, user):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def expected_cached(earlier, messages) -> int:
    """Prompt tokens a prefix cache that has seen `earlier` serves for `messages`: the full blocks
    of their common token prefix, one token always left to compute."""
    tok = FakeTokenizer()
    a, b = (tok.encode(tok.apply_chat_template(m)) for m in (earlier, messages))
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return 16 * min(common // 16, (len(b) - 1) // 16)


@pytest.fixture(scope="module")
def client(fake_cluster):
    return openai.OpenAI(base_url=f"{fake_cluster}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    """The one-process server over the same fake engine: the replies the ingress must match."""
    model, embedder = fake_backend(step_ms=1.0)
    with TestClient(create_app(model, embedder)) as http:  # an httpx.Client over the app itself
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)


def test_chat_and_completions_match_the_one_process_server(client, reference):
    for messages in (chat(SYSTEMS[0], "hello"), chat(SYSTEMS[1], "a café in 東京?")):
        got = client.chat.completions.create(model="fake", messages=messages, max_tokens=12)
        want = reference.chat.completions.create(model="fake", messages=messages, max_tokens=12)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].finish_reason == want.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens, 12)
    got = client.completions.create(model="fake", prompt="Once upon a time", max_tokens=10)
    want = reference.completions.create(model="fake", prompt="Once upon a time", max_tokens=10)
    assert got.choices[0].text == want.choices[0].text and got.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.NotFoundError):  # the same errors, from the same routes
        client.chat.completions.create(model="nope", messages=chat("s", "u"))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake", prompt="x", max_tokens=5000)


def test_streaming_joins_to_the_unstreamed_text_and_reports_cached_tokens(client):
    messages = chat(SYSTEMS[2], "stream please")
    whole = client.chat.completions.create(model="fake", messages=messages, max_tokens=16)
    chunks = list(client.chat.completions.create(model="fake", messages=messages, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage.completion_tokens == 16
    # the second request found the first one's system prompt in the same replica's cache
    assert usage.prompt_tokens_details.cached_tokens == expected_cached(messages, messages) > 0


def test_requests_sharing_a_system_prompt_hit_and_the_router_predicted_each_hit(client, fake_cluster):
    before = httpx.get(f"{fake_cluster}/cluster/stats").json()["accuracy"]
    cached, last = [], {}
    for round_ in range(3):
        for system in SYSTEMS[:3]:
            messages = chat("Routing check. " + system, f"question {round_}")  # a fresh prefix
            r = client.chat.completions.create(model="fake", messages=messages, max_tokens=4)
            want = expected_cached(last[system], messages) if system in last else 0
            cached.append((r.usage.prompt_tokens_details.cached_tokens, want))
            last[system] = messages
            time.sleep(0.05)
    # the first request of each system prompt finds at most the opening blocks every chat prompt
    # here shares ("<|im_start|>system\nRouting check. You are assistant number "); the later ones
    # find all of the previous request's prompt up to the user's words
    assert all(c <= 48 for c, _ in cached[:3]), cached
    assert all(c == want > 0 for c, want in cached[3:]), cached
    after = httpx.get(f"{fake_cluster}/cluster/stats").json()["accuracy"]
    n = after["requests"] - before["requests"]
    assert n == 9 and after["exact"] - before["exact"] == 9  # predicted == actual cached tokens, each one
    metrics = httpx.get(f"{fake_cluster}/cluster/metrics").text
    assert f"scratchllm_router_exact_total {float(after['exact'])}" in metrics


def test_cluster_metrics_are_counters_for_totals_and_gauges_for_what_holds_now(fake_cluster):
    from prometheus_client.parser import text_string_to_metric_families

    stats = httpx.get(f"{fake_cluster}/cluster/stats").json()
    types = {f.name: f.type for f in text_string_to_metric_families(httpx.get(f"{fake_cluster}/cluster/metrics").text)}
    totals = [f"scratchllm_router_{k}" for k in ("requests", "predicted_hits", "actual_hits", "hit_agreement", "exact",
                                                 "predicted_tokens", "actual_tokens", "prompt_tokens")]
    totals += [f"scratchllm_cluster_{k}" for k in stats["requests"]]  # submitted, finished, retried, failed...
    assert {name: types.get(name) for name in totals} == dict.fromkeys(totals, "counter")
    assert types["scratchllm_cluster_requests_open"] == types["scratchllm_router_replicas"] == "gauge"
    assert set(types) == set(totals) | {"scratchllm_cluster_requests_open", "scratchllm_router_replicas"}
    samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{fake_cluster}/cluster/metrics")
                                                                           .text) for s in f.samples}
    assert samples["scratchllm_router_replicas"] == 2 and samples["scratchllm_cluster_submitted_total"] >= 1


def test_embeddings_and_the_model_list_are_the_one_process_servers(client, reference):
    """The ingress serves the embedding model itself: /v1/models lists both, /v1/embeddings answers."""
    assert sorted(m.id for m in client.models.list().data) == sorted(m.id for m in reference.models.list().data) \
        == ["fake", "fake-embed"]
    texts = ["hello world", "a café in 東京"]
    got = client.embeddings.create(model="fake-embed", input=texts)
    want = reference.embeddings.create(model="fake-embed", input=texts)
    assert [d.embedding for d in got.data] == [d.embedding for d in want.data] and len(got.data[0].embedding) == 32
    assert got.usage.prompt_tokens == want.usage.prompt_tokens > 0


def _stream(client, i, results):
    try:
        stream = client.chat.completions.create(model="fake", messages=chat(f"Fault test {i}. " * 4, "go"),
                                                max_tokens=150, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        results[i] = ("done", len(text))
    except openai.APIError as err:  # the SSE error event the ingress sends when a stream's replica dies
        results[i] = ("error", str(err))


def test_a_replica_killed_mid_load_loses_no_request(client, fake_cluster):
    from ray import serve
    from ray.util import list_named_actors

    n = 16  # 4 run at once per replica, the rest wait there: both kinds are on the replica killed
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=_stream, args=(client, i, results)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while True:  # wait until every request is on a replica (the first ones are streaming by then)
        before = httpx.get(f"{fake_cluster}/cluster/stats").json()
        in_flight = {rid: r["in_flight"] for rid, r in before["routers"][0]["replicas"].items()}
        if sum(in_flight.values()) == n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    victim = max(in_flight, key=in_flight.get)
    assert in_flight[victim] > 4, before  # more than it runs at once: some wait, some stream
    import ray

    names = [a["name"] for a in list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{victim}")]
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a request hung"
    after = httpx.get(f"{fake_cluster}/cluster/stats").json()
    done = sum(1 for kind, _ in results.values() if kind == "done")
    errors = sum(1 for kind, _ in results.values() if kind == "error")
    retried = after["requests"]["retried"] - before["requests"]["retried"]
    failed_mid = after["requests"]["failed_mid_stream"] - before["requests"]["failed_mid_stream"]
    print(f"replica kill: {n} requests ({in_flight[victim]} on the replica killed), {done} completed "
          f"({retried} of them retried on the other replica), {errors} ended with an error event mid-stream")
    assert done + errors == n and errors == failed_mid
    assert retried >= 1 and all(length > 0 for kind, length in results.values() if kind == "done")
    assert after["routers"][0]["forgotten"] >= 1  # the router dropped the dead replica's blocks
    # Serve replaces the replica; the cluster serves on two replicas again
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = serve.status().applications["scratchllm"].deployments["engine"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the replica was not replaced: {status}")
    r = client.chat.completions.create(model="fake", messages=chat("after", "the kill"), max_tokens=4)
    assert r.choices[0].finish_reason == "length"
