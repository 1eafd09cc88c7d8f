"""Ollama's API, through the official `ollama` Python client, against a live `scratchllm serve` on
the fake engine: chat (streamed and not), generate (with its context), embed, list, show, ps,
keep_alive, the options and their refusals. Each answer is checked against the OpenAI endpoints'
answer to the same request, on the same server."""

import contextlib
import json
import re
import subprocess
import sys
import time

import httpx
import ollama
import pytest

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_specs
from scratchllm.server.registry import ModelRegistry

MSG = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 9, "seed": 7}


@contextlib.contextmanager
def scratchllm_serve(*options, timeout_s=20):
    """(base URL, process) of `scratchllm serve OPTIONS...` on a free port."""
    proc = subprocess.Popen([sys.executable, "-m", "scratchllm.cli.main", "serve", "--port", "0", *options],
                            stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        while not (found := re.search(r"http://\S+", line := proc.stderr.readline())) and line:
            seen += line  # what comes before the address (a model file joined once, warnings)
        assert found, f"server did not start: {seen}{line}{proc.stderr.read() if proc.poll() is not None else ''}"
        url = found.group(0)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.05)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.fixture(scope="module")
def server():
    with scratchllm_serve("--fake-engine", "--fake-step-ms", "1", "fake", "other", "--keep-alive", "60") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    with ollama.Client(host=server, timeout=20) as c:
        yield c


def openai_chat(url, model, messages, **fields):
    r = httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": messages, **fields}, timeout=20)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_equals_the_openai_endpoints_answer(client, server):
    reply = client.chat(model="fake", messages=MSG, stream=False, options=GREEDY)
    same = openai_chat(server, "fake", MSG, temperature=0, max_tokens=9, seed=7)
    assert reply.message.role == "assistant" and reply.message.content == same["choices"][0]["message"]["content"]
    assert reply.done and reply.done_reason == "length" == same["choices"][0]["finish_reason"]
    assert reply.eval_count == 9 and reply.prompt_eval_count == same["usage"]["prompt_tokens"]
    assert reply.total_duration >= reply.eval_duration > 0 and reply.prompt_eval_duration > 0


def test_chat_streams_ndjson_that_adds_up_to_the_whole_reply(client, server):
    whole = client.chat(model="other", messages=MSG, stream=False, options=GREEDY)
    parts = list(client.chat(model="other", messages=MSG, stream=True, options=GREEDY))
    assert len(parts) > 2 and all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 9
    body = {"model": "fake", "messages": MSG, "options": {"num_predict": 5}}
    with httpx.stream("POST", server + "/api/chat", json=body) as r:  # streamed unless "stream": false
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [line for line in r.iter_lines() if line]
    assert len(lines) > 2 and '"done":true' in lines[-1]


