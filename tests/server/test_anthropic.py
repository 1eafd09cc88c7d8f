"""Anthropic's Messages API, driven by the official `anthropic` client (pinned, test-only) against
a live server over a scripted engine with Qwen3's real chat template: messages.create and
messages.stream with text, a system prompt, a tool round trip, thinking, stop sequences and
count_tokens; every streamed event validated against the SDK's own event types and their order
checked; Anthropic's error shape for unknown fields, refused blocks and bad keys; the capture
records the chat request a Messages request runs as, which replays to the same text. The real
Qwen2.5-Coder model through the same client: test_tool_calls_real.py."""

import json
import re

import anthropic
import httpx
import pydantic
import pytest
from anthropic.types import RawMessageStreamEvent

from scratchllm.evaluate.capture import CaptureWriter
from scratchllm.evaluate.replay import ReplayOptions, replay
from scratchllm.evaluate.sources import read_traffic
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from tests.server.scripted import ScriptedEngine, TemplateTokenizer, scripted_app

WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


class Recording(ScriptedEngine):
    """A scripted engine that writes `replies` in turn and keeps the prompts it was given."""

    def next_token(self, prompt, offset, n):
        if n == 0:
            self.prompts.append(list(prompt))
            self.reply = self.replies.pop(0) if self.replies else self.reply
        return super().next_token(prompt, offset, n)


@pytest.fixture
def server(serve):
    app, _ = scripted_app("qwen3")
    engine = Recording(step_ms=0.2, max_running=8)
    engine.prompts, engine.replies = [], []
    from scratchllm.server.state import ServedModel

    app = create_app(ServedModel("qwen", engine, TemplateTokenizer("qwen3"), 4096), None, ServerConfig(api_key="sk-a"))
    with serve(app) as url, anthropic.Anthropic(base_url=url, api_key="sk-a", max_retries=0) as client:
        yield client, engine, url


def prompt_text(engine, k=-1):
    return bytes(t - 3 for t in engine.prompts[k]).decode()


def test_create_with_a_system_prompt(server):
    client, engine, _ = server
    engine.replies = ["<think>\nA greeting.\n</think>\n\nHello there."]
    msg = client.messages.create(model="qwen", max_tokens=64, system="You are terse.",
                                 messages=[{"role": "user", "content": "Say hello."}])
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert (msg.content[0].thinking, msg.content[1].text) == ("A greeting.", "Hello there.")
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None and msg.role == "assistant"
    assert msg.usage.input_tokens == len(engine.prompts[0]) and msg.usage.output_tokens > 0
    text = prompt_text(engine)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>") and "Say hello." in text


def test_stream_events_are_the_sdks_types_in_anthropics_order(server):
    client, engine, url = server
    engine.replies = ["<think>\nHmm.\n</think>\n\nHi!"]
    body = {"model": "qwen", "max_tokens": 32, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    events = []
    with httpx.stream("POST", url + "/v1/messages", json=body, headers={"x-api-key": "sk-a",
                                                                        "anthropic-version": "2023-06-01"}) as r:
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(EVENTS.validate_python(data, strict=True) if name != "ping" else data)
    kinds = " ".join(e.type for e in events if not isinstance(e, dict))
    # Anthropic's order: message_start, then each block's start, deltas and stop, then the end
    assert re.fullmatch(r"message_start( content_block_start( content_block_delta)* content_block_stop)+ "
                        r"message_delta message_stop", kinds), kinds
    blocks = [e for e in events if getattr(e, "type", "") == "content_block_start"]
    assert [(b.index, b.content_block.type) for b in blocks] == [(0, "thinking"), (1, "text")]
    deltas = [(e.index, e.delta.type) for e in events if getattr(e, "type", "") == "content_block_delta"]
    assert sorted(set(deltas)) == [(0, "signature_delta"), (0, "thinking_delta"), (1, "text_delta")]
    assert deltas.index((0, "signature_delta")) == max(i for i, d in enumerate(deltas) if d[0] == 0)
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens > 0
    # the client's own stream helper builds the same message
    engine.replies = ["<think>\nHmm.\n</think>\n\nHi!"]
    with client.messages.stream(model="qwen", max_tokens=32, messages=[{"role": "user", "content": "Hi"}]) as s:
        assert "".join(s.text_stream) == "Hi!"
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Hi!"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(server, stream):
    client, engine, _ = server
    engine.replies = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                      "It is 21 C in Paris."]
    question = [{"role": "user", "content": "What's the weather in Paris? Use the tool."}]

    def ask(messages):
        kwargs = dict(model="qwen", max_tokens=200, tools=[WEATHER_TOOL], messages=messages)
        if not stream:
            return client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as s:
            return s.get_final_message()

    first = ask(question)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    answer = ask([*question, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]}])
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "It is 21 C in Paris."
    text = prompt_text(engine)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text and '"name": "get_weather"' in text


