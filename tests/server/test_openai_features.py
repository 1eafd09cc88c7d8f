"""n choices, best_of, echo, text_offset, cached_tokens, tools and the hostile corpus, through
HTTP with the official `openai` client, against a live server over the fake engine.

The fake engine is deterministic per (prompt, seed), so each choice is checked against a single
request of its own; what needs a real model's logits (penalties, grammars on real text) is in
test_openai_model_features.py.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from scratchllm.engine.fake import FakeTokenizer
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from tests.server.hostile_corpus import CORPUS

TOK = FakeTokenizer()
MSG = [{"role": "user", "content": "Name three colours."}]
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@pytest.fixture(scope="module")
def client(fake_server):
    url, _ = fake_server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def http(fake_server):
    url, _ = fake_server
    with httpx.Client(base_url=url, timeout=20) as c:
        yield c


def assert_openai_error(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


def test_chat_n3_choices_equal_single_runs_seeded_s_to_s_plus_2(client):
    kw = {"model": "fake", "messages": MSG, "max_tokens": 12, "temperature": 0.9}
    r = client.chat.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=40 + i, **kw).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in r.choices] == singles
    assert len(set(singles)) > 1  # the seeds differ, so the choices do
    one = client.chat.completions.create(seed=40, **kw)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once
    assert r.usage.completion_tokens == 3 * 12


def test_completions_n_over_two_prompts_indexes_choices_per_prompt(client):
    kw = {"model": "fake", "max_tokens": 6, "temperature": 0.7}
    r = client.completions.create(prompt=["first", "second one"], n=2, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [client.completions.create(prompt=p, seed=7 + i, **kw).choices[0].text
            for p in ("first", "second one") for i in range(2)]
    assert [c.text for c in r.choices] == want
    assert r.usage.prompt_tokens == len(TOK.encode("first")) + len(TOK.encode("second one"))


def test_streamed_n3_chunks_carry_the_choice_index(client):
    kw = {"model": "fake", "messages": MSG, "max_tokens": 10, "temperature": 0.9, "seed": 3, "n": 3}
    full = client.chat.completions.create(**kw)
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 30
            assert chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert texts == [c.message.content for c in full.choices]
    assert finish == ["length"] * 3


def test_best_of_generates_all_and_returns_n(client, fake_server):
    kw = {"model": "fake", "prompt": "pick the best", "max_tokens": 5, "temperature": 0.8, "seed": 11}
    r = client.completions.create(n=1, best_of=3, **kw)
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 15  # every generated choice is billed, as OpenAI does
    # the fake gives every sampled token the same logprob: a tie, which goes to the earliest choice
    assert r.choices[0].text == client.completions.create(**kw).choices[0].text


def test_best_of_and_n_refusals(http):
    base = {"model": "fake", "prompt": "x", "max_tokens": 2}
    assert assert_openai_error(http.post("/v1/completions", json={**base, "n": 3, "best_of": 2}))["param"] == "best_of"
    err = assert_openai_error(http.post("/v1/completions", json={**base, "best_of": 2, "stream": True}))
    assert err["param"] == "best_of"


def test_echo_puts_the_prompt_first(client):
    r = client.completions.create(model="fake", prompt="Once upon", max_tokens=8, temperature=0, echo=True)
    plain = client.completions.create(model="fake", prompt="Once upon", max_tokens=8, temperature=0)
    assert r.choices[0].text == "Once upon" + plain.choices[0].text
    ids = TOK.encode("Hi ☕")
    r = client.completions.create(model="fake", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hi ☕")  # token-id prompts are echoed as their text
    chunks = list(client.completions.create(model="fake", prompt="Once upon", max_tokens=8, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Once upon" + plain.choices[0].text


def reference_offsets(text_bytes: bytes, n_tokens: int) -> list[int]:
    """Byte-level tokens: token i starts after the complete characters of the bytes before it."""
    return [len(text_bytes[:i].decode("utf-8", errors="ignore")) for i in range(n_tokens)]


def test_text_offset_is_each_tokens_character_offset(client):
    # the fake's phrase holds 2- and 3-byte characters, so offsets and byte counts differ
    for prompt in ("a", "quick", "café"):
        r = client.completions.create(model="fake", prompt=prompt, max_tokens=40, temperature=0, logprobs=1)
        c = r.choices[0]
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 40
        assert lp.text_offset == reference_offsets(c.text.encode(), 40)
        for tok, at in zip(lp.tokens, lp.text_offset, strict=True):
            if "\ufffd" not in tok:  # a whole character: it is in the text where its offset says
                assert c.text[at:at + len(tok)] == tok


def test_usage_reports_cached_tokens(http):
    r = http.post("/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": 2}).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the fake has no prefix cache
    r = http.post("/v1/chat/completions", json={"model": "fake", "messages": MSG, "max_tokens": 2}).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_choice_auto_without_a_tool_template_is_a_clear_400(http):
    for choice in (None, "auto"):
        body = {"model": "fake", "messages": MSG, "tools": TOOLS, "tool_choice": choice}
        err = assert_openai_error(http.post("/v1/chat/completions", json=body))
        assert err["param"] == "tool_choice" and "template" in err["message"]


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model="fake", messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_structured_output_on_the_fake_engine_is_honoured(http):
    """The fake's byte tokenizer feeds llguidance and its rows go through the one sampling path:
    a constrained request gets text its grammar accepts."""
    schema = {"type": "string", "enum": ["red", "green", "blue"]}
    body = {"model": "fake", "messages": MSG, "temperature": 0, "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert json.loads(choice["message"]["content"]) in schema["enum"] and choice["finish_reason"] == "stop"
    body = {"model": "fake", "messages": MSG, "temperature": 0, "max_tokens": 8, "guided_regex": "[0-9]+"}
    assert re.fullmatch("[0-9]{8}", http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"][
        "content"])


class TextOnlyTokenizer(FakeTokenizer):
    byte_level = False  # a tokenizer whose tokens are not byte strings cannot feed llguidance


def test_structured_output_without_grammar_support_is_a_400(serve):
    """Constrained requests on a tokenizer that cannot feed llguidance are refused, never ignored."""
    model, _ = fake_backend(step_ms=1.0)
    model.tokenizer = TextOnlyTokenizer()
    try:
        with serve(create_app(model, None, ServerConfig())) as url, httpx.Client(base_url=url, timeout=20) as http:
            for body in ({"response_format": {"type": "json_object"}}, {"tool_choice": "required", "tools": TOOLS},
                         {"guided_regex": "[0-9]+"}):
                r = http.post("/v1/chat/completions", json={"model": "fake", "messages": MSG, **body})
                assert assert_openai_error(r)["param"] in ("response_format", "tool_choice", "guided_regex")
    finally:
        model.engine.shutdown(drain=False)


@pytest.mark.parametrize("name,endpoint,raw", CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_corpus_over_http_is_a_4xx(http, name, endpoint, raw):
    raw = raw.replace(b'"model": "m"', b'"model": "fake"')  # past the model check, into the handlers
    r = http.post(ENDPOINTS[endpoint], content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r)


def test_server_healthy_after_the_corpus(http, fake_server):
    with ThreadPoolExecutor(4) as pool:  # a few concurrent requests still go through
        rs = list(pool.map(lambda _: http.post("/v1/completions", json={"model": "fake", "prompt": "ok",
                                                                        "max_tokens": 3}), range(8)))
    assert all(r.status_code == 200 for r in rs)
    assert http.get("/health").json()["status"] == "ok"
    state = fake_server[1].state.server
    assert state.metrics.in_flight == 0 and state.model.engine.stats().kv_blocks_used == 0


def test_openapi_describes_the_request_bodies(http):
    spec = http.get("/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        schema = spec["components"]["schemas"][model]
        assert "model" in schema["required"] and "temperature" in schema["properties"]
    refs = {m for m in json.dumps(spec).split('"#/components/schemas/')[1:]}
    for ref in refs:  # every reference resolves inside the document
        assert ref.split('"')[0] in spec["components"]["schemas"]


def test_more_choices_than_the_server_ever_holds_is_a_400(serve):
    model, embedder = fake_backend(step_ms=0.5)
    with serve(create_app(model, embedder, ServerConfig(max_in_flight=4))) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": ["a", "b", "c"], "n": 2,
                                                      "max_tokens": 2})
        err = assert_openai_error(r)
        assert r.status_code == 400 and err["param"] == "n"
        ok = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
