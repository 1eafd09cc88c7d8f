"""Ollama's API, through the official `ollama` Python client, against a live `scratchllm serve` on
the fake engine: chat (streamed and not), generate (with its context), embed, list, show, ps,
keep_alive, the options and their refusals, logprobs (and on the real default model, whose
logprobs are its own). Each answer is checked against the OpenAI endpoints' answer to the same
request, on the same server."""

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
from scratchllm.server.backend import fake_specs, load_model
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
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
    ({"top_logprobs": -1}, "top_logprobs must be between 0 and 20"),  # checked even without logprobs
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
    with pytest.raises(ollama.ResponseError, match="'suffix' needs a fill-in-the-middle model"):  # the fake has none
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
        while state.metrics.in_flight or state.model.engine.stats().kv_blocks_used:
            assert time.monotonic() < deadline, "the failed stream's request was never closed"
            time.sleep(0.01)


def entries(lines):
    """The logprob entries of NDJSON reply lines (or of one whole reply), in order."""
    return [e for line in lines for e in line.get("logprobs") or []]


def ndjson(url, path, body):
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_streamed_logprobs_add_up_to_the_whole_replys(server, path):
    # a stop string holds text back: tokens that show no text yet still bring their logprobs
    body = {"model": "fake", "options": {**GREEDY, "stop": ["never in the reply"]}, "logprobs": True,
            "top_logprobs": 2, **({"messages": MSG} if path == "/api/chat" else {"prompt": "Once upon", "raw": True})}
    whole = httpx.post(server + path, json={**body, "stream": False}).json()
    lines = ndjson(server, path, body)
    assert len(whole["logprobs"]) == whole["eval_count"] == 9 and entries(lines) == whole["logprobs"]
    text = [line["message"]["content"] if "message" in line else line["response"] for line in lines]
    assert any(t == "" and line.get("logprobs") and not line["done"] for t, line in zip(text, lines, strict=True))
    for e in whole["logprobs"]:
        assert e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2
    plain = httpx.post(server + path, json={**body, "stream": False, "logprobs": False}).json()
    assert "logprobs" not in plain and entries(ndjson(server, path, {**body, "logprobs": False})) == []
    # as Ollama reads it: top_logprobs alone asks for nothing
    assert "logprobs" not in httpx.post(server + path, json={**body, "stream": False, "logprobs": None}).json()


@pytest.fixture(scope="module")
def default_model(serve_module):
    """(URL, ollama client) of a server on the real default model: logprobs of a real distribution."""
    app = create_app(load_model("default", "default", {}), None, ServerConfig())
    with serve_module(app) as url, ollama.Client(host=url, timeout=120) as c:
        yield url, c


def check_top(entry, k):
    """The alternatives: k of them, most likely first, the greedy choice (the argmax) among them first."""
    top = entry["top_logprobs"]
    assert len(top) == k and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    assert top[0]["token"] == entry["token"] and abs(top[0]["logprob"] - entry["logprob"]) < 1e-6
    assert entry["logprob"] <= 0


@pytest.mark.slow
def test_chat_logprobs_equal_the_openai_routes_on_the_default_model(default_model):
    url, client = default_model
    mine = client.chat(model="default", messages=MSG, options={"temperature": 0, "num_predict": 8}, logprobs=True,
                       top_logprobs=5)
    same = openai_chat(url, "default", MSG, temperature=0, max_tokens=8, logprobs=True, top_logprobs=5)
    theirs = same["choices"][0]["logprobs"]["content"]
    got = [e.model_dump() for e in mine.logprobs]
    assert [e["token"] for e in got] == [e["token"] for e in theirs] and len(got) == mine.eval_count
    for a, b in zip(got, theirs, strict=True):
        assert abs(a["logprob"] - b["logprob"]) < 1e-6
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-6 for x, y in zip(a["top_logprobs"], b["top_logprobs"],
                                                                         strict=True))
        check_top(a, 5)
    streamed = [part.model_dump() for part in client.chat(model="default", messages=MSG, stream=True, logprobs=True,
                                                          top_logprobs=5, options={"temperature": 0,
                                                                                   "num_predict": 8})]
    assert entries(streamed) == got
    raw = httpx.post(url + "/api/chat", json={"model": "default", "messages": MSG, "stream": False, "logprobs": True,
                                              "options": {"temperature": 0, "num_predict": 8}}, timeout=60).json()
    assert [e["bytes"] for e in raw["logprobs"]] == [b["bytes"] for b in theirs]  # the client drops `bytes`
    assert all(e["top_logprobs"] == [] for e in raw["logprobs"])  # top_logprobs 0: the chosen token only


@pytest.mark.slow
def test_generate_logprobs_equal_the_completions_route_on_the_default_model(default_model):
    url, client = default_model
    options = {"temperature": 0, "num_predict": 8}
    mine = client.generate(model="default", prompt="The three primary colours are", raw=True, options=options,
                           logprobs=True, top_logprobs=3)
    same = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "The three primary colours are",
                                                     "max_tokens": 8, "temperature": 0, "logprobs": 3},
                      timeout=60).json()["choices"][0]["logprobs"]
    got = [e.model_dump() for e in mine.logprobs]
    assert [e["token"] for e in got] == same["tokens"] and len(got) == 8
    for e, lp, top in zip(got, same["token_logprobs"], same["top_logprobs"], strict=True):
        assert abs(e["logprob"] - lp) < 1e-6
        assert {t["token"]: t["logprob"] for t in e["top_logprobs"]} == pytest.approx(top, abs=1e-6)
        check_top(e, 3)
    streamed = [p.model_dump() for p in client.generate(model="default", prompt="The three primary colours are",
                                                        raw=True, options=options, logprobs=True, top_logprobs=3,
                                                        stream=True)]
    assert entries(streamed) == got and "".join(p["response"] for p in streamed) == mine.response


def test_tags_and_show_name_the_file_type_as_ollama_does(serve):
    """The quantization level is the GGUF's file type (Q4_K_M for the Qwen and Gemma files, Q4_1
    for the default model), not the dtype most of its tensors have (Q5_0 for the 0.5B: its rows
    are not a multiple of 256, so its quantizer fell back to Q5_0 for most of them). Read from
    the headers: nothing is loaded."""
    from scratchllm.server.backend import model_specs

    refs = ["default", "gemma3-270m", "qwen2.5-coder-0.5b"]
    specs, _ = model_specs(refs, {"max_num_seqs": 2})
    with serve(create_app(ModelRegistry(specs), config=ServerConfig())) as url, \
            ollama.Client(host=url, timeout=20) as client:
        tags = {m.model: m.details.quantization_level for m in client.list().models}
        shown = client.show("qwen2.5-coder-0.5b").details.quantization_level
    assert tags == {"default": "Q4_1", "gemma3-270m": "Q4_K_M", "qwen2.5-coder-0.5b": "Q4_K_M"} and shown == "Q4_K_M"