def test_tool_choice_none_reads_no_calls(server):
    client, engine, _ = server
    engine.replies = ['{"name": "get_weather", "arguments": {"city": "Oslo"}}']
    msg = client.messages.create(model="qwen", max_tokens=200, tools=[WEATHER_TOOL], tool_choice={"type": "none"},
                                 messages=[{"role": "user", "content": "Weather?"}])
    assert msg.stop_reason == "end_turn" and msg.content[0].text == engine.reply


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(server, stream):
    client, engine, _ = server
    engine.reply = "one, two, three, four"
    kwargs = dict(model="qwen", max_tokens=64, stop_sequences=["three"],
                  messages=[{"role": "user", "content": "Count"}])
    if stream:
        with client.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == ("one, two, ", "stop_sequence", "three")
    engine.reply = "one, two"
    msg = client.messages.create(model="qwen", max_tokens=3, messages=[{"role": "user", "content": "Count"}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_only_runs_the_prompt(server, stream):
    client, engine, _ = server
    engine.reply = "never shown"
    kwargs = dict(model="qwen", max_tokens=0, messages=[{"role": "user", "content": "Warm the cache."}])
    if stream:
        with client.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    assert (msg.content, msg.stop_reason, msg.usage.output_tokens) == ([], "max_tokens", 0)


def test_count_tokens_is_the_prompts_length(server):
    client, engine, _ = server
    kwargs = dict(model="qwen", system="Be brief.", tools=[WEATHER_TOOL],
                  messages=[{"role": "user", "content": "Weather in Lyon?"}])
    counted = client.messages.count_tokens(**kwargs)
    engine.replies = ["Sunny."]
    msg = client.messages.create(max_tokens=8, **kwargs)
    assert counted.input_tokens == len(engine.prompts[-1]) == msg.usage.input_tokens


@pytest.mark.parametrize("body,param", [
    ({"foo": 1}, "foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bar": 2}]}]},
     "messages.0.content.0.bar"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),  # Qwen3's template thinks: accepted
])
def test_what_is_refused_is_a_400_in_anthropics_shape(server, body, param):
    client, engine, _ = server
    engine.replies = ["ok"]
    request = {"model": "qwen", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **body}
    if param == "thinking":
        assert client.messages.create(**request).content[0].text == "ok"
        return
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(**{k: v for k, v in request.items() if k != "foo"},
                               extra_body={"foo": 1} if "foo" in body else None)
    assert err.value.status_code == 400 and err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error" and param in err.value.body["error"]["message"]


