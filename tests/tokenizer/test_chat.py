"""Chat templates: rendered as transformers renders them, in a sandbox that refuses escapes."""

import pytest

from scratchllm import Tokenizer
from scratchllm.errors import ConfigError
from scratchllm.tokenizer.chat import render_chat

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋 你好"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x3?"}],
]


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_pretrained("default")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm_template_equals_transformers(ours, messages, add_generation_prompt):
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    expected, _ = ctu.render_jinja_template(
        [messages], chat_template=ours.chat_template, add_generation_prompt=add_generation_prompt,
        bos_token="<|im_start|>", eos_token="<|im_end|>",
    )
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected[0]
    assert got.startswith("<|im_start|>system\n")  # the template adds one when none is given


def test_rendered_prompt_tokenizes_to_specials(ours):
    prompt = ours.apply_chat_template(CONVERSATIONS[0])
    ids = ours.encode(prompt)
    tail = [ours.bos_token_id, *ours.encode("assistant\n")]
    assert ids[0] == ours.bos_token_id and ids[-len(tail):] == tail
    assert ids.count(ours.eos_token_id) == 2  # system and user turns closed


def test_helpers_match_transformers():
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    source = ("{{ messages | tojson }}|{{ strftime_now('%Y') }}|"
              "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}")
    messages = [{"role": "user", "content": "é <b>"}, {"role": "assistant", "content": "x"}]
    expected, _ = ctu.render_jinja_template([messages], chat_template=source)
    assert render_chat(source, messages) == expected[0]
    assert '"é <b>"' in expected[0]  # no HTML escaping, no \\u escapes


def test_sandbox_refuses_python_internals():
    with pytest.raises(ConfigError, match="chat template"):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ConfigError, match="chat template"):
        render_chat("{% set _ = messages.append(1) %}", [{"role": "user", "content": "x"}])


def test_raise_exception_and_bad_input():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    assert render_chat(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ConfigError, match="user first"):
        render_chat(template, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ConfigError, match="role"):
        render_chat(template, ["not a dict"])
    with pytest.raises(ConfigError, match="parse"):
        render_chat("{% for %}", [])


def test_no_template_is_a_clear_error():
    with pytest.raises(ConfigError, match="no chat template"):
        Tokenizer.from_pretrained("minilm").apply_chat_template(CONVERSATIONS[0])
