"""Structured output end to end on the default model: every output of 50 varied JSON schemas
validates with the jsonschema package (a validator nobody here wrote), and regex, choice and
forced tool calls hold, greedy and seeded-sampled, all in batched generate calls. (JSON mode
allows an object of any size, so a small greedy model can run to max_tokens inside it; its
masks are tested in test_grammar.py.)"""

import json
import re

import jsonschema
import pytest

import scratchllm
from scratchllm import SamplingParams
from scratchllm.bench.schemas import schemas
from scratchllm.structured import GrammarCompiler, tool_calls_from_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return scratchllm.LLM("default")


@pytest.fixture(scope="module")
def compiler(llm):
    return GrammarCompiler(llm.tokenizer)


def chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": text}]),
                                add_special_tokens=False)


def test_fifty_schemas_every_output_validates(llm, compiler):
    cases = schemas()
    assert len(cases) == 50
    for s in cases:
        jsonschema.Draft202012Validator.check_schema(s)  # the cases themselves are valid schemas
    # A short raw prompt: the grammar, not the prompt, is what makes the output valid, and 50
    # copies of the chat template's system prompt would cost more prefill than the outputs.
    ids = llm.tokenizer.encode("An example JSON value:")
    params = [SamplingParams(max_tokens=96, temperature=0.0, grammar=compiler.json_schema(s)) for s in cases]
    outs = llm.generate([ids] * len(cases), params)  # one batch: every grammar steps together
    for schema, out in zip(cases, outs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_tool_calls(llm, compiler):
    tool = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    prompts = [chat_ids(llm, t) for t in ("What is the date today?", "Is the sky green?",
                                          "What is the weather in Paris?", "Invent a person.", "Invent a person.")]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, grammar=compiler.regex("[0-9]{4}-[0-9]{2}-[0-9]{2}")),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, grammar=compiler.choice(["yes", "no", "unsure"])),
        SamplingParams(max_tokens=64, temperature=0.0, grammar=compiler.tool_call([tool])),
        SamplingParams(max_tokens=48, temperature=0.9, seed=7, grammar=compiler.json_schema(person)),
        SamplingParams(max_tokens=48, temperature=0.9, seed=7, grammar=compiler.json_schema(person)),
    ]
    date, choice, call, p1, p2 = llm.generate(prompts, params)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text), date.text
    assert choice.text in ("yes", "no", "unsure")
    (tc,) = tool_calls_from_text(call.text)
    assert tc["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(tc["function"]["arguments"]), tool["parameters"])
    assert p1.token_ids == p2.token_ids, "seeded sampling under a grammar must be reproducible"
    jsonschema.validate(json.loads(p1.text), person)
