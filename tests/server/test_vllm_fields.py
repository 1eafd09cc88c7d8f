"""vLLM's extension fields in the engine path: min_tokens (end tokens masked until N tokens),
stop_token_ids, include_stop_str_in_output; and the structured-output fields' parsing."""

import json

import pytest

from scratchllm.engine.engine import LLMEngine
from scratchllm.engine.fake import FakeTokenizer
from scratchllm.engine.output import OutputProcessor
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams
from scratchllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from tests.engine.tiny import tiny_llama

EOS, STOP = 5, 7


def run(params: SamplingParams) -> list[int]:
    engine = LLMEngine(tiny_llama(), eos_token_id=EOS)
    (out,) = engine.generate([[1, 2, 3]], params)
    return out.token_ids


def test_min_tokens_masks_the_eos_until_n_tokens():
    eos_first = {EOS: 100.0}  # the EOS is the model's top token at every step
    assert run(SamplingParams(max_tokens=10, temperature=0.0, logit_bias=eos_first)) == [EOS]
    ids = run(SamplingParams(max_tokens=10, temperature=0.0, logit_bias=eos_first, min_tokens=4, eos_token_ids=(EOS,)))
    assert len(ids) == 5 and EOS not in ids[:4] and ids[4] == EOS


def test_min_tokens_masks_stop_token_ids_too():
    bias = {STOP: 100.0}
    assert run(SamplingParams(max_tokens=10, temperature=0.0, logit_bias=bias, stop_token_ids=(STOP,))) == [STOP]
    ids = run(SamplingParams(max_tokens=10, temperature=0.0, logit_bias=bias, stop_token_ids=(STOP,), min_tokens=3,
                             eos_token_ids=(EOS,)))
    assert len(ids) == 4 and STOP not in ids[:3] and ids[3] == STOP


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    req = parse_body(b'{"model":"m","prompt":"x","min_tokens":9}', CompletionRequest)
    with pytest.raises(APIError) as info:
        req.sampling_params(4)
    assert info.value.param == "min_tokens"


def events(params: SamplingParams, text: str) -> tuple[str, str | None]:
    """The text and finish reason the output path gives for `text` fed byte by byte (fake tokenizer)."""
    tok = FakeTokenizer()
    out = OutputProcessor("r", params, tok.detokenizer(), end_token_ids=(), arrival=0.0)
    shown, reason = "", None
    for t in tok.encode(text):
        e = out.process(t, now=0.0)
        shown += e.text
        if e.finish_reason:
            reason = e.finish_reason
            break
    return shown, reason


def test_include_stop_str_in_output_keeps_the_stop_string():
    p = SamplingParams(max_tokens=50, stop=("END", "X"))
    assert events(p, "abc END def") == ("abc ", "stop")
    kept = SamplingParams(max_tokens=50, stop=("END", "X"), include_stop_str_in_output=True)
    assert events(kept, "abc END def") == ("abc END", "stop")
    assert events(kept, "aXbEND") == ("aX", "stop")  # the earliest stop string ends the text


def test_stop_strings_are_not_looked_for_before_min_tokens():
    assert events(SamplingParams(max_tokens=50, stop=("a",), min_tokens=4), "aaaaaa") == ("aaa", "stop")


def test_stop_token_text_shows_only_with_include_stop_str_in_output():
    tok = FakeTokenizer()
    stop = tok.encode("!")[0]
    for include, expected in ((False, "hi"), (True, "hi!")):
        p = SamplingParams(max_tokens=9, stop_token_ids=(stop,), include_stop_str_in_output=include)
        out = OutputProcessor("r", p, tok.detokenizer(), end_token_ids=(), arrival=0.0)
        text = "".join(out.process(t, now=0.0).text for t in tok.encode("hi!"))
        assert text == expected and out.finish_reason == "stop"


def chat(**extra: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return parse_body(json.dumps(body).encode(), ChatCompletionRequest)


def test_structured_outputs_and_guided_fields_name_their_constraint():
    schema = {"type": "object"}
    assert chat(structured_outputs={"json": schema}).constraint() == ("json_schema", "structured_outputs.json",
                                                                      (schema, True))
    assert chat(structured_outputs={"json": json.dumps(schema)}).constraint()[2] == (schema, True)
    assert chat(structured_outputs={"regex": "a+"}).constraint() == ("regex", "structured_outputs.regex", "a+")
    assert chat(structured_outputs={"choice": ["a"]}).constraint() == ("choice", "structured_outputs.choice", ["a"])
    assert chat(structured_outputs={"json_object": True}).constraint()[:2] == ("json_object",
                                                                               "structured_outputs.json_object")
    assert chat(guided_grammar="root ::= \"a\"").constraint()[:2] == ("grammar", "guided_grammar")
    assert chat(grammar="start: \"a\"").constraint()[:2] == ("grammar", "grammar")
    assert chat(guided_regex="a", guided_decoding_backend="xgrammar").constraint()[0] == "regex"


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_bad_structured_fields_are_400s_naming_them(extra, param):
    with pytest.raises(APIError) as info:
        chat(**extra)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_chat_template_kwargs_reach_the_template():
    import dataclasses
    from types import SimpleNamespace

    from scratchllm.server.chat import render
    from scratchllm.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained("default")
    template = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}" \
               "{% for m in messages %}{{ m.content }}{% endfor %}"
    state = SimpleNamespace(model=SimpleNamespace(tokenizer=Tokenizer(dataclasses.replace(tok.spec,
                                                                                          chat_template=template))))
    req = chat(chat_template_kwargs={"enable_thinking": False})
    assert render(state, req, req.tool_plan()) == "/no_think hi"  # type: ignore[arg-type]
    assert render(state, chat(), chat().tool_plan()) == "hi"  # type: ignore[arg-type]


def test_skip_special_tokens_false_shows_special_tokens():
    from scratchllm.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained("default")
    special = min(tok.special_ids)  # a special token that is not the EOS ends nothing
    ids = [*tok.encode("hi", add_special_tokens=False), special]
    for skip, expected in ((True, tok.decode(ids, skip_special_tokens=True)), (False, tok.decode(ids))):
        p = SamplingParams(max_tokens=9, skip_special_tokens=skip, ignore_eos=True)
        out = OutputProcessor("r", p, tok.detokenizer(skip_special_tokens=p.skip_special_tokens), end_token_ids=(),
                              arrival=0.0)
        text = "".join(out.process(t, now=0.0).text for t in ids) + "".join(
            [out.process(ids[0], context_full=True, now=0.0).text])
        assert text.startswith(expected) and (skip or tok.id_to_token(special) in text)
