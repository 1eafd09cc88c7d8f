"""Each family's chat template renders through our sandbox (tokenizer/chat.py) as transformers'
apply_chat_template renders it (its render_jinja_template, with the same variables).

The templates in chat_templates/ are the `chat_template` of each model's tokenizer_config.json on
the Hugging Face Hub, as their model cards publish them, and two of Mistral's own:
  gemma3.jinja  - google/gemma-3-270m-it (the Gemma 3 family's text template)
  gemma2.jinja  - google/gemma-2-2b-it
  qwen3.jinja   - Qwen/Qwen3-0.6B (thinking and tool calls)
  llama3.jinja  - meta-llama/Llama-3.1-8B-Instruct (tools in the user message, date_string)
  mistral.jinja - mistralai/Mistral-7B-Instruct-v0.3 (tool calls, alternation check)
  mistral_v11.jinja, mistral_v13.jinja - the templates for Mistral's tokenizers v11 and v13, in
      mistral-common (github.com/mistralai/mistral-common, tests/data/chat_templates/v11.jinja
      and v13.jinja): tool calls as `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` and
      `[TOOL_CALLS]name[ARGS]{...}`
  mistral_v13_think.jinja - mistral-common's v13 template with thinking (Magistral's;
      tests/data/chat_templates/v13_think.jinja there): thinking as `[THINK]...[/THINK]`
  phi3.jinja    - microsoft/Phi-3-mini-4k-instruct
"""

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")
from transformers.utils.chat_template_utils import render_jinja_template

from scratchllm.errors import ConfigError
from scratchllm.tokenizer.chat import render_chat

TEMPLATES = Path(__file__).parent / "chat_templates"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [{"role": "user", "content": "  Hi there!  "}, {"role": "assistant", "content": "Hello. "},
         {"role": "user", "content": "What is 2 + 2?"}]
CONVERSATIONS = {"turns": TURNS, "system": [SYSTEM, *TURNS], "one": TURNS[:1], "answered": TURNS[:2]}
WITH_SYSTEM = {"gemma3", "qwen3", "llama3", "mistral", "mistral_v11", "mistral_v13", "mistral_v13_think",
               "phi3"}  # Gemma 2 refuses one


def _reference(template, messages, add_generation_prompt, **extra):
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **SPECIAL, **extra)
    return rendered[0]


FAMILIES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
CASES = [(f, c) for f in FAMILIES for c in sorted(CONVERSATIONS) if c != "system" or f in WITH_SYSTEM]


def test_every_family_has_its_template():
    assert FAMILIES == ["gemma2", "gemma3", "llama3", "mistral", "mistral_v11", "mistral_v13",
                        "mistral_v13_think", "phi3", "qwen3"]


@pytest.mark.parametrize("family,conversation", CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_renders_as_transformers(family, conversation, add_generation_prompt):
    template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    messages = CONVERSATIONS[conversation]
    want = _reference(template, messages, add_generation_prompt)
    got = render_chat(template, messages, add_generation_prompt=add_generation_prompt, special_tokens=SPECIAL)
    assert got == want


def test_qwen3_thinking_and_tool_calls_render_as_transformers():
    template = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
    schema = {"type": "object", "properties": {"a": {"type": "number"}}}
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": schema}}]
    messages = [*TURNS[:1], {"role": "assistant", "content": "<think>\nsum it\n</think>\n\nOK",
                             "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}]},
                {"role": "tool", "content": "4"}]
    for extra in ({"tools": tools}, {"enable_thinking": False}):
        want = _reference(template, messages, True, **extra)
        assert render_chat(template, messages, add_generation_prompt=True, special_tokens=SPECIAL, **extra) == want


def test_template_exceptions_become_config_errors():
    gemma2 = (TEMPLATES / "gemma2.jinja").read_text(encoding="utf-8")
    with pytest.raises(ConfigError, match="System role not supported"):
        render_chat(gemma2, [SYSTEM, *TURNS], special_tokens=SPECIAL)
    mistral = (TEMPLATES / "mistral.jinja").read_text(encoding="utf-8")
    with pytest.raises(ConfigError, match="roles must alternate"):
        render_chat(mistral, [TURNS[0], TURNS[0]], special_tokens=SPECIAL)
