"""Tool calls per model family: each family's reply, as its own chat template writes tool calls
(tests/server/scripted.py), parsed into OpenAI tool calls by the format the server picks from
that template, unstreamed and streamed (the official client's stream helper assembles the
deltas and their logprobs), whole and cut by max_tokens; and the parsers alone, fed in pieces of
every size."""

import json

import openai
import pytest

from scratchllm.engine.protocol import RequestOutput
from scratchllm.server.app import ServerConfig
from scratchllm.server.json_calls import assemble
from scratchllm.server.reasoning import BRACKETS, TAGS
from scratchllm.server.tool_calls import ReplyFormat, message
from scratchllm.server.tool_parsers import TOOL_FORMATS, detect
from tests.server.scripted import FAMILIES, QUESTION, TOOLS, TemplateTokenizer, arguments, scripted_app, template_reply

CALLS = [("get_weather", {"city": "Lyon", "unit": "celsius"}), ("add", {"a": 2, "b": 3})]
NAMES = ("get_weather", "add")
THINKING = {"qwen3": TAGS, "mistral_v13_think": BRACKETS}  # the families whose templates write thinking
# the others' templates drop text beside calls
WRITES_CONTENT = {"qwen3", "gemma3", "mistral_v11", "mistral_v13", "mistral_v13_think"}


def family_calls(family):
    return CALLS[:1] if family == "llama3" else CALLS  # Llama 3.1's template takes one call per turn


def parse(fmt, text, piece, thinking=None, finish_reason="stop"):
    parser = ReplyFormat("auto", TOOL_FORMATS[fmt], NAMES, thinking=thinking).parser()
    parts = [parser.push(text[i:i + piece]) for i in range(0, len(text), piece)]
    end, finish = parser.finish(finish_reason)
    parts.append(end)
    content = "".join(p.get("content", "") for p in parts)
    return content, assemble([d for p in parts for d in p.get("tool_calls", [])]), finish


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_format_is_the_one_the_template_writes(family):
    assert detect(TemplateTokenizer(family).spec.chat_template) == FAMILIES[family]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 10_000])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_reply_parses_to_its_calls_in_pieces_of_any_size(family, piece):
    text = template_reply(family, family_calls(family), content="I will look that up.")
    content, calls, finish = parse(FAMILIES[family], text, piece, thinking=THINKING.get(family))
    assert arguments(calls) == family_calls(family) and finish == "tool_calls"
    assert [c["id"] for c in calls] and all(c["type"] == "function" for c in calls)
    assert content == ("I will look that up." if family in WRITES_CONTENT else "")
    if FAMILIES[family] == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)  # its templates refuse other ids


