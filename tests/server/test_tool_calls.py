"""Tool calls in chat replies: the Hermes-format parser (finished and streamed) against json.loads
of the blocks, and `tools` reaching a chat template that reads them (auto mode)."""

import json
import types

import openai
import pytest

from scratchllm.engine.fake import FakeTokenizer
from scratchllm.engine.protocol import RequestOutput
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from scratchllm.server.tool_calls import HermesStream, hermes_calls, reply

CALL_A = {"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}
CALL_B = {"name": "add", "arguments": {"a": 2, "b": 3}}
TEXT = (f"Let me check. <tool_call>\n{json.dumps(CALL_A)}\n</tool_call> and "
        f"<tool_call>{json.dumps(CALL_B)}</tool_call> <tool_call>not json</tool_call> done <tool")


def test_hermes_calls_in_a_finished_text():
    content, calls = hermes_calls(TEXT)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(CALL_A["name"], CALL_A["arguments"]), (CALL_B["name"], CALL_B["arguments"])]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert "<tool_call>not json</tool_call>" in content and "get_weather" not in content


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 50])
def test_hermes_stream_equals_the_finished_parse(piece):
    stream, content, deltas = HermesStream(), "", []
    for i in range(0, len(TEXT), piece):
        c, d = stream.push(TEXT[i:i + piece])
        content, deltas = content + c, deltas + d
        assert "<tool_call>{" not in content  # a call's text is never sent as content
    content += stream.finish()
    want_content, want_calls = hermes_calls(TEXT)
    assert [d["index"] for d in deltas] == [0, 1]
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    assert " ".join(content.split()) == " ".join(want_content.split())  # the same text outside the calls
    assert want_content.endswith("done <tool")


def test_reply_of_a_forced_call_cut_short_is_text():
    cut = RequestOutput("r", None, [1], text='{"name": "add", "arguments": {"a": 1', finish_reason="length")
    assert reply(cut, "forced") == {"message": {"role": "assistant", "content": cut.text}, "finish_reason": "length"}
    done = RequestOutput("r", None, [1], text=json.dumps(CALL_B), finish_reason="stop")
    r = reply(done, "forced")
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None
    assert json.loads(r["message"]["tool_calls"][0]["function"]["arguments"]) == CALL_B["arguments"]


class ToolTemplateTokenizer(FakeTokenizer):
    """The fake's tokenizer with a chat template that reads `tools` (as Hermes templates do)."""

    spec = types.SimpleNamespace(chat_template="{% if tools %}{{ tools | tojson }}{% endif %}...")

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        head = f"<|im_start|>system\n{json.dumps(tools)}<|im_end|>\n" if tools else ""
        return head + super().apply_chat_template(messages, add_generation_prompt)


def test_auto_passes_tools_to_a_template_that_reads_them(serve):
    model, embedder = fake_backend(step_ms=0.5)
    model.tokenizer = ToolTemplateTokenizer()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "2 + 3?"}]
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "mul"}}]}}
    with serve(create_app(model, embedder, ServerConfig())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
        r = client.chat.completions.create(model="fake", messages=messages, tools=tools, max_tokens=5)
        none = client.chat.completions.create(model="fake", messages=messages, tools=tools, tool_choice="none",
                                              max_tokens=5)
        only = client.chat.completions.create(model="fake", messages=messages, tools=tools, tool_choice=allowed,
                                              max_tokens=5)
    tok = ToolTemplateTokenizer()
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages, tools=tools)))
    assert none.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages)))
    assert only.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages, tools=tools[1:])))
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
