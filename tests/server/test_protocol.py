"""The OpenAI request models: every field of the official client's request types is declared,
unknown fields are logged once, nulls mean defaults, and a parsed request becomes the right
SamplingParams, tool plan and constraint."""

import json
import logging
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from scratchllm.sampling import SamplingParams
from scratchllm.server import protocol
from scratchllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    validate_choices,
)

DOCS = Path(__file__).parents[2] / "docs" / "openai-api.md"


def openai_fields(module) -> set[str]:
    # `stream` is declared on the Streaming/NonStreaming subclasses, the rest on the base
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def chat(**extra) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return parse_body(json.dumps(body).encode(), ChatCompletionRequest)


def cmpl(**extra) -> CompletionRequest:
    return parse_body(json.dumps({"model": "m", "prompt": "hi", **extra}).encode(), CompletionRequest)


def test_every_openai_field_is_declared():
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    assert openai_fields(completion_create_params) <= set(CompletionRequest.model_fields)
    assert openai_fields(chat_params) <= set(ChatCompletionRequest.model_fields)


def test_docs_list_every_field_with_a_status():
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    text = DOCS.read_text()
    sections = text.split("## ")
    for title, fields in (("Completions", openai_fields(completion_create_params)),
                          ("Chat completions", openai_fields(chat_params))):
        section = next(s for s in sections if s.startswith(title))
        rows = dict(re.findall(r"^\| `([a-z_]+)` \| ([a-z ,0-9]+?) \|", section, flags=re.M))
        assert fields <= set(rows), sorted(fields - set(rows))
        assert set(rows.values()) <= {"implemented", "refused unless neutral", "accepted, no effect",
                                      "extension", "refused unless 1"}


def test_unknown_fields_are_logged_once_when_lenient(caplog):
    protocol._warned_fields.discard("x_custom_field")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with caplog.at_level(logging.WARNING, logger="scratchllm.server.protocol"):
        for value in (1, 2):
            raw = json.dumps({**body, "x_custom_field": value}).encode()
            parse_body(raw, ChatCompletionRequest, lenient=True)
    hits = [r for r in caplog.records if "x_custom_field" in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelno == logging.WARNING


def test_nulls_mean_defaults_as_the_official_client_sends_them():
    req = chat(temperature=None, top_p=None, n=None, stop=None, seed=None, logprobs=None, presence_penalty=None)
    assert req.temperature == 1.0 and req.top_p == 1.0 and req.n == 1 and req.stop_list() == ()


def test_sampling_kwargs_carry_every_sampling_field():
    req = chat(temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, repetition_penalty=1.1, presence_penalty=0.5,
               frequency_penalty=-0.5, logit_bias={"5": -100, "7": 2}, seed=-1, stop=["x"], stop_token_ids=[3],
               ignore_eos=True, logprobs=True, top_logprobs=2, min_tokens=2, skip_special_tokens=False,
               include_stop_str_in_output=True)
    p = req.sampling_params(max_tokens=8, vocab_size=100, eos_token_id=9)
    assert p == SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, repetition_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={5: -100, 7: 2},
                               seed=2**64 - 1, stop=("x",), stop_token_ids=(3,), ignore_eos=True, logprobs=2,
                               min_tokens=2, skip_special_tokens=False, include_stop_str_in_output=True)
    # min_tokens holds back the tokenizer's EOS, unless ignore_eos already does
    assert chat(min_tokens=2).sampling_params(8, eos_token_id=9).eos_token_ids == (9,)
    assert cmpl(logprobs=3).sampling_params(4).logprobs == 3
    assert chat().sampling_params(4).logprobs is None and chat(logprobs=True).sampling_params(4).logprobs == 0


def test_logit_bias_outside_the_vocabulary_is_a_400():
    with pytest.raises(APIError, match="outside the vocabulary") as info:
        chat(logit_bias={"500": 1}).sampling_params(4, vocab_size=100)
    assert info.value.param == "logit_bias"


