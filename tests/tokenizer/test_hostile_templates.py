"""Hostile chat templates (a GGUF's tokenizer.chat_template, a folder's tokenizer_config.json, or
--chat-template): escapes to Python, file reads, long loops and huge values are refused or stopped
with a ChatTemplateError, nothing runs, no render outlives its time limit, memory stays bounded; the
server answers 400 and goes on serving. Real templates (Qwen2.5, Llama 3.1, Gemma 2) still render
exactly as transformers renders them."""

import contextlib
import gc
import json
import time
import tracemalloc

import pytest

from scratchllm.errors import ConfigError
from scratchllm.tokenizer import Tokenizer
from scratchllm.tokenizer.chat import ChatTemplateError, TemplateLimits, render_chat

LIMITS = TemplateLimits(seconds=0.25, max_chars=1 << 20)
USER = [{"role": "user", "content": "hi"}]


def hostile(canary):
    """(name, template, what the error says). Every escape would create the canary file."""
    touch = f"touch {canary}"
    return [
        ("mro-subclasses", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("subclass-popen", "{% for c in ''.__class__.__base__.__subclasses__() %}{% if c.__name__ == 'Popen' %}"
                           f"{{{{ c('{touch}', shell=True) }}}}{{% endif %}}{{% endfor %}}", "unsafe"),
        ("cycler-globals", f"{{{{ cycler.__init__.__globals__.os.system('{touch}') }}}}", "unsafe"),
        ("joiner-globals", f"{{{{ joiner.__init__.__globals__['os'].popen('{touch}').read() }}}}", "unsafe"),
        ("template-context", "{{ self._TemplateReference__context }}", "unsafe"),
        ("lipsum-globals", f"{{{{ lipsum.__globals__['os'].system('{touch}') }}}}", "lipsum"),
        ("namespace-init", f"{{% set ns = namespace(a=1) %}}{{{{ ns.__init__.__globals__.os.system('{touch}') }}}}",
         "__init__"),
        ("namespace-class", "{{ namespace.__class__.__mro__ }}", "unsafe"),
        ("helper-globals", f"{{{{ raise_exception.__globals__['os'].system('{touch}') }}}}", "unsafe"),
        ("format-field", "{{ '{0.__class__.__mro__}'.format(messages) }}", "unsafe"),
        ("attribute-map", "{{ messages|map(attribute='__class__')|list }}", "unsafe"),
        ("mutate-messages", "{% set _ = messages.append({'role': 'system'}) %}", "unsafe"),
        ("include", "{% include '/etc/passwd' %}", "include"),
        ("import", "{% import '/etc/passwd' as p %}", "import"),
        ("from-import", "{% from '/etc/passwd' import x %}", "import"),
        ("extends", "{% extends '/etc/passwd' %}", "extends"),
        ("range-huge", "{{ range(10**9)|list }}", "range"),
        ("nested-range", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         "time limit"),
        ("nested-output", "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
         "time limit|characters"),
        ("macro-forever", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
        ("macro-doubling", "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
         "time limit"),
        ("recursive-loop", "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "recursed|time limit"),
        ("str-times", "{{ 'x' * 10**10 }}", "characters"),
        ("list-times", "{{ [0] * 10000000000 }}", "characters"),
        ("big-power", "{{ 2 ** 10000000000 }}", "bits"),
        ("squaring", "{% set ns = namespace(n=3) %}{% for i in range(100) %}{% set ns.n = ns.n * ns.n %}"
                     "{% endfor %}{{ ns.n }}", "bits"),
        ("doubling-join", "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s }}", "characters"),
        ("doubling-plus", "{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                          "{% endfor %}{{ ns.s }}", "characters"),
        ("shared-tree", "{% set ns = namespace(a=[1]) %}{% for i in range(200) %}{% set ns.a = [ns.a, ns.a] %}"
                        "{% endfor %}{{ ns.a|tojson }}", "characters"),
        ("block-text", "{% set big = 'x' * 1000000 %}{% set out %}{% for i in range(100000) %}{{ big }}"
                       "{% endfor %}{% endset %}{{ out|length }}", "characters|time limit"),
        ("center", "{{ 'x'|center(10000000000) }}", "characters"),
        ("ljust", "{{ 'x'.ljust(10000000000) }}", "characters"),
        ("replace-empty", "{% set s = 'x' * 1000000 %}{{ s.replace('', s) }}", "characters"),
        ("join-wide", "{% set s = 'x' * 1000000 %}{{ s.join(['a', 'b', 'c', 'd']) }}", "characters"),
        ("format-width", "{{ '{:>10000000000}'.format(1) }}", "characters"),
        ("percent-width", "{{ '%*d' % (10000000000, 1) }}", "characters"),
        ("format-filter", "{{ '%.10000000000f'|format(1.0) }}", "characters"),
        ("indent-wide", "{% set s = 'x\n' * 500000 %}{{ s|indent('y' * 1000000) }}", "characters"),
        ("tojson-indent", "{{ messages|tojson(indent=100000000) }}", "indent"),
        ("expandtabs", "{{ ('\t' * 1000000).expandtabs(100000000) }}", "characters"),
        ("batch-fill", "{{ [1]|batch(10000000000, 0)|list }}", "characters"),
        ("sum-lists", "{{ range(100000)|map('string')|map('list')|sum(start=[])|length }}", "time limit"),
        ("unary-chain", "{{ bos_" + "-" * 120 + "token }}", "undefined"),  # compiling it took 13 s
        ("output-flood", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "characters"),
    ]


@contextlib.contextmanager
def no_collections():
    """What a timed render measures is the template's own work: a collection of the whole test
    process's heap (the models and modules of earlier tests) that landed inside one took 1 s of it
    on a 2-core machine, past a 0.25 s limit's slack."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def canary(tmp_path):
    return tmp_path / "pwned"


def test_there_are_enough_hostile_templates(canary):
    assert len(hostile(canary)) >= 15


@pytest.mark.parametrize("case", range(len(hostile("x"))), ids=[h[0] for h in hostile("x")])
def test_hostile_template_is_refused_or_stopped(case, canary):
    name, template, said = hostile(canary)[case]
    with no_collections():
        tracemalloc.start()
        started = time.monotonic()
        try:
            with pytest.raises(ChatTemplateError, match=said):
                render_chat(template, USER, limits=LIMITS)
            took = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert not canary.exists(), f"{name} ran a command"
    assert took < LIMITS.seconds + 0.5, f"{name} ran {took:.2f} s past a {LIMITS.seconds} s limit"
    assert peak < 64 << 20, f"{name} allocated {peak >> 20} MiB"


def test_the_default_limit_is_one_second():
    with no_collections():
        started = time.monotonic()
        with pytest.raises(ChatTemplateError, match="time limit of 1 s"):
            render_chat("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", USER)
        assert 1.0 <= time.monotonic() - started < 1.5


def test_limits_come_from_the_environment(monkeypatch):
    flood = "{% for i in range(1000) %}{{ 'x' * 100 }}{% endfor %}"  # 100000 characters
    assert len(render_chat(flood, USER)) == 100_000
    monkeypatch.setenv("SCRATCHLLM_CHAT_TEMPLATE_MAX_CHARS", "50000")
    with pytest.raises(ChatTemplateError, match="limit of 50"):
        render_chat(flood, USER)
    monkeypatch.setenv("SCRATCHLLM_CHAT_TEMPLATE_SECONDS", "soon")
    with pytest.raises(ConfigError, match="SCRATCHLLM_CHAT_TEMPLATE"):
        render_chat(flood, USER)


def test_a_long_conversation_fits_its_template():
    """The size limit is on top of twice the inputs: a 3 MiB conversation still renders."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 20000} for i in range(30)]
    out = render_chat(QWEN, messages, limits=LIMITS)
    assert out.count("<|im_start|>") == 32 and len(out) > 3_000_000


# ---- real templates render as transformers renders them --------------------------------------
QWEN = (  # Qwen2.5-Instruct's
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

LLAMA31 = (  # Llama 3.1 Instruct's (the built-in tools part left out)
    "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}\n{%- endif %}\n"
    "{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n{%- endif %}\n"
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n{%- if tools is not none %}\n"
    "    {{- \"Environment: ipython\\n\" }}\n{%- endif %}\n{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n{{- system_message }}\n{{- \"<|eot_id|>\" }}\n\n"
    "{%- if tools_in_user_message and not tools is none %}\n    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    "        {%- set messages = messages[1:] %}\n    {%- else %}\n"
    "        {{- raise_exception(\"Cannot put tools in the first user message when there's no first user "
    "message!\") }}\n{%- endif %}\n    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    "    {{- \"Given the following functions, please respond with a JSON for a function call \" }}\n"
    "    {{- \"with its proper arguments that best answers the given prompt.\\n\\n\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.' }}\n    {{- \"Do not use variables.\\n\\n\" }}\n    {%- for t in tools %}\n"
    "        {{- t | tojson(indent=4) }}\n        {{- \"\\n\\n\" }}\n    {%- endfor %}\n"
    "    {{- first_user_message + \"<|eot_id|>\"}}\n{%- endif %}\n\n{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' }}\n    {%- elif 'tool_calls' in message %}\n"
    "        {%- if not message.tool_calls|length == 1 %}\n"
    "            {{- raise_exception(\"This model only supports single tool-calls at once!\") }}\n"
    "        {%- endif %}\n        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "        {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n        {{- '\"parameters\": ' }}\n"
    "        {{- tool_call.arguments | tojson }}\n        {{- \"}\" }}\n        {{- \"<|eot_id|>\" }}\n"
    "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"
    "        {{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}\n"
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n        {%- else %}\n            {{- message.content }}\n"
    "        {%- endif %}\n        {{- \"<|eot_id|>\" }}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

GEMMA2 = (  # Gemma 2 Instruct's
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋 你好 <b>"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x3?"}],
]
CASES = [
    ("qwen", QWEN, CHATS, None), ("qwen-tools", QWEN, [[*CHATS[0], CALL, {"role": "tool", "content": "sunny"}]], TOOLS),
    ("llama31", LLAMA31, CHATS, None), ("llama31-tools", LLAMA31, [CHATS[0]], TOOLS),
    ("gemma2", GEMMA2, [CHATS[0], CHATS[2]], None),
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(("name", "template", "chats", "tools"), CASES, ids=[c[0] for c in CASES])
def test_real_templates_equal_transformers(name, template, chats, tools, add_generation_prompt):
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    for messages in chats:
        expected, _ = ctu.render_jinja_template([messages], tools=tools, chat_template=template,
                                                add_generation_prompt=add_generation_prompt, **specials)
        extra = {"tools": tools} if tools else {}
        got = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                          special_tokens=specials, **extra)
        assert got == expected[0]


def test_gemma2_refusal_is_still_its_own():
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat(GEMMA2, CHATS[1])


# ---- hostile templates where models load them: a GGUF, tokenizer_config.json, --chat-template ----
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def write_gguf(path, template):
    """A small SentencePiece vocabulary (as Gemma's) with `template` as its tokenizer.chat_template."""
    gguf = pytest.importorskip("gguf")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *BYTES, "a", "b", "\u2581"]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([3, 3, 3, 3, *[6] * 256, 1, 1, 1])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SERVED = {"escape": "{{ cycler.__init__.__globals__.os.system('touch CANARY') }}",
          "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
          "flood": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
          "include": "{% include '/etc/passwd' %}"}


@pytest.mark.parametrize("kind", SERVED)
def test_server_answers_400_to_a_gguf_template_and_goes_on(tmp_path, kind, monkeypatch):
    from fastapi.testclient import TestClient

    from scratchllm.server.app import ServerConfig, create_app
    from scratchllm.server.backend import fake_backend
    from scratchllm.server.state import ServedModel

    monkeypatch.setenv("SCRATCHLLM_CHAT_TEMPLATE_SECONDS", "0.25")
    canary = tmp_path / "pwned"
    tok = Tokenizer.from_pretrained(write_gguf(tmp_path / "m.gguf", SERVED[kind].replace("CANARY", str(canary))))
    fake, embedder = fake_backend(step_ms=0.0)
    model = ServedModel("m", fake.engine, tok, 2048)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(create_app(model, embedder, ServerConfig())) as client:
        for _ in range(2):  # the same again: the server is unharmed
            started = time.monotonic()
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            assert "chat template" in r.json()["error"]["message"]
            assert time.monotonic() - started < 1.5
        ok = client.post("/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    assert not canary.exists()


def test_tokenizer_config_template_is_stopped(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": SERVED["flood"]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ChatTemplateError, match="characters"):
        tok.apply_chat_template(USER)


def test_chat_template_flag_refuses_a_hostile_file(tmp_path):
    from scratchllm.cli import serve_cmd

    tok = Tokenizer.from_pretrained(write_gguf(tmp_path / "m.gguf", "{{ messages[0].content }}"))
    for kind, template in SERVED.items():
        path = tmp_path / f"{kind}.jinja"
        path.write_text(template)
        started = time.monotonic()
        with pytest.raises(ConfigError, match="--chat-template does not render: chat template"):
            serve_cmd._with_chat_template(tok, str(path))
        assert time.monotonic() - started < 1.5
