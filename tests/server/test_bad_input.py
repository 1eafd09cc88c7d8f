"""Every way a request can be wrong -> 4xx with an OpenAI-style error body; never a 500.

Raw HTTP (httpx), because the official client would refuse to send most of these.
"""

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(fake_server):
    url, _ = fake_server
    with httpx.Client(base_url=url, timeout=20) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("body, param", [
    ({"model": "fake", "messages": MSG, "max_tokens": "10"}, "max_tokens"),  # string for a number
    ({"model": "fake", "messages": MSG, "max_tokens": 10.5}, "max_tokens"),
    ({"model": "fake", "messages": MSG, "temperature": "hot"}, "temperature"),
    ({"model": "fake", "messages": MSG, "temperature": 3.0}, "temperature"),
    ({"model": "fake", "messages": MSG, "stream": "yes"}, "stream"),
    ({"model": "fake", "messages": "hi"}, "messages"),
    ({"model": "fake", "messages": []}, "messages"),
    ({"model": "fake", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"model": "fake", "messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"model": 7, "messages": MSG}, "model"),
    ({"messages": MSG}, "model"),
    ({"model": "fake", "messages": MSG, "n": 0}, "n"),
    ({"model": "fake", "messages": MSG, "n": 17}, "n"),
    ({"model": "fake", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "fake", "messages": MSG, "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "fake", "messages": MSG, "audio": {"voice": "alloy"}}, "audio"),
    ({"model": "fake", "messages": [{"role": "tool", "content": "4"}]}, "messages.0.tool_call_id"),
])
def test_wrong_types_and_values_are_400(http, body, param):
    assert_openai_error(http.post(CHAT, json=body), 400, param=param)


@pytest.mark.parametrize("max_tokens", [0, -1, -(2**40)])
def test_non_positive_max_tokens(http, max_tokens):
    r = http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": max_tokens})
    assert_openai_error(r, 400, param="max_tokens")


@pytest.mark.parametrize("max_tokens", [2048, 10**6, 2**63])
def test_absurd_max_tokens_exceeds_context(http, max_tokens):
    r = http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": max_tokens})
    assert_openai_error(r, 400, param="max_tokens", code="context_length_exceeded")


def test_prompt_longer_than_context(http):
    r = http.post("/v1/completions", json={"model": "fake", "prompt": "x" * 3000, "max_tokens": 1})
    assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")
    r = http.post(CHAT, json={"model": "fake", "messages": [{"role": "user", "content": "y" * 3000}]})
    assert_openai_error(r, 400, param="messages", code="context_length_exceeded")


def test_token_ids_outside_vocabulary(http):
    r = http.post("/v1/completions", json={"model": "fake", "prompt": [5, 10**9], "max_tokens": 1})
    assert_openai_error(r, 400, param="prompt")


def test_unknown_model_is_404(http):
    err = assert_openai_error(http.post(CHAT, json={"model": "gpt-4o", "messages": MSG}), 404, param="model",
                              code="model_not_found")
    assert "gpt-4o" in err["message"]
    assert_openai_error(http.post("/v1/embeddings", json={"model": "fake", "input": "x"}), 404, param="model")


@pytest.mark.parametrize("raw", [b"{", b"not json", b'{"model": "fake",}', b"[1, 2]", b"", b"null"])
def test_malformed_json_is_400(http, raw):
    r = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, code="invalid_json")


def test_invalid_utf8_is_400(http):
    raw = b'{"model": "fake", "messages": [{"role": "user", "content": "caf\xe9 \xff"}]}'
    r = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, code="invalid_utf8")


def test_oversized_body_is_413_by_content_length(http):
    body = json.dumps({"model": "fake", "prompt": "x" * (70 * 1024)}).encode()
    assert_openai_error(http.post("/v1/completions", content=body), 413, code="body_too_large")


def test_oversized_chunked_body_is_413(http):
    def chunks():  # no Content-Length: the limit must hold while the body streams in
        yield b'{"model": "fake", "prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}'

    assert_openai_error(http.post("/v1/completions", content=chunks()), 413, code="body_too_large")


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_embedding_inputs(http):
    assert_openai_error(http.post("/v1/embeddings", json={"model": "fake-embed", "input": []}), 400, param="input")
    assert_openai_error(http.post("/v1/embeddings", json={"model": "fake-embed", "input": "x" * 600}), 400,
                        param="input", code="context_length_exceeded")
    assert_openai_error(http.post("/v1/embeddings", json={"model": "fake-embed", "input": 3}), 400, param="input")


def test_server_still_healthy_and_nothing_leaked(http, fake_server):
    """After all the bad requests: no slot held, no KV block held, and the server answers."""
    _, app = fake_server
    assert http.get("/health").json()["status"] == "ok"
    assert app.state.server.metrics.in_flight == 0
    assert app.state.server.model.engine.stats().kv_blocks_used == 0