def test_choices():
    assert validate_choices(1, None, False) == (1, 1)
    assert validate_choices(3, 5, False, max_n=8) == (3, 5)
    assert validate_choices(4, None, True) == (4, 4)  # n > 1 streams; best_of > n does not
    for args, param in (((2, None, False, 1), "n"), ((3, 2, False, 8), "best_of"), ((1, 2, True, 8), "best_of"),
                        ((17, None, False), "n")):
        with pytest.raises(APIError) as info:
            validate_choices(*args)
        assert info.value.param == param


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}}]


@pytest.mark.parametrize("choice,mode,names", [
    (None, "auto", ["get_weather", "noop"]),
    ("auto", "auto", ["get_weather", "noop"]),
    ("none", "none", ["get_weather", "noop"]),
    ("required", "forced", ["get_weather", "noop"]),
    ({"type": "function", "function": {"name": "noop"}}, "forced", ["noop"]),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}, "forced", ["get_weather"]),
])
def test_tool_plan(choice, mode, names):
    plan = chat(tools=TOOLS, tool_choice=choice).tool_plan()
    assert plan.mode == mode and [t["name"] for t in plan.tools] == names


def test_constraints_are_found_in_each_field():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat(response_format=rf).constraint() == ("json_schema", "response_format", (schema, True))
    assert chat(response_format={"type": "json_object"}).constraint()[0] == "json_object"
    assert chat(response_format={"type": "text"}).constraint() is None
    assert cmpl(guided_json=json.dumps(schema)).constraint() == ("json_schema", "guided_json", (schema, True))
    assert cmpl(guided_regex="[0-9]+").constraint() == ("regex", "guided_regex", "[0-9]+")
    assert cmpl(guided_choice=["a", "b"]).constraint() == ("choice", "guided_choice", ["a", "b"])
    assert chat(tools=TOOLS, tool_choice="required").constraint()[0] == "tool_call"
    with pytest.raises(APIError, match="structured output is not available"):
        chat(response_format={"type": "json_object"}).sampling_params(4)  # no compiler for this model


def test_the_official_clients_parse_payload_is_read():
    """What client.chat.completions.parse(response_format=Model) sends."""
    from openai.lib._parsing._completions import type_to_response_format_param

    class Person(BaseModel):
        name: str
        age: int

    rf = type_to_response_format_param(Person)
    kind, _, (schema, strict) = chat(response_format=rf).constraint()
    assert kind == "json_schema" and strict and schema["required"] == ["name", "age"]


def test_messages_for_the_template_keep_tool_calls_and_ids():
    req = parse_body(json.dumps({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12C"},
    ]}).encode(), ChatCompletionRequest)
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12C", "tool_call_id": "c1"},
    ]


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "x"}], "suffix": "s"}, "suffix"),  # chat has no suffix: unknown
])
def test_errors_name_the_field(body, param):
    raw = json.dumps({"model": "m", **body}).encode()
    with pytest.raises(APIError) as info:
        parse_body(raw, ChatCompletionRequest)
    assert info.value.param == param and param in info.value.message


def test_neutral_values_of_refused_fields_pass():
    chat(audio=None, modalities=["text"], store=False, functions=[], function_call="none", metadata={"k": "v"},
         service_tier="auto", prediction={"type": "content", "content": "x"}, parallel_tool_calls=False)
    cmpl(suffix="", echo=True, best_of=1, n=1)


def test_tools_on_completions_are_an_unknown_field_not_a_tool_plan():
    """Completions has no tools: the field is an extra holding raw JSON, never read as tools."""
    raw = json.dumps({"model": "m", "prompt": "hi", "tools": [None], "tool_choice": "required"}).encode()
    with pytest.raises(APIError, match="arguments supplied: tools, tool_choice"):
        parse_body(raw, CompletionRequest)
    req = parse_body(raw, CompletionRequest, lenient=True)
    assert req.tool_plan().mode == "none" and req.constraint() is None
