"""vLLM's structured_outputs and the grammar fields end to end on the default model, through
the HTTP handlers (httpx's in-process ASGI transport; all requests at once, so the engine
batches them): every output of 50 JSON schemas sent as `structured_outputs.json` validates with
the jsonschema package, and every output of 10 grammars (5 Lark, 5 GBNF, sent through each
grammar field) is checked against a Python regular expression written for the same language
(an oracle independent of llguidance and of the GBNF conversion), and against llguidance's
matcher for the grammar as sent."""

import asyncio
import json
import re

import httpx
import jsonschema
import llguidance
import pytest

from scratchllm.bench.schemas import schemas
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import load_model

pytestmark = pytest.mark.slow

# (grammar, the field it is sent in, the same language as a Python regex, the question asked)
GRAMMARS = [
    ('start: "yes" | "no"\n', "structured_outputs", r"yes|no", "Is water wet?"),
    ('start: year "-" month "-" day\nyear: /[12][0-9]{3}/\nmonth: /0[1-9]|1[0-2]/\nday: /0[1-9]|[12][0-9]|3[01]/\n',
     "guided_grammar", r"[12][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "When did the Berlin wall fall?"),
    ('start: "[" num "," num "," num "]"\nnum: /[0-9]{1,3}/\n', "grammar",
     r"\[[0-9]{1,3},[0-9]{1,3},[0-9]{1,3}\]", "List three small numbers."),
    ('start: num op num "=" num\nop: "+" | "-" | "*"\nnum: /[0-9]{1,2}/\n', "structured_outputs",
     r"[0-9]{1,2}[-+*][0-9]{1,2}=[0-9]{1,2}", "Write a sum and its result."),
    ('start: greet " " name "!"\ngreet: "Hello" | "Hi"\nname: /[A-Z][a-z]{1,8}/\n', "guided_grammar",
     r"(Hello|Hi) [A-Z][a-z]{1,8}!", "Greet Alice."),
    ('# a boolean\nroot ::= answer\nanswer ::= "true" | "false"\n', "grammar", r"true|false",
     "Is the sun a star? Answer true or false."),
    ('root ::= "(" d d d ") " d{3} "-" d{4}\nd ::= [0-9]\n', "structured_outputs",
     r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", "Make up a phone number."),
    ('root ::= [A-Z] [a-z]{1,10} " " [A-Z] [a-z]{1,10}\n', "guided_grammar", r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,10}",
     "Name a famous scientist."),
    ('root ::= "\\"" [^"\\n\\\\]{1,12} "\\""\n', "grammar", r'"[^"\n\\]{1,12}"', "Quote a short word."),
    ('root ::= item ("," " "? item)? ("," " "? item)?\nitem ::= "red" | "green" | "blue"\n', "structured_outputs",
     r"(red|green|blue)(, ?(red|green|blue))?(, ?(red|green|blue))?", "Name some colours."),
]


@pytest.fixture(scope="module")
def app():
    model = load_model("default", "default", {})
    yield create_app(model, None, ServerConfig(max_in_flight=64))
    model.engine.shutdown(False)


async def post_all(app, path, bodies):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=600) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


def test_fifty_schemas_through_structured_outputs_json(app):
    cases = schemas()
    assert len(cases) == 50
    # a short raw prompt: the grammar, not the prompt, makes the output valid
    bodies = [{"model": "default", "prompt": "An example JSON value:", "max_tokens": 96, "temperature": 0,
               "structured_outputs": {"json": s}} for s in cases]
    replies = asyncio.run(post_all(app, "/v1/completions", bodies))
    for schema, r in zip(cases, replies, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (schema, choice["text"])
        jsonschema.validate(json.loads(choice["text"]), schema)


def matcher_accepts(app, grammar: str, text: str) -> bool:
    """llguidance's own matcher, fed the output's tokens: does the grammar accept the text whole?"""
    compiled = app.state.server.grammar_compiler().grammar(grammar)
    m = llguidance.LLMatcher(compiled.lltokenizer, compiled.grammar, log_level=0)
    tokens = compiled.lltokenizer.tokenize_str(text)
    return m.consume_tokens(tokens) and m.is_accepting()


def test_ten_grammars_lark_and_gbnf(app):
    assert sum("::=" in g for g, *_ in GRAMMARS) == 5  # five GBNF, five Lark
    bodies = []
    for grammar, field, _, question in GRAMMARS:
        constraint = {"structured_outputs": {"grammar": grammar}} if field == "structured_outputs" else {field: grammar}
        bodies.append({"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": 32,
                       "temperature": 0, **constraint})
    replies = asyncio.run(post_all(app, "/v1/chat/completions", bodies))
    for (grammar, field, pattern, _), r in zip(GRAMMARS, replies, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (grammar, text)
        assert re.fullmatch(pattern, text), (grammar, field, text)
        assert matcher_accepts(app, grammar, text), (grammar, text)
