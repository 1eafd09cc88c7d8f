"""Grammars and matchers over the default tokenizer (no model): the llguidance vocabulary is ours
byte for byte, masks allow exactly what the grammar can continue with, and bad constraints are
refused with a message naming the problem."""

import json
import time

import numpy as np
import pytest

from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams
from scratchllm.structured import GrammarCompiler, apply_mask, tool_calls_from_text
from scratchllm.tokenizer import Tokenizer
from scratchllm.tokenizer.guidance import llg_tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained("default")


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok)


def test_llguidance_sees_our_token_bytes(tok):
    ll = llg_tokenizer(tok)
    assert ll.vocab_size == tok.vocab_size and ll.eos_token == tok.eos_token_id
    assert llg_tokenizer(tok) is ll  # built once per tokenizer
    specials = set(tok.special_ids) | {tok.eos_token_id}
    for i in range(tok.vocab_size):
        # decode_bytes shows a special token's text without the marker; is_special_token tells it
        assert ll.decode_bytes([i]) == tok.token_bytes(i), i
        assert ll.is_special_token(i) == (i in specials), i


def allowed_strings(tok, matcher) -> set[bytes]:
    return {tok.token_bytes(int(i)) for i in np.nonzero(matcher.allowed())[0]}


def consume_text(tok, matcher, text: str) -> None:
    for t in tok.encode(text, add_special_tokens=False):
        assert matcher.allowed()[t], (text, tok.token_bytes(t))
        matcher.consume(t)


def test_json_schema_mask_follows_the_schema(tok, compiler):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = compiler.json_schema(schema).new_matcher()
    first = allowed_strings(tok, m)
    assert first and all(s.startswith(b"{") for s in first), sorted(first)[:10]
    assert not m.allowed()[tok.eos_token_id]  # nothing written yet: ending now would be invalid JSON
    consume_text(tok, m, '{"ok": ')
    after = allowed_strings(tok, m)
    assert b"true" in after and b"false" in after and all(s[:1] in (b"t", b"f") for s in after)
    consume_text(tok, m, "true}")
    assert m.is_accepting() and np.nonzero(m.allowed())[0].tolist() == [tok.eos_token_id]


def test_json_mode_allows_any_object_and_nothing_else(tok, compiler):
    m = compiler.json_object().new_matcher()
    assert all(s.startswith(b"{") for s in allowed_strings(tok, m))
    consume_text(tok, m, '{"a": [1, {"b": null}], "c": "d"')
    after = allowed_strings(tok, m)
    assert b"}" in after and b"," in after and not any(s[:1].isalnum() or s.startswith(b"]") for s in after)
    consume_text(tok, m, "}")
    assert m.is_accepting() and np.nonzero(m.allowed())[0].tolist() == [tok.eos_token_id]


def test_sync_rolls_back_and_catches_up(tok, compiler):
    m = compiler.regex("[a-z]{1,8}=[0-9]{1,3}").new_matcher()
    ids = tok.encode("abc=12", add_special_tokens=False)
    m.sync(ids)
    assert m.num_consumed == len(ids)
    m.sync(ids[:1])  # an engine that dropped output: the matcher follows it back
    t0 = time.perf_counter()
    allowed = m.allowed()  # the one mask the sampler asks for: what it waited is inside this call
    took = time.perf_counter() - t0
    assert m.num_consumed == 1 and allowed[ids[1]]
    assert m.compute_s > 0 and 0 < m.wait_s <= took and 0 <= m.num_late <= m.num_masks == 1


def test_choice_and_regex_masks(tok, compiler):
    m = compiler.choice(["yes", "no", "maybe later"]).new_matcher()
    first = allowed_strings(tok, m)
    assert first and all(any(o.startswith(s) for o in (b"yes", b"no", b"maybe later")) for s in first)
    m = compiler.regex("[0-9]{3}").new_matcher()
    assert all(s.isdigit() for s in allowed_strings(tok, m))


def test_tool_call_grammar_writes_name_then_arguments(tok, compiler):
    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}},
             {"name": "noop", "parameters": {"type": "object"}}]
    m = compiler.tool_call(tools).new_matcher()
    consume_text(tok, m, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert m.is_accepting()
    m = compiler.tool_call(tools).new_matcher()
    consume_text(tok, m, '{"name": "')
    assert {s[:1] for s in allowed_strings(tok, m)} <= {b"g", b"n"}


@pytest.mark.parametrize("make,match", [
    (lambda c: c.regex("[unclosed"), "regex"),
    (lambda c: c.regex(""), "non-empty"),
    (lambda c: c.choice([]), "non-empty list"),
    (lambda c: c.choice(["a", 1]), "non-empty list"),
    (lambda c: c.json_schema({"type": "string", "format": "no-such-format"}, strict=True), "no-such-format"),
    (lambda c: c.json_schema("not a schema"), "must be an object"),
    (lambda c: c.json_schema({"type": "wat"}), "JSON schema"),
    (lambda c: c.tool_call([]), "at least one tool"),
])
def test_bad_constraints_are_config_errors(compiler, make, match):
    with pytest.raises(ConfigError, match=match):
        make(compiler)


def test_non_strict_schema_skips_what_it_cannot_enforce(compiler):
    assert compiler.json_schema({"type": "string", "format": "no-such-format"}, strict=False).kind == "json_schema"


def test_apply_mask_bans_padding_columns():
    row = np.arange(6, dtype=np.float32)
    apply_mask(row, np.array([True, False, True, False]))
    assert row.tolist()[:4] == [0, -np.inf, 2, -np.inf] and np.isneginf(row[4:]).all()


def test_params_hold_the_grammar(compiler):
    g = compiler.json_object()
    p = SamplingParams(grammar=g)
    assert p.grammar is g and g.kind == "json_object" and "CompiledGrammar" in repr(g)


def test_tool_calls_from_text():
    calls = tool_calls_from_text('{"name": "f", "arguments": {"x": [1, 2]}}')
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "f", "arguments": json.dumps({"x": [1, 2]})}
    with pytest.raises(ConfigError, match="max_tokens"):
        tool_calls_from_text('{"name": "f", "argum')
    with pytest.raises(ConfigError, match="'name' and 'arguments'"):
        tool_calls_from_text('{"x": 1}')


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_tool_call_stream_deltas_add_up_to_the_call(chunk):
    from scratchllm.structured import ToolCallStream

    text = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}'
    stream = ToolCallStream()
    deltas = []
    for i in range(0, len(text), chunk):
        deltas += stream.push(text[i:i + chunk])
    deltas += stream.finish()
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith("call_")
    args = "".join(d["function"]["arguments"] for d in deltas[1:])
    assert json.loads(args) == {"city": "Oslo", "days": [1, 2]} and "name" not in deltas[1]["function"]
    with pytest.raises(ConfigError):
        ToolCallStream().finish()  # nothing written: no call
