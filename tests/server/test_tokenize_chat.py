"""/tokenize renders a conversation with everything the chat template reads of a chat request
(tool calls, tool results, `tools`, `chat_template_kwargs`), over a family's real template; the
real Qwen2.5-Coder file against transformers' apply_chat_template: test_tool_calls_real.py."""

from fastapi.testclient import TestClient

from scratchllm.engine.fake import FakeTokenizer
from tests.server.scripted import TOOLS, TemplateTokenizer, scripted_app

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def test_tools_and_tool_turns_are_rendered_by_the_template():
    app, _ = scripted_app("qwen3")
    with TestClient(app) as client:
        r = client.post("/tokenize", json={"messages": CONVERSATION, "tools": TOOLS,
                                           "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        text = FakeTokenizer().decode(r.json()["tokens"])
        want = TemplateTokenizer("qwen3").apply_chat_template(
            [{**m, "content": m["content"] or ""} for m in CONVERSATION[:2]] + [
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Lyon"}}}]},
                {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}],
            tools=TOOLS, enable_thinking=False)
        assert text == want
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}'
        assert '"name": "get_weather"' in text and call in text and "<tool_response>\n21 C\n</tool_response>" in text
        without = FakeTokenizer().decode(client.post("/tokenize", json={"messages": CONVERSATION}).json()["tokens"])
        assert "get_weather" in without and '"description": "Weather in a city"' not in without


def test_what_tokenize_refuses():
    app, _ = scripted_app("qwen3")
    with TestClient(app) as client:
        for body, param in [({"prompt": "a", "tools": TOOLS}, "tools"),
                            ({"messages": CONVERSATION, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                            ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages.0.foo"),
                            ({"messages": CONVERSATION, "tools": [{"type": "function", "function": {"name": "f"},
                                                                  "x": 1}]}, "tools.0.x")]:
            r = client.post("/tokenize", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
