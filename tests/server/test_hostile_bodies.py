"""parse_body against a corpus of hostile bodies and against fuzzed JSON: every bad body ends
as a 4xx APIError with an OpenAI-shaped body, and no other exception ever escapes."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from tests.server.hostile_corpus import CORPUS

MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}


def assert_openai_error(err: APIError) -> None:
    assert 400 <= err.status < 500
    body = json.loads(json.dumps(err.body()))  # serializable, as the server sends it
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    body["error"]["message"].encode("utf-8")  # the message itself must be valid text


@pytest.mark.parametrize("name,endpoint,raw", CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_body_is_a_4xx(name, endpoint, raw):
    with pytest.raises(APIError) as info:
        parse_body(raw, MODELS[endpoint])
    assert_openai_error(info.value)


def test_corpus_names_are_unique():
    names = [c[0] for c in CORPUS]
    assert len(names) == len(set(names)) and len(names) >= 100


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)
FIELDS = sorted(set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from(sorted(MODELS)),
       body=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6),
       base=st.booleans())
def test_fuzzed_bodies_parse_or_fail_cleanly(endpoint, body, base):
    if base:  # mostly valid requests with one or more fields fuzzed reach deeper validation
        body = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **body}
    raw = json.dumps(body).encode()
    try:
        parse_body(raw, MODELS[endpoint])
    except APIError as err:
        assert_openai_error(err)


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=64))
def test_random_bytes_fail_cleanly(raw):
    try:
        parse_body(raw, ChatCompletionRequest)
    except APIError as err:
        assert_openai_error(err)


def test_an_undeclared_tools_field_is_refused_or_an_extra_not_a_crash():
    """Found by the fuzzer: completions do not declare 'tools': a 400 naming it, or (lenient) an
    unknown extra field the tool plan must not read as validated tools."""
    body = b'{"model":"m","prompt":"hi","tools":[null]}'
    with pytest.raises(APIError) as refused:
        parse_body(body, CompletionRequest)
    assert refused.value.status == 400 and refused.value.body()["error"]["param"] == "tools"
    req = parse_body(body, CompletionRequest, lenient=True)
    assert req.tool_plan().mode == "none"
