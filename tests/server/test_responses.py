"""/v1/responses with the official client's `responses.create` and `responses.stream`: against a
`scratchllm serve --fake-engine` process, against family templates with scripted replies (tool
calls, thinking, a tool loop sent back as input items), and on the default model with a JSON
schema as `text.format` (checked with jsonschema)."""

import json

import httpx
import jsonschema
import openai
import pytest

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import load_model
from tests.server.scripted import QUESTION, TOOLS, TemplateTokenizer, scripted_app, template_reply
from tests.server.test_sigterm import serve as serve_process

RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_create_and_stream_against_scratchllm_serve():
    with serve_process("--fake-step-ms", "1") as (_, url, _log), _client(url) as client:
        chat = client.chat.completions.create(model="fake", messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], max_tokens=12,
            temperature=0)
        r = client.responses.create(model="fake", instructions="Be brief.", input="Hello", max_output_tokens=12,
                                    temperature=0)
        with client.responses.stream(model="fake", instructions="Be brief.", input="Hello", max_output_tokens=12,
                                     temperature=0) as stream:
            events = list(stream)
        # a reply cut by max_output_tokens ends with response.incomplete (the helper then has no final)
        assert events[-1].type == "response.incomplete"
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds.index("response.output_text.done") < kinds.index("response.content_part.done") \
        < kinds.index("response.output_item.done") < kinds.index("response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text == events[-1].response.output_text


def test_a_whole_reply_streams_to_the_helpers_final_response(serve):
    app, engine = scripted_app("llama3")
    engine.reply = "Lyon is sunny today."
    with serve(app) as url, _client(url) as client:
        full = client.responses.create(model="fake", input="Weather in Lyon?")
        with client.responses.stream(model="fake", input="Weather in Lyon?") as stream:
            final = stream.get_final_response()
    assert full.status == final.status == "completed"
    assert full.output_text == final.output_text == "Lyon is sunny today."
    assert [o.type for o in final.output] == ["message"] and final.output[0].status == "completed"


def test_function_calls_and_thinking_as_output_items(serve):
    app, engine = scripted_app("qwen3")
    engine.reply = template_reply("qwen3", [("get_weather", {"city": "Lyon"}), ("add", {"a": 2, "b": 3})],
                                  content="Checking.", reasoning="Two tools are needed.")
    kw = {"model": "fake", "input": QUESTION[0]["content"], "tools": RESPONSE_TOOLS}
    with serve(app) as url, _client(url) as client:
        full = client.responses.create(**kw)
        with client.responses.stream(**kw) as stream:
            final = stream.get_final_response()
    for r in (full, final):
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call", "function_call"]
        assert r.output[0].content[0].text == "Two tools are needed." and r.output[1].content[0].text == "Checking."
        calls = [(o.name, json.loads(o.arguments)) for o in r.output[2:]]
        assert calls == [("get_weather", {"city": "Lyon"}), ("add", {"a": 2, "b": 3})]
        assert all(o.call_id and o.status == "completed" for o in r.output[2:]) and r.status == "completed"


def test_a_tool_loop_sent_back_as_input_items_renders_as_the_chat_conversation(serve):
    app, engine = scripted_app("qwen3")
    engine.reply = "It is 21 degrees."
    items = [{"role": "user", "content": "Weather in Lyon?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"celsius": 21}'}]
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Lyon?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Lyon"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
    tok = TemplateTokenizer("qwen3")
    with serve(app) as url, _client(url) as client:
        r = client.responses.create(model="fake", instructions="Use tools.", input=items, tools=RESPONSE_TOOLS)
    assert r.output_text == "It is 21 degrees."
    assert r.usage.input_tokens == len(tok.encode(tok.apply_chat_template(chat, tools=TOOLS)))


@pytest.mark.parametrize("field,value", [("store", True), ("previous_response_id", "resp_1"),
                                         ("background", True), ("reasoning", {"effort": "high"}), ("foo", 1)])
def test_what_a_stateless_server_cannot_do_is_a_400_naming_it(fake_server, field, value):
    url, _ = fake_server
    r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "hi", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


@pytest.mark.slow
def test_structured_output_on_the_default_model(serve):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}}
    app = create_app(load_model("default", "default", {}), None, ServerConfig())
    with serve(app) as url, _client(url) as client:
        kw = {"model": "default", "input": "Name the capital of France as JSON.", "text": text,
              "max_output_tokens": 60, "temperature": 0}
        r = client.responses.create(**kw)
        with client.responses.stream(**kw) as stream:
            final = stream.get_final_response()
    jsonschema.validate(json.loads(r.output_text), schema)
    assert final.output_text == r.output_text and r.text.format.type == "json_schema"
