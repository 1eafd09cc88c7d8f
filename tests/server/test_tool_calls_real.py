"""Tool calls as the real Qwen2.5-Coder files write them. Asked "What's the weather in Paris?
Use the tool." with one get_weather tool and tool_choice auto, both sizes answer with the call's
bare JSON (not the <tool_call> tags their template asks for); the server returns it as a
tool_calls entry with {"city": "Paris"}, streamed and not (the official openai client's stream
helper assembles the deltas). Through the official anthropic client on the 0.5B, the same
question is a tool round trip: a tool_use block, then the tool_result, then the answer. The
model runs as `serve` runs it (dtype "auto"), greedy.
The parsers on replies that only mention a tool: test_lenient_calls.py."""

import json

import anthropic
import openai
import pytest

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import load_model

pytestmark = pytest.mark.slow
QUESTION = "What's the weather in Paris? Use the tool."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
          "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": SCHEMA}}]


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def served(request, serve_module):
    name = request.param
    model = load_model(name, name, {"dtype": "auto", "max_model_len": 2048})
    with serve_module(create_app(model, None, ServerConfig())) as url:
        yield url, name


def test_the_weather_question_is_a_tool_call_streamed_and_not(served):
    url, name = served
    request = {"model": name, "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
               "tool_choice": "auto", "temperature": 0, "max_tokens": 60}
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        whole = client.chat.completions.create(**request)
        with client.chat.completions.stream(**request) as stream:
            streamed = stream.get_final_completion()
    for reply in (whole, streamed):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_an_anthropic_tool_round_trip(served):
    url, name = served
    if name != "qwen2.5-coder-0.5b":
        pytest.skip("one size is enough for the round trip")
    tool = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": SCHEMA}
    question = [{"role": "user", "content": QUESTION}]
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as client:
        first = client.messages.create(model=name, max_tokens=60, tools=[tool], messages=question,
                                       extra_body={"temperature": 0})
        assert first.stop_reason == "tool_use"
        (call,) = [b for b in first.content if b.type == "tool_use"]
        assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
        follow = [*question, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "Sunny, 21 degrees Celsius"}]}]
        # the answer: tool_choice none (the 0.5B, left to choose, calls the tool again)
        with client.messages.stream(model=name, max_tokens=40, tools=[tool], tool_choice={"type": "none"},
                                    messages=follow, extra_body={"temperature": 0}) as stream:
            answer = stream.get_final_message()
        counted = client.messages.count_tokens(model=name, tools=[tool], tool_choice={"type": "none"},
                                               messages=follow)
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert answer.stop_reason in ("end_turn", "max_tokens") and "21" in text, answer
    assert counted.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
