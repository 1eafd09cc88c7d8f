"""Model replies without a model: a fake engine that writes a given text, tokenizers that render
a family's real chat template (tests/models/chat_templates), and each family's tool-call
reply as its own template writes an assistant's tool calls (the text the model was trained to
write: the template renders a conversation's earlier calls in it)."""

import json
import types
from pathlib import Path
from typing import Any

from scratchllm.engine.fake import EOS, FakeEngine, FakeTokenizer
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.gemma_prompt import gemma_messages
from scratchllm.server.state import ServedModel
from scratchllm.tokenizer.chat import render_chat

TEMPLATES = Path(__file__).parents[1] / "models" / "chat_templates"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
FAMILIES = {"qwen3": "hermes", "llama3": "llama3_json", "mistral": "mistral", "mistral_v11": "mistral",
            "mistral_v13": "mistral", "mistral_v13_think": "mistral", "gemma3": "gemma"}
END_OF_TURN = {"qwen3": "<|im_end|>\n", "llama3": "<|eot_id|>", "mistral": "</s>", "mistral_v11": "</s>",
               "mistral_v13": "</s>", "mistral_v13_think": "</s>", "gemma3": "<end_of_turn>\n"}

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
QUESTION = [{"role": "user", "content": "Weather in Lyon, and 2 + 3?"}]


class ScriptedEngine(FakeEngine):
    """Writes `reply` (one byte token per UTF-8 byte), then the end token."""

    reply = ""

    def next_token(self, prompt: list[int], offset: int, n: int) -> int:
        data = self.reply.encode()
        return data[n] + 3 if n < len(data) else EOS


class TemplateTokenizer(FakeTokenizer):
    """The fake's byte-level tokenizer with a family's real chat template."""

    def __init__(self, family: str) -> None:
        self.spec = types.SimpleNamespace(chat_template=(TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8"))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        return render_chat(self.spec.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=SPECIAL, **extra)


def scripted_app(family: str, config: ServerConfig | None = None) -> tuple[Any, ScriptedEngine]:
    engine = ScriptedEngine(step_ms=0.2, max_running=8)
    model = ServedModel("fake", engine, TemplateTokenizer(family), 4096)
    return create_app(model, None, config or ServerConfig()), engine


def call_ids(family: str, count: int) -> list[str]:
    return [f"call{i:05d}" if FAMILIES[family] == "mistral" else f"call_{i}" for i in range(count)]  # Mistral's: 9 long


def template_reply(family: str, calls: list[tuple[str, dict[str, Any]]], content: str = "",
                   reasoning: str | None = None) -> str:
    """The text the family's template writes for an assistant turn with these tool calls."""
    tok = TemplateTokenizer(family)
    tool_calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                  for i, (n, a) in zip(call_ids(family, len(calls)), calls, strict=True)]
    turn: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    before, after = QUESTION, [*QUESTION, turn]
    tools = [t["function"] for t in TOOLS]
    if family == "gemma3":  # the template has no tools: the server's Gemma prompt carries them
        prompt = tok.apply_chat_template(gemma_messages(before, tools))
        whole = tok.apply_chat_template(gemma_messages(after, tools), add_generation_prompt=False)
    else:
        prompt = tok.apply_chat_template(before, tools=TOOLS)
        whole = tok.apply_chat_template(after, add_generation_prompt=False, tools=TOOLS)
    assert whole.startswith(prompt), (prompt, whole)
    reply = whole[len(prompt):]
    assert reply.endswith(END_OF_TURN[family]), reply
    return reply[:-len(END_OF_TURN[family])]


def arguments(calls: list[Any]) -> list[tuple[str, Any]]:
    """(name, parsed arguments) of OpenAI tool calls (dicts or the client's objects)."""
    out = []
    for c in calls:
        fn = c["function"] if isinstance(c, dict) else c.function
        name, args = (fn["name"], fn["arguments"]) if isinstance(fn, dict) else (fn.name, fn.arguments)
        out.append((name, json.loads(args)))
    return out