def test_generate_returns_its_context_and_continues_from_it(client, server):
    first = client.generate(model="fake", prompt="Once upon", raw=True, options=GREEDY)
    prompt_ids = httpx.post(server + "/tokenize", json={"model": "fake", "prompt": "Once upon"}).json()["tokens"]
    completion = httpx.post(server + "/v1/completions", json={"model": "fake", "prompt": "Once upon", "max_tokens": 9,
                                                              "temperature": 0, "seed": 7}).json()
    assert first.response == completion["choices"][0]["text"] and first.eval_count == 9
    assert list(first.context[:len(prompt_ids)]) == prompt_ids and len(first.context) == len(prompt_ids) + 9
    # the returned context is the conversation so far: a follow-up is prompted by it, plus its own text
    second = client.generate(model="fake", prompt=" and", raw=True, context=first.context, options=GREEDY)
    more = httpx.post(server + "/tokenize", json={"model": "fake", "prompt": " and"}).json()["tokens"]
    ids = list(first.context) + more
    direct = httpx.post(server + "/v1/completions", json={"model": "fake", "prompt": ids, "max_tokens": 9,
                                                          "temperature": 0, "seed": 7}).json()
    assert second.response == direct["choices"][0]["text"]
    templated = client.generate(model="fake", prompt="Name three colours.", options=GREEDY)  # the chat template
    assert templated.response == client.chat(model="fake", messages=MSG, options=GREEDY).message.content
    streamed = list(client.generate(model="fake", prompt="Once upon", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == first.response and streamed[-1].context == first.context


def test_embed_equals_the_openai_endpoint(client, server):
    texts = ["red", "a longer sentence about green"]
    mine = client.embed(model="fake-embed", input=texts)
    same = httpx.post(server + "/v1/embeddings", json={"model": "fake-embed", "input": texts}).json()
    assert [list(v) for v in mine.embeddings] == [d["embedding"] for d in same["data"]]
    assert mine.prompt_eval_count == same["usage"]["prompt_tokens"]
    assert list(client.embeddings(model="fake-embed", prompt="red").embedding) == same["data"][0]["embedding"]
    with pytest.raises(ollama.ResponseError, match="embedding models here: 'fake-embed'") as err:
        client.embed(model="fake", input="x")
    assert err.value.status_code == 404


def test_list_show_and_ps(client, server):
    assert [m.model for m in client.list().models] == ["fake", "other", "fake-embed"]
    shown = client.show("fake")
    assert shown.capabilities == ["completion"] and shown.modelinfo["fake.context_length"] == 2048
    assert client.show("fake-embed").capabilities == ["embedding"]
    client.chat(model="other", messages=MSG, options={"num_predict": 2})
    running = {m.model: m for m in client.ps().models}
    assert "other" in running and running["other"].context_length == 2048
    left = running["other"].expires_at.timestamp() - time.time()
    assert 50 < left <= 60  # --keep-alive 60, counted from the end of its last request
    with pytest.raises(ollama.ResponseError, match="does not exist.*'fake', 'other'") as err:
        client.show("missing")
    assert err.value.status_code == 404
    assert httpx.get(server + "/api/version").json()["version"]


def test_keep_alive_per_request_and_the_empty_prompt_loads_and_unloads(client):
    client.generate(model="other", prompt="hi", options={"num_predict": 1}, keep_alive=0)  # unloaded after it
    assert "other" not in {m.model for m in client.ps().models}
    loaded = client.generate(model="other", keep_alive="2m")  # no prompt: load only
    assert loaded.done_reason == "load" and loaded.response == ""
    left = {m.model: m for m in client.ps().models}["other"].expires_at.timestamp() - time.time()
    assert 100 < left <= 120
    assert client.chat(model="other", messages=[], keep_alive=0).done_reason == "unload"
    assert "other" not in {m.model for m in client.ps().models}
    forever = client.chat(model="other", messages=MSG, options={"num_predict": 1}, keep_alive=-1)
    assert forever.done and {m.model: m for m in client.ps().models}["other"].expires_at.year == 9999
    with pytest.raises(ollama.ResponseError, match="keep_alive 'soon' is not a duration"):
        client.chat(model="other", messages=MSG, keep_alive="soon")


def test_options_map_to_the_sampling_fields(client, server):
    a = client.chat(model="fake", messages=MSG, options={"seed": 3, "temperature": 0.9, "num_predict": 12,
                                                         "top_k": 5, "top_p": 0.8, "repeat_penalty": 1.2,
                                                         "num_thread": 2, "num_ctx": 1024, "repeat_last_n": -1})
    same = openai_chat(server, "fake", MSG, seed=3, temperature=0.9, max_tokens=12, top_k=5, top_p=0.8,
                       repetition_penalty=1.2)
    assert a.message.content == same["choices"][0]["message"]["content"] and a.eval_count == 12
    stop = a.message.content[4:6]
    stopped = client.chat(model="fake", messages=MSG, options={"seed": 3, "temperature": 0.9, "num_predict": 12,
                                                               "top_k": 5, "top_p": 0.8, "repeat_penalty": 1.2,
                                                               "stop": [stop]})
    assert stopped.done_reason == "stop" and stopped.message.content == a.message.content.split(stop)[0]
    with pytest.raises(ollama.ResponseError, match="the context is 40 tokens.*num_ctx"):
        client.chat(model="fake", messages=MSG, options={"num_ctx": 40})


@pytest.mark.parametrize(("request_fields", "named"), [
    ({"options": {"mirostat": 2}}, "options.mirostat = 2 is not supported"),
    ({"options": {"typical_p": 0.5}}, "options.typical_p = 0.5 is not supported"),
    ({"options": {"frobnicate": 1}}, "unknown option 'frobnicate'"),
    ({"options": {"temperature": "hot"}}, "options.temperature"),
    ({"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
    ({"options": {"num_predict": 0}}, "options.num_predict must be a positive number"),
    ({"think": True}, "'think' is not supported"),
    ({"format": "yaml"}, "'format' is \"json\" or a JSON schema"),
    ({"surprise": 1}, "Unrecognized request argument supplied: surprise"),
])
def test_what_cannot_be_honoured_is_refused_in_ollamas_error_shape(server, client, request_fields, named):
    r = httpx.post(server + "/api/chat", json={"model": "fake", "messages": MSG, "stream": False, **request_fields})
    assert r.status_code == 400 and list(r.json()) == ["error"] and named in r.json()["error"], r.text
    if "surprise" not in request_fields and "format" not in request_fields:  # what the client itself lets through
        with pytest.raises(ollama.ResponseError, match=re.escape(named)) as err:
            client.chat(model="fake", messages=MSG, **request_fields)
        assert err.value.status_code == 400


def test_images_and_suffix_are_refused(client):
    with pytest.raises(ollama.ResponseError, match="'images' is not supported"):
        client.chat(model="fake", messages=[{"role": "user", "content": "what is this", "images": [b"\x89PNG"]}])
    with pytest.raises(ollama.ResponseError, match="'suffix' is not supported"):
        client.generate(model="fake", prompt="def f(", suffix="return x")


def test_the_api_key_guards_ollamas_routes_too(serve):
    app = create_app(ModelRegistry(fake_specs(["fake"], embedder=False)), config=ServerConfig(api_key="sesame"))
    with serve(app) as url:
        with ollama.Client(host=url) as keyless, pytest.raises(ollama.ResponseError, match="API key") as err:
            keyless.list()
        assert err.value.status_code == 401
        with ollama.Client(host=url, headers={"Authorization": "Bearer sesame"}) as keyed:
            assert [m.model for m in keyed.list().models] == ["fake"]
            assert keyed.chat(model="fake", messages=MSG, options={"num_predict": 2}).eval_count == 2
        assert httpx.get(url + "/api/version").status_code == 200  # open, as /version is


def test_an_engine_failure_mid_stream_is_a_last_error_line(serve, monkeypatch):
    from scratchllm.server.generation import Generation

    real_events = Generation.events

    async def failing(self, k):
        n = 0
        async for event in real_events(self, k):
            yield event
            n += 1
            if n == 3:
                raise RuntimeError("the kernel fell over")

    monkeypatch.setattr(Generation, "events", failing)
    app = create_app(ModelRegistry(fake_specs(["fake"], embedder=False, step_ms=1.0)), config=ServerConfig())
    with serve(app) as url:
        with httpx.stream("POST", url + "/api/chat", json={"model": "fake", "messages": MSG,
                                                           "options": {"num_predict": 20}}) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert r.status_code == 200 and len(lines) == 4  # three tokens, then the error
        assert lines[-1] == {"error": "the engine failed mid-stream: RuntimeError: the kernel fell over"}
        with ollama.Client(host=url) as c, pytest.raises(ollama.ResponseError, match="kernel fell over"):
            list(c.chat(model="fake", messages=MSG, stream=True, options={"num_predict": 20}))
        state = app.state.models.entry("fake").state
        deadline = time.monotonic() + 5  # closed once the response has ended, just after the client read it
        while state.metrics.in_flight or state.model.engine.stats()["kv_blocks_used"]:
            assert time.monotonic() < deadline, "the failed stream's request was never closed"
            time.sleep(0.01)
