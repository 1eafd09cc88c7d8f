"""Several models in one server, through the official `openai` client over the fake engine: each
request reaches the engine its `model` names; an unknown name is a 404 listing the served ones;
a model loads on first use, once however many requests wait for it, is unloaded after its
keep-alive (never while a request holds it) and loads again on the next request, which
/v1/models and /metrics show."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from scratchllm.bench.http_client import parse_metrics
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_specs
from scratchllm.server.registry import ModelRegistry, ModelSpec, parse_keep_alive

MSG = [{"role": "user", "content": "Name a colour."}]


def client_of(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def states(url) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(url + "/v1/models").json()["data"]}


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_requests_reach_the_model_they_name(serve):
    app = create_app(ModelRegistry(fake_specs(["alpha", "beta"], step_ms=1.0)), config=ServerConfig())
    with serve(app) as url:
        client = client_of(url)
        a = client.chat.completions.create(model="alpha", messages=MSG, max_tokens=3)
        b = client.chat.completions.create(model="beta", messages=MSG, max_tokens=5)
        e = client.embeddings.create(model="fake-embed", input="hello")
        assert (a.model, b.model, len(e.data)) == ("alpha", "beta", 1)
        listed = [(x.id, x.task, x.state) for x in client.models.list().data]
        m = parse_metrics(httpx.get(url + "/metrics").text)
        registry = app.state.models
        engines = {n: registry.entry(n).state.model.engine for n in ("alpha", "beta")}
    # each request ran on its own model's engine, and the page counts it under that model's name
    assert m['scratchllm:generation_tokens_total{model_name="alpha"}'] == 3
    assert m['scratchllm:generation_tokens_total{model_name="beta"}'] == 5
    assert engines["alpha"] is not engines["beta"]
    assert sum(engines["alpha"].stats().finished.values()) == 1 == sum(engines["beta"].stats().finished.values())
    assert listed == [("alpha", "generate", "loaded"), ("beta", "generate", "loaded"),
                      ("fake-embed", "embed", "loaded")]


def test_an_unknown_model_is_a_404_that_lists_the_served_ones(serve):
    app = create_app(ModelRegistry(fake_specs(["alpha", "beta"])), config=ServerConfig())
    with serve(app) as url:
        client = client_of(url)
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
        body = err.value.body
        assert body["code"] == "model_not_found" and body["param"] == "model"
        for name in ("'gpt-4o'", "'alpha'", "'beta'", "'fake-embed'"):
            assert name in body["message"]
        with pytest.raises(openai.NotFoundError, match="'fake-embed'.*embedding"):  # the other task's model
            client.chat.completions.create(model="fake-embed", messages=MSG, max_tokens=2)
        with pytest.raises(openai.NotFoundError, match="embedding models here: 'fake-embed'"):
            client.embeddings.create(model="alpha", input="x")
        assert states(url) == {"alpha": "unloaded", "beta": "unloaded", "fake-embed": "unloaded"}  # none loaded


def test_unloaded_after_keep_alive_and_loaded_again(serve):
    app = create_app(ModelRegistry(fake_specs(["alpha", "beta"], step_ms=1.0), keep_alive_s=0.3),
                     config=ServerConfig())
    with serve(app) as url:
        client = client_of(url)
        assert states(url)["alpha"] == "unloaded"
        client.chat.completions.create(model="alpha", messages=MSG, max_tokens=2)
        assert states(url)["alpha"] == "loaded" and states(url)["beta"] == "unloaded"
        wait_for(lambda: states(url)["alpha"] == "unloaded")
        m = parse_metrics(httpx.get(url + "/metrics").text)
        assert m['scratchllm:model_loaded{model_name="alpha"}'] == 0
        assert m['scratchllm:model_loads_total{model_name="alpha"}'] == 1
        assert m['scratchllm:model_unloads_total{model_name="alpha"}'] == 1
        assert 'scratchllm:num_requests_running{model_name="alpha"}' not in m  # no engine to read
        assert m['scratchllm:generation_tokens_total{model_name="alpha"}'] == 2  # counters outlive the engine
        r = client.chat.completions.create(model="alpha", messages=MSG, max_tokens=2)
        assert r.choices[0].message.content and states(url)["alpha"] == "loaded"
        m = parse_metrics(httpx.get(url + "/metrics").text)
        assert m['scratchllm:model_loaded{model_name="alpha"}'] == 1
        assert m['scratchllm:model_loads_total{model_name="alpha"}'] == 2
        assert m['scratchllm:num_requests_running{model_name="alpha"}'] == 0
        assert m['scratchllm:model_loads_total{model_name="beta"}'] == 0


def test_a_model_in_use_is_never_unloaded(serve):
    """A stream that runs for twenty keep-alives holds its model; it unloads once the stream ends.
    Watched from the server's side: the client may read its chunks late (a busy machine)."""
    app = create_app(ModelRegistry(fake_specs(["alpha"], step_ms=50.0), keep_alive_s=0.05), config=ServerConfig())
    with serve(app) as url:
        entry = app.state.models.entry("alpha")
        client = client_of(url)
        reader = threading.Thread(target=lambda: list(client.chat.completions.create(
            model="alpha", messages=MSG, max_tokens=20, stream=True)))
        reader.start()
        wait_for(lambda: entry.metrics.in_flight == 1)
        busy = []
        while reader.is_alive():
            status = entry.status  # read first: a request in the engine after it means it was loaded then
            if entry.metrics.in_flight:
                busy.append(status)
            time.sleep(0.005)
        assert len(busy) > 50 and set(busy) == {"loaded"}  # a second of generation, sampled every 5 ms
        wait_for(lambda: states(url)["alpha"] == "unloaded")


def test_concurrent_first_requests_load_the_model_once(serve):
    calls = []
    [alpha] = fake_specs(["alpha"], embedder=False, step_ms=1.0)
    real_load = alpha.load

    def slow_load():
        calls.append(threading.get_ident())
        time.sleep(0.3)  # every request below arrives while this load runs
        return real_load()

    spec = ModelSpec("alpha", "generate", slow_load)
    app = create_app(ModelRegistry([spec]), config=ServerConfig())
    with serve(app) as url:
        client = client_of(url)
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda i: client.chat.completions.create(
                model="alpha", messages=MSG, max_tokens=2, seed=i), range(6)))
    assert len(calls) == 1 and all(r.choices[0].finish_reason == "length" for r in replies)


def test_a_load_that_fails_is_a_503_and_the_next_request_tries_again(serve):
    [alpha] = fake_specs(["alpha"], embedder=False, step_ms=1.0)
    attempts = []

    def flaky_load():
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("disk went away")
        return alpha.load()

    app = create_app(ModelRegistry([ModelSpec("alpha", "generate", flaky_load)]), config=ServerConfig())
    with serve(app) as url:
        client = client_of(url)
        with pytest.raises(openai.InternalServerError, match="could not be loaded: disk went away") as err:
            client.chat.completions.create(model="alpha", messages=MSG, max_tokens=2)
        assert err.value.status_code == 503 and states(url)["alpha"] == "unloaded"
        assert client.chat.completions.create(model="alpha", messages=MSG, max_tokens=2).choices
        assert len(attempts) == 2 and states(url)["alpha"] == "loaded"


def test_keep_alive_values():
    assert [parse_keep_alive(v) for v in (0, 30, 2.5, "30", "300ms", "5m", "1h30m", "-1", -1, "-5m", "forever")] == [
        0.0, 30.0, 2.5, 30.0, 0.3, 300.0, 5400.0, None, None, None, None]
    for bad in ("5 minutes", "m", "", True, [1], "1x", float("nan")):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)