def test_keys_and_versions(server):
    _, _, url = server
    body = {"model": "qwen", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as err:
            bad.messages.create(**body)
    assert err.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": "sk-a", "anthropic-version": "latest"})
    assert r.status_code == 400 and "anthropic-version" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/messages", json=body, headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_a_model_that_does_not_think_refuses_enabled_thinking(serve):
    model, _ = fake_backend(step_ms=0.2)
    with serve(create_app(model, None, ServerConfig())) as url, \
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as client:
        request = dict(model="fake", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(anthropic.BadRequestError, match="writes no thinking"):
            client.messages.create(thinking={"type": "enabled", "budget_tokens": 2048}, **request)
        assert client.messages.create(thinking={"type": "adaptive"}, **request).stop_reason == "max_tokens"


def test_captured_as_the_chat_request_it_runs_as_and_replayed(tmp_path, serve):
    model, embedder = fake_backend(step_ms=0.5)
    capture = CaptureWriter(tmp_path / "cap", rate=1.0, key="k")
    with serve(create_app(model, embedder, ServerConfig(), capture=capture)) as url:
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as client:
            msg = client.messages.create(model="fake", max_tokens=12, system="Be brief.", extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": "Name a colour."}])
        traffic = read_traffic(tmp_path / "cap")
        store = replay(traffic, tmp_path / "run.sqlite", ReplayOptions(url, url, progress=False))
    (captured,) = traffic.requests
    assert (captured.endpoint, captured.translated_from) == ("/v1/chat/completions", "/v1/messages")
    assert captured.body["messages"] == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Name a colour."}]
    (request,) = store.requests()
    assert store.outputs(request["id"])["primary"].text == msg.content[0].text


def test_every_field_of_the_clients_request_types_is_declared():
    """A field a new `anthropic` client sends fails here before it fails a user (as the openai
    client's fields do in test_unknown_fields.py)."""
    from anthropic import types as t
    from anthropic.types import message_create_params

    from scratchllm.server import anthropic_protocol as ours

    def keys(typed_dict):
        return typed_dict.__required_keys__ | typed_dict.__optional_keys__

    pairs = [(message_create_params.MessageCreateParamsStreaming, ours.AnthropicRequest),
             (t.MessageCountTokensParams, ours.AnthropicCountRequest), (t.ToolParam, ours.ToolIn),
             (t.TextBlockParam, ours.TextBlockIn), (t.ToolUseBlockParam, ours.ToolUseBlockIn),
             (t.ToolResultBlockParam, ours.ToolResultBlockIn), (t.ThinkingBlockParam, ours.ThinkingBlockIn),
             (t.ToolChoiceAutoParam, ours.ToolChoiceIn), (t.ToolChoiceAnyParam, ours.ToolChoiceIn),
             (t.ToolChoiceToolParam, ours.ToolChoiceIn), (t.ToolChoiceNoneParam, ours.ToolChoiceIn),
             (t.ThinkingConfigEnabledParam, ours.ThinkingIn), (t.ThinkingConfigAdaptiveParam, ours.ThinkingIn),
             (t.OutputConfigParam, ours.OutputConfig), (t.MetadataParam, ours.MetadataIn),
             (t.CacheControlEphemeralParam, ours.CacheControl), (t.UserMessageParam, ours.Turn)]
    for theirs, model in pairs:
        declared = {f.alias or name for name, f in model.model_fields.items()}
        assert keys(theirs) <= declared, (theirs.__name__, keys(theirs) - declared)
    # and the sampling fields older clients send
    assert {"temperature", "top_p", "top_k"} <= set(ours.AnthropicRequest.model_fields)


def test_the_docs_list_every_field_with_a_status():
    from pathlib import Path

    from scratchllm.server.anthropic_protocol import AnthropicRequest

    text = (Path(__file__).parents[2] / "docs" / "anthropic-api.md").read_text()
    section = text.split("## POST /v1/messages\n")[1].split("### ")[0]
    rows = re.findall(r"^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \| ([a-z ,]+?) \|", section, flags=re.M)
    documented = {name: status for names, status in rows for name in re.findall(r"`([a-z_]+)`", names)}
    assert set(AnthropicRequest.model_fields) == set(documented)
    assert set(documented.values()) <= {"implemented", "refused unless neutral", "accepted, no effect"}
