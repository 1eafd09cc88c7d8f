"""Tool calls as small models write them: a reply that is a declared tool's call as bare JSON
(or in a ```json fence, or a list of calls) is read as calls by the hermes, mistral and gemma
parsers, in pieces of every size, streamed and not; prose that mentions a tool, JSON of another
shape and undeclared names stay content; `--tool-call-parser strict` reads the format's markers
only. The real Qwen2.5-Coder files writing such replies: test_tool_calls_real.py."""

import json

import openai
import pytest

from scratchllm.server.app import ServerConfig
from scratchllm.server.json_calls import assemble
from scratchllm.server.tool_calls import ReplyFormat
from scratchllm.server.tool_parsers import TOOL_FORMATS
from tests.server.scripted import TOOLS, arguments, scripted_app

NAMES = ("get_weather", "add")
LENIENT = ("hermes", "mistral", "gemma")
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL_REPLIES = [
    PARIS,
    f"  {PARIS}\n",
    f"```json\n{PARIS}\n```",
    f"```\n{PARIS}\n```",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',
    f'[{PARIS}, {{"name": "add", "arguments": {{"a": 2, "b": 3}}}}]',
]
# replies that mention a tool, or hold JSON, without being a declared tool's call: content, whole
PROSE = [
    "I'll use the get_weather tool to check the weather in Paris.",
    "To get the weather, call get_weather with the city name.",
    'You could call get_weather like this: {"name": "get_weather", "arguments": {"city": "Paris"}}',
    "The get_weather function needs a city. Which city do you mean?",
    "Sure! get_weather(city='Paris') would tell us.",
    '{"temperature": 21, "unit": "celsius"}',
    '{"name": "get_forecast", "arguments": {"city": "Paris"}}',
    '```json\n{"city": "Paris"}\n```',
    '```python\nprint(get_weather("Paris"))\n```',
    "```\nget_weather Paris\n```",
    "[1, 2, 3] are the first three numbers.",
    '["get_weather", "add"] are the tools I have.',
    "{city} is a placeholder in the get_weather template.",
    "Calling tools: none needed. It is sunny in Paris.",
    'I would call {"name": "add"} but the numbers are missing.',
    "The add tool adds two integers; get_weather reports the weather.",
    "```json\n[1, 2]\n```",
    '{"name": 42, "arguments": {}}',
    "Here is the JSON you asked for: {\"name\": \"get_weather\"}",
    "get_weather\n{\"city\": \"Paris\"}",
]


def parse(fmt, text, piece, lenient=True):
    parser = ReplyFormat("auto", TOOL_FORMATS[fmt], NAMES, lenient=lenient).parser()
    parts = [parser.push(text[i:i + piece]) for i in range(0, len(text), piece)]
    end, finish = parser.finish("stop")
    parts.append(end)
    calls = assemble([d for p in parts for d in p.get("tool_calls", [])])
    return "".join(p.get("content", "") for p in parts), calls, finish


@pytest.mark.parametrize("fmt", LENIENT)
@pytest.mark.parametrize("text", CALL_REPLIES)
def test_a_declared_tools_bare_json_is_a_call_in_pieces_of_every_size(fmt, text):
    want = [("get_weather", {"city": "Paris"})] + ([("add", {"a": 2, "b": 3})] if text.startswith("[") else [])
    for piece in range(1, len(text) + 1):
        content, calls, finish = parse(fmt, text, piece)
        assert (content, arguments(calls), finish) == ("", want, "tool_calls"), piece


@pytest.mark.parametrize("fmt", LENIENT)
def test_text_after_a_bare_call_is_content(fmt):
    content, calls, _ = parse(fmt, PARIS + "\n\nI am checking the weather.", 3)
    assert (content, arguments(calls)) == ("I am checking the weather.", [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize("fmt", LENIENT)
@pytest.mark.parametrize("text", PROSE)
def test_a_reply_that_only_mentions_a_tool_stays_content(fmt, text):
    for piece in (1, 2, 5, 1000):
        assert parse(fmt, text, piece) == (text, [], "stop"), piece


@pytest.mark.parametrize("fmt", LENIENT)
def test_strict_reads_only_the_formats_markers(fmt):
    assert parse(fmt, PARIS, 4, lenient=False) == (PARIS, [], "stop")


def test_the_formats_own_markers_still_win():
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    assert arguments(parse("mistral", text, 1)[1]) == [("add", {"a": 1, "b": 2})]
    text = "```tool_code\nadd(a=1, b=2)\n```"
    assert arguments(parse("gemma", text, 1)[1]) == [("add", {"a": 1, "b": 2})]
    text = f"<tool_call>\n{PARIS}\n</tool_call>"
    assert arguments(parse("hermes", text, 1)[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("parser,called", [("auto", True), ("strict", False)])
def test_through_the_server_streamed_and_not(serve, parser, called):
    app, engine = scripted_app("qwen3", ServerConfig(tool_call_parser=parser))
    engine.reply = f"```json\n{PARIS}\n```"
    request = {"model": "fake", "messages": [{"role": "user", "content": "What's the weather in Paris? Use the tool."}],
               "tools": TOOLS[:1], "tool_choice": "auto"}
    with serve(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        whole = client.chat.completions.create(**request)
        with client.chat.completions.stream(**request) as stream:
            streamed = stream.get_final_completion()
    for reply in (whole, streamed):
        choice = reply.choices[0]
        if called:
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
                [("get_weather", {"city": "Paris"})]
        else:
            assert (choice.finish_reason, choice.message.content) == ("stop", engine.reply)
            assert not choice.message.tool_calls