@pytest.mark.parametrize("fmt,text,content", [
    ("hermes", "Plain <tool_call>not json</tool_call> done <tool", "Plain <tool_call>not json</tool_call> done <tool"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("llama3_json", "The answer is {x}.", "The answer is {x}."),
    ("gemma", "```tool_code\nimport os\n```", "```tool_code\nimport os\n```"),  # not calls: text
    ("gemma", "```tool_code\nget_weather('Lyon')\n```", "```tool_code\nget_weather('Lyon')\n```"),
])
def test_text_that_only_looks_like_a_call_stays_content(fmt, text, content):
    for piece in (1, 4, 1000):
        got, calls, finish = parse(fmt, text, piece)
        assert (got, calls, finish) == (content, [], "stop")


def test_llama3_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lyon"}}; {"name": "add", "parameters": {}}'
    _, calls, _ = parse("llama3_json", text, 3)
    assert arguments(calls) == [("get_weather", {"city": "Lyon"}), ("add", {})]


@pytest.mark.parametrize("family", ["mistral_v11", "mistral_v13"])
def test_mistral_calls_one_per_marker_parse_alike_in_pieces_of_every_size(family):
    text = template_reply(family, CALLS, content="I will look that up.")  # [TOOL_CALLS]name([CALL_ID]id)[ARGS]{..}
    for piece in range(1, len(text) + 1):
        content, calls, finish = parse("mistral", text, piece)
        assert (content, arguments(calls), finish) == ("I will look that up.", CALLS, "tool_calls"), piece


@pytest.mark.parametrize("family", ["mistral_v11", "mistral_v13"])
def test_a_mistral_call_cut_anywhere_is_a_call_once_its_name_is_known(family):
    text = template_reply(family, CALLS[:1], content="Let me check.")
    opened = text.index("[TOOL_CALLS]") + len("[TOOL_CALLS]")
    args_at = text.index("[ARGS]") + len("[ARGS]")
    for length in range(len(text) + 1):
        content, calls, finish = parse("mistral", text[:length], 1, finish_reason="length")
        assert finish == "length"
        if length < opened:  # a cut marker is the model's text
            assert (content, calls) == (text[:length], [])
            continue
        assert content == "Let me check."
        # "g" already picks get_weather over add; the arguments as far as they were written
        written = [("get_weather", text[args_at:length])] if length > opened else []
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == written


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_reply_cut_inside_a_call_is_a_cut_call_never_content(family):
    text = template_reply(family, CALLS[:1])
    marker = "unit=" if family == "gemma3" else '"Ly'
    cut = text[:text.index(marker) + len(marker)]
    for piece in (1, 5, 1000):
        parser = ReplyFormat("auto", TOOL_FORMATS[FAMILIES[family]], NAMES, thinking=THINKING.get(family)).parser()
        parts = [parser.push(cut[i:i + piece]) for i in range(0, len(cut), piece)]
        end, finish = parser.finish("length")
        parts.append(end)
        assert not "".join(p.get("content", "") for p in parts)
        (call,) = assemble([d for p in parts for d in p.get("tool_calls", [])])
        assert finish == "length" and call["function"]["name"] == "get_weather"
        assert call["function"]["arguments"] in ('{"city": "Ly', '{"city": "Lyon"')  # as far as it was written


@pytest.mark.parametrize("length", range(1, 60))
def test_a_forced_call_cut_anywhere_is_a_call_once_its_name_is_known(length):
    text = json.dumps({"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}})[:length]
    out = RequestOutput("r", None, [1], text=text, finish_reason="length")
    for names in (("get_weather", "add"), ("get_weather",)):  # "required" over two tools; a named function
        msg, finish = message(ReplyFormat("forced", None, names), out.text, "length")
        assert finish == "length" and msg["content"] is None or msg["content"] == ""
        assert text not in (msg["content"] or "") or not text
        calls = msg.get("tool_calls") or []
        unique = len(names) == 1 or len(text) > len('{"name": "')  # "g" already picks get_weather over add
        assert [c["function"]["name"] for c in calls] == (["get_weather"] if unique else [])
        if calls:
            assert ('{"name": "get_weather", "arguments": ' + calls[0]["function"]["arguments"]).startswith(text) \
                or len(text) < len('{"name": "get_weather", "arguments": ')


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_reply_through_the_server_streamed_and_not(serve, family):
    app, engine = scripted_app(family)
    engine.reply = template_reply(family, family_calls(family), content="Let me check.")
    kw = {"model": "fake", "messages": QUESTION, "tools": TOOLS, "max_tokens": 400, "logprobs": True}
    with serve(app) as url, _client(url) as client:
        full = client.chat.completions.create(**kw).choices[0]
        with client.chat.completions.stream(**kw) as stream:
            streamed = stream.get_final_completion().choices[0]
    assert full.finish_reason == streamed.finish_reason == "tool_calls"
    # the tokens of the call's markup, which the parser holds back, still stream their logprobs
    assert streamed.logprobs.content == full.logprobs.content
    assert len(full.logprobs.content) == len(engine.reply.encode()) + 1  # a byte token each, and the end token
    assert arguments(full.message.tool_calls) == arguments(streamed.message.tool_calls) == family_calls(family)
    said = "Let me check." if family in WRITES_CONTENT else None
    assert full.message.content == said and (streamed.message.content or None) == said  # a stream starts with ""
    assert [c.id for c in full.message.tool_calls] != [c.id for c in streamed.message.tool_calls]  # fresh ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_call_cut_by_max_tokens_through_the_server(serve, family):
    app, engine = scripted_app(family)
    engine.reply = template_reply(family, CALLS[:1])
    cut = len(engine.reply[:engine.reply.index("Lyon") + 2].encode())  # byte tokens: the cut is inside "Lyon"
    kw = {"model": "fake", "messages": QUESTION, "tools": TOOLS, "max_tokens": cut}
    with serve(app) as url, _client(url) as client:
        full = client.chat.completions.create(**kw).choices[0]
        deltas, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                assert not c.delta.content
                deltas += [d.model_dump(exclude_none=True) for d in c.delta.tool_calls or []]
                finish = c.finish_reason or finish
    streamed = assemble(deltas)
    assert full.finish_reason == finish == "length" and not full.message.content
    (call,) = full.message.tool_calls
    assert call.function.name == streamed[0]["function"]["name"] == "get_weather"
    assert call.function.arguments == streamed[0]["function"]["arguments"]
    assert call.function.arguments.startswith('{"city": "Ly') and "Lyon" not in call.function.arguments


def test_tool_choice_none_shows_no_tools_and_parses_no_calls(serve):
    app, engine = scripted_app("qwen3")
    engine.reply = template_reply("qwen3", CALLS[:1])
    tok = TemplateTokenizer("qwen3")
    with serve(app) as url, _client(url) as client:
        r = client.chat.completions.create(model="fake", messages=QUESTION, tools=TOOLS, tool_choice="none",
                                                 max_tokens=400)
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(QUESTION)))
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_the_parser_option_overrides_the_template(serve):
    app, engine = scripted_app("qwen3", ServerConfig(tool_call_parser="llama3_json"))
    engine.reply = '{"name": "add", "parameters": {"a": 1}}'
    with serve(app) as url, _client(url) as client:
        r = client.chat.completions.create(model="fake", messages=QUESTION, tools=TOOLS, max_tokens=400)
    assert arguments(r.choices[0].message.tool_calls) == [("add", {"a": 1})]


def test_allowed_tools_in_auto_mode_show_only_those(serve):
    app, engine = scripted_app("qwen3")
    engine.reply = "ok"
    tok = TemplateTokenizer("qwen3")
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}
    with serve(app) as url, _client(url) as client:
        r = client.chat.completions.create(model="fake", messages=QUESTION, tools=TOOLS, tool_choice=allowed,
                                                 max_tokens=5)
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(QUESTION, tools=TOOLS[1:])))
    assert r.choices[0].message.content == "ok" and r.choices[0].finish_reason == "stop"
