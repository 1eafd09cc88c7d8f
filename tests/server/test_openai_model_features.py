"""The official `openai` client against a live server on the default model: what needs real
logits. Structured output and tool calls are checked with the `jsonschema` package, penalties
and logit_bias by what they must do to the greedy answer, n and best_of against single runs."""

import json
import threading

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import load_model

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REF_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PARIS = 7042  # " Paris" in the default model's vocabulary: its greedy answer is "The capital of France is Paris."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def real(serve_module):
    app = create_app(load_model("default", "default", {}), None, ServerConfig(max_in_flight=16))
    with serve_module(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(real):
    return openai.OpenAI(base_url=real[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


class City(BaseModel):
    # bounded: a small model left free inside a string can fill max_tokens with it
    name: str = Field(max_length=32)
    country: str = Field(max_length=32)
    population: int = Field(ge=0, le=100_000_000)


def test_parse_with_a_pydantic_model_validates(client):
    r = client.chat.completions.parse(model="default", messages=[
        {"role": "user", "content": "Describe Paris as JSON with its name, country and population."}],
        response_format=City, max_tokens=80, temperature=0)
    message = r.choices[0].message
    assert isinstance(message.parsed, City), message.content
    jsonschema.validate(json.loads(message.content), City.model_json_schema())


def weather_question():
    return [{"role": "user", "content": "What is the weather in Lyon?"}]


def test_named_tool_call_arguments_validate(client):
    r = client.chat.completions.create(model="default", messages=weather_question(), tools=TOOLS, max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_call_streamed_equals_unstreamed(client):
    kw = {"model": "default", "messages": weather_question(), "tools": TOOLS, "tool_choice": "required",
          "max_tokens": 60, "temperature": 0}
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls"
    name, args, ids, finish = None, "", set(), None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                name = name or (d.function.name if d.function else None)
                args += (d.function.arguments or "") if d.function else ""
                if d.id:
                    ids.add(d.id)
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1
    (call,) = full.message.tool_calls
    assert (name, json.loads(args)) == (call.function.name, json.loads(call.function.arguments))
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(json.loads(args), schema)


@pytest.mark.parametrize("max_tokens", [5, 12])
def test_a_required_call_cut_by_max_tokens_is_a_cut_call_not_content(client, max_tokens):
    """The new user's case: tool_choice required with a small max_tokens gave raw JSON as content."""
    kw = {"model": "default", "messages": weather_question(), "tools": TOOLS[:1], "tool_choice": "required",
          "max_tokens": max_tokens, "temperature": 0}
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "length" and full.message.content is None
    (call,) = full.message.tool_calls
    assert call.function.name == "get_weather"
    name, args = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                name = name or (d.function.name if d.function else None)
                args += (d.function.arguments or "") if d.function else ""
    assert (name, args) == ("get_weather", call.function.arguments)


def test_logit_bias_bans_a_token(client):
    kw = {"model": "default", "prompt": REF_PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    plain = client.completions.create(**kw).choices[0]
    assert " Paris" in plain.logprobs.tokens
    banned = client.completions.create(logit_bias={str(PARIS): -100}, **kw).choices[0]
    assert " Paris" not in banned.logprobs.tokens and banned.text != plain.text


def repeats(tokens: list[str]) -> int:
    return len(tokens) - len(set(tokens))


def test_penalties_cut_repetition(client):
    kw = {"model": "default", "prompt": "apple apple apple apple apple apple apple", "max_tokens": 24,
          "temperature": 0, "logprobs": 0}
    base = client.completions.create(**kw).choices[0].logprobs.tokens
    assert repeats(base) > 12  # greedy keeps repeating the word
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        tokens = client.completions.create(**penalty, **kw).choices[0].logprobs.tokens
        assert repeats(tokens) < repeats(base), (penalty, tokens)
    negative = client.completions.create(frequency_penalty=-2.0, **kw).choices[0].logprobs.tokens
    assert repeats(negative) >= repeats(base)


def test_n4_shares_kv_blocks_and_equals_four_seeded_runs(client, real):
    engine = real[1].state.server.model.engine
    question = "Write a short poem about the sea. " * 12  # a prompt of many blocks
    kw = {"model": "default", "max_tokens": 12, "temperature": 0.9}
    group = client.completions.create(prompt=question, n=4, seed=1000, **kw)
    group_peak = engine.stats().kv_blocks_peak
    singles = [client.completions.create(prompt=question, seed=1000 + i, **kw).choices[0].text for i in range(4)]
    assert [c.text for c in group.choices] == singles
    assert len(set(singles)) > 1

    # four separate requests at once, each its own prompt of the same length (no prefix to share)
    def one(i):
        client.completions.create(prompt=f"{i}" + question[1:], seed=i, **kw)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    separate_peak = engine.stats().kv_blocks_peak
    block_bytes = engine.stats().kv_block_bytes
    print(f"\nKV peak, prompt of {group.usage.prompt_tokens} tokens: n=4 on one prompt {group_peak} blocks "
          f"({group_peak * block_bytes / 2**20:.1f} MiB); "
          f"4 separate requests {separate_peak} blocks ({separate_peak * block_bytes / 2**20:.1f} MiB)")
    assert separate_peak > group_peak


def test_best_of_returns_the_highest_mean_logprob(client):
    kw = {"model": "default", "prompt": "My favourite animal is", "max_tokens": 8, "temperature": 1.0, "logprobs": 0}
    best = client.completions.create(n=2, best_of=4, seed=5, **kw)
    runs = [client.completions.create(seed=5 + i, **kw).choices[0] for i in range(4)]
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in runs]
    order = sorted(range(4), key=lambda i: -means[i])
    assert [c.text for c in best.choices] == [runs[i].text for i in order[:2]]
    assert [c.index for c in best.choices] == [0, 1]


def test_cached_tokens_on_a_repeated_prompt(client):
    prompt = "Tell me about the history of the Roman empire in detail. " * 6
    first = client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens


@pytest.mark.parametrize("schema", [{"type": "string", "pattern": "(("}, {"$ref": "#/nope"}, {"enum": []},
                                    {"type": "integer", "minimum": 5, "maximum": 1}, {"properties": 5},
                                    {"type": "array", "minItems": 5, "maxItems": 2}, {"format": "xyz"}])
def test_a_schema_the_grammar_cannot_take_is_a_400(real, schema):
    body = {"model": "default", "messages": QUESTION, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}}
    r = httpx.post(real[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"
