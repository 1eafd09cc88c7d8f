"""The server's own capture: sampled requests land in the capture directory with the response
the client got, the client's address only hashed and truncated; Ollama's requests as the OpenAI
requests they run as, which replay to the same answers; and the priority-feedback map follows
requests in and out of the engine."""

import json

import httpx

from scratchllm.evaluate.capture import CaptureWriter
from scratchllm.evaluate.feedback import RequestClasses
from scratchllm.evaluate.replay import ReplayOptions, replay
from scratchllm.evaluate.sources import read_traffic
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from tests.server.conftest import live_server


def test_sampled_requests_are_captured_with_their_responses(tmp_path):
    model, embedder = fake_backend(step_ms=0.5)
    capture = CaptureWriter(tmp_path / "cap", rate=1.0, key="k")
    app = create_app(model, embedder, ServerConfig(trusted_proxies=1), capture=capture)
    with live_server(app) as url:
        headers = {"X-Forwarded-For": "203.0.113.77"}
        plain = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "abc", "max_tokens": 6,
                                                         "temperature": 0}, headers=headers).json()
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            streamed = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content", "")
                               for x in r.iter_lines() if x.startswith("data: {") and '"choices":[{' in x)
    traffic = read_traffic(tmp_path / "cap")
    assert len(traffic.requests) == 2 and traffic.partial_lines == 0
    raw = "".join(p.read_text() for p in (tmp_path / "cap").glob("*.jsonl"))
    assert "203.0.113.77" not in raw and "203.0.113.0/24" in raw  # hashed and truncated, never raw
    by_endpoint = {r.endpoint: r for r in traffic.requests}
    completion, chat = by_endpoint["/v1/completions"], by_endpoint["/v1/chat/completions"]
    assert completion.body["prompt"] == "abc" and completion.response["text"] == plain["choices"][0]["text"]
    assert chat.response["text"] == streamed and len(chat.response["token_ids"]) == 5
    assert completion.response["finish_reason"] == "length" and completion.model == "fake"


def test_request_classes_are_kept_while_requests_run(tmp_path):
    model, embedder = fake_backend(step_ms=0.5)
    classes = RequestClasses()
    seen = []
    remember = classes.remember

    def spy(request_id, body):
        seen.append(request_id)
        return remember(request_id, body)

    classes.remember = spy
    with live_server(create_app(model, embedder, ServerConfig(), classes=classes)) as url:
        httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": ["a", "b"], "max_tokens": 2,
                                                 "metadata": {"request_class": "gold"}})
    assert len(seen) == 2 and seen[0].endswith("-0") and seen[1].endswith("-1")
    assert classes._keys == {}  # forgotten when the requests ended


def test_ollama_requests_are_captured_as_their_openai_requests_and_replay(tmp_path):
    model, embedder = fake_backend(step_ms=0.5)
    capture = CaptureWriter(tmp_path / "cap", rate=1.0, key="k")
    messages = [{"role": "user", "content": "Name three colours."}]
    seeded = {"temperature": 0.8, "seed": 7, "repeat_penalty": 1.1, "top_k": 20}
    with live_server(create_app(model, embedder, ServerConfig(), capture=capture)) as url:
        def ollama(path, **body):
            return httpx.post(url + path, json={"model": "fake", "stream": False, **body}, timeout=30).json()

        # no num_predict: to the end of num_ctx's context, which the record must say in max_tokens
        chat = ollama("/api/chat", messages=messages, options={**seeded, "num_ctx": 96})
        first = ollama("/api/generate", prompt="Once upon", raw=True, options={**seeded, "num_predict": 6})
        more = ollama("/api/generate", prompt=" and", raw=True, context=first["context"],
                      options={**seeded, "num_predict": 5, "stop": ["zz"]})
        templated = ollama("/api/generate", prompt="Name three colours.", system="Be brief.",
                           options={**seeded, "num_predict": 7})
        traffic = read_traffic(tmp_path / "cap")
        store = replay(traffic, tmp_path / "run.sqlite", ReplayOptions(url, url, progress=False))
    replies = [chat["message"]["content"], first["response"], more["response"], templated["response"]]
    captured = sorted(traffic.requests, key=lambda r: r.time)
    assert [(r.endpoint, r.translated_from) for r in captured] == [
        ("/v1/chat/completions", "/api/chat"), ("/v1/completions", "/api/generate"),
        ("/v1/completions", "/api/generate"), ("/v1/completions", "/api/generate")]
    assert [r.response["text"] for r in captured] == replies
    assert captured[0].body["max_tokens"] == chat["eval_count"] == 96 - chat["prompt_eval_count"]
    assert captured[0].body["repetition_penalty"] == 1.1 and captured[0].body["messages"] == messages
    assert captured[1].body["prompt"] == "Once upon" and captured[2].body["prompt"] == more["context"][:-5]
    assert captured[2].body["stop"] == ["zz"]
    # replayed on the OpenAI routes, each request gives the answer it gave on Ollama's
    by_source = {r["source"]: store.outputs(r["id"]) for r in store.requests()}
    for r, reply in zip(captured, replies, strict=True):
        outs = by_source[r.source]
        assert outs["primary"].status == 200 and outs["primary"].text == reply == outs["candidate"].text
